"""`Service.files` against a fake engine and a real control store: who may, what is recorded, which roots go out."""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import itertools
import os
import threading
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from corral import AgentError, NotFoundError, PermissionDeniedError
from corral.backends import DEFAULT_FILE_ROOTS
from corral.control import ControlStore, Principal, Role
from corral.engine import Engine, Entry, SandboxSession, SandboxSpec, WatchEvent
from corral.engine import Files as SandboxFiles
from corral.service import Service

pytestmark = pytest.mark.anyio

ROOTS = ["/workspace/out", "/tmp"]


class FakeWatch:
    """What the agent client's `watch` returns: its events, then (`fail`) the sandbox going away, else a wait
    like a live watch's."""

    def __init__(self, events: list[WatchEvent], fail: bool) -> None:
        self.events = list(events)
        self.fail = fail
        self.closed = False

    def __aiter__(self) -> FakeWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self.closed:
            raise StopAsyncIteration
        if self.events:
            return self.events.pop(0)
        if self.fail:
            raise AgentError("the agent went away")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class FakeAgent:
    """The agent's file API in memory; records the roots of every call, as the agent would check them."""

    files: dict[str, bytes] = field(default_factory=dict)
    calls: list[tuple[str, str, list[str] | None]] = field(default_factory=list)
    writes: list[dict[str, Any]] = field(default_factory=list)
    watch_events: list[WatchEvent] = field(default_factory=lambda: [WatchEvent("create", "a"),
                                                                     WatchEvent("write", "a")])
    fail_watch: bool = False
    watches: list[FakeWatch] = field(default_factory=list)
    watchers: dict[str, str] = field(default_factory=dict)  # id -> owner
    fail_after_first_chunk: bool = False

    def _call(self, op: str, path: str, roots: list[str] | None) -> None:
        self.calls.append((op, path, roots))

    def _data(self, path: str) -> bytes:
        if path not in self.files:
            raise NotFoundError(f"no such file: {path}")
        return self.files[path]

    async def iter_file(self, path: str, *, roots: list[str] | None = None) -> AsyncIterator[bytes]:
        self._call("read", path, roots)
        data = self._data(path)
        for i in range(0, len(data), 4):
            yield data[i:i + 4]
            if self.fail_after_first_chunk:
                raise AgentError("the agent went away")

    async def download_tar(self, path: str, *, roots: list[str] | None = None) -> AsyncIterator[bytes]:
        self._call("tar_get", path, roots)
        yield b"TAR:" + path.encode()

    async def write_file(self, path: str, data: AsyncIterable[bytes], *, mode: int = 0o644,
                         roots: list[str] | None = None, in_place: bool = False,
                         metadata: dict[str, str] | None = None) -> int:
        self._call("write", path, roots)
        self.writes.append({"in_place": in_place, "metadata": metadata})
        body = b""
        async for chunk in data:
            body += chunk
            if b"!" in body:
                raise AgentError("refused half-way")
        self.files[path] = body
        return len(body)

    async def upload_tar(self, path: str, data: AsyncIterable[bytes], *, roots: list[str] | None = None) -> int:
        self._call("tar_put", path, roots)
        return len([chunk async for chunk in data])

    async def list(self, path: str, *, roots: list[str] | None = None, depth: int = 1) -> builtins.list[Entry]:
        self._call("list", path, roots)
        return [_entry(p) for p in sorted(self.files) if p.startswith(path.rstrip("/") + "/")]

    async def stat(self, path: str, *, roots: builtins.list[str] | None = None) -> Entry:
        self._call("stat", path, roots)
        self._data(path)
        return _entry(path, len(self.files[path]))

    async def exists(self, path: str, *, roots: builtins.list[str] | None = None) -> bool:
        self._call("exists", path, roots)
        return path in self.files

    async def make_dir(self, path: str, *, parents: bool = True, roots: builtins.list[str] | None = None) -> bool:
        self._call("mkdir", path, roots)
        return True

    async def remove(self, path: str, *, recursive: bool = True, roots: builtins.list[str] | None = None) -> None:
        self._call("remove", path, roots)
        self._data(path)
        del self.files[path]

    async def rename(self, src: str, dst: str, *, overwrite: bool = False,
                     roots: builtins.list[str] | None = None, parents: bool = False) -> Entry:
        self._call("rename", f"{src} -> {dst}", roots)
        self.files[dst] = self.files.pop(src)
        return _entry(dst, len(self.files[dst]))


    async def watch(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                    roots: builtins.list[str] | None = None) -> FakeWatch:
        self._call("watch", path, roots)
        if path.endswith("/missing"):
            raise NotFoundError(f"{path}: No such file or directory")
        self.watches.append(FakeWatch(self.watch_events, self.fail_watch))
        return self.watches[-1]

    async def create_watcher(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                             owner: str = "", roots: builtins.list[str] | None = None) -> str:
        self._call("watcher_create", path, roots)
        watcher_id = f"w-{len(self.watchers)}"
        self.watchers[watcher_id] = owner
        return watcher_id

    def _watcher(self, watcher_id: str, owner: str) -> None:
        if self.watchers.get(watcher_id) != owner:
            raise NotFoundError(f"no watcher {watcher_id!r}")

    async def watcher_events(self, watcher_id: str, *, owner: str = "") -> builtins.list[WatchEvent]:
        self._call("watcher_events", watcher_id, None)
        self._watcher(watcher_id, owner)
        return list(self.watch_events)

    async def remove_watcher(self, watcher_id: str, *, owner: str = "") -> None:
        self._call("watcher_remove", watcher_id, None)
        self._watcher(watcher_id, owner)
        del self.watchers[watcher_id]


