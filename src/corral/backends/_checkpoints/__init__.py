"""The backend-neutral checkpoint store (docs/lifecycle.md, "Checkpoints"), used by the local and Docker backends.

A backend whose sandboxes write into an overlay's upper directory on this host gives the store that directory
(with the sandbox's uid base, so owners are kept relative to it) and the overlay's lower directories; the store
keeps manifests, immutable objects and an index, and restores an upper directory (or paths of it) while nothing
of the overlay is mounted.
"""

from ._diff import Lowers
from ._store import CheckpointStore, relative

__all__ = ["CheckpointStore", "Lowers", "relative"]
