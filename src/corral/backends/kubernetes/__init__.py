"""The Kubernetes backend: sandboxes as hardened Pods, and Corral's reference deployment (docs/kubernetes.md).

The objects are built by pure functions (`_objects`, `_deployment`) that import the standard library, pyyaml
and Corral's own leaves only, so this package imports without the `kubernetes` client library.
"""

from ._objects import ClusterSettings, SandboxObjects, hardening_problems, sandbox_objects

__all__ = ["ClusterSettings", "SandboxObjects", "hardening_problems", "sandbox_objects"]
