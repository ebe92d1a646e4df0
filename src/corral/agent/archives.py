"""Directory archives: download a path as a tar stream, upload a tar that is checked whole before extraction.

An upload is extracted below its target without ever following a symbolic link: not one in the archive, and not
one that sandbox code planted (or plants during the upload) under the target. See "walking without following".

Kept apart from `files` because `tarfile` is slow to import and most sandboxes never use archives.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile

from . import protocol
from .channel import Channel
from .file_access import FileError, check_path
from .files import receive_into
from .users import AGENT_IS_ROOT, ROOT

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any


class _FrameWriter:
    """A write-only file object that turns bytes into DATA frames."""

    def __init__(self, ch: Channel) -> None:
        self.ch = ch
        self.buf = bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        if len(self.buf) >= protocol.CHUNK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self.buf:
            self.ch.send(protocol.DATA, bytes(self.buf))
            self.buf.clear()


def op_tar_get(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    if not os.path.lexists(path):
        raise FileError("not_found", f"{path}: No such file or directory")
    ch.event(event="archive")
    writer = _FrameWriter(ch)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        if req.get("contents") is True and os.path.isdir(path):
            # What is in the directory, not the directory: extracting it back into a directory the agent does
            # not own (a tmpfs root) must not try to change that directory's mode.
            for name in sorted(os.listdir(path)):
                tar.add(posixpath.join(path, name), arcname=name, recursive=True)
        else:
            tar.add(path, arcname=posixpath.basename(path) or ".", recursive=True)
    writer.flush()
    ch.send(protocol.DATA_END)
    ch.event(event="done")


def op_tar_put(ch: Channel, req: dict[str, Any]) -> None:
    """Unpack an uploaded tar below `path`. `owners`: entries keep the owners the archive names, for a request
    acting as root (the engine restoring the /tmp of a sandbox with root across a pause to disk); otherwise what
    is unpacked belongs to whoever the request acts as."""
    roots = req.get("roots")
    target = check_path(req.get("path"), roots, write=True)
    owners = req.get("owners") is True
    if owners and not (AGENT_IS_ROOT and req.get("user") == ROOT.name):
        raise FileError("permission_denied", "an archive's owners are kept only by a request acting as root")
    real = os.path.realpath(target)  # the target's own links are followed once, here, and checked
    if roots:
        check_path(real, roots)
    root = _open_target(real, target)  # below it, nothing is ever followed
    try:
        count = _receive_and_extract(ch, root, real, target, owners=owners)
    finally:
        os.close(root)
    ch.event(event="done", entries=count)


def _receive_and_extract(ch: Channel, root: int, real: str, target: str, *, owners: bool = False) -> int:
    fd, spool = _spool(root, target)
    try:
        ch.event(event="ready")
        try:
            receive_into(ch, fd, target)
        except OSError as exc:
            raise FileError.from_os(exc, target) from exc
        os.lseek(fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(fd), "rb") as f:
            return _extract_safely(f, _Dirs(root, target, owners=owners), real)
    finally:
        os.close(fd)
        try:
            os.unlink(spool, dir_fd=root)
        except OSError:
            pass


def _open_target(real: str, target: str) -> int:
    """The target directory (made if missing) as a descriptor, walked from `/` without following any link: a
    link swapped into `real` after it was resolved and checked is refused, not followed."""
    try:
        top = os.open("/", _DIR)
    except OSError as exc:
        raise FileError.from_os(exc, target) from exc
    try:
        return _descend(top, real.split("/"), "/")
    finally:
        os.close(top)


def _spool(root: int, target: str) -> tuple[int, str]:
    """A new private file in the target directory, to hold the archive until it is checked whole."""
    for _ in range(100):
        name = ".corral-archive-" + os.urandom(6).hex()
        try:
            return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=root), name
        except FileExistsError:
            continue
        except OSError as exc:
            raise FileError.from_os(exc, target) from exc
    raise FileError("server_error", f"could not create a temporary file in {target}")


# -- walking without following links ----------------------------------------------------------------------
#
# Sandbox code can plant a symlink under the target at any time (`/workspace/out -> /etc`, or `-> ~/.ssh`, which
# is inside the roots but outside the target). Every path below the target is therefore opened one component at
# a time relative to its parent's descriptor, with O_NOFOLLOW: a link in the way is refused, even one that
# appears between the check before extraction and the write.

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# tarfile's own extraction filter (Python 3.12, 3.11.4+), applied as a second check: a template's Python may be
# older, so it is optional, and modes stay ours so that every template extracts the same way.
_DATA_FILTER = getattr(tarfile, "data_filter", None)


def _descend(fd: int, parts: list[str], base: str) -> int:
    """A new descriptor for the directory `parts` below `fd` (made where missing). `fd` stays open."""
    current = os.dup(fd)
    shown = base
    for part in parts:
        if not part:
            continue
        shown = posixpath.join(shown, part)
        try:
            child = _open_dir(current, part)
        except OSError as exc:
            raise _walk_error(exc, current, part, shown) from exc
        finally:
            os.close(current)
        current = child
    return current


def _open_dir(fd: int, name: str) -> int:
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(name, dir_fd=fd)
    except FileExistsError:
        pass  # made meanwhile: the open says what it is
    return os.open(name, _DIR, dir_fd=fd)


def _walk_error(exc: OSError, fd: int, name: str, shown: str) -> FileError:
    if _is_link(fd, name):
        return _through_link(shown)
    return FileError.from_os(exc, shown)


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _through_link(shown: str) -> FileError:
    return FileError("invalid_request", f"{shown} is a symbolic link: an archive is never extracted through one")


class _Dirs:
    """Directories below the target as descriptors, the last parent kept open (members come grouped by directory)."""

    def __init__(self, root: int, target: str, *, owners: bool = False) -> None:
        self.root = root
        self.target = target
        self.owners = owners  # entries get the owners the archive names (see `op_tar_put`)
        self._parts: list[str] | None = None
        self._fd = -1

    def open(self, parts: list[str]) -> int:
        """A new descriptor, for the caller to close."""
        return _descend(self.root, parts, self.target)

    def parent(self, parts: list[str]) -> int:
        """A descriptor this object keeps (until `close` or the next other parent)."""
        if parts != self._parts:
            self.close()
            self._fd = self.open(parts)
            self._parts = parts
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._parts = -1, None

    def refuse_planted_links(self, members: list[tarfile.TarInfo]) -> None:
        """Before anything is written: refuse the archive if an entry's directory is a link already on disk."""
        seen: set[str] = set()
        for m in members:
            parts = _parts(m.name)
            self._check_links(parts if m.isdir() else parts[:-1], seen)
            if m.islnk():
                self._check_links(_parts(m.linkname)[:-1], seen)

    def _check_links(self, parts: list[str], seen: set[str]) -> None:
        for i in range(1, len(parts) + 1):
            rel = "/".join(parts[:i])
            if rel in seen:
                continue
            try:
                st = os.stat(rel, dir_fd=self.root, follow_symlinks=False)
            except FileNotFoundError:
                return  # nothing below a missing directory exists yet
            if stat.S_ISLNK(st.st_mode):
                raise _through_link(posixpath.join(self.target, rel))
            seen.add(rel)


