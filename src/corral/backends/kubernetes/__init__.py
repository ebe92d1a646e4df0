"""The Kubernetes backend: sandboxes as hardened Pods, and Corral's reference deployment (docs/kubernetes.md).

The objects are built by pure functions (`_objects`: one sandbox's; `_deployment`: the reference deployment;
`_yaml`: their YAML) that import the standard library and Corral's own leaves only, so this package imports
without the `kubernetes` client library. The backend itself (`_backend.KubernetesBackend`, which needs
`corral[kubernetes]`) is loaded by name: `load_backend("kubernetes", home)`, `corral serve --backend kubernetes`
(docs/kubernetes-backend.md).
"""

from ._deployment import (
    DEFAULT_IMAGE,
    EGRESS_COMMAND,
    reference_deployment,
    reference_files,
    render_files,
    write_kustomization,
)
from ._objects import ClusterSettings, SandboxObjects, hardening_problems, sandbox_objects
from ._tokens import KEY_FILE, TokenKey
from ._yaml import dump_all

__all__ = [
    "DEFAULT_IMAGE",
    "EGRESS_COMMAND",
    "KEY_FILE",
    "ClusterSettings",
    "SandboxObjects",
    "TokenKey",
    "dump_all",
    "hardening_problems",
    "reference_deployment",
    "reference_files",
    "render_files",
    "sandbox_objects",
    "write_kustomization",
]