def _entry(path: str, size: int = 0) -> Entry:
    return Entry(name=path.rsplit("/", 1)[-1], path=path, type="file", size=size, mode=0o644, mtime=0.0)


class FakeEngine:
    """What the service's file operations use of an engine: `agent(id)` (through `corral.engine.Files`).

    It has no `spec`: the roots must come from the store record, never from the engine."""

    backend = None  # what the service's composition reads (Info, Templates); the file operations never do
    templates = None
    home = Path("/nonexistent")  # the eval reports' home: never read here

    def __init__(self) -> None:
        self.agents: dict[str, FakeAgent] = {}

    def agent(self, sandbox_id: str) -> FakeAgent:
        if sandbox_id not in self.agents:
            raise NotFoundError(f"no sandbox {sandbox_id!r}")
        return self.agents[sandbox_id]

    def get(self, sandbox_id: str) -> FakeSession:
        return FakeSession(self.agent(sandbox_id))


class FakeSession:
    """What the engine's `Files` uses of a session: its agent (as any user: the fake checks no user)."""

    def __init__(self, agent: FakeAgent) -> None:
        self._agent = agent

    def agent(self, user: str | None = None) -> FakeAgent:
        return self._agent

    def files_for(self, *, roots: builtins.list[str] | None = None, user: str | None = None) -> SandboxFiles:
        return SandboxFiles(cast(SandboxSession, self), roots=roots, user=user)


@dataclass
class World:
    service: Service
    store: ControlStore
    engine: FakeEngine
    principals: dict[str, Principal]

    async def sandbox(self, who: str = "dev", roots: list[str] | None = ROOTS) -> tuple[str, FakeAgent]:
        spec = SandboxSpec(file_roots=None if roots is None else tuple(roots))
        record = await self.store.reserve_sandbox(self.principals[who], spec)
        await self.store.mark_running(record.id)
        agent = self.engine.agents[record.id] = FakeAgent()
        return record.id, agent

    async def records(self, sandbox_id: str) -> list[dict[str, Any]]:
        return [e.to_dict() for e in await self.store.audit.query(sandbox=sandbox_id)]

    async def last(self, sandbox_id: str) -> dict[str, Any]:
        return (await self.records(sandbox_id))[-1]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with ControlStore(home=tmp_path) as store:
        acme, other = await store.create_tenant("acme"), await store.create_tenant("other")
        keys = {"dev": (acme.id, Role.DEVELOPER), "aud": (acme.id, Role.AUDITOR),
                "stranger": (other.id, Role.DEVELOPER)}
        principals = {name: await store.authenticate((await store.create_key(t, role)).key)
                      for name, (t, role) in keys.items()}
        engine = FakeEngine()
        yield World(Service(cast(Engine, engine), store), store, engine, principals)


