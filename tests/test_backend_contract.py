"""The backend contract (docs/backends.md): the engine against a small in-test backend, and the parity every
backend must keep with `corral.backends.Backend`.

No runtime needed: `FakeBackend` keeps its "sandboxes" in memory and serves each one's agent as a tiny asyncio
Unix server speaking `corral/agent/protocol.py` (enough for `ping`). A new backend joins the parity tests by
adding itself to `BACKENDS`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import CapacityError, RuntimeUnavailableError, ServerError
from corral.backends import (
    AgentAddress,
    Backend,
    BackendCapacity,
    UnixEndpoint,
    load_backend,
)
from corral.backends.local import LocalBackend, LocalRecord
from corral.engine import Adoption, Capacity, Engine, Limits, SandboxSpec

from .fakes import FakeBackend, FakeTemplates, World, fake_record

pytestmark = pytest.mark.anyio

MiB = 1024**2


def _engine(home: Path, backend: Backend, **kwargs: Any) -> Engine:
    return Engine(home, backend, templates=FakeTemplates(), **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def world() -> Iterator[World]:
    w = World(Path(tempfile.mkdtemp(prefix="cf-", dir="/tmp")))  # short: Unix socket paths have 108 bytes
    yield w
    for server in w.agents.values():
        server.close()
    shutil.rmtree(w.dir, ignore_errors=True)


def _state_files(home: Path) -> list[str]:
    return sorted(p.stem for p in (home / "engine").glob("*.json"))


SPEC = SandboxSpec(limits=Limits(memory=256 * MiB))


# -- (a) the engine stands on the contract alone -------------------------------------------------------------


def test_the_engine_imports_without_any_backend_implementation() -> None:
    code = ("import sys, corral.engine, corral.backends\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('corral.backends.'))\n"
            "assert 'corral.backends.local' not in sys.modules, loaded\n"
            "print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "local" not in out.stdout


def test_a_backend_is_loaded_by_name_and_an_unknown_name_is_refused(tmp_path: Path) -> None:
    assert isinstance(load_backend("local", tmp_path), LocalBackend)
    assert isinstance(Engine(tmp_path).backend, LocalBackend)  # the default
    with pytest.raises(RuntimeUnavailableError, match="no backend 'nope'"):
        load_backend("nope", tmp_path)


# -- (b) what the engine does around the contract ---------------------------------------------------------------


async def test_create_waits_for_the_agent_and_keeps_its_own_state(tmp_path: Path, world: World) -> None:
    backend = FakeBackend(tmp_path, world, agent_delay=0.3)
    async with _engine(tmp_path, backend) as engine:
        sb = await engine.create(SPEC)
        assert (await engine.agent(sb.id).ping())["event"] == "pong"  # answered: create waited for it
        assert engine.agent(sb.id) is engine.agent(sb.id)  # one client per sandbox, kept
        assert [n for n, _ in backend.calls[:4]] == ["sweep", "check", "capacity", "create"]
        state = json.loads((tmp_path / "engine" / f"{sb.id}.json").read_text())
        assert state["backend"] == "fake" and "state" not in state and "spec" not in state  # the store's
        assert state["record"] == fake_record(engine.runtime.sandboxes[sb.id].record).to_json()
        assert engine.sandbox_env(sb.id)["FROM_TEMPLATE"] == "1"
        await sb.pause()
        assert "state" not in json.loads((tmp_path / "engine" / f"{sb.id}.json").read_text())  # the store's
        await sb.resume()
        await sb.destroy()
        assert backend.called("destroy") == [sb.id] and _state_files(tmp_path) == []


async def test_an_agent_that_never_answers_fails_the_create_with_diagnostics_and_leaves_nothing(
        tmp_path: Path, world: World) -> None:
    backend = FakeBackend(tmp_path, world, agent_delay=None, ready_timeout=0.5)
    async with _engine(tmp_path, backend) as engine:
        started = time.monotonic()
        with pytest.raises(ServerError, match=r"did not answer within 0\.5s") as info:
            await engine.create(SPEC)
        assert time.monotonic() - started < 3
        sid = backend.called("create")[0]
        assert f"the fake log of {sid}" in info.value.message
        assert info.value.code == "agent_error"  # HTTP 502: the sandbox's side failed, not the server
        assert backend.called("destroy") == [sid] and world.running == set()
        assert engine.list() == [] and engine.usage().sandboxes == 0 and _state_files(tmp_path) == []


async def test_a_sandbox_that_stops_before_its_agent_answers_fails_at_once(tmp_path: Path, world: World) -> None:
    backend = FakeBackend(tmp_path, world, agent_delay=None, ready_timeout=60)

    async def crash_soon() -> None:
        await asyncio.sleep(0.1)
        world.running.clear()  # the agent died at start: the backend says it is not alive

    async with _engine(tmp_path, backend) as engine:
        crash = asyncio.create_task(crash_soon())
        started = time.monotonic()
        with pytest.raises(ServerError, match="stopped") as info:
            await engine.create(SPEC)
        await crash
        assert time.monotonic() - started < 5, "waited out the ready timeout for a sandbox that had stopped"
        assert "the fake log of" in info.value.message and info.value.code == "agent_error"
        assert len(backend.called("destroy")) == 1 and engine.list() == []


async def test_a_failed_backend_create_leaves_nothing(tmp_path: Path, world: World) -> None:
    backend = FakeBackend(tmp_path, world, fail_create=True)
    async with _engine(tmp_path, backend) as engine:
        with pytest.raises(ServerError, match="refused"):
            await engine.create(SPEC)
        assert engine.list() == [] and engine.usage().sandboxes == 0 and _state_files(tmp_path) == []
        assert backend.called("destroy") == []  # the backend's own promise: a failed create left nothing


async def test_a_create_cancelled_while_waiting_for_the_agent_destroys_the_sandbox(
        tmp_path: Path, world: World) -> None:
    backend = FakeBackend(tmp_path, world, agent_delay=None, ready_timeout=60)
    async with _engine(tmp_path, backend) as engine:
        task = asyncio.create_task(engine.create(SPEC))
        while not backend.called("create"):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)  # the shielded clean-up runs on
        assert backend.called("destroy") == backend.called("create") and world.running == set()
        assert engine.usage().sandboxes == 0 and _state_files(tmp_path) == []


async def test_a_restarted_engine_restores_reattaches_and_has_the_rest_swept(tmp_path: Path, world: World) -> None:
    first_backend = FakeBackend(tmp_path, world)
    first = _engine(tmp_path, first_backend)
    await first.start()
    # What the store no longer vouches for (ended, or never recorded) is swept without a question to the backend.
    kept, died, _forgotten = [(await first.create(SPEC)).id for _ in range(3)]
    await first.close()  # the sandboxes stay
    await first_backend.world_remove(died)  # crashed while no engine ran
    world.running.add("sb-orphan0001")  # made by a backend whose engine never recorded it
    other = tmp_path / "engine" / "sb-otherbackend1.json"  # another backend's sandbox, from another --backend
    other.write_text(json.dumps({"id": "sb-otherbackend1", "backend": "docker", "record": {}}))
    await asyncio.sleep(0.1)

    backend = FakeBackend(tmp_path, world)  # a new process: a new backend object, the same world
    engine = _engine(tmp_path, backend)
    await engine.start(adopt={kept: Adoption(spec=SPEC), died: Adoption(spec=SPEC)})  # the store's live records
    try:
        assert [s.id for s in engine.list()] == [kept]
        assert sorted(backend.called("restore")) == sorted([kept, died])
        assert sorted(backend.called("alive")) == sorted([kept, died])  # the forgotten one is not even asked
        assert backend.called("adopt") == [kept]
        assert backend.called("sweep") == [kept]
        assert world.running == {kept}
        assert _state_files(tmp_path) == sorted([kept, "sb-otherbackend1"])
        assert (await engine.agent(kept).ping())["event"] == "pong"
        await engine.destroy(kept)
    finally:
        await engine.close()


async def test_a_state_file_holds_no_spec_state_or_timeout(tmp_path: Path, world: World) -> None:
    async with _engine(tmp_path, FakeBackend(tmp_path, world)) as engine:
        sb = await engine.create(SandboxSpec(template="default", env={"K": "v"}, timeout=60, metadata={"m": "1"}))
        await sb.pause()
        state = json.loads((tmp_path / "engine" / f"{sb.id}.json").read_text())
        assert set(state) == {"id", "backend", "record", "template_env", "env"} and state["env"] == {"K": "v"}
        await sb.destroy()


async def test_a_bare_engine_restart_sweeps_what_no_store_vouches_for(tmp_path: Path, world: World) -> None:
    async with _engine(tmp_path, FakeBackend(tmp_path, world)) as first:
        made = (await first.create(SPEC)).id
    assert world.running == {made}
    backend = FakeBackend(tmp_path, world)
    async with _engine(tmp_path, backend) as engine:
        assert engine.list() == [] and world.running == set() and _state_files(tmp_path) == []
        assert backend.called("sweep") == [""]


async def test_a_sandbox_whose_destroy_failed_is_swept_at_the_next_start_not_reattached(
        tmp_path: Path, world: World) -> None:
    backend = FakeBackend(tmp_path, world)
    async with _engine(tmp_path, backend) as engine:
        sid = (await engine.create(SPEC)).id
        backend.fail_destroy = True
        with pytest.raises(ServerError, match="cannot destroy"):
            await engine.destroy(sid)
    assert world.running == {sid}
    fresh = FakeBackend(tmp_path, world)
    async with _engine(tmp_path, fresh) as engine:
        assert engine.list() == [] and fresh.called("adopt") == [] and fresh.called("sweep") == [""]
        assert world.running == set() and _state_files(tmp_path) == []


async def test_a_state_file_the_backend_cannot_restore_is_forgotten(tmp_path: Path, world: World) -> None:
    (tmp_path / "engine").mkdir(parents=True)
    (tmp_path / "engine" / "sb-garbled00001.json").write_text('{"id": "sb-garbled00001", "backend": "fake", ')
    (tmp_path / "engine" / "sb-foreign00001.json").write_text(json.dumps(
        {"id": "sb-foreign00001", "backend": "fake", "record": {"what": "not a fake record"}}))
    backend = FakeBackend(tmp_path, world)
    async with _engine(tmp_path, backend) as engine:
        assert engine.list() == [] and _state_files(tmp_path) == []
        assert backend.called("sweep") == [""]


@pytest.mark.parametrize(("figures", "resource"), [
    (BackendCapacity(sandboxes_max=1), "sandboxes_max"),
    (BackendCapacity(memory_total=384 * MiB), "memory_overcommit"),
    (BackendCapacity(memory_available=128 * MiB), "min_free_memory"),
    (BackendCapacity(disk_free=100 * MiB), "min_free_disk"),
])
async def test_capacity_comes_from_the_backend(tmp_path: Path, world: World, figures: BackendCapacity,
                                               resource: str) -> None:
    backend = FakeBackend(tmp_path, world, capacity=figures)
    capacity = Capacity(memory_overcommit=1.0, min_free_memory=256 * MiB, min_free_disk=1024 * MiB)
    async with _engine(tmp_path, backend, capacity=capacity) as engine:
        if resource in ("sandboxes_max", "memory_overcommit"):  # counts: the first one fits
            await engine.create(SPEC)
        with pytest.raises(CapacityError) as info:
            await engine.create(SPEC)
        assert info.value.details["resource"] == resource
        assert len(backend.called("create")) == len(engine.list())  # the refused one was never started


async def test_no_figures_no_refusal_and_concurrent_creates_cannot_squeeze_past(
        tmp_path: Path, world: World) -> None:
    backend = FakeBackend(tmp_path, world, agent_delay=0.1, capacity=BackendCapacity(sandboxes_max=2))
    async with _engine(tmp_path, backend) as engine:
        results = await asyncio.gather(*(engine.create(SPEC) for _ in range(6)), return_exceptions=True)
        refused = [r for r in results if isinstance(r, CapacityError)]
        assert len(refused) == 4 and len(engine.list()) == 2 and len(backend.called("create")) == 2
        await engine.close(destroy_all=True)


# -- (c) parity: every backend implements the contract as declared ---------------------------------------------


def _contract_methods() -> dict[str, Any]:
    return {name: member for name, member in vars(Backend).items()
            if not name.startswith("_") and inspect.isfunction(member)}


BACKENDS: dict[str, Callable[[Path], Backend]] = {  # typed: mypy checks each against the Protocol too
    "local": LocalBackend,
    "fake": FakeBackend,
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return BACKENDS[request.param](tmp_path)


def test_the_contract_is_what_the_parity_test_checks() -> None:
    assert set(_contract_methods()) == {
        "check", "create", "agent_address", "ready_timeout", "egress_endpoint", "diagnostics", "pause", "resume",
        "destroy", "alive", "frozen", "oom_kills", "restore", "adopt", "sweep", "capacity", "close",
        "stop", "boot", "snapshot", "delete_snapshot", "create_volume", "delete_volume", "volume_used", "usage"}


def test_a_backend_implements_every_contract_method_with_its_async_ness(backend: Any) -> None:
    assert isinstance(backend, Backend)
    assert isinstance(backend.name, str) and backend.name
    for name, declared in _contract_methods().items():
        implemented = getattr(type(backend), name)
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), \
            f"{type(backend).__name__}.{name}: async must match the contract"
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(implemented).parameters)
        assert got == want, f"{type(backend).__name__}.{name}{got}: the contract says {want}"


def test_a_backend_refuses_a_record_that_is_not_its_own(backend: Any) -> None:
    for garbage in ({}, {"sandbox_id": "sb-x"}, {"sandbox_id": 1, "dir": [], "runtime": "qemu"}):
        with pytest.raises(ValueError):
            backend.restore(garbage)


def test_the_local_record_round_trips_and_stays_in_its_home(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path, cgroup_parent="corral-x")
    record = LocalRecord(sandbox_id="sb-abcd", dir=tmp_path / "sandboxes" / "sb-abcd", runtime=SPEC.runtime,
                         slot=3, uid_base=(1 << 20) + 3 * 65536, token="t", cgroups_path="/corral-x/sb-abcd")
    data = json.loads(json.dumps(record.to_json()))
    assert backend.restore(data) == record
    assert backend.agent_address(record) == AgentAddress(UnixEndpoint(str(record.dir / "agent.sock")), "t")
    assert backend.egress_endpoint(record) == UnixEndpoint(str(record.dir / "egress" / "proxy.sock"))
    with pytest.raises(ValueError, match="not under"):  # destroy removes that directory: never elsewhere
        backend.restore({**data, "dir": "/etc"})
    with pytest.raises(ValueError):
        backend.restore({**data, "slot": "3"})
