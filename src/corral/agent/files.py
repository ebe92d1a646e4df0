"""File operations, performed inside the sandbox as the sandbox user.

Paths are resolved here, in the sandbox's own mount namespace, so a symlink planted by sandbox code can only
ever lead to another file of the same sandbox. Writes land in a temporary file beside the target and are
renamed into place only when every byte has arrived: a failed upload changes nothing. A write `in_place` opens
the target itself (O_CREAT, then truncated), as E2B's envd does: a directory watcher then sees the events of the
file's own name, and a failed write leaves what it wrote in a file that existed before.

Entries carry owner and group names (as the sandbox's /etc/passwd and /etc/group say), `ls -l` permissions and
the file's metadata: its `user.e2b.*` extended attributes, prefix stripped (E2B's name for them).

The parts: `file_access.py` (`check_path`, `FileError`), `file_entries.py` (`entry`, `Names`), `file_metadata.py`
(the `user.e2b.*` attributes); here the operations.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import stat

from . import protocol
from .channel import Channel
from .file_access import FileError, check_path
from .file_entries import Names, entry
from .file_metadata import check_metadata, replace_metadata

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any


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
    path = check_path(req.get("path"), req.get("roots"), write=True)
    mode = int(req.get("mode", 0o644)) & 0o7777
    metadata = check_metadata(req.get("metadata"))
    if os.path.isdir(path):
        raise FileError("invalid_request", f"{path} is a directory")
    if req.get("in_place"):
        size = _write_in_place(ch, path, mode, metadata)
    else:
        size = _write_and_rename(ch, path, mode, metadata)
    ch.event(event="done", size=size, path=path)


def _write_and_rename(ch: Channel, path: str, mode: int, metadata: dict[str, str]) -> int:
    fd, tmp = temp_in(posixpath.dirname(path), ".corral-upload-", path)
    try:
        if metadata:  # before "ready": metadata the file system refuses costs no byte of the upload
            replace_metadata(fd, metadata, path)
        ch.event(event="ready")
        size = receive_into(ch, fd, path)
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
            unlink_quietly(tmp)
    return size


def _write_in_place(ch: Channel, path: str, mode: int, metadata: dict[str, str]) -> int:
    """Open the target itself and write into it, as envd does: a new file gets CREATE, CHMOD (its mode) and
    WRITE events on its own name, a rewrite gets WRITE. Refusals (metadata the file system cannot keep, a
    target that is no regular file) come before "ready" and change nothing; a new file whose upload fails is
    removed, an existing one keeps what was written (that is what writing in place means)."""
    try:
        make_dirs(posixpath.dirname(path))
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    fd, created = _open_target(path, mode)
    try:
        try:
            replace_metadata(fd, metadata, path)
        except FileError:
            if created:
                unlink_quietly(path)
            raise
        ch.event(event="ready")
        if not created:
            os.ftruncate(fd, 0)
        if created or stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            os.fchmod(fd, mode)
        try:
            return receive_into(ch, fd, path)
        except BaseException:  # disk full, the host gone: a file this write made goes again
            if created:
                unlink_quietly(path)
            raise
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    finally:
        os.close(fd)


def _open_target(path: str, mode: int) -> tuple[int, bool]:
    """The target opened for writing, and whether this call created it. An existing file is opened without
    O_TRUNC (truncated once the write is accepted) and non-blocking, so that a FIFO is refused, not waited on."""
    flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOCTTY
    try:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, mode & 0o777), True
        except FileExistsError:
            fd = os.open(path, flags | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads, a socket
            raise FileError("invalid_request", f"{path} is not a regular file") from exc
        raise FileError.from_os(exc, path) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileError("invalid_request", f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd, False


def receive_into(ch: Channel, fd: int, path: str) -> int:
    """Write the DATA frames of an upload to `fd` until DATA_END; the bytes written.

    Each piece goes from the socket into one reused buffer and from there to the file, as soon as it arrives.
    """
    size = 0
    buf = memoryview(bytearray(protocol.CHUNK))
    while True:
        kind, length = ch.recv_header()
        if kind != protocol.DATA:
            ch.skip(length)
            if kind == protocol.DATA_END:
                return size
            raise FileError("invalid_request", f"unexpected frame kind {kind} during upload of {path}")
        while length:
            n = ch.recv_into(buf[: min(length, len(buf))])
            length -= n
            try:
                write_all(fd, buf[:n])
            except OSError:
                # Read the rest of the upload before answering: closing on unread data resets the connection,
                # and the host would see "connection reset" instead of our error (disk full, say).
                ch.skip(length)
                _drain(ch)
                raise
            size += n


def write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _drain(ch: Channel) -> None:
    while True:
        kind, length = ch.recv_header()
        ch.skip(length)
        if kind == protocol.DATA_END:
            return


MAX_LIST_ENTRIES = 200_000  # a listing is held whole on the host: past this, list less deep or a subdirectory
_BATCH_BYTES = protocol.CHUNK // 2  # entries go in EVENT frames below this (`Channel.send` splits at CHUNK)


def op_list(ch: Channel, req: dict[str, Any]) -> None:
    """The entries below `path`, `depth` levels deep (1: its own entries), depth first in name order like envd's
    ListDir: a directory, then what it holds, then its next sibling. Symlinks are listed, never followed (but
    `path` itself may be one); a subdirectory that cannot be read is listed without its contents."""
    path = check_path(req.get("path"), req.get("roots"))
    depth = req.get("depth", 1)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise FileError("invalid_request", f"depth must be a whole number of at least 1, not {depth!r}")
    try:
        top = _sorted_dir(path)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    batch = _Batch(ch)
    names = Names()
    stack = [(path.rstrip("/") + "/", iter(top), 1)]  # each directory as the prefix of its entries' paths
    while stack:
        prefix, children, level = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            continue
        full = prefix + child.name
        try:
            st = child.stat(follow_symlinks=False)
        except OSError:
            continue  # gone since it was listed
        if batch.count >= MAX_LIST_ENTRIES:
            raise FileError("invalid_request", f"{path} holds more than {MAX_LIST_ENTRIES} entries within depth "
                            f"{depth}; list a subdirectory or fewer levels")
        batch.add(entry(full, st, child.name, names))
        if level < depth and stat.S_ISDIR(st.st_mode):
            try:
                stack.append((full + "/", iter(_sorted_dir(full)), level + 1))
            except OSError:
                pass
    batch.flush()
    ch.event(event="done")


def _sorted_dir(path: str) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)


class _Batch:
    """Entries sent as {"event": "entries", "entries": [...]} frames below `_BATCH_BYTES`: a listing of any
    size fits the protocol's frames, and the host starts reading before the walk ends."""

    def __init__(self, ch: Channel) -> None:
        self.ch = ch
        self.parts: list[bytes] = []
        self.size = 0
        self.count = 0

    def add(self, item: dict[str, Any]) -> None:
        part = json.dumps(item, separators=(",", ":")).encode()  # at most ~100 KB: a path, a link, metadata
        if self.size + len(part) >= _BATCH_BYTES:
            self.flush()
        self.parts.append(part)
        self.size += len(part) + 1
        self.count += 1

    def flush(self) -> None:
        if self.parts:
            self.ch.send(protocol.EVENT, b'{"event":"entries","entries":[' + b",".join(self.parts) + b"]}")
            self.parts, self.size = [], 0


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
    path = check_path(req.get("path"), req.get("roots"), write=True)
    created = not os.path.isdir(path)
    try:
        if req.get("parents", True):
            make_dirs(path)
        else:
            os.mkdir(path)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    ch.event(event="done", created=created)


