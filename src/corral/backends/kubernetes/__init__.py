"""The Kubernetes backend: sandboxes as Pods of a cluster (docs/kubernetes-backend.md).

The objects are built by pure functions (`_objects`) that import no client, so this package imports without the
Kubernetes client library. The backend itself (`_backend.KubernetesBackend`, which needs `corral[kubernetes]`)
is loaded by name: `load_backend("kubernetes", home)`, `corral serve --backend kubernetes`.
"""

from ._objects import ClusterSettings, SandboxObjects, sandbox_objects

__all__ = ["ClusterSettings", "SandboxObjects", "sandbox_objects"]
