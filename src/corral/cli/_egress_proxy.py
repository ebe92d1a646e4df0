"""`corral egress-proxy`: the egress proxy as a process of its own, for sandboxes on other machines (Pods).

On one host the server runs the proxy itself, a Unix socket per sandbox. On Kubernetes sandboxes are Pods, and
their one way out is this process, a Deployment behind a Service (docs/kubernetes-backend.md): it knows each
sandbox by the `<sandbox id>:<credential>` in its proxy URL (checked with the key the servers derive it from,
`CORRAL_ACCESS_SECRET`), reads its policy from the servers' database (`CORRAL_DB_URL`), enforces it exactly as the
server's own proxy does (same rules, refusals, package mirror) and writes the same audit records, refusals
before it answers them so that the server that ran the command reports them with its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .._exceptions import InvalidRequestError

if TYPE_CHECKING:  # the proxy's modules load only when it runs: `corral --help` stays fast
    from ..egress import EgressProxy, PackageMirror
    from ..service import EgressDirectory, EgressMetrics

__all__ = ["egress_proxy_command"]

log = logging.getLogger("corral.egress")


def egress_proxy_command(
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 in a Pod).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 3128,
    db: Annotated[str | None, typer.Option("--db", help="The servers' database URL (default $CORRAL_DB_URL).",
                                           show_default=False)] = None,
    home: Annotated[Path | None, typer.Option("--home", help="State directory: the package mirror's cache "
                                              "(default $CORRAL_HOME).", show_default=False)] = None,
    cache_ttl: Annotated[float, typer.Option("--cache-ttl", min=0.0, help="Seconds a sandbox's policy is reused: "
                                             "a policy change reaches this proxy within this time.")] = 2.0,
    mirror: Annotated[bool, typer.Option("--mirror/--no-mirror", help="Serve the package mirror (pip) to "
                                         "sandboxes granted @packages.")] = True,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", min=0, max=65535, help="Also serve "
                                                     "Prometheus metrics (/metrics, no authentication) on this port: "
                                                     "corral_egress_requests_total, corral_egress_bytes_total.",
                                                     show_default=False)] = None,
    metrics_host: Annotated[str, typer.Option("--metrics-host", help="Address of --metrics-port (0.0.0.0 in a Pod, "
                                              "with a NetworkPolicy that lets only the scraper in).")] = "127.0.0.1",
) -> None:
    """Run the egress proxy for sandboxes on other machines (Kubernetes Pods), with the servers' database and secret.

    Each request names its sandbox and credential (Proxy-Authorization) and gets that sandbox's policy from the
    servers' database. Needs CORRAL_ACCESS_SECRET and CORRAL_AUDIT_KEY (the servers' values) and CORRAL_DB_URL (their
    database).
    """
    from .._settings import access_secret, audit_key, corral_home, database_url
    from ..backends.kubernetes import KEY_FILE
    from ..control import AUDIT_KEY_FILE

    url = db or database_url()
    if not url:
        raise typer.BadParameter("the servers' database is needed: set CORRAL_DB_URL or pass --db", param_hint="--db")
    state = corral_home(home)
    if access_secret() is None and not (state / KEY_FILE).exists():
        raise InvalidRequestError("CORRAL_ACCESS_SECRET is not set (nor is there a key a server on this machine made "
                                  f"in {state}): set it to the servers' value, which sandboxes' egress credentials "
                                  "derive from")
    if audit_key() is None and not (state / AUDIT_KEY_FILE).exists():
        # Else the proxy would make a key of its own, and the servers could not verify its egress records.
        raise InvalidRequestError(f"CORRAL_AUDIT_KEY is not set (nor is there a key a server on this machine made "
                                  f"in {state}): set it to the servers' value, which the audit chain is signed with")
    metrics = None if metrics_port is None else (metrics_host, metrics_port)
    asyncio.run(_run(host, port, url, state, cache_ttl, mirror, metrics))


async def _run(host: str, port: int, url: str, home: Path, cache_ttl: float, with_mirror: bool,
               metrics_at: tuple[str, int] | None) -> None:
    from ..backends.kubernetes import TokenKey
    from ..control import ControlStore
    from ..egress import EgressProxy, PackageMirror
    from ..service import EgressDirectory

    with _metrics_server(metrics_at) as metrics:
        store = ControlStore(url, home=home)
        directory = EgressDirectory(store, TokenKey.load(home).verify_egress, cache_ttl=cache_ttl, metrics=metrics)
        mirror = PackageMirror(home / "cache" / "packages") if with_mirror else None
        proxy = EgressProxy(on_event=directory.record, mirror=mirror)
        await _serve(directory, proxy, mirror, host, port)


@contextlib.contextmanager
def _metrics_server(at: tuple[str, int] | None) -> Iterator[EgressMetrics | None]:
    """The proxy's counters, served by prometheus_client's own HTTP server (a thread: a scrape never waits for the
    event loop) when `at` is given."""
    if at is None:
        yield None
        return
    from prometheus_client import start_http_server

    from ..service import egress_registry

    registry, metrics = egress_registry()
    try:
        server, thread = start_http_server(at[1], at[0], registry)
    except OSError as exc:
        raise InvalidRequestError(f"--metrics-port: cannot listen on {at[0]}:{at[1]}: {exc.strerror or exc}") from exc
    typer.echo(f"corral egress-proxy: metrics on {at[0]}:{server.server_port}/metrics", err=True)
    try:
        yield metrics
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def _serve(directory: EgressDirectory, proxy: EgressProxy, mirror: PackageMirror | None, host: str,
                 port: int) -> None:
    store = directory.store
    await store.start()
    try:
        await proxy.start()
        bound = await proxy.listen(host, port, directory.policy)
        where = ", ".join(f"{h}:{p}" for h, p in bound)
        typer.echo(f"corral egress-proxy: listening on {where}", err=True)
        log.info("egress proxy listening", extra={"addresses": where})
        await _until_stopped()
    finally:
        await proxy.close()
        if mirror is not None:
            await mirror.close()
        await store.close()


async def _until_stopped() -> None:
    """Until SIGTERM (a Pod's end) or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(RuntimeError):
                loop.remove_signal_handler(sig)
