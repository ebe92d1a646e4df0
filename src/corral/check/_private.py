"""`corral check --backend NAME`: the checklist against a private server that the check starts on this machine,
and an honest skip when the platform that backend needs is not there.

The server is `corral serve --backend NAME` itself (`corral.server.private_server`: a temporary state directory,
embedded SQLite, an admin key of its own, this machine's templates); the check reaches it by URL and, being on
the same machine, with its state directory (the host-side probes run). Afterwards it is stopped and every
sandbox it left is destroyed through the same backend (on Kubernetes: the Pods, Secrets and NetworkPolicies of
its own replica id, nobody else's).

On Kubernetes the cluster is asked first (`GET /version`, within `CLUSTER_TIMEOUT` seconds): when no
configuration is found or nothing answers, nothing runs and the command exits `SKIPPED` (3), saying why. A
cluster that answers and refuses (RBAC, credentials) is an error, not a skip: there is a cluster to fix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from .._exceptions import RuntimeUnavailableError
from .._settings import k8s_backend
from ._context import Target

__all__ = ["CLUSTER_TIMEOUT", "SKIPPED", "cluster_missing", "private_target"]

SKIPPED = 3  # exit status: the checklist did not run (0 passed, 1 failed, 2 usage error)
CLUSTER_TIMEOUT = 5.0  # seconds the Kubernetes API server has to answer before the check is skipped


def cluster_missing(timeout: float = CLUSTER_TIMEOUT) -> str | None:
    """Why no Kubernetes cluster can be checked from here (no configuration, or no API server answers within
    `timeout` seconds), or None when one answers. A cluster that answers with a refusal raises its Corral error."""
    return asyncio.run(_cluster_missing(timeout))


async def _cluster_missing(timeout: float) -> str | None:
    from ..backends.kubernetes._api import KubeAPI  # the Kubernetes client: corral[kubernetes], only when asked

    api = KubeAPI("default")  # the version is cluster-wide: the namespace is never used
    try:
        await api.version(timeout)
    except RuntimeUnavailableError as exc:
        if "kubernetes_status" in exc.details:
            raise  # the API server answered (403, 5xx): a cluster is there and something about it needs fixing
        return exc.message
    finally:
        await api.close()
    return None


@contextmanager
def private_target(backend: str, *, namespace: str | None = None, template: str = "default") -> Iterator[Target]:
    """A private `corral serve --backend <backend>` as a `Target`, with `namespace` for its sandbox Pods on
    Kubernetes (else `$CORRAL_K8S_NAMESPACE`, else `corral-sandboxes`); stopped and emptied afterwards."""
    from ..backends.kubernetes import ClusterSettings
    from ..server import private_server  # the server's dependencies: corral[server], only when asked

    env = {"CORRAL_K8S_NAMESPACE": namespace} if namespace else {}
    # On Kubernetes the check reaches the cluster its server uses (the same configuration): item 44 reads its Pods.
    pods = None
    if backend == "kubernetes":
        pods = namespace or k8s_backend().get("namespace") or ClusterSettings().namespace
    with private_server(backend, env=env, prefix="corral-check-") as server:
        yield Target(url=server.url, admin_key=server.admin_key, home=server.home, template=template,
                     kube_namespace=pods)
