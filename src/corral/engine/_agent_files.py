"""The agent client's files: reads and writes streamed in frames, listings, stat, mkdir, remove, rename, tar
archives both ways, and directory watches (streamed, `WatchStream`, or polled watchers; docs: corral/agent/watch.py)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from .._exceptions import AgentError
from ..agent import protocol
from ._agent_calls import AgentCalls, Roots
from ._agent_connection import AgentConnection, Source, send_data, widen_send_buffer
from ._models import Entry, WatchEvent


class AgentFiles(AgentCalls):
    """What `AgentClient` does with the sandbox's files."""

    async def read_file(self, path: str, *, roots: Roots = None) -> bytes:
        # A list joined once: a growing bytearray, then bytes() of it, copies (and page-faults) twice as much.
        return b"".join([chunk async for chunk in self.iter_file(path, roots=roots)])

    async def iter_file(self, path: str, *, roots: Roots = None) -> AsyncIterator[bytes]:
        async with self._op("read", path=path, roots=roots) as conn:
            await conn.event()  # {"event": "file", "size": ...}: the size when the read began
            received = 0
            while True:
                kind, payload = await conn.recv()
                if kind == protocol.DATA_END:
                    break
                received += len(payload)
                yield payload
            done = await conn.event()
            if received != done["size"]:
                raise AgentError(f"download of {path} lost bytes: got {received} of {done['size']}")

    async def write_file(self, path: str, data: Source, *, mode: int = 0o644, roots: Roots = None,
                         in_place: bool = False, metadata: dict[str, str] | None = None) -> int:
        """Write `data` to `path`: into a temporary file renamed over it at the end, or (`in_place`) into the
        file itself, as E2B's envd does. `metadata` replaces the file's user.e2b.* attributes (None: none)."""
        args: dict[str, Any] = {"path": path, "mode": mode, "roots": roots}
        if in_place:
            args["in_place"] = True
        if metadata is not None:
            args["metadata"] = metadata
        async with self._op("write", **args) as conn:
            widen_send_buffer(conn)
            await conn.event()  # ready
            sent = await send_data(conn, data)
            done = await conn.event()
            if done["size"] != sent:
                raise AgentError(f"upload of {path} lost bytes: agent wrote {done['size']} of {sent}")
            return sent

    async def list(self, path: str, *, roots: Roots = None, depth: int = 1) -> builtins.list[Entry]:
        """The entries `depth` levels below `path`, depth first in name order; they come in batches."""
        entries: builtins.list[Entry] = []
        async with self._op("list", path=path, roots=roots, depth=depth) as conn:
            while True:
                ev = await conn.event()
                entries += [_entry(e) for e in ev.get("entries", ())]  # an agent of before batches sends them here
                if ev.get("event") == "done":
                    return entries

    async def stat(self, path: str, *, roots: Roots = None) -> Entry:
        ev = await self._simple("stat", path=path, roots=roots)
        return _entry(ev["entry"])

    async def exists(self, path: str, *, roots: Roots = None) -> bool:
        ev = await self._simple("exists", path=path, roots=roots)
        return bool(ev["exists"])

    async def make_dir(self, path: str, *, parents: bool = True, roots: Roots = None) -> bool:
        ev = await self._simple("mkdir", path=path, parents=parents, roots=roots)
        return bool(ev["created"])

    async def remove(self, path: str, *, recursive: bool = True, roots: Roots = None) -> None:
        await self._simple("remove", path=path, recursive=recursive, roots=roots)

    async def rename(self, src: str, dst: str, *, overwrite: bool = False, roots: Roots = None,
                     parents: bool = False) -> Entry:
        """Move `src` to `dst` (`parents`: making dst's missing parents first); the entry now at `dst`."""
        ev = await self._simple("rename", src=src, dst=dst, overwrite=overwrite, roots=roots, parents=parents)
        if "entry" not in ev:  # an agent started before renames answered with the entry
            return await self.stat(dst, roots=roots)
        return _entry(ev["entry"])

    # -- watching directories (docs: corral/agent/watch.py) -----------------------------------------------

    async def watch(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                    roots: Roots = None) -> WatchStream:
        """Events in the directory `path` as they happen, until the stream is closed. A refusal (not found, not a
        directory, outside the roots, too many watches) raises here, before the stream is returned."""
        cm = self._op("watch", path=path, recursive=recursive, include_entry=include_entry, roots=roots)
        conn = await cm.__aenter__()
        try:
            await conn.event()  # {"event": "started"}: the kernel watches the directory from here on
        except BaseException as exc:
            await cm.__aexit__(type(exc), exc, exc.__traceback__)  # maps a foreign error, closes the connection
            raise
        return WatchStream(conn, cm)

    async def create_watcher(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                             owner: str = "", roots: Roots = None) -> str:
        """A watcher kept by the agent, to poll with `watcher_events`; its id. Only `owner` may use it."""
        ev = await self._simple("watcher_create", path=path, recursive=recursive, include_entry=include_entry,
                                owner=owner, roots=roots)
        return str(ev["id"])

    async def watcher_events(self, watcher_id: str, *, owner: str = "") -> builtins.list[WatchEvent]:
        """The events since the last poll, including those of every change that finished before this call."""
        ev = await self._simple("watcher_events", id=watcher_id, owner=owner)
        return [_watch_event(e) for e in ev["events"]]

    async def remove_watcher(self, watcher_id: str, *, owner: str = "") -> None:
        await self._simple("watcher_remove", id=watcher_id, owner=owner)

    async def download_tar(self, path: str, *, roots: Roots = None,
                           contents: bool = False) -> AsyncIterator[bytes]:
        """A tar of `path`; with `contents`, of what the directory holds (entries named relative to it)."""
        extra = {"contents": True} if contents else {}
        async with self._op("tar_get", path=path, roots=roots, **extra) as conn:
            await conn.event()
            while True:
                kind, payload = await conn.recv()
                if kind == protocol.DATA_END:
                    break
                yield payload
            await conn.event()

    async def upload_tar(self, path: str, data: Source, *, roots: Roots = None, owners: bool = False) -> int:
        """Unpack the tar `data` into the directory `path`; the number of entries. `owners`: entries keep the
        owners the archive names (a client acting as root only: a /tmp saved across a pause to disk)."""
        extra = {"owners": True} if owners else {}
        async with self._op("tar_put", path=path, roots=roots, **extra) as conn:
            widen_send_buffer(conn)
            await conn.event()
            await send_data(conn, data)
            done = await conn.event()
            return int(done["entries"])