async def chunks(parts: Iterable[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def drain(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in stream])


# -- allowed, with the record's roots ----------------------------------------------------------------------------


async def test_read_streams_and_is_recorded_when_the_stream_ends(world: World) -> None:
    sid, agent = await world.sandbox()
    agent.files["/workspace/out/a"] = b"0123456789"
    stream = await world.service.files.read(world.principals["dev"], sid, "/workspace/out/a")
    assert agent.calls == [("read", "/workspace/out/a", ROOTS)]  # started before it returned
    assert [r["action"] for r in await world.records(sid)] == []  # recorded when it ends, with its size
    assert await drain(stream) == b"0123456789"
    record = await world.last(sid)
    assert record["action"] == "files.read" and record["target"] == sid
    assert record["params"] == {"path": "/workspace/out/a"}
    assert record["outcome"] == {"status": 200, "size": 10}
    assert record["key_id"] == world.principals["dev"].key_id


async def test_a_refused_read_raises_before_any_byte(world: World) -> None:
    sid, _ = await world.sandbox()
    with pytest.raises(NotFoundError):
        await world.service.files.read(world.principals["dev"], sid, "/workspace/out/missing")
    record = await world.last(sid)
    assert record["action"] == "files.read" and record["outcome"] == {"status": 404, "error": "not_found"}


async def test_a_read_failing_mid_way_is_recorded_with_its_error_and_size(world: World) -> None:
    sid, agent = await world.sandbox()
    agent.files["/workspace/out/a"], agent.fail_after_first_chunk = b"0123456789", True
    stream = await world.service.files.read(world.principals["dev"], sid, "/workspace/out/a")
    with pytest.raises(AgentError):
        await drain(stream)
    assert (await world.last(sid))["outcome"] == {"status": 502, "error": "agent_error", "size": 4}


async def test_an_empty_file_streams_nothing_and_is_recorded(world: World) -> None:
    sid, agent = await world.sandbox()
    agent.files["/tmp/empty"] = b""
    assert await drain(await world.service.files.read(world.principals["dev"], sid, "/tmp/empty")) == b""
    assert (await world.last(sid))["outcome"] == {"status": 200, "size": 0}


async def test_read_archive(world: World) -> None:
    sid, agent = await world.sandbox()
    stream = await world.service.files.read_archive(world.principals["dev"], sid, "/workspace/out")
    assert await drain(stream) == b"TAR:/workspace/out"
    record = await world.last(sid)
    assert record["action"] == "archive.read" and record["params"] == {"path": "/workspace/out"}
    assert record["outcome"] == {"status": 200, "size": 18} and agent.calls == [("tar_get", "/workspace/out", ROOTS)]


async def test_write_records_size_and_sha256(world: World) -> None:
    sid, agent = await world.sandbox()
    size = await world.service.files.write(world.principals["dev"], sid, "/workspace/out/a",
                                           chunks([b"ab", b"", b"cd"]), mode=0o600)
    assert size == 4 and agent.files["/workspace/out/a"] == b"abcd"
    assert agent.calls == [("write", "/workspace/out/a", ROOTS)]
    record = await world.last(sid)
    assert record["action"] == "files.write" and record["outcome"] == {"status": 200}
    assert record["params"] == {"mode": 0o600, "path": "/workspace/out/a", "size": 4,
                                "sha256": hashlib.sha256(b"abcd").hexdigest()}


async def test_a_write_failing_mid_way_records_what_was_sent(world: World) -> None:
    sid, _ = await world.sandbox()
    with pytest.raises(AgentError):
        await world.service.files.write(world.principals["dev"], sid, "/workspace/out/a", chunks([b"ab", b"!"]))
    record = await world.last(sid)
    assert record["outcome"] == {"status": 502, "error": "agent_error"}
    assert record["params"]["size"] == 3 and record["params"]["sha256"] == hashlib.sha256(b"ab!").hexdigest()


async def test_write_archive_records_its_entries(world: World) -> None:
    sid, agent = await world.sandbox()
    entries = await world.service.files.write_archive(world.principals["dev"], sid, "/workspace/out",
                                                      chunks([b"t1", b"t2", b"t3"]))
    assert entries == 3 and agent.calls == [("tar_put", "/workspace/out", ROOTS)]
    record = await world.last(sid)
    assert record["action"] == "archive.write" and record["outcome"] == {"status": 200, "entries": 3}
    assert record["params"] == {"path": "/workspace/out", "size": 6,
                                "sha256": hashlib.sha256(b"t1t2t3").hexdigest()}


async def test_the_other_operations_each_have_their_record(world: World) -> None:
    sid, agent = await world.sandbox()
    files, dev = world.service.files, world.principals["dev"]
    agent.files["/workspace/out/a"] = b"xyz"
    assert [e.path for e in await files.list(dev, sid, "/workspace/out")] == ["/workspace/out/a"]
    assert (await files.stat(dev, sid, "/workspace/out/a")).size == 3
    assert await files.exists(dev, sid, "/workspace/out/a") is True
    assert await files.make_dir(dev, sid, "/workspace/out/d", parents=False) is True
    await files.rename(dev, sid, "/workspace/out/a", "/workspace/out/b", overwrite=True)
    await files.remove(dev, sid, "/workspace/out/b", recursive=False)
    got = [(r["action"], r["params"], r["outcome"]) for r in await world.records(sid)]
    assert got == [
        ("files.list", {"path": "/workspace/out"}, {"status": 200}),
        ("files.stat", {"path": "/workspace/out/a"}, {"status": 200}),
        ("files.exists", {"path": "/workspace/out/a"}, {"status": 200}),
        ("files.mkdir", {"path": "/workspace/out/d"}, {"status": 200}),
        ("files.rename", {"src": "/workspace/out/a", "dst": "/workspace/out/b", "overwrite": True}, {"status": 204}),
        ("files.remove", {"recursive": False, "path": "/workspace/out/b"}, {"status": 204}),
    ]
    assert len(agent.calls) == 6 and all(roots == ROOTS for _, _, roots in agent.calls)


async def test_a_failed_operation_is_recorded_with_its_error(world: World) -> None:
    sid, _ = await world.sandbox()
    with pytest.raises(NotFoundError):
        await world.service.files.remove(world.principals["dev"], sid, "/workspace/out/nope")
    record = await world.last(sid)
    assert record["action"] == "files.remove" and record["outcome"] == {"status": 404, "error": "not_found"}


async def test_a_sandbox_without_roots_gets_the_default_ones(world: World) -> None:
    sid, agent = await world.sandbox(roots=None)
    await world.service.files.exists(world.principals["dev"], sid, "/workspace/a")
    assert agent.calls == [("exists", "/workspace/a", list(DEFAULT_FILE_ROOTS))]


# -- forbidden --------------------------------------------------------------------------------------------------


async def _every_operation(world: World, who: str, sid: str) -> dict[str, BaseException | None]:
    files, principal = world.service.files, world.principals[who]
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "read": lambda: files.read(principal, sid, "/workspace/out/a"),
        "read_archive": lambda: files.read_archive(principal, sid, "/workspace/out"),
        "write": lambda: files.write(principal, sid, "/workspace/out/a", chunks([b"x"])),
        "write_archive": lambda: files.write_archive(principal, sid, "/workspace/out", chunks([b"x"])),
        "list": lambda: files.list(principal, sid, "/workspace/out"),
        "stat": lambda: files.stat(principal, sid, "/workspace/out/a"),
        "exists": lambda: files.exists(principal, sid, "/workspace/out/a"),
        "make_dir": lambda: files.make_dir(principal, sid, "/workspace/out/d"),
        "remove": lambda: files.remove(principal, sid, "/workspace/out/a"),
        "rename": lambda: files.rename(principal, sid, "/workspace/out/a", "/workspace/out/b"),
        "watch": lambda: files.watch(principal, sid, "/workspace/out"),
        "create_watcher": lambda: files.create_watcher(principal, sid, "/workspace/out"),
        "watcher_events": lambda: files.watcher_events(principal, sid, "w-0"),
        "remove_watcher": lambda: files.remove_watcher(principal, sid, "w-0"),
    }
    raised: dict[str, BaseException | None] = {}
    for name, call in calls.items():
        try:
            await call()
            raised[name] = None
        except Exception as exc:
            raised[name] = exc
    return raised


