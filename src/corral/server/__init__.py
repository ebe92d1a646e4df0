"""Corral's HTTP API server (FastAPI on uvicorn); the contract is `docs/api.md`.

```python
app = create_app(engine, store)      # an ASGI app; its lifespan starts and stops engine and store
serve("127.0.0.1", 7770)             # `corral serve`: Engine + ControlStore in CORRAL_HOME, admin key, uvicorn
```
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .._logging import LOG_FORMATS, log_as_json
from .._settings import admin_key, corral_home, database_url
from ..control import CACHE_TTL, ControlStore
from ..e2b import E2BConfig
from ..egress import CA_DIR, CertificateAuthority, EgressProxy, PackageMirror, upstream_context
from ..engine import Capacity, Engine, WarmPool
from ..service import DEFAULT_DOMAIN, STATUS_BY_CODE, ReplicaConfig, status_for
from ._app import create_app
from ._metrics_port import MetricsPort, serve_with_metrics_port
from ._process import ServerProcess, private_server

__all__ = ["STATUS_BY_CODE", "MetricsPort", "ServerProcess", "create_app", "private_server", "serve", "status_for"]

logger = logging.getLogger("corral.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7770
KEEP_ALIVE = 75  # seconds an idle HTTP connection is kept (nginx's default; uvicorn's own is 5)


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
          home: str | os.PathLike[str] | None = None, db_url: str | None = None,
          capacity: Capacity | None = None, backend: str = "local", domain: str = DEFAULT_DOMAIN,
          e2b: E2BConfig | None = None, replica: ReplicaConfig | None = None,
          cache_ttl: float = CACHE_TTL, log_format: str = "text", metrics: bool = True,
          metrics_port: MetricsPort | None = None, upstream_ca: Path | None = None,
          pools: Sequence[WarmPool] = ()) -> None:
    """Run the API server until interrupted, with its state in `home` (default `CORRAL_HOME`), its control
    database at `db_url` (default `CORRAL_DB_URL`, else SQLite in `home`; PostgreSQL for several replicas),
    the machine's `capacity` for sandboxes (past it, creates answer 503 with `Retry-After`), and sandboxes on
    the `backend` of that name (`corral.backends.BACKEND_NAMES`; docs/backends.md), and sandboxes' ports
    served at `<port>-<sandbox id>.<domain>` on the same port (docs/ports.md), and E2B's API with the `e2b`
    settings (docs/e2b.md), and as the `replica` among several on one database (docs/replicas.md; default: a
    single server reached at `http://<host>:<port>`), serving keys and sandbox records from memory for
    `cache_ttl` seconds (how late another replica's revocation may be seen here), logging as `log_format`
    ("text", or "json": one JSON object per line, a line per request), counting Prometheus `metrics` (served to
    admins at /metrics, and to anyone at `metrics_port` if given; docs/operations.md), trusting `upstream_ca` too
    where the egress proxy checks the hosts that secrets are bound to (docs/secrets.md), keeping the warm `pools`
    filled (docs/performance.md)."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from ._reads import HttpProtocol

    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: choose one of {', '.join(LOG_FORMATS)}")
    if metrics_port is not None and not metrics:
        raise ValueError("a metrics port needs metrics")
    if log_format == "json":
        log_as_json()
    say = _announcer(log_format)
    state = corral_home(home)
    # The egress proxy (and its package mirror) live in this process; the app wires its events to the audit
    # trail and starts it before the engine reattaches sandboxes (docs/egress.md).
    proxy = EgressProxy(mirror=PackageMirror(state / "cache" / "packages"),
                        ca=CertificateAuthority.load_or_create(state / CA_DIR),
                        upstream_tls=upstream_context(upstream_ca))
    engine = Engine(state, backend, capacity=capacity, egress=proxy, pools=pools)
    store = ControlStore(db_url or database_url(), home=state, cache_ttl=cache_ttl)
    explicit = admin_key()

    async def bootstrap(store: ControlStore) -> None:
        path = await store.bootstrap_admin(explicit)
        if path is not None:
            say(f"corral: generated the admin API key; it is in {path} (mode 0600)")
        elif explicit is not None:
            say("corral: admin API key taken from CORRAL_ADMIN_KEY (used only if the server had no keys)")

    replica = replica or ReplicaConfig(url=f"http://{host}:{port}")
    app = create_app(engine, store, on_startup=bootstrap, domain=domain, e2b=e2b, replica=replica, metrics=metrics)
    # What no tenant may ever be granted as a private destination (docs/egress.md): this server's own listeners.
    control_plane = app.state.corral.grants.control_plane
    control_plane.add_listener(host, port, "the control plane's API listener")
    if metrics_port is not None:
        control_plane.add_listener(metrics_port.host, metrics_port.port, "the control plane's metrics port")
    # Idle connections live longer here than in clients' pools (httpx and pyqwest keep theirs 5 s by default): a
    # server that closes first races a client reusing the connection at that instant (a failed request, seen).
    # JSON logs: uvicorn configures no loggers of its own (its records reach the JSON root handler), and its
    # access log gives way to the request log (`_request_log`), which says more.
    text = log_format == "text"
    config = uvicorn.Config(app, host=host, port=port, lifespan="on", log_level="info",
                            timeout_keep_alive=KEEP_ALIVE, log_config=LOGGING_CONFIG if text else None,
                            access_log=text, http=HttpProtocol)
    main = uvicorn.Server(config)
    if metrics_port is None:
        asyncio.run(main.serve())
    else:
        serve_with_metrics_port(main, app.state.corral, metrics_port, json_logs=not text)


def _announcer(log_format: str) -> Callable[[str], None]:
    """How startup notices reach the operator: printed, or a log record where every line must be JSON (a warning:
    where the admin key is must show whatever level the logs are filtered at)."""
    if log_format == "json":
        return logger.warning
    return lambda text: print(text, flush=True)
