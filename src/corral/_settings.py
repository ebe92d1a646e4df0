"""The one place that reads Corral's environment variables.

`CORRAL_HOME` is the server's state directory (database, templates, sandboxes); default `/var/lib/corral`.
`CORRAL_ADMIN_KEY` is the bootstrap admin key a fresh server takes (else it generates one).
`CORRAL_DB_URL` is the server's database, a SQLAlchemy async URL (`postgresql+asyncpg://user@host/db`, or
`postgresql+asyncpg://user@/db?host=/run/postgresql` for a Unix socket); default SQLite in `CORRAL_HOME`.
`CORRAL_URL` is where clients find the API server; default `http://127.0.0.1:7770`.
`CORRAL_API_KEY` is the API key clients send as a Bearer token.
`CORRAL_ACCESS_SECRET` is the secret sandboxes' access tokens are derived from (several replicas share one); by
default each server keeps one in `CORRAL_HOME/access.key`.
`CORRAL_AUDIT_KEY` is the audit chain's HMAC key, or several separated by commas, newest first (replicas sharing
one database share it); by default each server keeps them in `CORRAL_HOME/audit.key`.
`CORRAL_REGISTRY_CREDS` (`USER:PASSWORD`) is what `corral templates push` logs in to a registry with, when no
`--creds` is given (without either, skopeo reads the standard auth files).
`KUBECONFIG` is read by the Kubernetes client itself; Corral reads it only to say where it looked.
`CORRAL_REPLICA_ID`, `CORRAL_ADVERTISE_URL`: this server's replica id and the URL other replicas reach it at
(docs/replicas.md); `CORRAL_REPLICA_SECRET` the secret replicas sign forwarded requests with (default: one kept in
the shared database).
`CORRAL_AGENT_HEARTBEAT_INTERVAL`, `CORRAL_AGENT_IDLE_TIMEOUT` (seconds; default 5 and 30, an idle timeout of 0
waits forever): how often a silent sandbox agent beats, and how long the server waits on one that says nothing
(docs/architecture.md, "Agent liveness").
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = Path("/var/lib/corral")
DEFAULT_URL = "http://127.0.0.1:7770"


def corral_home(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state directory: `explicit`, else `$CORRAL_HOME`, else `/var/lib/corral`."""
    if explicit is not None:
        return Path(explicit)
    value = os.environ.get("CORRAL_HOME")
    return Path(value) if value else DEFAULT_HOME


def agent_seconds(name: str) -> float | None:
    """`$CORRAL_AGENT_<NAME>` as seconds, if set; a value that is no number is an error at start, not a default."""
    value = os.environ.get(f"CORRAL_AGENT_{name}")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"CORRAL_AGENT_{name} must be a number of seconds, not {value!r}") from None
    if not seconds >= 0:
        raise ValueError(f"CORRAL_AGENT_{name} must not be negative, not {value!r}")
    return seconds


def admin_key() -> str | None:
    """`$CORRAL_ADMIN_KEY`, the bootstrap admin key of a fresh server, if set."""
    return os.environ.get("CORRAL_ADMIN_KEY") or None


def database_url() -> str | None:
    """`$CORRAL_DB_URL`, the server's database, if set (else the server uses SQLite in its state directory)."""
    return os.environ.get("CORRAL_DB_URL") or None


def api_url() -> str:
    """`$CORRAL_URL`, the API server clients talk to, else `http://127.0.0.1:7770`."""
    return os.environ.get("CORRAL_URL") or DEFAULT_URL


def api_key() -> str | None:
    """`$CORRAL_API_KEY`, the key clients send as `Authorization: Bearer`, if set."""
    return os.environ.get("CORRAL_API_KEY") or None


def access_secret() -> str | None:
    """`$CORRAL_ACCESS_SECRET`, the secret sandboxes' access tokens are derived from, if set."""
    return os.environ.get("CORRAL_ACCESS_SECRET") or None


def audit_key() -> str | None:
    """`$CORRAL_AUDIT_KEY`, the audit chain's HMAC keys (comma-separated, newest first), if set."""
    return os.environ.get("CORRAL_AUDIT_KEY") or None


def k8s_images() -> str | None:
    """`$CORRAL_K8S_IMAGES`: the Kubernetes backend's template images, a JSON object (template name or digest ->
    image reference by digest) or the path of a file holding one."""
    return os.environ.get("CORRAL_K8S_IMAGES") or None


def k8s_backend() -> dict[str, str]:
    """The Kubernetes backend's settings from the environment (`corral serve --backend kubernetes` passes no
    options): `CORRAL_K8S_NAMESPACE`, `CORRAL_K8S_CONTROL_NAMESPACE`, `CORRAL_K8S_RUNTIME_CLASS` (`none`: the
    cluster's default runtime), `CORRAL_K8S_POOL` (`template=size,...`) and `CORRAL_K8S_USER_NAMESPACE` (`1`:
    each Pod with `hostUsers: false`), those that are set."""
    names = {"namespace": "CORRAL_K8S_NAMESPACE", "control_namespace": "CORRAL_K8S_CONTROL_NAMESPACE",
             "runtime_class": "CORRAL_K8S_RUNTIME_CLASS", "pool": "CORRAL_K8S_POOL",
             "user_namespace": "CORRAL_K8S_USER_NAMESPACE"}
    return {key: os.environ[name] for key, name in names.items() if os.environ.get(name)}


def kubeconfig() -> str | None:
    """`$KUBECONFIG`, if set: the Kubernetes client reads it itself; Corral names it when no cluster answers."""
    return os.environ.get("KUBECONFIG") or None


def registry_creds() -> str | None:
    """`$CORRAL_REGISTRY_CREDS` (`USER:PASSWORD`) for pushing template images, if set."""
    return os.environ.get("CORRAL_REGISTRY_CREDS") or None


def warm_pools() -> str | None:
    """`CORRAL_POOLS`: warm pools for `corral serve` (`default=50:10 default/root=20`; docs/performance.md)."""
    return os.environ.get("CORRAL_POOLS") or None


def replica_id() -> str | None:
    """`$CORRAL_REPLICA_ID`, this server's replica id, if set (else one kept in `CORRAL_HOME/replica.id`)."""
    return os.environ.get("CORRAL_REPLICA_ID") or None


def advertise_url() -> str | None:
    """`$CORRAL_ADVERTISE_URL`, where the other replicas reach this server, if set."""
    return os.environ.get("CORRAL_ADVERTISE_URL") or None


def replica_secret() -> str | None:
    """`$CORRAL_REPLICA_SECRET`, the secret replicas sign forwarded requests with, if set."""
    return os.environ.get("CORRAL_REPLICA_SECRET") or None
