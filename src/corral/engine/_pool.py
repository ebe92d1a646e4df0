"""Warm pools: sandboxes started ahead of demand, per template, so a burst of creates is served from ready ones.

An operator sets, per pool, the spec its members are made with (template, runtime, root; the default limits),
how many to keep ready and how fast to refill (`corral serve --pool default=50:10`). Members are made in idle
time (never while a caller's own create is starting), are invisible to every tenant (no record, no id handed out)
until one is claimed, and the pools give members back under memory pressure. What a claim applies (env, network
policy, secrets' trust files, metadata, timeout) is the engine's business (`Engine.claim`); this module holds the
configuration and the bookkeeping of who is ready.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .._exceptions import InvalidRequestError
from ._models import Runtime, SandboxSpec

_POOL = re.compile(r"(?P<template>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<flags>(/[a-z]+)*)=(?P<size>\d+)"
                   r"(:(?P<refill>\d+(\.\d+)?))?")
MAX_POOL_SIZE = 10_000


@dataclass(frozen=True)
class WarmPool:
    """One pool: `size` sandboxes of `spec` kept started, at most `refill` new ones a second (0: no bound).

    Only a spec's `pool_key()` matters to whom a member can serve: its template, runtime, limits and whether it has
    root (pooled sandboxes never have volumes).
    """

    spec: SandboxSpec
    size: int
    refill: float = 0.0

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
        """`TEMPLATE[/root][/runsc]=SIZE[:REFILL]`, e.g. `default=50`, `default/root=20:5` (5 a second)."""
        match = _POOL.fullmatch(text.strip())
        if match is None:
            raise InvalidRequestError(f"invalid warm pool {text!r}: expected TEMPLATE[/root][/runsc]=SIZE[:REFILL], "
                                      "e.g. default=50 or default/root=20:5")
        flags = [f for f in match["flags"].split("/") if f]
        unknown = sorted(set(flags) - {"root", "runc", "runsc"})
        if unknown:
            raise InvalidRequestError(f"invalid warm pool {text!r}: unknown flag {unknown[0]!r} (root, runc, runsc)")
        runtime = Runtime.RUNSC if "runsc" in flags else Runtime.RUNC
        spec = SandboxSpec(template=match["template"], runtime=runtime, root="root" in flags)
        return cls(spec=spec, size=int(match["size"]), refill=float(match["refill"] or 0))

    def describe(self) -> str:
        flags = ("/root" if self.spec.root else "") + ("/runsc" if self.spec.runtime is Runtime.RUNSC else "")
        return f"{self.spec.template}{flags}={self.size}" + (f":{self.refill:g}" if self.refill else "")


@dataclass
class PoolStats:
    """What a pool did since the engine started: how bursts were served, in figures for metrics and the bench."""

    ready: int = 0
    starting: int = 0
    claimed: int = 0
    missed: int = 0  # creates that matched the pool and found it empty
    made: int = 0
    failed: int = 0
    evicted: int = 0  # given back under memory pressure or to make room for a caller's create


@dataclass
class PoolState:
    pool: WarmPool
    members: list[str] = field(default_factory=list)  # ready sandbox ids, oldest first
    starting: int = 0
    stats: PoolStats = field(default_factory=PoolStats)
    next_start: float = 0.0  # monotonic time before which the refill rate allows no new start

    def deficit(self) -> int:
        return self.pool.size - len(self.members) - self.starting


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
