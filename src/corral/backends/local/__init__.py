"""The local backend: sandboxes as OCI bundles run by runc or runsc on this host."""

from ._backend import LocalBackend, LocalRecord

__all__ = ["LocalBackend", "LocalRecord"]
