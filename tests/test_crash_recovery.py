"""A server killed between any two steps of create, timeout change, pause and destroy: after a restart (a new engine
and service over the same home and store, the reconciler run), the store and the backend agree.

The kill is in-process: every call into the backend or the store counts as a step, and at the chosen one the
"process" dies. From then on every such call raises (a killed process runs no compensation, no `finally` that
reaches the world), its engine lock is let go, and a new `Engine` + `Service` start over the same home, the same
database and the same `World` (tests/fakes.py: what outlives an engine).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corral.control import ControlStore, Principal, Role
from corral.engine import Engine, SandboxState
from corral.service import CreateSandbox, Service

from .fakes import FakeBackend, FakeTemplates, World

pytestmark = pytest.mark.anyio

_counting: contextvars.ContextVar[bool] = contextvars.ContextVar("counting", default=False)


class Killed(BaseException):
    """The server process died here (a BaseException: nothing in the service catches it as an error)."""


@dataclass
class Fault:
    at: int | None  # the step that kills the server (None: none does)
    steps: int = 0
    dead: bool = False

    def step(self, what: str) -> None:
        if self.dead:
            raise Killed(f"dead (at {what})")
        if not _counting.get():
            return  # background work (reconciler, heartbeat, sampler): not the scenario's steps
        self.steps += 1
        if self.steps == self.at:
            self.dead = True
            raise Killed(f"killed before step {self.steps}: {what}")


def _wrap(obj: object, fault: Fault, label: str) -> None:
    """Every coroutine method of `obj` counts as a step (and fails once the server is dead)."""
    for name, member in inspect.getmembers(type(obj), inspect.iscoroutinefunction):
        if name.startswith("__") or name == "_serve":  # the fake agent's start is the sandbox's, not the server's
            continue
        bound = getattr(obj, name)

        @functools.wraps(member)
        async def call(*args: Any, _bound: Callable[..., Awaitable[Any]] = bound, _name: str = name,
                       **kwargs: Any) -> Any:
            fault.step(f"{label}.{_name}")
            return await _bound(*args, **kwargs)

        setattr(obj, name, call)


@dataclass
class Server:
    service: Service
    backend: FakeBackend
    store: ControlStore


async def _serve(home: Path, world: World, fault: Fault | None = None) -> Server:
    backend = FakeBackend(home, world)
    store = ControlStore(home=home)
    engine = Engine(home, backend, templates=FakeTemplates())  # type: ignore[arg-type]
    service = Service(engine, store)
    await service.start()
    if fault is not None:
        _wrap(backend, fault, "backend")
        _wrap(store, fault, "store")
    return Server(service, backend, store)


async def _bury(server: Server) -> None:
    """What the kernel does for a killed process: its tasks stop, its engine lock and database go."""
    svc = server.service
    for part in (svc.sampler, svc.reconciler, svc.replica):
        try:
            await part.close()
        except (Killed, Exception):
            pass
    engine = svc.engine
    for task in engine._tasks:
        task.cancel()
    if engine._lock_fd is not None:
        os.close(engine._lock_fd)
        engine._lock_fd = None
    await type(server.store).close(server.store)  # the unwrapped method: the database file outlives the process


async def _scenario(server: Server, who: Principal) -> None:
    sandboxes = server.service.sandboxes
    token = _counting.set(True)
    try:
        record = await sandboxes.create(who, CreateSandbox(env={"K": "v"}, timeout=300))
        await sandboxes.set_timeout(who, record.id, 600)
        await sandboxes.pause(who, record.id)
        await sandboxes.resume(who, record.id)
        await sandboxes.pause(who, record.id, memory=False)
        await sandboxes.resume(who, record.id)
        await sandboxes.kill(who, record.id)
    finally:
        _counting.reset(token)


async def _agree(server: Server, world: World) -> None:
    """Store, engine and backend name the same live sandboxes, in the same state: frozen in the backend if and
    only if the store says paused in place, stopped if and only if paused to disk."""
    await server.service.reconciler.run_pass(orphans=True)
    live = {r.id: r for r in await server.store.list_sandboxes(None)}
    engine = {i.id: i for i in server.service.engine.list()}
    on_disk = {i for i, r in live.items() if r.paused_to_disk}
    assert set(live) == set(engine) == world.running | world.stopped, (live, engine, world.running, world.stopped)
    assert on_disk == world.stopped and not world.running & world.stopped, (on_disk, world.stopped)
    in_place = {i for i, r in live.items() if r.state is SandboxState.PAUSED and not r.paused_to_disk}
    assert in_place == world.frozen, (in_place, world.frozen)
    for sandbox_id, record in live.items():
        assert record.state in (SandboxState.RUNNING, SandboxState.PAUSED)
        assert engine[sandbox_id].state is record.state
        if record.state is SandboxState.RUNNING:  # usable: its agent answers, with its environment
            assert await server.service.engine.alive(sandbox_id)
            assert server.service.engine.sandbox_env(sandbox_id)["K"] == "v"


@pytest.fixture
async def home() -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cc-", dir="/tmp"))  # short: the fake agents' Unix sockets live here
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _run(home: Path, kill_at: int | None) -> int:
    """The scenario with a kill at step `kill_at`, then a restart and the check; the steps the scenario took."""
    world = World(home / "world")
    world.dir.mkdir(parents=True)
    fault = Fault(kill_at)
    first = await _serve(home, world, fault)
    tenant = (await first.store.create_tenant("t")).id
    who = await first.store.authenticate((await first.store.create_key(tenant, Role.DEVELOPER)).key)
    try:
        await _scenario(first, who)
    except Killed:
        assert kill_at is not None
    finally:
        await _bury(first)
    second = await _serve(home, world)
    try:
        await _agree(second, world)
    finally:
        await second.service.close()
        await second.service.engine.close(destroy_all=True)
        for server in world.agents.values():
            server.close()
    return fault.steps


async def test_a_kill_between_any_two_steps_leaves_store_and_backend_agreeing(home: Path) -> None:
    steps = await _run(home / "c", None)
    assert steps > 8  # the scenario's store and backend calls: each a place to die
    for at in range(1, steps + 1):
        try:
            await _run(home / f"k{at}", at)
        except AssertionError as exc:
            raise AssertionError(f"killed at step {at} of {steps}: {exc}") from exc
