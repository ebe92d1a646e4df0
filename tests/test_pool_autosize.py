"""A self-sizing warm pool's wiring (engine/_pool.py over engine/_pool_sizing.py), with members that are plain
records (no sandbox): demand is recorded at every claim and miss, the filler fills to the policy's target and gives
back what is over it once the burst has left the window, within the machine's room; `corral serve` gets the
self-sizing pool of the default template by default, `--pool` pins, `--no-pool` turns it off."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from corral.backends import BackendCapacity
from corral.cli import app
from corral.engine import Capacity, MachineUsage, SandboxSpec, WarmPool, serve_pools
from corral.engine._pool import Pools, PoolState
from corral.engine._pool_sizing import AutoSize
from corral.engine._sandbox import LiveSandbox

pytestmark = pytest.mark.anyio

GiB = 1024**3


class Members:
    """make/destroy for `Pools`: members are records, counted."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.destroyed: list[str] = []

    async def make(self, spec: SandboxSpec, sandbox_id: str) -> LiveSandbox:
        self.made.append(sandbox_id)
        return LiveSandbox(id=sandbox_id, spec=spec, record=None, agent=None, created_at=0.0)  # type: ignore[arg-type]

    async def destroy(self, sb: LiveSandbox, reason: str) -> None:
        self.destroyed.append(sb.id)


async def _capacity() -> BackendCapacity:
    return BackendCapacity(memory_total=64 * GiB, memory_available=64 * GiB)


