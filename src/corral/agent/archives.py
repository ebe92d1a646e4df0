"""Directory archives: download a path as a tar stream, upload a tar that is checked whole before extraction.

Kept apart from `files` because `tarfile` is slow to import and most sandboxes never use archives.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile

from . import protocol
from .channel import Channel
from .files import FileError, check_path, make_dirs, receive_into, temp_in, unlink_quietly

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
        tar.add(path, arcname=posixpath.basename(path) or ".", recursive=True)
    writer.flush()
    ch.send(protocol.DATA_END)
    ch.event(event="done")


def op_tar_put(ch: Channel, req: dict[str, Any]) -> None:
    target = check_path(req.get("path"), req.get("roots"))
    fd, spool = temp_in(target, ".corral-archive-", target)
    try:
        ch.event(event="ready")
        try:
            receive_into(ch, fd, target)
        except OSError as exc:
            raise FileError.from_os(exc, target) from exc
        os.lseek(fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(fd), "rb") as f:
            count = _extract_safely(f, target)
    finally:
        os.close(fd)
        unlink_quietly(spool)
    ch.event(event="done", entries=count)


def _extract_safely(f: IO[bytes], target: str) -> int:
    try:
        with tarfile.open(fileobj=f, mode="r:*") as tar:
            members = tar.getmembers()
            _validate_members(members)
            for member in members:
                _extract_member(tar, member, target)
            return len(members)
    except tarfile.TarError as exc:
        raise FileError("invalid_request", f"not a valid tar archive: {exc}") from exc
    except OSError as exc:
        raise FileError.from_os(exc, target) from exc


def _validate_members(members: list[tarfile.TarInfo]) -> None:
    """Refuse the whole archive before writing anything if any entry could land outside the target."""
    links: set[str] = set()
    for m in members:
        name = _member_name(m.name)
        if any(name == link or name.startswith(link + "/") for link in links):
            raise FileError("invalid_request", f"archive entry {m.name!r} goes through a link in the archive")
        if m.issym() or m.islnk():
            dest = m.linkname
            if "\x00" in dest or dest.startswith("/"):
                raise FileError("invalid_request", f"archive link {m.name!r} points to absolute path {dest!r}")
            base = posixpath.dirname(name) if m.issym() else ""
            resolved = posixpath.normpath(posixpath.join(base, dest))
            if resolved == ".." or resolved.startswith("../"):
                raise FileError("invalid_request", f"archive link {m.name!r} -> {dest!r} leads outside the target")
            links.add(name)
        elif not (m.isfile() or m.isdir()):
            raise FileError("invalid_request", f"archive entry {m.name!r} is a device, FIFO or other special file")


def _member_name(raw: str) -> str:
    if "\x00" in raw or raw.startswith("/"):
        raise FileError("invalid_request", f"archive entry {raw!r} has an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileError("invalid_request", f"archive entry {raw!r} contains '..'")
    if not parts:
        return "."
    return "/".join(parts)


def _extract_member(tar: tarfile.TarFile, m: tarfile.TarInfo, target: str) -> None:
    name = _member_name(m.name)
    dest = posixpath.join(target, name) if name != "." else target
    mode = (m.mode & 0o777) or (0o755 if m.isdir() else 0o644)
    if m.isdir():
        make_dirs(dest)
        os.chmod(dest, mode | 0o700)
        return
    make_dirs(posixpath.dirname(dest))
    if os.path.lexists(dest) and not os.path.isdir(dest):
        os.unlink(dest)
    if m.issym():
        os.symlink(m.linkname, dest)
    elif m.islnk():
        os.link(posixpath.join(target, _member_name(m.linkname)), dest)
    else:
        src = tar.extractfile(m)
        assert src is not None
        with src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, protocol.CHUNK)
        os.chmod(dest, mode)




OPS = {"tar_get": op_tar_get, "tar_put": op_tar_put}
