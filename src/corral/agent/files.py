"""File operations, performed inside the sandbox as the sandbox user.

Paths are resolved here, in the sandbox's own mount namespace, so a symlink planted by sandbox code can only
ever lead to another file of the same sandbox. Writes land in a temporary file beside the target and are
renamed into place only when every byte has arrived: a failed upload changes nothing.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
from typing import IO, Any

from . import protocol
from .channel import Channel

ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "disk_full",
    errno.EEXIST: "conflict",
    errno.ENOTEMPTY: "conflict",
    errno.EISDIR: "invalid_request",
    errno.ENOTDIR: "invalid_request",
    errno.ENAMETOOLONG: "invalid_request",
    errno.ELOOP: "invalid_request",
    errno.EXDEV: "invalid_request",
    errno.EINVAL: "invalid_request",
}


class FileError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_os(cls, exc: OSError, path: str) -> FileError:
        code = ERRNO_CODES.get(exc.errno or 0, "server_error")
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if code == "disk_full":
            reason = "no space left: the sandbox's disk limit is reached"
        return cls(code, f"{path}: {reason}")


def check_path(value: Any, roots: Any = None) -> str:
    """Validate a request path: absolute, valid UTF-8, no NUL; inside `roots` when given."""
    if not isinstance(value, str) or not value:
        raise FileError("invalid_request", "path must be a non-empty string")
    if "\x00" in value:
        raise FileError("invalid_request", "path contains a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FileError("invalid_request", "path is not valid UTF-8") from exc
    if not value.startswith("/"):
        raise FileError("invalid_request", f"path {value!r} is not absolute")
    path = posixpath.normpath(value)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    if roots:
        _check_roots(path, roots)
    return path


def _check_roots(path: str, roots: list[str]) -> None:
    # Resolve symlinks of everything but a missing tail: a link that leads out of the roots is refused.
    real = os.path.realpath(path)
    for root in roots:
        real_root = os.path.realpath(root)
        if real == real_root or real.startswith(real_root.rstrip("/") + "/"):
            return
    raise FileError("permission_denied",
                    f"{path} is outside the directories the file API may touch ({', '.join(roots)})")


def entry(path: str, st: os.stat_result, name: str | None = None) -> dict[str, Any]:
    kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
            else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
    info: dict[str, Any] = {
        "name": name if name is not None else posixpath.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }
    if kind == "symlink":
        try:
            info["target"] = os.readlink(path)
        except OSError:
            info["target"] = None
    return info


# -- operations ------------------------------------------------------------------------------------


def op_read(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise FileError("invalid_request", f"{path} is a directory; download it as an archive instead")
        if not stat.S_ISREG(st.st_mode):
            raise FileError("invalid_request", f"{path} is not a regular file")
        os.set_blocking(fd, True)
        ch.event(event="file", size=st.st_size)
        sent = 0
        while True:
            chunk = os.read(fd, protocol.CHUNK)
            if not chunk:
                break
            ch.send(protocol.DATA, chunk)
            sent += len(chunk)
        ch.send(protocol.DATA_END)
        ch.event(event="done", size=sent)
    finally:
        os.close(fd)


def op_write(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    mode = int(req.get("mode", 0o644)) & 0o7777
    parent = posixpath.dirname(path)
    if os.path.isdir(path):
        raise FileError("invalid_request", f"{path} is a directory")
    try:
        os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".corral-upload-", dir=parent)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    try:
        ch.event(event="ready")
        size = _receive_into(ch, fd, path)
        os.fchmod(fd, mode)
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
        tmp = ""
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            _unlink_quietly(tmp)
    ch.event(event="done", size=size, path=path)


def _receive_into(ch: Channel, fd: int, path: str) -> int:
    size = 0
    while True:
        kind, payload = ch.recv()
        if kind == protocol.DATA_END:
            return size
        if kind != protocol.DATA:
            raise FileError("invalid_request", f"unexpected frame kind {kind} during upload of {path}")
        view = memoryview(payload)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            # Read the rest of the upload before answering: closing on unread data resets the connection,
            # and the host would see "connection reset" instead of our error (disk full, say).
            _drain(ch)
            raise
        size += len(payload)


def _drain(ch: Channel) -> None:
    while ch.recv()[0] != protocol.DATA_END:
        pass


def op_list(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    try:
        with os.scandir(path) as it:
            entries = []
            for e in it:
                try:
                    entries.append(entry(posixpath.join(path, e.name), e.stat(follow_symlinks=False), e.name))
                except OSError:
                    continue
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    entries.sort(key=lambda e: e["name"])
    ch.event(event="done", entries=entries)


def op_stat(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    ch.event(event="done", entry=entry(path, st))


def op_exists(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    ch.event(event="done", exists=os.path.lexists(path))


def op_mkdir(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    created = not os.path.isdir(path)
    try:
        if req.get("parents", True):
            os.makedirs(path, exist_ok=True)
        else:
            os.mkdir(path)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    ch.event(event="done", created=created)


def op_remove(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"))
    if path == "/":
        raise FileError("invalid_request", "refusing to remove /")
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            if req.get("recursive", True):
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    ch.event(event="done")


def op_rename(ch: Channel, req: dict[str, Any]) -> None:
    roots = req.get("roots")
    src = check_path(req.get("src"), roots)
    dst = check_path(req.get("dst"), roots)
    try:
        if not req.get("overwrite", False) and os.path.lexists(dst):
            raise FileError("conflict", f"{dst} already exists")
        os.rename(src, dst)
    except OSError as exc:
        raise FileError.from_os(exc, src) from exc
    ch.event(event="done")


# -- archives --------------------------------------------------------------------------------------


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
    try:
        os.makedirs(target, exist_ok=True)
        fd, spool = tempfile.mkstemp(prefix=".corral-archive-", dir=target)
    except OSError as exc:
        raise FileError.from_os(exc, target) from exc
    try:
        ch.event(event="ready")
        try:
            _receive_into(ch, fd, target)
        except OSError as exc:
            raise FileError.from_os(exc, target) from exc
        os.lseek(fd, 0, os.SEEK_SET)
        with os.fdopen(os.dup(fd), "rb") as f:
            count = _extract_safely(f, target)
    finally:
        os.close(fd)
        _unlink_quietly(spool)
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
        os.makedirs(dest, exist_ok=True)
        os.chmod(dest, mode | 0o700)
        return
    os.makedirs(posixpath.dirname(dest), exist_ok=True)
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


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


OPS = {
    "read": op_read,
    "write": op_write,
    "list": op_list,
    "stat": op_stat,
    "exists": op_exists,
    "mkdir": op_mkdir,
    "remove": op_remove,
    "rename": op_rename,
    "tar_get": op_tar_get,
    "tar_put": op_tar_put,
}
