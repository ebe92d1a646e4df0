"""Egress control: the one way out of a sandbox (docs/egress.md).

`EgressPolicy` says what a sandbox may reach, and carries its secrets (docs/secrets.md); `EgressProxy` enforces it
on the host, per sandbox socket, reports every attempt as an `EgressEvent`, and puts secrets into requests to their
hosts, through TLS it intercepts with the deployment's `CertificateAuthority`; `PackageMirrorProtocol` is the seam
to the package mirror (`PackageMirror`, the host's cache of PyPI and npm).
"""

from ._ca import CA_DIR, CertificateAuthority, upstream_context
from ._events import RULE_CLASSES, EgressEvent, MirrorResponse, PackageMirrorProtocol, rule_class
from ._mirror import PackageMirror
from ._policy import EgressPolicy
from ._proxy import EgressProxy, Identify

__all__ = ["CA_DIR", "RULE_CLASSES", "CertificateAuthority", "EgressEvent", "EgressPolicy", "EgressProxy", "Identify",
           "MirrorResponse", "PackageMirror", "PackageMirrorProtocol", "rule_class", "upstream_context"]