async def test_another_tenants_sandbox_is_not_found_for_every_operation(world: World) -> None:
    sid, agent = await world.sandbox()
    agent.files["/workspace/out/a"] = b"secret"
    raised = await _every_operation(world, "stranger", sid)
    missing = await _every_operation(world, "stranger", "sb-doesnotexist")
    for name, exc in raised.items():
        assert isinstance(exc, NotFoundError), name
        assert exc.message.replace(sid, "ID") == str(missing[name]).replace("sb-doesnotexist", "ID"), name
    assert agent.calls == [] and agent.files == {"/workspace/out/a": b"secret"}
    records = await world.records(sid)
    assert len(records) == len(raised)
    assert all(r["tenant_id"] == world.principals["stranger"].tenant_id for r in records)
    assert all(r["outcome"] == {"status": 404, "error": "not_found"} for r in records)


async def test_an_auditor_can_neither_read_nor_write(world: World) -> None:
    sid, agent = await world.sandbox()
    raised = await _every_operation(world, "aud", sid)
    assert all(isinstance(exc, PermissionDeniedError) for exc in raised.values()), raised
    assert agent.calls == []
    records = await world.records(sid)
    assert {r["action"] for r in records} == {"files.read", "archive.read", "files.write", "archive.write",
                                              "files.list", "files.stat", "files.exists", "files.mkdir",
                                              "files.remove", "files.rename", "files.watch",
                                              "files.watcher_create", "files.watcher_events",
                                              "files.watcher_remove"}
    assert all(r["outcome"] == {"status": 403, "error": "permission_denied"} for r in records)
    assert all(r["role"] == "auditor" for r in records)


