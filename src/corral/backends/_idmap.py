"""Idmapped bind mounts: a directory shown with its owners shifted, without touching a byte of it.

Snapshot layers and volumes are stored with *canonical* owners (`CANONICAL_BASE + id`, for the ids 0..65535 of a
sandbox), while each sandbox runs in a user namespace of its own host range (`uid_base + id`). An idmapped mount
(Linux 5.12+, `mount_setattr(MOUNT_ATTR_IDMAP)`; overlayfs takes idmapped lower layers since 5.19) shows a
canonical tree to one sandbox with its own ids, so a snapshot or volume is shared by sandboxes of different
ranges with no `chown` pass over its files.

Written by hand because nothing packaged does it: util-linux's `mount -o X-mount.idmap` arrived in 2.39 (Debian 12
has 2.38, which ignores the option silently), runc only does idmapped mounts from 1.2, and Python has no binding
for `open_tree`/`mount_setattr`/`move_mount`. The user namespace that carries a mapping comes from a short-lived
`unshare --user` child whose maps are written from here, then opened and kept by fd; the child is killed at once.

Mappings are lists of `(on_disk, shown, count)` extents, the order of `/proc/<pid>/uid_map` lines: an on-disk owner
`on_disk + i` is shown (and written) as `shown + i`. Ids no extent covers show as the overflow id (`nobody`), and
the kernel refuses writes to files they own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .._exceptions import RuntimeUnavailableError, ServerError

__all__ = ["CANONICAL_BASE", "Extent", "canonical_to_sandbox", "host_to_sandbox", "idmapped_bind",
           "sandbox_to_canonical", "user_namespace"]

# Far above any sandbox slot (slots start at 1<<20 and take 65536 ids each) and below the invalid (uid_t)-1: no
# process on the host ever runs with these ids, so a canonical file is nobody's on the host.
CANONICAL_BASE = 0xF000_0000
ID_RANGE = 65536

Extent = tuple[int, int, int]  # (on disk, shown, count)

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # x86_64 and aarch64 alike (new syscalls)
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x0010_0000
_MOUNT_ATTR_NOATIME = 0x10
_MOUNT_ATTR__ATIME = 0x70  # the atime flags are one field: clear it to set one of them
_NS_WAIT = 2.0  # seconds for `unshare` to enter its new user namespace


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def sandbox_to_canonical(uid_base: int) -> list[Extent]:
    """Read a sandbox's files (host root's copy-ups stay root's) as canonical ones: for copying them out."""
    if uid_base == 0:
        return [(0, CANONICAL_BASE, ID_RANGE)]
    return [(0, 0, 1), (uid_base, CANONICAL_BASE, ID_RANGE)]


def canonical_to_sandbox(uid_base: int) -> list[Extent]:
    """Show canonical files to the sandbox whose root is host uid `uid_base` (0: a sandbox without a user
    namespace, whose ids are the host's: host root's files then stay unmapped, `nobody`, since an extent of
    root alone would overlap the range and the kernel refuses such a map)."""
    if uid_base == 0:
        return [(CANONICAL_BASE, 0, ID_RANGE)]
    return [(0, 0, 1), (CANONICAL_BASE, uid_base, ID_RANGE)]


def host_to_sandbox(uid_base: int) -> list[Extent]:
    """Show files owned by the host's ids (a template: host root's, and uid 1000's home) as the sandbox's own ids:
    what makes a template's files root's inside a sandbox created with root (docs/security.md)."""
    return [(0, uid_base, ID_RANGE)]


@contextlib.contextmanager
def user_namespace(extents: Sequence[Extent]) -> Iterator[int]:
    """An fd of a new user namespace with `extents` as its uid and gid maps, for `idmapped_bind`."""
    lines = "".join(f"{on_disk} {shown} {count}\n" for on_disk, shown, count in extents)
    try:
        child = subprocess.Popen(["unshare", "--user", "--", "sleep", "60"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise RuntimeUnavailableError("idmapped mounts need `unshare` (util-linux) on the host") from exc
    try:
        _wait_unshared(child.pid)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{child.pid}/{name}", "w") as f:
                f.write(lines)
        fd = os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ServerError(f"cannot make a user namespace for an idmapped mount: {exc}") from exc
    finally:
        child.kill()
        child.wait()
    try:
        yield fd
    finally:
        os.close(fd)


def _wait_unshared(pid: int) -> None:
    ours = os.readlink("/proc/self/ns/user")
    deadline = time.monotonic() + _NS_WAIT
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(f"/proc/{pid}/ns/user") != ours:
                return
        time.sleep(0.0005)
    raise ServerError(f"`unshare --user` did not enter a new user namespace within {_NS_WAIT:g}s")


def idmapped_bind(source: Path, target: Path, userns_fd: int, *, recursive: bool = False,
                  noatime: bool = False) -> None:
    """Bind-mount `source` on `target` (an existing directory), its owners mapped through `userns_fd`;
    `noatime`: reading through it never updates access times (a copy made through it writes nothing)."""
    flags = _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | (_AT_RECURSIVE if recursive else 0)
    tree = _syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), flags, what=f"open_tree({source})")
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP | (_MOUNT_ATTR_NOATIME if noatime else 0),
                          _MOUNT_ATTR__ATIME if noatime else 0, 0, userns_fd)
        _syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | (_AT_RECURSIVE if recursive else 0),
                 ctypes.byref(attr), ctypes.sizeof(attr), what=f"mount_setattr(idmap, {source})")
        _syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH,
                 what=f"move_mount({target})")
    finally:
        os.close(tree)


def _syscall(number: int, *args: object, what: str) -> int:
    result: int = _libc.syscall(number, *args)
    if result < 0:
        err = ctypes.get_errno()
        if err in (38, 22) and number != _SYS_MOVE_MOUNT:  # ENOSYS, EINVAL: kernel or filesystem without idmaps
            raise RuntimeUnavailableError(f"{what} failed: {os.strerror(err)}; idmapped mounts need Linux 5.19+ "
                                          "and a filesystem that supports them (ext4, xfs, btrfs, tmpfs 6.3+)")
        raise ServerError(f"{what} failed: {os.strerror(err)}")
    return result