class Clock:
    """The pools' monotonic time, moved by the test: a window passes without waiting for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pools(members: Members, *, auto: AutoSize | None = None, size: int = 0, room: Any = None,
           clock: Clock | None = None) -> tuple[Pools, PoolState]:
    pool = WarmPool(SandboxSpec(), size=size, auto=auto) if auto else WarmPool(SandboxSpec(), size)
    pools = Pools([pool], resizable=False, make=members.make, destroy=members.destroy, capacity=_capacity,
                  creating={}, room=room, clock=clock or Clock())
    (state,) = pools.states.values()
    return pools, state


async def _settle(pools: Pools) -> None:
    """One filler step after the quiet that follows demand, and the members it started (bounded: a few steps)."""
    for _ in range(5):
        pools.last_demand = -1e9  # the quiet after the last create has passed
        await pools.step()
        await asyncio.gather(*pools.tasks)


def _burst(pools: Pools, n: int) -> list[str | None]:
    return [pools.claim(SandboxSpec()) for _ in range(n)]


async def test_a_self_sizing_pool_fills_to_its_rest_size_then_to_the_burst_it_saw() -> None:
    members = Members()
    pools, state = _pools(members, auto=AutoSize(rest=3))
    await _settle(pools)
    assert len(state.members) == 3 and pools.stats()["default=auto"].target == 3
    claimed = _burst(pools, 10)  # 3 served warm, 7 missed: all 10 are demand
    assert sum(c is not None for c in claimed) == 3
    assert state.stats.claimed == 3 and state.stats.missed == 7
    assert pools.wanted(state) == 10
    await _settle(pools)
    assert len(state.members) == 10, "the next burst like it is served warm"
    assert sum(c is not None for c in _burst(pools, 10)) == 10


async def test_the_filler_waits_for_the_quiet_after_a_burst_before_it_grows_the_pool() -> None:
    members = Members()
    pools, state = _pools(members, auto=AutoSize(rest=1))
    await _settle(pools)
    _burst(pools, 6)
    made = len(members.made)
    await pools.step()  # right after the burst: nothing competes with its creates
    assert len(members.made) == made and pools.wanted(state) == 6


async def test_a_self_sizing_pool_shrinks_back_to_rest_once_the_burst_leaves_the_window() -> None:
    members, clock = Members(), Clock()
    pools, state = _pools(members, auto=AutoSize(rest=2, window=60, span=5), clock=clock)
    _burst(pools, 6)
    await _settle(pools)
    assert len(state.members) == 6
    clock.now += 59
    assert pools.wanted(state) == 6, "still within the window"
    await _settle(pools)
    assert len(state.members) == 6 and not members.destroyed
    clock.now += 2
    assert pools.wanted(state) == 2, "the burst left the window"
    await _settle(pools)
    assert len(state.members) == 2 and len(members.destroyed) == 4
    assert state.stats.evicted == 4
    assert set(members.destroyed).isdisjoint(state.members)


async def test_wanted_follows_the_largest_burst_still_in_the_window() -> None:
    clock = Clock()
    pools, state = _pools(Members(), auto=AutoSize(rest=2, window=60, span=5), clock=clock)
    assert pools.wanted(state) == 2, "no demand yet: the rest size"
    _burst(pools, 9)
    clock.now += 30
    _burst(pools, 4)  # a smaller burst later: the pool keeps the larger one's size
    assert pools.wanted(state) == 9
    clock.now += 3
    _burst(pools, 3)  # within the second's span: one burst of 7
    assert pools.wanted(state) == 9
    clock.now += 28  # the first burst left the window, the second has not
    assert pools.wanted(state) == 7
    clock.now += 61
    assert pools.wanted(state) == 2, "idle for a window: back to rest"


async def test_a_self_sizing_pool_grows_only_into_the_room_the_machine_has() -> None:
    members = Members()
    machine = {"slots": 8, "others": 2}  # room for 8 sandboxes; 2 run that are not the pool's

    def room(memory: int, figures: BackendCapacity) -> int:
        held = len(members.made) - len(members.destroyed) - claimed
        return machine["slots"] - machine["others"] - held

    claimed = 0
    pools, state = _pools(members, auto=AutoSize(rest=1), room=room)
    await _settle(pools)
    assert len(state.members) == 1
    claimed = sum(c is not None for c in _burst(pools, 50))  # the member claimed: it runs now, as an 'other'
    machine["others"] += claimed
    await _settle(pools)
    assert len(state.members) == 5 and pools.wanted(state) == 5, "8 slots, 3 taken: 5 members, not 50"
    machine["others"] -= 3  # three sandboxes end: the pool may grow into their room
    await _settle(pools)
    assert len(state.members) == 8 and not members.destroyed


async def test_a_pinned_pool_keeps_its_size_and_records_no_demand() -> None:
    members = Members()
    pools, state = _pools(members, size=3)
    _burst(pools, 20)
    await _settle(pools)
    assert state.demand is None and len(state.members) == 3 and pools.wanted(state) == 3


def test_capacity_room_counts_what_the_check_would_still_let_in() -> None:
    figures = BackendCapacity(memory_total=8 * GiB, memory_available=6 * GiB, disk_free=100 * GiB)
    usage = MachineUsage(sandboxes=10, memory=10 * GiB // 2)
    assert Capacity().room(usage, GiB // 2, figures) == (32 * GiB - 5 * GiB) // (GiB // 2)
    assert Capacity(max_sandboxes=12).room(usage, GiB // 2, figures) == 2
    assert Capacity(max_sandboxes=8).room(usage, GiB // 2, figures) == 0, "over the cap: no room, never negative"
    assert Capacity().room(usage, GiB // 2, BackendCapacity()) is None, "nothing bounds it"
    short = BackendCapacity(memory_total=8 * GiB, memory_available=100 * 1024**2)
    assert Capacity().room(usage, GiB // 2, short) == 0, "memory short now: the check would refuse"
    for n in range(Capacity(max_sandboxes=12).room(usage, GiB // 2, figures) or 0):
        Capacity(max_sandboxes=12).check(MachineUsage(usage.sandboxes + n, usage.memory), GiB // 2, figures,
                                         retry_after=1)


def test_serve_pools_adds_the_self_sizing_default_unless_one_given_serves_it() -> None:
    def described(pools: list[WarmPool]) -> list[str]:
        return [p.describe() for p in pools]

    assert described(serve_pools([], default=True)) == ["default=auto"]
    assert described(serve_pools([], default=False)) == []
    assert described(serve_pools([WarmPool.parse("default=20")], default=True)) == ["default=20"]
    assert described(serve_pools([WarmPool.parse("default=0")], default=True)) == ["default=0"]
    assert described(serve_pools([WarmPool.parse("python=2")], default=True)) == ["python=2", "default=auto"]
    assert described(serve_pools([WarmPool.parse("default/root=2")], default=True)) == \
        ["default/root=2", "default=auto"]
    auto = WarmPool.parse("default/root=auto:5")
    assert auto.auto == AutoSize() and auto.spec.root and auto.refill == 5 and auto.describe() == "default/root=auto:5"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """`corral serve`'s arguments to the server, without starting one; the default template 'built'."""
    import corral.server
    import corral.templates

    seen: dict[str, Any] = {}
    monkeypatch.setattr(corral.server, "serve", lambda *args, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(corral.templates.TemplateStore, "exists", lambda self, name: name == "default")
    monkeypatch.setenv("CORRAL_HOME", str(tmp_path))
    monkeypatch.delenv("CORRAL_POOLS", raising=False)
    return seen


@pytest.mark.parametrize(("args", "pools"), [
    ([], ["default=auto"]),
    (["--no-pool"], []),
    (["--pool", "default=0"], ["default=0"]),
    (["--pool", "default=50:10"], ["default=50:10"]),
    (["--pool", "python=3"], ["python=3", "default=auto"]),
    (["--backend", "docker"], []),
    (["--backend", "docker", "--pool", "default=auto"], ["default=auto"]),
])
def test_serve_gets_the_self_sizing_default_pool_and_pool_pins_it(served: dict[str, Any], args: list[str],
                                                                  pools: list[str]) -> None:
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 0, result.output
    assert [p.describe() for p in served["pools"]] == pools
    assert f"warm pools: {pools[0] if pools else 'none'}" in result.output, "serve says its pool choice at start"


def test_serve_refuses_no_pool_with_pools(served: dict[str, Any]) -> None:
    result = CliRunner().invoke(app, ["serve", "--no-pool", "--pool", "default=3"])
    assert result.exit_code == 2 and "--no-pool" in result.output, result.output
    assert "pools" not in served
