"""The fake agent's directory watches (`watch`, `watcher_create`, `watcher_events`, `watcher_remove` of
`corral/agent/watch.py`), by comparing scans of the fake file system instead of inotify.

The event names and shapes are the real agent's: `create` (also the new name of a rename, and a file the
agent's `write` renamed into place), `write` (a file's size or mtime changed, or a new file with content that a
command wrote), `chmod`, `remove`, `rename` (the old name); `name` is relative to the watched directory
("nested/f.txt" in a recursive watch). A stream scans every 20 ms; a poll scans first, so the events of a change
that finished before the call are in its answer, as the real agent promises. What a scan cannot see, it does
not report: a file written and removed between two scans, or the number of writes (one `write` per scan that
saw a change). Bounded as the real agent: `MAX_WATCHES` watches per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.agent.watch import IDLE_SECONDS, MAX_WATCHES

from .fake_wire import AgentFailure

if TYPE_CHECKING:
    from .fake_shell import FakeFs
    from .fake_wire import Conn

__all__ = ["WatchOps", "WatchRegistry"]

STREAM_SCAN = 0.02
_State = tuple[bool, int, int, int, int]  # is a dir, size, mtime_ns, mode, inode


@dataclass
class _Watch:
    path: str  # the sandbox path of the watched directory
    host: Path
    recursive: bool
    entry: Callable[[str, Path], dict[str, Any]] | None  # with include_entry: the entry of a name
    owner: str = ""
    seen: dict[str, _State] = field(default_factory=dict)
    queued: list[dict[str, Any]] = field(default_factory=list)

    placed: set[int] = field(default_factory=set)  # the file system's: files renamed into place whole

    def __post_init__(self) -> None:
        self.seen = self._scan()

    def _scan(self) -> dict[str, _State]:
        found: dict[str, _State] = {}

        def walk(host: Path, prefix: str) -> None:
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(host)):
                    child = host / name
                    try:
                        st = child.lstat()
                    except OSError:
                        continue
                    rel = prefix + name
                    found[rel] = (stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode),
                                  st.st_ino)
                    if self.recursive and stat.S_ISDIR(st.st_mode):
                        walk(child, rel + "/")

        walk(self.host, "")
        return found

    def scan(self) -> list[dict[str, Any]]:
        """The events since the last scan (and what was queued before)."""
        now = self._scan()
        before, self.seen = self.seen, now
        gone = {name: state for name, state in before.items() if name not in now}
        moved_from = {state[4]: name for name, state in gone.items()}
        events: list[tuple[str, str]] = []
        for name, state in now.items():
            old = before.get(name)
            if old is None:
                source = moved_from.pop(state[4], None)
                if source is not None:
                    events.append(("rename", source))
                    gone.pop(source, None)
                events.append(("create", name))
                if source is None and not state[0] and state[1] > 0 and state[4] not in self.placed:
                    events.append(("write", name))
                continue
            if not state[0] and (state[1], state[2]) != (old[1], old[2]):
                events.append(("write", name))
            if state[3] != old[3]:
                events.append(("chmod", name))
        events += [("remove", name) for name in gone]
        out = self.queued + [self._event(kind, name) for kind, name in events]
        self.queued = []
        return out

    def _event(self, kind: str, name: str) -> dict[str, Any]:
        event: dict[str, Any] = {"type": kind, "name": name}
        host = self.host / name
        if self.entry is not None and kind not in ("remove", "rename") and (host.exists() or host.is_symlink()):
            event["entry"] = self.entry(posixpath.join(self.path, name), host)
        return event


class WatchRegistry:
    """One sandbox's polled watchers, and how many watches (streams too) it has."""

    def __init__(self, fs: FakeFs) -> None:
        self.fs = fs
        self.watchers: dict[str, _Watch] = {}
        self.streams = 0

    def check_room(self) -> None:
        if len(self.watchers) + self.streams >= MAX_WATCHES:
            raise AgentFailure("quota_exceeded", f"the sandbox has {MAX_WATCHES} watches already; remove some first")

    def get(self, req: dict[str, Any]) -> _Watch:
        watcher_id, owner = req.get("id"), str(req.get("owner") or "")
        found = self.watchers.get(watcher_id) if isinstance(watcher_id, str) else None
        if found is None or found.owner != owner:
            raise AgentFailure("not_found", f"no watcher {watcher_id!r} (removed, expired after "
                               f"{IDLE_SECONDS:g}s without a poll, or the sandbox restarted)")
        return found

    def close(self) -> None:
        self.watchers.clear()


class WatchOps:
    """Mixed into `FakeAgent` (which has `_path` and `_entry` from `FileOps`)."""

    watches: WatchRegistry
    fs: FakeFs
    _path: Callable[..., str]
    _entry: Callable[..., dict[str, Any]]

    def _new_watch(self, req: dict[str, Any]) -> _Watch:
        path = self._path(req.get("path"), req.get("roots"))
        flags = {}
        for name in ("recursive", "include_entry"):
            value = req.get(name, False)
            if not isinstance(value, bool):
                raise AgentFailure("invalid_request", f"{name} must be true or false")
            flags[name] = value
        host = self.fs.host(path)
        if not host.exists():
            raise AgentFailure("not_found", f"{path}: No such file or directory")
        if not host.is_dir():
            raise AgentFailure("invalid_request", f"{path} is not a directory; only directories can be watched")
        self.watches.check_room()
        return _Watch(path, host, flags["recursive"], self._entry if flags["include_entry"] else None,
                      placed=self.fs.placed)

    async def op_watch(self, conn: Conn, req: dict[str, Any]) -> None:
        watch = self._new_watch(req)
        self.watches.streams += 1
        hangup = asyncio.ensure_future(conn.reader.read(1))  # anything from the host, or EOF, ends the stream
        try:
            conn.event(event="started")
            await conn.drain()
            while not hangup.done():
                for event in watch.scan():
                    conn.event(event="fs", **event)
                await conn.drain()
                await asyncio.wait({hangup}, timeout=STREAM_SCAN)
        finally:
            hangup.cancel()
            self.watches.streams -= 1

    async def op_watcher_create(self, conn: Conn, req: dict[str, Any]) -> None:
        watch = self._new_watch(req)
        watch.owner = str(req.get("owner") or "")
        watcher_id = "w-" + secrets.token_hex(8)
        self.watches.watchers[watcher_id] = watch
        conn.event(event="done", id=watcher_id)

    async def op_watcher_events(self, conn: Conn, req: dict[str, Any]) -> None:
        conn.event(event="done", events=self.watches.get(req).scan())

    async def op_watcher_remove(self, conn: Conn, req: dict[str, Any]) -> None:
        self.watches.get(req)
        self.watches.watchers.pop(str(req["id"]))
        conn.event(event="done")
