"""What differs between two states of a sandbox's filesystem, as the sandbox sees it (upper over lower).

A manifest records only the upper directory; what the sandbox saw at a path is the upper entry, or nothing where
that is a whiteout or where an entry above it hides the lower layers (a whiteout, a non-directory, an opaque
directory), or else the lower layers' entry. Two states are compared that way, path by path: a file is modified
when its object differs (or, against the template's file, its bytes), "mode" when only its mode or owner does.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._contract import ChangeKind, EntryType, PathChange
from ._entries import Entry
from ._objects import Objects

__all__ = ["Lowers", "diff", "hidden", "read_lower"]

Lowers = Sequence[Path]  # the overlay's lower directories, topmost first
_COMPARE_MAX = 64 << 20  # bytes of a copied-up template file compared with the template's before calling it changed


def hidden(manifest: Mapping[str, Entry], parts: list[str]) -> bool:
    """Whether an upper entry above the path `parts` hides the lower layers there."""
    for i in range(1, len(parts)):
        above = manifest.get("/".join(parts[:i]))
        if above is not None and (above.kind != "dir" or _opaque(above)):
            return True
    return False


def _opaque(entry: Entry) -> bool:
    return any(name == "trusted.overlay.opaque" and value == b"y" for name, value in entry.xattrs)


def lower_stat(lowers: Lowers, rel: str) -> tuple[Path, os.stat_result] | None:
    for lower in lowers:
        path = lower / rel
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            return None  # a whiteout in a snapshot layer
        return path, st
    return None


def read_lower(lowers: Lowers, rel: str, limit: int) -> bytes | None:
    found = lower_stat(lowers, rel)
    if found is None or not stat.S_ISREG(found[1].st_mode):
        return None
    fd = os.open(found[0], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)


class _Side:
    """One state: a manifest, and where its files' bytes are (objects; the upper itself for "now")."""

    def __init__(self, manifest: Mapping[str, Entry], lowers: Lowers, objects: Objects, upper: Path | None) -> None:
        self.manifest, self.lowers, self.objects, self.upper = manifest, lowers, objects, upper

    def at(self, rel: str) -> Entry | tuple[Path, os.stat_result] | None:
        entry = self.manifest.get(rel)
        if entry is not None:
            return None if entry.kind == "whiteout" else entry
        if hidden(self.manifest, rel.split("/")):
            return None
        return lower_stat(self.lowers, rel)

    def file(self, entry: Entry) -> Path:
        if entry.object is not None and entry.object.startswith("o-"):
            return self.objects.path(entry.object)
        assert self.upper is not None  # "now": a changed file's bytes are in the upper directory
        return self.upper / entry.path


def diff(before: Mapping[str, Entry], after: Mapping[str, Entry], lowers: Lowers, objects: Objects,
         upper: Path | None) -> list[PathChange]:
    """Every path whose state differs between `before` and `after` (`upper`: where `after`'s changed files
    are, when it is the filesystem now), sorted by path."""
    old, new = _Side(before, lowers, objects, None), _Side(after, lowers, objects, upper)
    changes: list[PathChange] = []
    for rel in sorted(before.keys() | after.keys()):
        a, b = old.at(rel), new.at(rel)
        kind = _kind(old, a, new, b)
        if kind is not None:
            shown = b if b is not None else a
            changes.append(PathChange(path="/" + rel, kind=kind, size=_size(b), old_size=_size(a),
                                      type=_type(shown)))
    return changes


def _kind(old: _Side, a: Entry | tuple[Path, os.stat_result] | None, new: _Side,
          b: Entry | tuple[Path, os.stat_result] | None) -> ChangeKind | None:
    if a is None and b is None:
        return None
    if a is None:
        return "added"
    if b is None:
        return "deleted"
    if not isinstance(a, Entry) and not isinstance(b, Entry):
        return None  # the template's on both sides
    if _type(a) != _type(b) or _fmt(a) != _fmt(b):
        return "modified"
    if _contents_differ(old, a, new, b):
        return "modified"
    if isinstance(a, Entry) and isinstance(b, Entry):
        return "mode" if (a.mode, a.uid, a.gid) != (b.mode, b.uid, b.gid) else None
    return "mode" if _meta(a) != _meta(b) else None


def _contents_differ(old: _Side, a: Entry | tuple[Path, os.stat_result], new: _Side,
                     b: Entry | tuple[Path, os.stat_result]) -> bool:
    if _type(a) == "symlink":
        return _target(a) != _target(b)
    if _type(a) != "file":
        return False
    if isinstance(a, Entry) and isinstance(b, Entry):
        if _first_object(old, a) == _first_object(new, b):
            return False
        if (a.size, a.mtime_ns) != (b.size, b.mtime_ns):
            return True  # written since: not read to find out it was written with the same bytes
        # The same size and mtime under another object: a chmod or chown copied it again; its bytes decide.
    if _size(a) != _size(b):
        return True
    return not _same_bytes(_path(old, a), _path(new, b), _size(a) or 0)


def _first_object(side: _Side, entry: Entry) -> str | None:
    first = side.manifest.get(entry.link) if entry.link else None
    return (first or entry).object


def _path(side: _Side, x: Entry | tuple[Path, os.stat_result]) -> Path:
    return side.file(x) if isinstance(x, Entry) else x[0]


def _same_bytes(p: Path, q: Path, size: int) -> bool:
    if size > _COMPARE_MAX:
        return False
    with open(p, "rb") as f, open(q, "rb") as g:
        while True:
            x, y = f.read(1 << 20), g.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def _type(x: Entry | tuple[Path, os.stat_result] | None) -> EntryType:
    if isinstance(x, Entry):
        return x.public_type  # type: ignore[return-value]
    if x is None:
        return "other"
    mode = x[1].st_mode
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "symlink" if stat.S_ISLNK(mode) \
        else "other"


def _fmt(x: Entry | tuple[Path, os.stat_result]) -> str:
    return x.kind if isinstance(x, Entry) else _type(x)


def _meta(x: Entry | tuple[Path, os.stat_result]) -> int:
    """The mode bits (owners are compared only between two upper entries: the template's are host ids)."""
    return x.mode if isinstance(x, Entry) else stat.S_IMODE(x[1].st_mode)


def _target(x: Entry | tuple[Path, os.stat_result]) -> str | None:
    return x.target if isinstance(x, Entry) else os.readlink(x[0])


def _size(x: Entry | tuple[Path, os.stat_result] | None) -> int | None:
    if x is None:
        return None
    if isinstance(x, Entry):
        return x.size
    mode = x[1].st_mode
    return x[1].st_size if stat.S_ISREG(mode) else len(os.fsencode(os.readlink(x[0]))) if stat.S_ISLNK(mode) else 0
