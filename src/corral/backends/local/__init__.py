"""The local backend: sandboxes as OCI bundles run by runc or runsc on this host."""

from ._backend import LocalBackend
from ._record import LocalRecord

__all__ = ["LocalBackend", "LocalRecord"]
