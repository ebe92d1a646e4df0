"""Warm pools: sandboxes started ahead of demand, per template, so a burst of creates is served from ready ones.

An operator sets, per pool, the spec its members are made with (template, runtime, root; the default limits),
how many to keep ready and how fast to refill (`corral serve --pool default=50:10`). Members are made in idle
time (never while a caller's own create is starting), are invisible to every tenant (no record, no id handed out)
until one is claimed, and the pools give members back under memory pressure. What a claim applies (env, network
policy, secrets' trust files, metadata, timeout) is the runtime's business (`Engine.adopt`); this module holds the
configuration, the bookkeeping of who is ready and the filler (`Pools`). How many members a pool wants at any
moment is one decision, `Pools.wanted`, that the filler, a claim and a release all consult: a pinned pool's size,
or, for a self-sizing one (`default=auto`), what `_pool_sizing.pool_target` makes of the demand it saw (recorded
at every claim and miss) and the machine's room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .._exceptions import InvalidRequestError
from ..backends import RESIZABLE_LIMITS, BackendCapacity
from ._models import Runtime, SandboxSpec
from ._pool_sizing import AutoSize, DemandHistory, PoolRoom, pool_target
from ._sandbox import LiveSandbox

logger = logging.getLogger("corral.engine")

_POOL_QUIET = 0.5  # seconds after the last create or claim before pools start refilling (a burst goes first)
_POOL_PARALLEL = max(1, os.cpu_count() or 1)  # members started at once: one per core
_POOL_IDLE_POLL = 2.0  # seconds between looks at the pools when nothing wakes the filler
_POOL_PRESSURE_POLL = 1.0  # ... while memory is short
_POOL_RETRY = 5.0  # seconds before a pool whose member failed to start tries again
_GiB = 1024**3

MakeMember = Callable[[SandboxSpec, str], Awaitable[LiveSandbox]]  # (spec, id) -> a started pool member
DestroyMember = Callable[[LiveSandbox, str], Awaitable[None]]  # (member, reason)
Room = Callable[[int, BackendCapacity], int | None]  # (memory limit, figures) -> more sandboxes that fit now

_POOL = re.compile(r"(?P<template>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<flags>(/[a-z]+)*)=(?P<size>\d+|auto)"
                   r"(:(?P<refill>\d+(\.\d+)?))?")
MAX_POOL_SIZE = 10_000


@dataclass(frozen=True)
class WarmPool:
    """One pool: `size` sandboxes of `spec` kept started, at most `refill` new ones a second (0: no bound); with
    `auto`, the size follows demand instead (`_pool_sizing`; `size` is then unused).

    Only a spec's `pool_key()` matters to whom a member can serve: its template, runtime, limits and whether it has
    root (pooled sandboxes never have volumes).
    """

    spec: SandboxSpec
    size: int = 0
    refill: float = 0.0
    auto: AutoSize | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.size <= MAX_POOL_SIZE:
            raise InvalidRequestError(f"a warm pool's size must be between 0 and {MAX_POOL_SIZE}, not {self.size}")
        if self.refill < 0:
            raise InvalidRequestError(f"a warm pool's refill rate must not be negative, not {self.refill:g}")
        if self.spec.volumes:
            raise InvalidRequestError("a warm pool's sandboxes cannot have volumes (each sandbox mounts its own)")

    @property
    def key(self) -> tuple[object, ...]:
        return self.spec.pool_key()

    @classmethod
    def parse(cls, text: str) -> WarmPool:
        """`TEMPLATE[/root][/runsc]=SIZE[:REFILL]`, e.g. `default=50`, `default/root=20:5` (5 a second), or
        `default=auto` (self-sizing)."""
        match = _POOL.fullmatch(text.strip())
        if match is None:
            raise InvalidRequestError(f"invalid warm pool {text!r}: expected TEMPLATE[/root][/runsc]=SIZE[:REFILL] "
                                      "(SIZE a number or auto), e.g. default=50, default/root=20:5 or default=auto")
        flags = [f for f in match["flags"].split("/") if f]
        unknown = sorted(set(flags) - {"root", "runc", "runsc"})
        if unknown:
            raise InvalidRequestError(f"invalid warm pool {text!r}: unknown flag {unknown[0]!r} (root, runc, runsc)")
        runtime = Runtime.RUNSC if "runsc" in flags else Runtime.RUNC
        spec = SandboxSpec(template=match["template"], runtime=runtime, root="root" in flags)
        refill = float(match["refill"] or 0)
        if match["size"] == "auto":
            return cls(spec=spec, refill=refill, auto=AutoSize())
        return cls(spec=spec, size=int(match["size"]), refill=refill)

    def describe(self) -> str:
        flags = ("/root" if self.spec.root else "") + ("/runsc" if self.spec.runtime is Runtime.RUNSC else "")
        size = "auto" if self.auto is not None else str(self.size)
        return f"{self.spec.template}{flags}={size}" + (f":{self.refill:g}" if self.refill else "")


@dataclass
class PoolStats:
    """What a pool did since the engine started: how bursts were served, in figures for metrics and the bench."""

    ready: int = 0
    starting: int = 0
    claimed: int = 0
    missed: int = 0  # creates that matched the pool and found it empty
    made: int = 0
    failed: int = 0
    evicted: int = 0  # given back under memory pressure, to make room for a caller's create, or over the target
    target: int = 0  # members the pool wants now (`Pools.wanted`)


@dataclass
class PoolState:
    pool: WarmPool
    members: list[str] = field(default_factory=list)  # ready sandbox ids, oldest first
    starting: int = 0
    stats: PoolStats = field(default_factory=PoolStats)
    next_start: float = 0.0  # monotonic time before which the refill rate allows no new start
    demand: DemandHistory | None = None  # a self-sizing pool's claims and misses

    def __post_init__(self) -> None:
        if self.pool.auto is not None and self.demand is None:
            self.demand = DemandHistory(self.pool.auto.window)


def parse_pools(texts: list[str]) -> list[WarmPool]:
    """Several pools; two for the same spec are an error (which size would win is not obvious)."""
    pools = [WarmPool.parse(t) for text in texts for t in re.split(r"[\s,;]+", text) if t]
    seen: dict[tuple[object, ...], WarmPool] = {}
    for pool in pools:
        if pool.key in seen:
            raise InvalidRequestError(f"warm pools {seen[pool.key].describe()!r} and {pool.describe()!r} are for the "
                                      "same sandboxes: give one")
        seen[pool.key] = pool
    return pools


DEFAULT_POOL = "default=auto"  # `corral serve`'s pool when none is given (the local backend, the template built)


def serve_pools(given: Sequence[WarmPool], *, default: bool) -> list[WarmPool]:
    """`corral serve`'s pools: those given, and with `default` the self-sizing pool of the default template unless
    one given serves the same sandboxes (`--pool default=20` pins it; `--pool default=0` turns it off)."""
    pools = list(given)
    auto = WarmPool.parse(DEFAULT_POOL)
    if default and all(pool.key != auto.key for pool in pools):
        pools.append(auto)
    return pools


def pools_notice(pools: Sequence[WarmPool]) -> str:
    """What `corral serve` says at start about its warm pools (one line)."""
    if not pools:
        return "warm pools: none (creates start cold; --pool TEMPLATE=SIZE or TEMPLATE=auto keeps some started)"
    said = []
    for pool in pools:
        auto = pool.auto
        said.append(pool.describe() if auto is None else
                    f"{pool.describe()} (self-sizing: {auto.rest} at rest, growing to the largest burst of creates "
                    f"of the last {auto.window:g} s, within capacity, {auto.memory_share:.0%} of memory and "
                    f"{auto.ceiling} members)")
    return "warm pools: " + ", ".join(said)


class Pools:
    """The warm pools of one engine: ready members, claims, the filler that keeps them full in idle time.

    `make` starts a member and `destroy` ends one (the runtime's); `creating` is the runtime's sandboxes being
    created (a caller's create goes before any refill); `capacity` the backend's figures; `room` how many more
    sandboxes of a memory limit the machine takes now (the runtime's capacity check, counted: bounds a self-sizing
    pool); `clock` the monotonic time the quiet, the refill rate and the demand window are counted in.
    """

    def __init__(self, pools: Sequence[WarmPool], *, resizable: bool, make: MakeMember, destroy: DestroyMember,
                 capacity: Callable[[], Awaitable[BackendCapacity]], creating: Mapping[str, int],
                 room: Room | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._resizable = resizable
        self._clock = clock  # monotonic seconds (a test's own clock: demand leaves the window without waiting)
        self._make, self._destroy, self._capacity, self._creating = make, destroy, capacity, creating
        self._room = room
        self._figures: BackendCapacity | None = None  # the backend's, as of the filler's last step
        self.states: dict[tuple[object, ...], PoolState] = {}
        for pool in pools:
            if self.key(pool.spec) in self.states:
                raise InvalidRequestError(f"warm pools {self.states[self.key(pool.spec)].pool.describe()!r} "
                                          f"and {pool.describe()!r} serve the same sandboxes on this backend")
            self.states[self.key(pool.spec)] = PoolState(pool)
        # Pools give members back while the backend has less memory available (None: 10% of its total, >= 1 GiB).
        self.memory_floor: int | None = None
        self.ready: dict[str, LiveSandbox] = {}  # ready members, by id
        self.claimed: dict[str, LiveSandbox] = {}  # taken by `claim`, not yet adopted or released
        self.starting: set[str] = set()  # members being created (not a caller's create)
        self.tasks: set[asyncio.Task[None]] = set()
        self.wake = asyncio.Event()
        self.last_demand = 0.0  # monotonic time of the last create or claim: pools fill in the quiet after it

    def key(self, spec: SandboxSpec) -> tuple[object, ...]:
        """Which pool can serve `spec`: its `pool_key`, without the limits a `Resizable` backend sets at claim."""
        if not self._resizable:
            return spec.pool_key()
        fixed = spec.limits.model_dump(exclude=set(RESIZABLE_LIMITS))
        return (spec.template, spec.runtime.value, tuple(sorted(fixed.items())), bool(spec.volumes), spec.root)

    def wanted(self, state: PoolState) -> int:
        """How many ready members the pool wants now: the one decision of a pool's size. A pinned pool's is its
        configured size; a self-sizing pool's follows the demand it saw, within the machine's room (as of the
        filler's last look) and its memory budget (`_pool_sizing`)."""
        auto, demand = state.pool.auto, state.demand
        if auto is None or demand is None:
            return state.pool.size
        figures = self._figures
        free = None if figures is None or self._room is None else self._room(state.pool.spec.limits.memory, figures)
        if free is not None:  # members spawned whose create has not reached the runtime's count yet take room too
            free -= sum(1 for sandbox_id in self.starting if sandbox_id not in self._creating)
        room = PoolRoom(held=len(state.members) + state.starting, free=free,
                        memory_total=None if figures is None else figures.memory_total)
        return pool_target(auto, demand, room, self._clock())

    def _deficit(self, state: PoolState) -> int:
        return self.wanted(state) - len(state.members) - state.starting

    def _fullness(self, state: PoolState) -> float:
        return len(state.members) / max(1, self.wanted(state))

    def held(self) -> list[LiveSandbox]:
        """Members that take room on the machine: ready and claimed."""
        return [*self.ready.values(), *self.claimed.values()]

    def demand(self) -> None:
        self.last_demand = self._clock()

    def claim(self, spec: SandboxSpec) -> str | None:
        """Take a ready member that can serve `spec` aside, and return its id (None: no pool for `spec`, or it is
        empty). No await: a burst's concurrent claims never get the same member."""
        self.demand()
        if not self.states or spec.volumes:  # no pool: no key to build on every create
            return None
        state = self.states.get(self.key(spec))
        if state is None:
            return None
        self.wake.set()
        if state.demand is not None:
            state.demand.record(self._clock())
        if not state.members:
            state.stats.missed += 1
            return None
        sandbox_id = state.members.pop()  # the newest: its pages are the likeliest still in memory
        self.claimed[sandbox_id] = self.ready.pop(sandbox_id)
        state.stats.claimed += 1
        return sandbox_id

    def release(self, sandbox_id: str, *, reuse: bool = True) -> None:
        """Give a claimed member back unused; with `reuse=False` it is destroyed."""
        sb = self.claimed.pop(sandbox_id)
        state = self.states.get(self.key(sb.spec))
        if not reuse or state is None or len(state.members) >= self.wanted(state):
            self.evict(sb, state)
            return
        state.members.append(sandbox_id)
        self.ready[sandbox_id] = sb

    def stats(self) -> dict[str, PoolStats]:
        """Each pool's figures, by its description (`default=50:10`)."""
        out = {}
        for state in self.states.values():
            state.stats.ready, state.stats.starting = len(state.members), state.starting
            state.stats.target = self.wanted(state)
            out[state.pool.describe()] = replace(state.stats)
        return out

    async def drain(self) -> list[LiveSandbox]:
        """Stop starting members and hand every member over (the engine closes): the caller destroys them."""
        # Members being started finish (a create cancelled half-way undoes itself in a shielded task that this
        # would not wait for), then every member goes with the rest.
        await asyncio.gather(*self.tasks, return_exceptions=True)
        members = self.held()
        self.ready.clear()
        self.claimed.clear()
        for state in self.states.values():
            state.members.clear()
        return members

    async def fill(self) -> None:
        """Keep the pools full in idle time: start members while no caller's create is starting and none came in
        the last `_POOL_QUIET` seconds, at most one per core at once and each pool's refill rate; give members
        back while the backend's available memory is under `memory_floor`."""
        while True:
            self.wake.clear()
            delay = await self.step()
            # `asyncio.timeout`, not `wait_for`: on 3.11 a cancel that lands as the event is set is lost by
            # `wait_for`, and `close` then waits for this loop forever (a test caught it).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.wake.wait()

    async def step(self) -> float:
        """Start what the pools lack now; the seconds until the next look."""
        try:
            figures = await self._capacity()
        except Exception:
            logger.exception("pool.capacity_failed")
            return 5.0
        self._figures = figures
        floor = self._floor(figures)
        available = figures.memory_available
        if available is not None and available < floor:
            if self.evict_one():
                logger.warning("pool.memory_pressure", extra={"available": available, "floor": floor})
            return _POOL_PRESSURE_POLL
        quiet = self.last_demand + _POOL_QUIET - self._clock()
        if quiet > 0 or any(sandbox_id not in self.starting for sandbox_id in self._creating):
            return max(quiet, _POOL_QUIET / 4)
        self._shrink()
        if available is not None and available < 2 * floor:
            return _POOL_PRESSURE_POLL
        now, delay = self._clock(), _POOL_IDLE_POLL
        for state in sorted(self.states.values(), key=self._fullness):
            while self._deficit(state) > 0 and len(self.tasks) < _POOL_PARALLEL:
                if now < state.next_start:
                    delay = min(delay, state.next_start - now)
                    break
                state.next_start = now + (1 / state.pool.refill if state.pool.refill else 0)
                state.starting += 1
                sandbox_id = f"sb-{secrets.token_hex(8)}"
                self.starting.add(sandbox_id)  # counted as room taken from now (`wanted`), not from its task's start
                self._spawn(self._make_member(state, sandbox_id), "corral-pool-member")
        return delay

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(work)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _make_member(self, state: PoolState, sandbox_id: str) -> None:
        try:
            sb = await self._make(state.pool.spec, sandbox_id)
        except Exception:
            state.stats.failed += 1
            state.next_start = self._clock() + _POOL_RETRY  # a broken template must not spin
            logger.exception("pool.fill_failed", extra={"pool": state.pool.describe()})
        else:
            state.stats.made += 1
            if self.states.get(self.key(state.pool.spec)) is state and len(state.members) < self.wanted(state):
                state.members.append(sb.id)
                self.ready[sb.id] = sb
            else:
                self.evict(sb, None)
        finally:
            state.starting -= 1
            self.starting.discard(sandbox_id)
            self.wake.set()

    def _shrink(self) -> None:
        """Give back ready members over what each pool wants (a self-sizing pool's target fell), oldest first."""
        for state in self.states.values():
            for _ in range(len(state.members) - self.wanted(state)):
                self.evict(self.ready.pop(state.members.pop(0)), state)

    def _floor(self, figures: BackendCapacity) -> int:
        if self.memory_floor is not None:
            return self.memory_floor
        return max(_GiB, int((figures.memory_total or 0) * 0.1))

    def evict_one(self) -> bool:
        """Give back the oldest ready member of the fullest pool; False when every pool is empty."""
        candidates = [st for st in self.states.values() if st.members]
        if not candidates:
            return False
        state = max(candidates, key=self._fullness)
        self.evict(self.ready.pop(state.members.pop(0)), state)
        return True

    def evict(self, sb: LiveSandbox, state: PoolState | None) -> None:
        """Destroy a member in the background; its room counts as free at once (`held` no longer has it)."""
        if state is not None:
            state.stats.evicted += 1
        self._spawn(self._destroy(sb, "pool member given back"), "corral-pool-evict")
