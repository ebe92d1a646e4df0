"""Filesystem primitives for building templates safely: mounts, removal, atomic writes, in-root paths.

Everything here works on host paths that Corral itself controls (the template store). The one rule that
matters: never delete through a mount point. A build directory can hold mounts (mmdebstrap mounts /proc and
/sys in its target, and may bind-mount host /dev nodes); `remove_tree` unmounts them first and then removes
with `rm --one-file-system`, so a leftover mount can never take host files with it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
from pathlib import Path

from .._atomic import fsync_dir, write_atomic
from .._exceptions import ServerError

__all__ = [
    "atomic_write",
    "disk_usage",
    "exchange",
    "fsync_dir",
    "mounts_under",
    "remove_tree",
    "resolve_in_root",
    "syncfs",
    "unmount_under",
]

logger = logging.getLogger("corral.templates")

_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_MAX_SYMLINKS = 40


def _raise_errno(path: str | os.PathLike[str]) -> None:
    code = ctypes.get_errno()
    raise OSError(code, os.strerror(code), os.fspath(path))


def _unescape_mountinfo(field: bytes) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as \ooo octal escapes.
    out = bytearray()
    i = 0
    while i < len(field):
        chunk = field[i + 1 : i + 4]
        if field[i] == 0x5C and len(chunk) == 3 and chunk.isdigit():
            out.append(int(chunk, 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return os.fsdecode(bytes(out))


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this mount namespace, deepest first."""
    base = os.path.realpath(path)
    found: list[str] = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            mount_point = _unescape_mountinfo(line.split(b" ")[4])
            if mount_point == base or mount_point.startswith(base.rstrip("/") + "/"):
                found.append(mount_point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def _umount(mount_point: str, *, lazy: bool) -> None:
    if _libc.umount2(os.fsencode(mount_point), _MNT_DETACH if lazy else 0) != 0:
        _raise_errno(mount_point)


def unmount_under(path: Path) -> None:
    """Unmount everything at or below `path`; a busy mount is detached (it stays alive elsewhere, unreachable
    from here). `ServerError` if something is still mounted afterwards."""
    for _ in range(8):  # mounts stacked on the same point come off one per pass
        remaining = mounts_under(path)
        if not remaining:
            return
        for mount_point in remaining:
            try:
                _umount(mount_point, lazy=False)
            except OSError:
                try:
                    _umount(mount_point, lazy=True)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOENT):  # already gone
                        logger.warning("cannot unmount %s: %s", mount_point, exc.strerror)
    remaining = mounts_under(path)
    if remaining:
        raise ServerError(f"cannot unmount {', '.join(remaining)}; refusing to delete {path}")


def remove_tree(path: Path) -> None:
    """Delete `path` recursively after unmounting anything below it, never crossing to another filesystem."""
    if not os.path.lexists(path):
        return
    unmount_under(path)
    result = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", os.fspath(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise ServerError(f"cannot delete {path}: {message}")


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that readers see the old content or the new, never a mix."""
    write_atomic(path, data, mode=mode)


def syncfs(path: Path) -> None:
    """Flush the filesystem holding `path`, so a crash after a rename cannot expose half-written files."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            _raise_errno(path)
    finally:
        os.close(fd)


def exchange(a: Path, b: Path) -> None:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE)."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        _raise_errno(a)


def disk_usage(path: Path) -> int:
    """Bytes allocated under `path` (like `du -s`), hard links counted once, other filesystems skipped."""
    top = os.lstat(path)
    total = top.st_blocks * 512
    seen: set[tuple[int, int]] = set()
    stack = [os.fspath(path)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if st.st_dev != top.st_dev:
                    continue
                if st.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return total


def resolve_in_root(root: Path, path: str, *, follow_last: bool = True) -> Path:
    """The host path of `path` as a process chrooted at `root` would see it.

    Symlinks are followed as if `root` were `/`: absolute targets start again at `root`, and `..` stops at
    `root`. The result is always inside `root`, whatever symlinks the tree holds. With `follow_last=False`
    the last component is returned as is (to replace or inspect a symlink itself).
    """
    pending = [p for p in path.split("/") if p not in ("", ".")]
    pending.reverse()  # a stack: the next component is at the end
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if (pending or follow_last) and candidate.is_symlink():
            links += 1
            if links > _MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            pending.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
            continue
        resolved.append(part)
    return root.joinpath(*resolved)
