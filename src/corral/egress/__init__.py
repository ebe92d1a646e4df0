"""Egress control: the one way out of a sandbox (docs/egress.md).

`EgressPolicy` says what a sandbox may reach; `EgressProxy` enforces it on the host, per sandbox socket, and
reports every attempt as an `EgressEvent`; `PackageMirrorProtocol` is the seam to the package mirror
(`PackageMirror`, the host's cache of PyPI and npm).
"""

from ._events import RULE_CLASSES, EgressEvent, MirrorResponse, PackageMirrorProtocol, rule_class
from ._mirror import PackageMirror
from ._policy import EgressPolicy
from ._proxy import EgressProxy, Identify

__all__ = ["RULE_CLASSES", "EgressEvent", "EgressPolicy", "EgressProxy", "Identify", "MirrorResponse",
           "PackageMirror", "PackageMirrorProtocol", "rule_class"]
