"""The Kubernetes backend: sandboxes as Pods of a cluster (`corral[kubernetes]`).

Loaded by name (`load_backend("kubernetes", home)`, `corral serve --backend kubernetes`), so that only those who
choose it need the Kubernetes client.
"""

from ._backend import LIMITATIONS, KubernetesBackend, KubernetesRecord
from ._objects import ClusterSettings, SandboxObjects, sandbox_objects

__all__ = ["LIMITATIONS", "ClusterSettings", "KubernetesBackend", "KubernetesRecord", "SandboxObjects",
           "sandbox_objects"]