# -- E2B's semantics: writes in place with metadata, listings with depth, moves with parents --------------------------


async def test_write_in_place_with_metadata_records_the_keys_not_the_values(world: World) -> None:
    sid, agent = await world.sandbox()
    await world.service.files.write(world.principals["dev"], sid, "/workspace/out/a", chunks([b"ab"]),
                                    in_place=True, metadata={"secret": "value", "author": "me"})
    assert agent.writes == [{"in_place": True, "metadata": {"secret": "value", "author": "me"}}]
    record = await world.last(sid)
    assert record["params"] == {"mode": 0o644, "path": "/workspace/out/a", "in_place": True,
                                "metadata_keys": ["author", "secret"], "size": 2,
                                "sha256": hashlib.sha256(b"ab").hexdigest()}
    assert "value" not in str(record)


async def test_list_with_depth_and_move_with_parents(world: World) -> None:
    sid, agent = await world.sandbox()
    files, dev = world.service.files, world.principals["dev"]
    agent.files["/workspace/out/a"] = b"xyz"
    assert [e.path for e in await files.list(dev, sid, "/workspace/out", depth=3)] == ["/workspace/out/a"]
    moved = await files.rename(dev, sid, "/workspace/out/a", "/workspace/out/new/b", parents=True)
    assert (moved.path, moved.size) == ("/workspace/out/new/b", 3)
    got = [(r["action"], r["params"], r["outcome"]) for r in await world.records(sid)]
    assert got == [
        ("files.list", {"path": "/workspace/out", "depth": 3}, {"status": 200, "entries": 1}),
        ("files.rename", {"src": "/workspace/out/a", "dst": "/workspace/out/new/b", "overwrite": False,
                          "parents": True}, {"status": 204}),
    ]


