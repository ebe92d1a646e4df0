"""Fakes for unit tests of the layers above the backends (no runtime, no built template needed).

`FakeBackend` implements the backend contract in memory: each "sandbox" is a name in a `World` (which outlives
an engine, like real sandboxes do), and its agent is `tests/fake_agent.py`'s `FakeAgent` on an asyncio Unix
server, speaking `corral/agent/protocol.py` (exec, processes, PTYs, files, archives, code cells, watches, port
tunnels) over a temp directory.
`FakeTemplates` serves every name as a template.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from corral import NotFoundError, ServerError
from corral.backends import (
    AgentAddress,
    BackendCapacity,
    BackendRecord,
    SandboxSpec,
    SandboxUsage,
    SnapshotArtifact,
    UnixEndpoint,
)
from corral.control import ControlStore, Principal, Role
from corral.engine import Engine
from corral.service import Service
from corral.templates import Template

from .fake_agent import FakeAgent
from .fake_checkpoints import FakeCheckpointing

__all__ = ["FakeBackend", "FakeRecord", "FakeTemplates", "World", "fake_record", "idle_usage"]




@dataclass(frozen=True)
class FakeRecord(BackendRecord):
    socket: str
    token: str

    def to_json(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox_id, "socket": self.socket, "token": self.token}


@dataclass
class World:
    """What outlives an engine (and its backend object): the sandboxes and their agents."""

    dir: Path
    running: set[str] = field(default_factory=set)
    agents: dict[str, asyncio.Server] = field(default_factory=dict)
    fake_agents: dict[str, FakeAgent] = field(default_factory=dict)  # each keeps its files in <dir>/<id>.fs
    stopped: set[str] = field(default_factory=set)  # paused to disk
    frozen: set[str] = field(default_factory=set)  # paused in place
    snapshots: dict[str, str] = field(default_factory=dict)  # snapshot id -> the sandbox it was taken of
    volumes: dict[str, int] = field(default_factory=dict)  # volume id -> size
    usage: dict[str, SandboxUsage] = field(default_factory=dict)  # what `usage` reports of a running sandbox


class FakeBackend(FakeCheckpointing):
    """The contract, in memory, with `Checkpointing` over the fake agent's files (tests/fake_checkpoints.py).
    `agent_delay`: seconds before the agent answers (None: never)."""

    name = "fake"

    def __init__(self, home: Path, world: World | None = None, *, agent_delay: float | None = 0.0,
                 ready_timeout: float = 5.0, fail_create: bool = False,
                 capacity: BackendCapacity | None = None) -> None:
        self.home = home
        self.world = world or World(home)
        self.agent_delay = agent_delay
        self.timeout = ready_timeout
        self.fail_create = fail_create
        self.figures = capacity or BackendCapacity()
        self.fail_destroy = False
        self.calls: list[tuple[str, str]] = []
        self._starting: set[asyncio.Task[None]] = set()

    async def check(self, spec: SandboxSpec) -> None:
        self.calls.append(("check", spec.template))

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template,
                     source: SnapshotArtifact | None = None) -> FakeRecord:
        self.calls.append(("create", sandbox_id))
        if source is not None and source.snapshot_id not in self.world.snapshots:
            raise NotFoundError(f"no fake snapshot {source.snapshot_id}")
        if missing := [v for v in spec.volumes.values() if v not in self.world.volumes]:
            raise NotFoundError(f"no fake volume {missing[0]}")
        if self.fail_create:
            raise ServerError("the fake runtime refused")
        record = FakeRecord(sandbox_id, str(self.world.dir / f"{sandbox_id}.sock"), secrets.token_hex(8))
        self._run(record)
        return record

    def _run(self, record: FakeRecord) -> None:
        self.world.running.add(record.sandbox_id)
        if self.agent_delay is not None:
            task = asyncio.create_task(self._serve(record, self.agent_delay))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def stop(self, record: BackendRecord) -> None:
        self.calls.append(("stop", record.sandbox_id))
        await self.world_remove(record.sandbox_id)
        self.world.stopped.add(record.sandbox_id)

    async def boot(self, record: BackendRecord, spec: SandboxSpec) -> FakeRecord:
        self.calls.append(("boot", record.sandbox_id))
        rec = fake_record(record)
        self.world.stopped.discard(rec.sandbox_id)
        self._run(rec)
        return rec

    async def snapshot(self, record: BackendRecord, snapshot_id: str) -> SnapshotArtifact:
        self.calls.append(("snapshot", record.sandbox_id))
        self.world.snapshots[snapshot_id] = record.sandbox_id
        return SnapshotArtifact(snapshot_id=snapshot_id, template="fake", size_bytes=4096,
                                data={"of": record.sandbox_id})

    async def delete_snapshot(self, snapshot: SnapshotArtifact) -> None:
        self.calls.append(("delete_snapshot", snapshot.snapshot_id))
        self.world.snapshots.pop(snapshot.snapshot_id, None)

    async def create_volume(self, volume_id: str, size: int) -> None:
        self.world.volumes[volume_id] = size

    async def delete_volume(self, volume_id: str) -> None:
        self.world.volumes.pop(volume_id, None)

    async def volume_used(self, volume_id: str) -> int:
        return 0

    async def _serve(self, record: FakeRecord, delay: float) -> None:
        await asyncio.sleep(delay)
        if record.sandbox_id in self.world.running:
            agent = FakeAgent(self.world.dir / f"{record.sandbox_id}.fs", record.token)
            self.world.fake_agents[record.sandbox_id] = agent
            self.world.agents[record.sandbox_id] = await asyncio.start_unix_server(agent.handle,
                                                                                   path=record.socket)

    def agent_address(self, record: BackendRecord) -> AgentAddress:
        rec = fake_record(record)
        return AgentAddress(UnixEndpoint(rec.socket), rec.token)

    def ready_timeout(self, record: BackendRecord) -> float:
        return self.timeout

    def egress_endpoint(self, record: BackendRecord) -> UnixEndpoint:
        return UnixEndpoint(str(self.world.dir / f"{record.sandbox_id}.egress"))

    async def diagnostics(self, record: BackendRecord) -> str:
        return f"the fake log of {record.sandbox_id}"

    async def pause(self, record: BackendRecord) -> None:
        self.calls.append(("pause", record.sandbox_id))
        if record.sandbox_id in self.world.running:
            self.world.frozen.add(record.sandbox_id)

    async def resume(self, record: BackendRecord) -> None:
        self.calls.append(("resume", record.sandbox_id))
        self.world.frozen.discard(record.sandbox_id)

    async def frozen(self, record: BackendRecord) -> bool:
        self.calls.append(("frozen", record.sandbox_id))
        return record.sandbox_id in self.world.frozen

    async def destroy(self, record: BackendRecord) -> None:
        self.calls.append(("destroy", record.sandbox_id))
        if self.fail_destroy:
            raise ServerError("the fake runtime cannot destroy it now")
        await self.world_remove(record.sandbox_id)
        self.world.stopped.discard(record.sandbox_id)
        shutil.rmtree(self.world.dir / f"{record.sandbox_id}.fs", ignore_errors=True)
        self.forget_checkpoints(record.sandbox_id)

    async def world_remove(self, sandbox_id: str) -> None:
        self.world.running.discard(sandbox_id)
        self.world.frozen.discard(sandbox_id)
        server = self.world.agents.pop(sandbox_id, None)
        if server is not None:
            server.close()
        agent = self.world.fake_agents.pop(sandbox_id, None)
        if agent is not None:
            await agent.close()
        if server is not None:
            await server.wait_closed()
        (self.world.dir / f"{sandbox_id}.sock").unlink(missing_ok=True)

    async def alive(self, record: BackendRecord) -> bool:
        self.calls.append(("alive", record.sandbox_id))
        return record.sandbox_id in self.world.running

    async def oom_kills(self, record: BackendRecord) -> int:
        return 0

    async def usage(self, record: BackendRecord) -> SandboxUsage | None:
        """`world.usage` of a running sandbox (an idle one by default); None for one not running."""
        if record.sandbox_id not in self.world.running:
            return None
        return self.world.usage.get(record.sandbox_id) or idle_usage(time.time())

    def restore(self, data: dict[str, Any]) -> FakeRecord:
        if set(data) != {"sandbox_id", "socket", "token"}:
            raise ValueError(f"not a fake record: {data!r}")
        self.calls.append(("restore", data["sandbox_id"]))
        return FakeRecord(**data)

    async def adopt(self, record: BackendRecord) -> None:
        self.calls.append(("adopt", record.sandbox_id))

    async def sweep(self, known: set[str]) -> list[str]:
        self.calls.append(("sweep", ",".join(sorted(known))))
        gone = sorted((self.world.running | self.world.stopped) - known)  # stopped ones too: their disks go
        for sid in gone:
            await self.world_remove(sid)
            self.world.stopped.discard(sid)
        return gone

    async def capacity(self) -> BackendCapacity:
        self.calls.append(("capacity", ""))
        return self.figures

    async def close(self) -> None:
        for task in self._starting:
            task.cancel()

    def called(self, what: str) -> list[str]:
        return [arg for name, arg in self.calls if name == what]


def idle_usage(at: float, cpu_seconds: float = 0.0, **figures: float) -> SandboxUsage:
    """A sandbox of 512M memory, 1G disk and 1 CPU, with `figures` (any `SandboxUsage` field) changed."""
    usage = SandboxUsage(cpu_seconds=cpu_seconds, memory_bytes=8 << 20, memory_cache_bytes=1 << 20,
                         memory_limit=512 << 20, disk_used=64 << 10, disk_total=1 << 30, cpus=1.0, at=at)
    return replace(usage, **figures)  # type: ignore[arg-type]


def fake_record(record: BackendRecord) -> FakeRecord:
    assert isinstance(record, FakeRecord)
    return record


@dataclass
class FakeTemplates:
    """Every name is a template, except those in `missing` and those that say so (`no-such-...`)."""

    missing: set[str] = field(default_factory=set)

    def get(self, name: str) -> Template:
        if name in self.missing or name.startswith("no-such-"):
            raise NotFoundError(f"no template {name!r}")
        return Template(name=name, digest="fake", rootfs=Path("/nonexistent"), env={"FROM_TEMPLATE": "1"},
                        created_at=datetime.now(UTC), size_bytes=0, source="debootstrap", spec={})


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """`127.0.0.1:PORT` of a server that accepts connections and never answers: only a timeout (or a stop)
    ends a client's wait on it. Closed, with every connection it took, on exit."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=10)
        for conn in held:
            conn.close()
        server.close()