def _extract_safely(f: IO[bytes], dirs: _Dirs, real: str) -> int:
    try:
        with tarfile.open(fileobj=f, mode="r:*") as tar:
            members = tar.getmembers()
            _validate_members(members, real)
            dirs.refuse_planted_links(members)
            try:
                for member in members:
                    _extract_member(tar, member, dirs)
            finally:
                dirs.close()
            return len(members)
    except tarfile.TarError as exc:
        raise FileError("invalid_request", f"not a valid tar archive: {exc}") from exc
    except OSError as exc:
        raise FileError.from_os(exc, dirs.target) from exc


def _validate_members(members: list[tarfile.TarInfo], real: str) -> None:
    """Refuse the whole archive before writing anything if any entry could land outside the target."""
    links: set[str] = set()
    for m in members:
        name = _member_name(m.name)
        if any(name == link or name.startswith(link + "/") for link in links):
            raise FileError("invalid_request", f"archive entry {m.name!r} goes through a link in the archive")
        if m.issym() or m.islnk():
            _validate_link(m, name, links)
            links.add(name)
        elif not (m.isfile() or m.isdir()):
            raise FileError("invalid_request", f"archive entry {m.name!r} is a device, FIFO or other special file")
        _filter(m, real)


def _validate_link(m: tarfile.TarInfo, name: str, links: set[str]) -> None:
    dest = m.linkname
    if "\x00" in dest or dest.startswith("/"):
        raise FileError("invalid_request", f"archive link {m.name!r} points to absolute path {dest!r}")
    base = posixpath.dirname(name) if m.issym() else ""
    resolved = posixpath.normpath(posixpath.join(base, dest))
    if resolved == ".." or resolved.startswith("../"):
        raise FileError("invalid_request", f"archive link {m.name!r} -> {dest!r} leads outside the target")
    if m.islnk():
        source = _member_name(dest)
        if source == "." or any(source == link or source.startswith(link + "/") for link in links):
            raise FileError("invalid_request", f"archive hard link {m.name!r} -> {dest!r} goes through a link")


