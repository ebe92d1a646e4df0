"""What one entry of an overlay's upper directory is, as a checkpoint's manifest records it.

An entry is everything needed to make it again from nothing: its type (whiteouts, char 0/0, are a type of their
own: they are how overlayfs records a deleted lower file), mode, owner *relative to the sandbox's uid base* (so
that the same manifest restores onto the sandbox's range whatever host ids it has), size, mtime, a symlink's
target, a device's numbers, its xattrs (overlayfs' `trusted.overlay.opaque` marks a directory that hides the
lower one; `security.capability` is a file's capabilities) and, for a regular file, the immutable object holding
its bytes (or, for a second name of a hard-linked file, the path of the first).

The walk never follows a symlink and reads each entry with one lstat: it runs over a tree the sandbox wrote.
"""

from __future__ import annotations

import base64
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["Entry", "Identity", "entry_from_stat", "identity", "walk"]

Identity = tuple[int, int, int, int, int, int, int]  # ino, size, mtime_ns, ctime_ns, st_mode, uid, gid

_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFIFO: "fifo",
          stat.S_IFCHR: "char", stat.S_IFBLK: "block", stat.S_IFSOCK: "socket"}
MODE_BITS = {kind: fmt for fmt, kind in _KINDS.items()} | {"whiteout": stat.S_IFCHR}


@dataclass(frozen=True, slots=True)
class Entry:
    path: str  # relative to the upper directory, "/"-separated, no leading "/"
    kind: str  # file, dir, symlink, whiteout, fifo, char, block, socket
    mode: int  # permission bits (S_IMODE)
    uid: int  # relative to the sandbox's uid base
    gid: int
    size: int
    mtime_ns: int
    target: str | None = None  # symlink
    rdev: int = 0  # char, block
    xattrs: tuple[tuple[str, bytes], ...] = ()
    object: str | None = None  # file: the object holding its bytes
    link: str | None = None  # file: the first path of its hard-linked inode in this manifest

    @property
    def public_type(self) -> str:
        """What `PathChange.type` calls it."""
        return self.kind if self.kind in ("file", "dir", "symlink") else "other"

    def with_object(self, object_id: str | None, link: str | None = None) -> Entry:
        return replace(self, object=object_id, link=link)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"p": self.path, "k": self.kind, "m": self.mode, "u": self.uid, "g": self.gid,
                               "s": self.size, "t": self.mtime_ns}
        if self.target is not None:
            out["y"] = self.target
        if self.rdev:
            out["r"] = self.rdev
        if self.xattrs:
            out["x"] = [[name, base64.b64encode(value).decode()] for name, value in self.xattrs]
        if self.object is not None:
            out["o"] = self.object
        if self.link is not None:
            out["l"] = self.link
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(path=str(data["p"]), kind=str(data["k"]), mode=int(data["m"]), uid=int(data["u"]),
                   gid=int(data["g"]), size=int(data["s"]), mtime_ns=int(data["t"]), target=data.get("y"),
                   rdev=int(data.get("r", 0)),
                   xattrs=tuple((str(n), base64.b64decode(v)) for n, v in data.get("x", ())),
                   object=data.get("o"), link=data.get("l"))


def identity(st: os.stat_result) -> Identity:
    """What says a file was not touched since it was last seen: any write, chmod, chown, rename over or
    replacement changes one of these (ctime moves with every change to the inode)."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_gid)


def walk(root: Path, top: str = "") -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below `root/top` (and `top` itself when given), parents before children, never following a
    symlink: (path relative to `root`, its lstat)."""
    stack: list[str] = []
    if top:
        try:
            st = os.lstat(root / top)
        except FileNotFoundError:
            return
        yield top, st
        if not stat.S_ISDIR(st.st_mode):
            return
    stack.append(top)
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(root / rel if rel else root) as it:
                children = sorted((entry.name, entry.stat(follow_symlinks=False)) for entry in it)
        except FileNotFoundError:
            continue
        dirs: list[str] = []
        for name, st in children:
            path = f"{rel}/{name}" if rel else name
            yield path, st
            if stat.S_ISDIR(st.st_mode):
                dirs.append(path)
        stack.extend(reversed(dirs))


def entry_from_stat(root: Path, rel: str, st: os.stat_result, uid_base: int) -> Entry:
    """The entry for `rel` (its lstat `st`), without its object (the caller decides whether to copy)."""
    fmt = stat.S_IFMT(st.st_mode)
    kind = _KINDS.get(fmt, "other")
    rdev = st.st_rdev if fmt in (stat.S_IFCHR, stat.S_IFBLK) else 0
    if fmt == stat.S_IFCHR and rdev == 0:
        kind = "whiteout"
    path = root / rel
    target = os.readlink(path) if kind == "symlink" else None
    size = len(os.fsencode(target)) if target is not None else (st.st_size if kind == "file" else 0)
    return Entry(path=rel, kind=kind, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid - uid_base,
                 gid=st.st_gid - uid_base, size=size, mtime_ns=st.st_mtime_ns, target=target, rdev=rdev,
                 xattrs=_xattrs(path) if kind != "symlink" else ())


def _xattrs(path: Path) -> tuple[tuple[str, bytes], ...]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return ()
    found: list[tuple[str, bytes]] = []
    for name in sorted(names):
        try:
            found.append((name, os.getxattr(path, name, follow_symlinks=False)))
        except OSError:
            continue
    return tuple(found)