# -- watches ---------------------------------------------------------------------------------------------------------


async def test_a_watch_streams_its_events_and_is_recorded_once_when_closed(world: World) -> None:
    sid, agent = await world.sandbox()
    stream = await world.service.files.watch(world.principals["dev"], sid, "/workspace/out", recursive=True)
    assert agent.calls == [("watch", "/workspace/out", ROOTS)]  # begun before it returned
    assert [(await anext(stream)).type, (await anext(stream)).type] == ["create", "write"]
    assert await world.records(sid) == []  # recorded when it ends
    await stream.aclose()
    assert agent.watches[0].closed
    [record] = await world.records(sid)
    assert record["action"] == "files.watch"
    assert record["params"] == {"path": "/workspace/out", "recursive": True, "include_entry": False}
    assert record["outcome"] == {"status": 200, "events": 2}


async def test_a_refused_watch_raises_before_any_event(world: World) -> None:
    sid, _ = await world.sandbox()
    with pytest.raises(NotFoundError):
        await world.service.files.watch(world.principals["dev"], sid, "/workspace/out/missing")
    assert (await world.last(sid))["outcome"] == {"status": 404, "error": "not_found"}


async def test_a_watch_the_sandbox_ends_is_recorded_with_its_error(world: World) -> None:
    sid, agent = await world.sandbox()
    agent.fail_watch = True
    stream = await world.service.files.watch(world.principals["dev"], sid, "/workspace/out")
    with pytest.raises(AgentError):
        async for _ in stream:
            pass
    assert (await world.last(sid))["outcome"] == {"status": 502, "error": "agent_error", "events": 2}


async def test_a_watch_whose_consumer_is_cancelled_is_closed_and_recorded(world: World) -> None:
    sid, agent = await world.sandbox()
    stream = await world.service.files.watch(world.principals["dev"], sid, "/workspace/out")
    received: list[WatchEvent] = []

    async def consume() -> None:
        async for event in stream:
            received.append(event)

    task = asyncio.ensure_future(consume())
    while len(received) < 2:  # then it waits for a third, like a client that left would
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert agent.watches[0].closed
    assert (await world.last(sid))["outcome"] == {"status": 200, "events": 2}


async def test_watchers_are_kept_for_the_key_that_made_them_and_each_call_is_recorded(world: World) -> None:
    sid, agent = await world.sandbox()
    files, dev = world.service.files, world.principals["dev"]
    watcher = await files.create_watcher(dev, sid, "/workspace/out", include_entry=True)
    assert agent.watchers == {watcher: dev.key_id}
    assert [e.name for e in await files.watcher_events(dev, sid, watcher)] == ["a", "a"]
    await files.remove_watcher(dev, sid, watcher)
    with pytest.raises(NotFoundError):
        await files.watcher_events(dev, sid, watcher)
    got = [(r["action"], r["params"], r["outcome"]) for r in await world.records(sid)]
    assert got == [
        ("files.watcher_create", {"path": "/workspace/out", "recursive": False, "include_entry": True},
         {"status": 200, "watcher_id": watcher}),
        ("files.watcher_events", {"watcher_id": watcher}, {"status": 200, "events": 2}),
        ("files.watcher_remove", {"watcher_id": watcher}, {"status": 204}),
        ("files.watcher_events", {"watcher_id": watcher}, {"status": 404, "error": "not_found"}),
    ]
    assert agent.calls[0] == ("watcher_create", "/workspace/out", ROOTS)


