"""Making an upper directory (or some paths of it) what a manifest says, touching what already matches least.

A file whose stat identity is the one the index recorded for the manifest's object was not touched since, and
stays; everything else that differs is removed and made again from the manifest (a regular file copied from its
object). Directories are kept and their metadata set; their times last, after their children are made. Nothing
below the upper directory is followed: entries are made and changed by name from their parent, and a symlink
where a directory should be is removed, never entered.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from ._entries import MODE_BITS, Entry, Identity, identity, walk
from ._objects import Objects, copy_fd

__all__ = ["apply", "in_scope"]

_OVERLAY_XATTRS = "trusted.overlay."


def in_scope(path: str, scopes: Iterable[str] | None) -> bool:
    return scopes is None or any(path == s or path.startswith(s + "/") for s in scopes)


def apply(upper: Path, uid_base: int, manifest: Mapping[str, Entry], index: Mapping[str, tuple[Identity, str]],
          objects: Objects, scopes: list[str] | None) -> dict[str, tuple[Identity, str]]:
    """Make `upper` (within `scopes`: relative paths, None for all of it) what `manifest` says; the index
    entries of the regular files it then holds in scope."""
    for scope in scopes or []:
        _ensure_parents(upper, scope, manifest, uid_base)
    _remove_differing(upper, uid_base, manifest, index, scopes)
    made: dict[str, tuple[Identity, str]] = {}
    dirs: list[Entry] = []
    for path in sorted(p for p in manifest if in_scope(p, scopes)):
        entry = manifest[path]
        _make(upper / path, entry, uid_base, objects)
        if entry.kind == "dir":
            dirs.append(entry)
        elif entry.kind == "file" and entry.object is not None:
            made[path] = (identity(os.lstat(upper / path)), entry.object)
    for entry in reversed(dirs):  # children first: making one moves its parent's mtime
        os.utime(upper / entry.path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
    return made


def _ensure_parents(upper: Path, scope: str, manifest: Mapping[str, Entry], uid_base: int) -> None:
    """The directories above a restored path exist as directories (as the manifest has them, where it has)."""
    parts = scope.split("/")[:-1]
    for i in range(len(parts)):
        rel = "/".join(parts[: i + 1])
        path = upper / rel
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                continue
            _remove(path)
        entry = manifest.get(rel)
        if entry is not None and entry.kind == "dir":
            _make(path, entry, uid_base, None)
        else:
            os.mkdir(path, 0o755)
            os.chown(path, uid_base, uid_base)


def _remove_differing(upper: Path, uid_base: int, manifest: Mapping[str, Entry],
                      index: Mapping[str, tuple[Identity, str]], scopes: list[str] | None) -> None:
    tops = scopes if scopes is not None else [""]
    for top in tops:
        removed: list[str] = []
        for rel, st in walk(upper, top):
            if not rel or any(rel.startswith(r + "/") for r in removed[-1:]):
                continue
            entry = manifest.get(rel)
            if entry is None or not _matches(entry, st, index.get(rel), uid_base):
                _remove(upper / rel)
                removed.append(rel)


def _matches(entry: Entry, st: os.stat_result, indexed: tuple[Identity, str] | None, uid_base: int) -> bool:
    """Whether what is there may stay (its metadata is set again anyway, except a kept file's)."""
    fmt = stat.S_IFMT(st.st_mode)
    if fmt != MODE_BITS.get(entry.kind, -1):
        return False
    if entry.kind == "file":
        return (entry.link is None and indexed is not None and indexed[1] == entry.object
                and tuple(indexed[0]) == identity(st) and stat.S_IMODE(st.st_mode) == entry.mode
                and st.st_uid - uid_base == entry.uid and st.st_gid - uid_base == entry.gid
                and st.st_mtime_ns == entry.mtime_ns)
    if entry.kind in ("char", "block", "whiteout"):
        return st.st_rdev == entry.rdev
    return entry.kind != "symlink"  # a symlink is made again (its target cannot be changed in place)


def _remove(path: Path) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()


def _make(path: Path, entry: Entry, uid_base: int, objects: Objects | None) -> None:
    """Make `entry` at `path` where nothing is (a directory or a kept file there gets its metadata only)."""
    exists = os.path.lexists(path)
    if entry.kind == "dir":
        if not exists:
            os.mkdir(path, 0o700)
    elif exists:
        if entry.kind == "file":
            return  # kept: it matched the manifest, metadata and all
        if entry.kind not in ("char", "block", "whiteout", "fifo", "socket"):
            return
    elif entry.kind == "file":
        _make_file(path, entry, objects)
    elif entry.kind == "symlink":
        os.symlink(entry.target or "", path)
    else:
        os.mknod(path, MODE_BITS[entry.kind] | 0o600, entry.rdev)
    if entry.kind == "file" and entry.link is not None and os.lstat(path).st_nlink > 1:
        return  # a second name: the first one's metadata is its own
    os.chown(path, entry.uid + uid_base, entry.gid + uid_base, follow_symlinks=False)
    if entry.kind != "symlink":
        os.chmod(path, entry.mode)
        _set_xattrs(path, entry)
    if entry.kind != "dir":
        os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)


def _make_file(path: Path, entry: Entry, objects: Objects | None) -> None:
    if entry.link is not None and os.path.lexists(first := _first_name(path, entry)):
        os.link(first, path, follow_symlinks=False)
        return
    if objects is None or entry.object is None:
        raise ValueError(f"no object for {entry.path}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        src = os.open(objects.path(entry.object), os.O_RDONLY | os.O_CLOEXEC)
        try:
            copy_fd(src, fd)
        finally:
            os.close(src)
    finally:
        os.close(fd)


def _first_name(path: Path, entry: Entry) -> Path:
    """The first name of a hard-linked file, found from this one's path (both relative to the same upper)."""
    depth = entry.path.count("/") + 1
    upper = path
    for _ in range(depth):
        upper = upper.parent
    return upper / (entry.link or "")


def _set_xattrs(path: Path, entry: Entry) -> None:
    """The manifest's xattrs, and no overlay xattr it does not have (an opaque mark left on a kept directory
    would hide the template's files under it)."""
    wanted = dict(entry.xattrs)
    with contextlib.suppress(OSError):
        for name in os.listxattr(path, follow_symlinks=False):
            if name.startswith(_OVERLAY_XATTRS) and name not in wanted:
                os.removexattr(path, name, follow_symlinks=False)
    for name, value in wanted.items():
        os.setxattr(path, name, value, follow_symlinks=False)