def _filter(m: tarfile.TarInfo, real: str) -> None:
    if _DATA_FILTER is None:
        return
    try:
        _DATA_FILTER(m, real)
    except tarfile.TarError as exc:  # tarfile.FilterError, where it exists
        raise FileError("invalid_request", f"archive entry {m.name!r} refused: {exc}") from exc


def _member_name(raw: str) -> str:
    return "/".join(_parts(raw)) or "."


def _parts(raw: str) -> list[str]:
    """The components of an entry's name below the target ([] for the target itself)."""
    if "\x00" in raw or raw.startswith("/"):
        raise FileError("invalid_request", f"archive entry {raw!r} has an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileError("invalid_request", f"archive entry {raw!r} contains '..'")
    return parts


def _extract_member(tar: tarfile.TarFile, m: tarfile.TarInfo, dirs: _Dirs) -> None:
    parts = _parts(m.name)
    mode = (m.mode & 0o777) or (0o755 if m.isdir() else 0o644)
    if m.isdir():
        fd = dirs.open(parts)
        try:
            os.fchmod(fd, mode | 0o700)
            if dirs.owners:
                os.fchown(fd, *_owner(m))
        finally:
            os.close(fd)
        return
    parent, name = dirs.parent(parts[:-1]), parts[-1]
    _clear(parent, name, posixpath.join(dirs.target, *parts))
    if m.issym():
        os.symlink(m.linkname, name, dir_fd=parent)
    elif m.islnk():
        _hard_link(dirs, _parts(m.linkname), parent, name)
        return  # the same inode as its source, whose owner is set already
    else:
        _write_file(tar, m, parent, name, mode)
    if dirs.owners:
        os.chown(name, *_owner(m), dir_fd=parent, follow_symlinks=False)


def _owner(m: tarfile.TarInfo) -> tuple[int, int]:
    """The entry's uid and gid, where the sandbox has them (its user namespace maps 0..65535); else root's."""
    return (m.uid if 0 <= m.uid < 65536 else 0), (m.gid if 0 <= m.gid < 65536 else 0)


def _clear(parent: int, name: str, shown: str) -> None:
    """Remove what is in the way of a new non-directory entry; a link there is removed, never followed."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise FileError("invalid_request", f"{shown}: Is a directory")
    os.unlink(name, dir_fd=parent)


def _hard_link(dirs: _Dirs, source: list[str], parent: int, name: str) -> None:
    src_dir = dirs.open(source[:-1])
    try:
        os.link(source[-1], name, src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
    finally:
        os.close(src_dir)


def _write_file(tar: tarfile.TarFile, m: tarfile.TarInfo, parent: int, name: str, mode: int) -> None:
    src = tar.extractfile(m)
    assert src is not None
    with src, os.fdopen(os.open(name, _NEW_FILE, 0o600, dir_fd=parent), "wb") as out:
        shutil.copyfileobj(src, out, protocol.CHUNK)
        os.fchmod(out.fileno(), mode)


OPS = {"tar_get": op_tar_get, "tar_put": op_tar_put}