class WatchStream:
    """A directory watch begun in the agent: its events, until `aclose()` (which ends the watch in the agent).

    ```python
    async with await agent.watch("/workspace", recursive=True) as events:
        async for event in events:
            ...
    ```
    """

    def __init__(self, conn: AgentConnection, cm: contextlib.AbstractAsyncContextManager[AgentConnection]) -> None:
        self._conn = conn
        self._cm = cm
        self._closed = False

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._closed:
            raise StopAsyncIteration
        try:
            return _watch_event(await self._conn.event())
        except BaseException as exc:
            await self._end(exc)
            raise

    async def aclose(self) -> None:
        await self._end(None)

    async def _end(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        # With the error, so that `_op` maps a foreign one (EOF: the sandbox went away) to `AgentError`.
        await self._cm.__aexit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)

    async def __aenter__(self) -> WatchStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _entry(e: dict[str, Any]) -> Entry:
    # Called once per entry of a listing (tens of thousands): no more work than the fields need.
    metadata = e.get("metadata")
    return Entry(name=e["name"], path=e["path"], type=e["type"], size=int(e["size"]), mode=int(e["mode"]),
                 mtime=float(e["mtime"]), target=e.get("target"), owner=e.get("owner", ""),
                 group=e.get("group", ""), permissions=e.get("permissions", ""),
                 metadata={str(k): str(v) for k, v in metadata.items()} if metadata else {},
                 resolved=e.get("resolved"), target_type=e.get("target_type"))


_WATCH_EVENT_TYPES = frozenset({"create", "write", "chmod", "remove", "rename", "overflow"})


def _watch_event(e: dict[str, Any]) -> WatchEvent:
    kind = e.get("type")
    if kind not in _WATCH_EVENT_TYPES:
        raise protocol.ProtocolError(f"unknown watch event type {kind!r}")
    found = e.get("entry")
    return WatchEvent(type=kind, name=str(e.get("name", "")), entry=_entry(found) if found else None)
