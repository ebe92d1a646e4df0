"""Directory watches: inotify through ctypes, events named as Go's fsnotify names them (and E2B's envd reports).

Two ways to watch a directory (never a file):

- a stream (`op_watch`): one connection, events sent as they happen, until the host hangs up;
- polled watchers (`op_watcher_create` -> an id, `op_watcher_events`, `op_watcher_remove`), for clients that
  ask now and then. A poll first reads what the kernel has queued *at the time of the call*, so the events of
  a write that already returned are always in its answer; a thread of the registry reads in between, so that
  a recursive watch adds a new subdirectory before files appear in it.

Event types: IN_CREATE and IN_MOVED_TO are `create`, IN_MODIFY `write`, IN_ATTRIB `chmod`, IN_DELETE (and
IN_DELETE_SELF of the watched directory) `remove`, IN_MOVED_FROM (and IN_MOVE_SELF of the watched directory)
`rename`. `name` is relative to the watched directory ("nested/f.txt" in a recursive watch; "." the directory
itself). A recursive watch watches every subdirectory, also those that appear later. What a new directory
already holds when its watch is added (made before the watch could be: `mkdir -p a/b`, or a file written at once
into a new directory) is reported as `create` events, and `write` for files with content: nothing is missed.

Bounded: `MAX_WATCHES` watches per sandbox (streams and watchers), `MAX_QUEUED` events (and about
`MAX_QUEUED_BYTES`) queued per watch, `MAX_DIRS` directories per recursive watch. Events past a bound, or lost
by the kernel's own queue, leave one `overflow` event where they were lost: never a hang, never unbounded
memory. A watcher nobody polled for `IDLE_SECONDS` is removed, and only its owner may poll or remove it.

Kept apart from `files` and imported on first use: ctypes prototypes and `select` are not needed by sandboxes
that never watch.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import posixpath
import select
import stat
import struct
import threading
import time

from . import threads
from .channel import Channel, Closed
from .file_access import FileError, check_path
from .file_entries import Names, entry

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF

# Checked in the order fsnotify's Op bits are (envd sends one event per bit, in this order).
_TYPES = ((IN_CREATE | IN_MOVED_TO, "create"), (IN_MOVED_FROM | IN_MOVE_SELF, "rename"), (IN_ATTRIB, "chmod"),
          (IN_MODIFY, "write"), (IN_DELETE | IN_DELETE_SELF, "remove"))
_WITH_ENTRY = ("create", "write", "chmod")  # the others name a path whose entry is gone
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name

MAX_WATCHES = 32
MAX_QUEUED = 4096
MAX_QUEUED_BYTES = 1024 * 1024  # and so an answer to a poll fits one protocol frame (4 MiB)
MAX_DIRS = 8192
IDLE_SECONDS = 600.0
_READ_SIZE = 64 * 1024
_MAX_READS = 64  # per drain: a directory written without pause cannot keep a poll from answering

_libc = ctypes.CDLL(None, use_errno=True)
_inotify_init1 = _libc.inotify_init1
_inotify_init1.argtypes = [ctypes.c_int]
_inotify_init1.restype = ctypes.c_int
_add_watch = _libc.inotify_add_watch
_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_add_watch.restype = ctypes.c_int
_rm_watch = _libc.inotify_rm_watch
_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
_rm_watch.restype = ctypes.c_int


def _os_error(path: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, os.strerror(err), path)


def _limit_error(exc: OSError, path: str) -> FileError:
    """What a failed inotify call means for the caller."""
    if exc.errno == errno.ENOSPC:
        return FileError("quota_exceeded", f"{path}: the sandbox's limit of watched directories is reached")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return FileError("quota_exceeded", "the sandbox's limit of inotify instances (or open files) is reached")
    return FileError.from_os(exc, path)


class Watch:
    """One inotify instance over a directory (and, recursive, its subdirectories), and the events read from it.

    Thread-safe: `drain` and `take` hold `lock`. `close` marks it closed under the lock before closing the
    descriptor, so a reader never reads a number the process has since given to another file."""

    def __init__(self, path: str, *, recursive: bool = False, include_entry: bool = False) -> None:
        self.path = path
        self.recursive = recursive
        self.include_entry = include_entry
        self.lock = threading.Lock()
        self.closed = False
        self.last_used = time.monotonic()
        self._queue: list[dict[str, Any]] = []
        self._queued_bytes = 0
        self._lost = False  # the last thing queued is an overflow marker
        self._dirs: dict[int, str] = {}  # watch descriptor -> directory relative to `path` ("" for `path`)
        self._names = Names()
        _check_dir(path)
        self.fd = _inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise _limit_error(_os_error(path), path)
        try:
            self._add(path, "", IN_ONLYDIR)  # the directory asked for may be reached through a symlink
            if recursive:
                self._add_tree(path, "", report=False)
        except BaseException:
            os.close(self.fd)
            raise

    # -- reading the kernel's queue ----------------------------------------------------------------------

    def drain(self) -> None:
        """Read and translate what the kernel has queued now (and a little more, if it keeps coming)."""
        with self.lock:
            if self.closed:
                return
            self._names = Names()  # owner names as /etc/passwd says now
            for _ in range(_MAX_READS):
                try:
                    data = os.read(self.fd, _READ_SIZE)
                except BlockingIOError:
                    return
                except OSError:
                    self._overflow()
                    return
                self._parse(data)

    def take(self) -> list[dict[str, Any]]:
        """Everything queued, after a drain; the queue starts again empty."""
        self.drain()
        with self.lock:
            self.last_used = time.monotonic()
            events, self._queue, self._queued_bytes, self._lost = self._queue, [], 0, False
        return events

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                os.close(self.fd)

    def _parse(self, data: bytes) -> None:
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _, length = _HEADER.unpack_from(data, offset)
            raw = data[offset + _HEADER.size : offset + _HEADER.size + length]
            offset += _HEADER.size + length
            self._handle(wd, mask, os.fsdecode(raw.rstrip(b"\0")))

    def _handle(self, wd: int, mask: int, child: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._overflow()
            return
        rel = self._dirs.get(wd)
        if rel is None:
            return  # a watch we dropped (a subdirectory moved away), still draining
        if mask & IN_IGNORED:
            del self._dirs[wd]
            return
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF) and rel:
            return  # a subdirectory: its parent's watch reports it (fsnotify does the same)
        name = posixpath.join(rel, child) if child else rel or "."
        for bits, kind in _TYPES:
            if mask & bits:
                self._emit(kind, name)
        if self.recursive and child and mask & IN_ISDIR:
            if mask & (IN_CREATE | IN_MOVED_TO):
                self._add_new_dir(name)
            elif mask & IN_MOVED_FROM:
                self._forget(name)

    # -- recursive watches -------------------------------------------------------------------------------

    def _add(self, path: str, rel: str, flags: int) -> None:
        if len(self._dirs) >= MAX_DIRS:
            raise FileError("quota_exceeded", f"{self.path} holds more than {MAX_DIRS} directories to watch")
        wd = _add_watch(self.fd, os.fsencode(path), MASK | flags)
        if wd < 0:
            raise _limit_error(_os_error(path), path)
        self._dirs[wd] = rel

    def _add_tree(self, path: str, rel: str, *, report: bool) -> None:
        """Watch the subdirectories below `path` (watched already), without following symlinks; with `report`,
        what is found there is new to the watcher and reported as `create` events."""
        stack = [(path, rel)]
        while stack:
            directory, drel = stack.pop()
            try:
                children = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError:
                continue  # gone, or not ours to read
            for child in children:
                crel = posixpath.join(drel, child.name)
                try:
                    st = child.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone already
                if report:
                    self._emit("create", crel)
                    if stat.S_ISREG(st.st_mode) and st.st_size:
                        self._emit("write", crel)  # it was written before we could watch: say so
                if not stat.S_ISDIR(st.st_mode):
                    continue
                try:
                    self._add(child.path, crel, IN_ONLYDIR | IN_DONT_FOLLOW)
                except FileError as exc:
                    if exc.code == "quota_exceeded":
                        raise
                    continue  # vanished or unreadable: nothing to watch there
                stack.append((child.path, crel))

    def _add_new_dir(self, rel: str) -> None:
        try:
            self._add(posixpath.join(self.path, rel), rel, IN_ONLYDIR | IN_DONT_FOLLOW)
            self._add_tree(posixpath.join(self.path, rel), rel, report=True)
        except FileError as exc:
            if exc.code == "quota_exceeded":
                self._overflow()  # its events are lost from here on: say so

    def _forget(self, rel: str) -> None:
        """A subdirectory moved away: stop watching it and what is below it (its new name, if still inside,
        comes back as IN_MOVED_TO and is watched again under that name)."""
        prefix = rel + "/"
        for wd, drel in list(self._dirs.items()):
            if drel == rel or drel.startswith(prefix):
                del self._dirs[wd]
                _rm_watch(self.fd, wd)

    # -- the queue ---------------------------------------------------------------------------------------

    def _emit(self, kind: str, name: str) -> None:
        event: dict[str, Any] = {"type": kind, "name": name}
        if self.include_entry and kind in _WITH_ENTRY:
            found = self._entry(name)
            if found is not None:
                event["entry"] = found
        size = len(json.dumps(event, separators=(",", ":"))) + 1
        if len(self._queue) >= MAX_QUEUED or self._queued_bytes + size > MAX_QUEUED_BYTES:
            self._overflow()
            return
        self._queue.append(event)
        self._queued_bytes += size
        self._lost = False

    def _overflow(self) -> None:
        if not self._lost:  # one marker where a run of events was lost
            self._queue.append({"type": "overflow", "name": ""})
            self._lost = True

    def _entry(self, name: str) -> dict[str, Any] | None:
        full = self.path if name == "." else posixpath.join(self.path, name)
        try:
            return entry(full, os.lstat(full), names=self._names)
        except OSError:
            return None  # gone again already


def _check_dir(path: str) -> None:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise FileError.from_os(exc, path) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise FileError("invalid_request", f"{path} is not a directory; only directories can be watched")


def _flag(req: dict[str, Any], name: str) -> bool:
    value = req.get(name, False)
    if not isinstance(value, bool):
        raise FileError("invalid_request", f"{name} must be true or false")
    return value


class Watches:
    """Every watch of the sandbox: the polled watchers by id, a count of the streams, and the thread that reads
    the watchers' queues between polls (started with the first watcher)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: dict[str, tuple[Watch, str]] = {}  # id -> (watch, owner)
        self._others = 0  # streams, and watchers being made (a recursive one walks its tree first)
        self._wake: tuple[int, int] | None = None

    def _new_watch(self, req: dict[str, Any]) -> Watch:
        """A watch of the request's directory, within the sandbox's bound; the caller ends with `_release`."""
        path = check_path(req.get("path"), req.get("roots"))
        recursive, include_entry = _flag(req, "recursive"), _flag(req, "include_entry")
        with self._lock:
            if len(self._watchers) + self._others >= MAX_WATCHES:
                raise FileError("quota_exceeded",
                                f"the sandbox has {MAX_WATCHES} watches already; remove some first")
            self._others += 1
        try:
            return Watch(path, recursive=recursive, include_entry=include_entry)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        with self._lock:
            self._others -= 1

    # -- streams -----------------------------------------------------------------------------------------

    def op_watch(self, ch: Channel, req: dict[str, Any]) -> None:
        """Events as they happen, one EVENT frame each ({"event": "fs", "type", "name", "entry"?}), after
        {"event": "started"}; until the host sends anything or hangs up."""
        watch = self._new_watch(req)
        try:
            ch.event(event="started")
            _pump_stream(ch, watch)
        finally:
            watch.close()
            self._release()

    # -- polled watchers ---------------------------------------------------------------------------------

    def op_watcher_create(self, ch: Channel, req: dict[str, Any]) -> None:
        watch = self._new_watch(req)
        watcher_id = "w-" + os.urandom(8).hex()
        try:
            with self._lock:
                self._start_reader()
                self._watchers[watcher_id] = (watch, str(req.get("owner") or ""))
        except BaseException:
            watch.close()
            raise
        finally:
            self._release()
        self._poke()
        ch.event(event="done", id=watcher_id)

    def op_watcher_events(self, ch: Channel, req: dict[str, Any]) -> None:
        watch = self._get(req)
        ch.event(event="done", events=watch.take())

    def op_watcher_remove(self, ch: Channel, req: dict[str, Any]) -> None:
        watch = self._get(req)
        with self._lock:
            self._watchers.pop(str(req.get("id")), None)
        watch.close()
        self._poke()
        ch.event(event="done")

    def _get(self, req: dict[str, Any]) -> Watch:
        watcher_id, owner = req.get("id"), str(req.get("owner") or "")
        with self._lock:
            found = self._watchers.get(watcher_id) if isinstance(watcher_id, str) else None
        if found is None or found[1] != owner:  # another owner's watcher does not exist for this one
            raise FileError("not_found", f"no watcher {watcher_id!r} (removed, expired after "
                            f"{IDLE_SECONDS:g}s without a poll, or the sandbox restarted)")
        return found[0]

    # -- the reader thread -------------------------------------------------------------------------------

    def _start_reader(self) -> None:
        if self._wake is not None:
            return
        wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            threads.start(self._read_loop, wake[0])
        except RuntimeError:
            os.close(wake[0])
            os.close(wake[1])
            raise FileError("quota_exceeded", "the sandbox's process limit is reached") from None
        self._wake = wake

    def _poke(self) -> None:
        """Make the reader poll the current set of watchers."""
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"x")
            except OSError:
                pass  # full: it will wake anyway

    def _read_loop(self, wake_fd: int) -> None:
        while True:
            with self._lock:
                watches = [w for w, _ in self._watchers.values()]
            poller = select.poll()
            poller.register(wake_fd, select.POLLIN)
            by_fd: dict[int, Watch] = {}
            for watch in watches:
                if not watch.closed:
                    by_fd[watch.fd] = watch
                    poller.register(watch.fd, select.POLLIN)
            for fd, _ in poller.poll(IDLE_SECONDS * 1000 / 10):
                if fd == wake_fd:
                    _read_all(wake_fd)
                elif fd in by_fd:
                    by_fd[fd].drain()  # takes the watch's lock, skips a closed one
            self._expire()

    def _expire(self) -> None:
        deadline = time.monotonic() - IDLE_SECONDS
        with self._lock:
            idle = [wid for wid, (w, _) in self._watchers.items() if w.last_used < deadline]
            gone = [self._watchers.pop(wid)[0] for wid in idle]
        for watch in gone:
            watch.close()


def _pump_stream(ch: Channel, watch: Watch) -> None:
    """Send the watch's events until the host sends something or goes away."""
    poller = select.poll()
    poller.register(watch.fd, select.POLLIN)
    poller.register(ch.sock.fileno(), select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd != watch.fd:
                return  # the host hung up (or asked to stop): the watch ends
        for event in watch.take():
            try:
                ch.event(event="fs", **event)
            except Closed:
                return


def _read_all(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


WATCHES = Watches()

OPS = {
    "watch": WATCHES.op_watch,
    "watcher_create": WATCHES.op_watcher_create,
    "watcher_events": WATCHES.op_watcher_events,
    "watcher_remove": WATCHES.op_watcher_remove,
}