def op_remove(ch: Channel, req: dict[str, Any]) -> None:
    path = check_path(req.get("path"), req.get("roots"), write=True)
    if path == "/":
        raise FileError("invalid_request", "refusing to remove /")
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            if req.get("recursive", True):
                import shutil

                _check_removable(path, st)  # before rmtree: never empty a directory that then stays
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    ch.event(event="done")


def _check_removable(path: str, st: os.stat_result) -> None:
    """Refuse, before anything is removed, a directory that could be emptied but not removed itself: a mount
    point (`/workspace`, a volume), or one whose parent the acting user may not change (a root-owned `/`, another
    user's entry in a sticky `/tmp`). Its contents are removed by naming them."""
    parent = os.path.dirname(path) or "/"
    try:
        parent_st = os.stat(parent)
    except OSError as exc:
        raise FileError.from_os(exc, parent) from exc
    euid = os.geteuid()
    sticky_other = bool(parent_st.st_mode & stat.S_ISVTX) and euid not in (0, st.st_uid, parent_st.st_uid)
    writable = os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids)
    if os.path.ismount(path) or sticky_other or not writable:
        raise FileError("permission_denied", f"{path} cannot be removed itself (a mount point, or its parent is "
                        "not writable by this user); nothing was removed: remove what is inside it instead")


def op_rename(ch: Channel, req: dict[str, Any]) -> None:
    """Move `src` to `dst`; with `parents`, dst's missing parent directories are made first (envd's Move). A
    missing source is refused before anything is made. Answers with the entry at `dst`."""
    roots = req.get("roots")
    src = check_path(req.get("src"), roots, write=True)
    dst = check_path(req.get("dst"), roots, write=True)
    try:
        os.lstat(src)
        if not req.get("overwrite", False) and os.path.lexists(dst):
            raise FileError("conflict", f"{dst} already exists")
    except OSError as exc:
        raise FileError.from_os(exc, src) from exc
    if req.get("parents", False):
        try:
            make_dirs(posixpath.dirname(dst))
        except OSError as exc:
            raise FileError.from_os(exc, dst) from exc
    try:
        os.rename(src, dst)
        st = os.lstat(dst)
    except OSError as exc:
        raise FileError.from_os(exc, src) from exc
    ch.event(event="done", entry=entry(dst, st))


def temp_in(directory: str, prefix: str, path: str) -> tuple[int, str]:
    """Create `directory` if needed and a temporary file in it; errors name `path`, what the caller asked for."""
    try:
        make_dirs(directory)
        return make_temp(directory, prefix)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc


def make_dirs(path: str) -> None:
    """`os.makedirs(path, exist_ok=True)` without recursion: a path 1,500 directories deep (well under PATH_MAX)
    must not hit Python's recursion limit (found by the eval corpus: it was a RecursionError, a 500)."""
    missing: list[str] = []
    head = path
    while head not in ("", "/") and not os.path.isdir(head):
        missing.append(head)
        head = posixpath.dirname(head)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise


def make_temp(directory: str, prefix: str) -> tuple[int, str]:
    """A new private file in `directory` (like tempfile.mkstemp, without importing tempfile)."""
    for _ in range(100):
        path = posixpath.join(directory, prefix + os.urandom(6).hex())
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), path
        except FileExistsError:
            continue
    raise FileError("server_error", f"could not create a temporary file in {directory}")


def unlink_quietly(path: str) -> None:
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
}
ARCHIVE_OPS = ("tar_get", "tar_put")  # in `archives`, imported on first use: tarfile is slow to import
WATCH_OPS = ("watch", "watcher_create", "watcher_events", "watcher_remove")  # in `watch`, also on first use
