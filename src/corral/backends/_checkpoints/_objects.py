"""The immutable objects a checkpoint's regular files point at, and the copy that makes them.

An object is a private copy (never a hard link: a file in the upper directory is changed in place by whoever
writes it, and a link would change the checkpoint with it), named `o-<16 hex>`, root's and 0400. The copy goes
through `copy_file_range`, which stays in the kernel (and shares blocks where the filesystem can reflink).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from ..._exceptions import CapacityError

__all__ = ["Objects", "copy_fd", "full_disk"]

_CHUNK = 1 << 30
_NO_KERNEL_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def full_disk(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def copy_fd(src: int, dst: int) -> int:
    """Copy all of `src` (from its start) to `dst`; the bytes copied."""
    total = 0
    try:
        while (n := os.copy_file_range(src, dst, _CHUNK)) > 0:
            total += n
        return total
    except OSError as exc:
        if exc.errno not in _NO_KERNEL_COPY or total:
            raise
    os.lseek(src, 0, os.SEEK_SET)
    while chunk := os.read(src, 1 << 20):
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
        total += len(chunk)
    return total


class Objects:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, object_id: str) -> Path:
        if not (object_id.startswith("o-") and len(object_id) == 18 and "/" not in object_id):
            raise ValueError(f"not an object id: {object_id!r}")
        return self.root / object_id

    def store(self, src: Path) -> tuple[str, int]:
        """Copy the regular file `src` (never followed if a symlink) into a new object: (its id, its bytes)."""
        object_id = f"o-{secrets.token_hex(8)}"
        dest = self.root / object_id
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOATIME)
        try:
            out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
            try:
                size = copy_fd(fd, out)
            except BaseException:
                os.close(out)
                dest.unlink(missing_ok=True)
                raise
            os.close(out)
        finally:
            os.close(fd)
        return object_id, size

    def read(self, object_id: str, limit: int) -> bytes:
        with open(self.path(object_id), "rb") as f:
            return f.read(limit)

    def remove(self, object_ids: set[str]) -> None:
        for object_id in object_ids:
            with contextlib.suppress(FileNotFoundError):
                self.path(object_id).unlink()

    def all(self) -> set[str]:
        try:
            return {name for name in os.listdir(self.root) if name.startswith("o-")}
        except FileNotFoundError:
            return set()

    def bytes_used(self) -> int:
        total = 0
        with os.scandir(self.root) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total


def capacity_error(exc: OSError, what: str) -> CapacityError:
    return CapacityError(f"{what}: no room left for it ({exc.strerror}); delete older checkpoints or give the "
                         "sandbox a larger disk", details={"reason": "checkpoint_disk_full"})
