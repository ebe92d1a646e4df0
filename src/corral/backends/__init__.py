"""Backends: where sandboxes get their isolation. `local` runs OCI bundles with runc or runsc."""

from ._base import Backend, Record

__all__ = ["Backend", "Record"]
