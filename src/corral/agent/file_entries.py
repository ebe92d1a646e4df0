"""A file's entry, as listings, stat and watches describe it: name, path, type, size, mode, mtime, owner and group
names (as the sandbox's /etc/passwd and /etc/group say, `Names`), `ls -l` permissions, metadata, and for a symlink
its text and where it leads."""

from __future__ import annotations

import os
import posixpath
import stat

from .file_metadata import read_metadata

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any


class Names:
    """uid -> user name and gid -> group name, from the sandbox's /etc/passwd and /etc/group, each read at most
    once: one `Names` per request keeps a listing of a big directory at one read of each file."""

    def __init__(self, users: str = "/etc/passwd", groups: str = "/etc/group") -> None:
        self._files = (users, groups)
        self._users: dict[int, str] | None = None
        self._groups: dict[int, str] | None = None

    def user(self, uid: int) -> str:
        if self._users is None:
            self._users = _read_ids(self._files[0])
        return self._users.get(uid, str(uid))

    def group(self, gid: int) -> str:
        if self._groups is None:
            self._groups = _read_ids(self._files[1])
        return self._groups.get(gid, str(gid))


def _read_ids(path: str) -> dict[int, str]:
    """name:x:id:... lines -> {id: name}; the first name of an id wins, as getpwuid's does."""
    ids: dict[int, str] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                fields = line.split(b":", 3)
                if len(fields) > 2 and fields[2].isdigit():
                    ids.setdefault(int(fields[2]), fields[0].decode("utf-8", "replace"))
    except OSError:
        pass
    return ids


def entry(path: str, st: os.stat_result, name: str | None = None, names: Names | None = None) -> dict[str, Any]:
    names = names or Names()
    kind = _kind(st.st_mode)
    info: dict[str, Any] = {
        "name": name if name is not None else posixpath.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
        "owner": names.user(st.st_uid),
        "group": names.group(st.st_gid),
        "permissions": stat.filemode(st.st_mode),
        "metadata": read_metadata(path) if kind in ("file", "dir") else {},
    }
    if kind == "symlink":
        info.update(_link(path))
    return info


def _kind(mode: int) -> str:
    return ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "symlink" if stat.S_ISLNK(mode) else "other")


def _link(path: str) -> dict[str, Any]:
    """A symlink's text, the path it finally leads to, and what is there (None: nothing, the link dangles)."""
    try:
        target: str | None = os.readlink(path)
    except OSError:
        target = None
    resolved = os.path.realpath(path)
    try:
        target_type: str | None = _kind(os.stat(resolved).st_mode)
    except OSError:
        target_type = None
    return {"target": target, "resolved": resolved, "target_type": target_type}