# -- an upload's size and sha256: hashed beside the event loop, in order, and complete however the upload ends ------


def _body(size: int) -> bytes:
    return bytes(b % 32 for b in os.urandom(size))  # random, without the b"!" the fake agent refuses at


def _cut(data: bytes, sizes: Iterable[int]) -> builtins.list[bytes]:
    """`data` in chunks of the given sizes, round and round."""
    out: builtins.list[bytes] = []
    start = 0
    for size in itertools.cycle(sizes):
        if start >= len(data):
            return out
        out.append(data[start:start + size])
        start += size
    raise AssertionError("unreachable")


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _only_pool_threads_since(before: set[threading.Thread]) -> bool:
    """No thread of the upload's own is left: any new one is a worker of the loop's executor (a bounded pool the
    hashing shares, started on demand and kept by the loop)."""
    return all(t.name.startswith("asyncio_") for t in _threads() - before)


async def test_the_digest_of_a_large_write_covers_every_byte_across_chunk_boundaries(world: World) -> None:
    sid, agent = await world.sandbox()
    data = _body(13 * 2**20 + 7)  # several batches for the thread, and a backlog past its bound (a 5 MiB chunk)
    parts = _cut(data, [1, 300_001, 2**20 - 1, 5 * 2**20, 17])
    assert await world.service.files.write(world.principals["dev"], sid, "/workspace/out/a", chunks(parts)) \
        == len(data)
    assert agent.files["/workspace/out/a"] == data
    record = await world.last(sid)
    assert record["params"]["size"] == len(data)
    assert record["params"]["sha256"] == hashlib.sha256(data).hexdigest()


async def test_a_large_write_failing_mid_way_records_the_digest_of_what_was_sent_and_leaves_nothing(
        world: World) -> None:
    sid, _ = await world.sandbox()
    files, dev = world.service.files, world.principals["dev"]
    await files.write(dev, sid, "/workspace/out/warm", chunks(_cut(_body(3 * 2**20), [2**18])))  # the pool's threads
    threads, tasks = _threads(), asyncio.all_tasks()
    sent = _body(6 * 2**20) + b"!"
    with pytest.raises(AgentError):
        await files.write(dev, sid, "/workspace/out/a", chunks(_cut(sent, [2**18])))
    record = await world.last(sid)
    assert record["params"]["size"] == len(sent) and record["params"]["sha256"] == hashlib.sha256(sent).hexdigest()
    assert _only_pool_threads_since(threads) and asyncio.all_tasks() == tasks


async def test_a_cancelled_large_write_records_the_digest_of_what_was_sent_and_leaves_nothing(world: World) -> None:
    sid, _ = await world.sandbox()
    files, dev = world.service.files, world.principals["dev"]
    await files.write(dev, sid, "/workspace/out/warm", chunks(_cut(_body(3 * 2**20), [2**18])))
    threads, tasks = _threads(), asyncio.all_tasks()
    sent, reached = _body(5 * 2**20 + 3), asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        for part in _cut(sent, [2**18]):
            yield part
        reached.set()
        await asyncio.Event().wait()  # a client that stops sending
        yield b"never"

    write = asyncio.create_task(files.write(dev, sid, "/workspace/out/a", stalls()))
    await asyncio.wait_for(reached.wait(), 30)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write
    record = await world.last(sid)
    assert record["params"]["size"] == len(sent) and record["params"]["sha256"] == hashlib.sha256(sent).hexdigest()
    assert _only_pool_threads_since(threads) and asyncio.all_tasks() == tasks