@contextlib.asynccontextmanager
async def fake_service(prefix: str, make_backend: Callable[[Path, World], FakeBackend],
                       people: Iterable[tuple[str, str, Role]]) -> AsyncIterator[FakeService]:
    """A started `Service` over a fake backend in a fresh short home (the fake agents' Unix sockets live in it),
    with tenants and one authenticated principal per (label, tenant, role) of `people`; all of it gone after."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    world = World(home / "world")
    world.dir.mkdir()
    backend = make_backend(home, world)
    service = Service(Engine(home, backend, templates=FakeTemplates()),  # type: ignore[arg-type]
                      ControlStore(home=home))
    await service.start()
    try:
        people = list(people)
        names = dict.fromkeys(tenant for _, tenant, _ in people)  # each tenant once, in the order first named
        tenants = {name: (await service.store.create_tenant(name)).id for name in names}
        who: dict[str, Principal] = {}
        for label, tenant, role in people:
            key = (await service.store.create_key(tenants[tenant], role)).key
            who[label] = await service.store.authenticate(key)
        yield FakeService(service, backend, who, tenants)
    finally:
        await service.close()
        await service.engine.close(destroy_all=True)
        shutil.rmtree(home, ignore_errors=True)


@dataclass(frozen=True)
class FakeService:
    service: Service
    backend: FakeBackend
    who: dict[str, Principal]
    tenants: dict[str, str]
