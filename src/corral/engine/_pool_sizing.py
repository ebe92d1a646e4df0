"""How many members a self-sizing warm pool keeps now: a pure policy (no I/O, no clock of its own).

A pool that sizes itself (`corral serve --pool default=auto`, the README's server by default) keeps a few members
at rest and grows to the largest burst of demand it saw lately, so the next burst like it is served from ready
members; when no burst came for a while it shrinks back. Demand is every create the pool could serve, whether it
found a member (a claim) or not (a miss): what arrived, not what the pool happened to hold.

* **a burst** is the demand that arrived within `span` seconds (50 agents asking at once arrive within a fraction
  of a second; agents started a little apart still count as one burst); the pool wants the largest one seen in the
  last `window` seconds, and at least `rest` members;
* **bounded by capacity**: never more members than the machine can take beside what it runs (the engine's count
  and memory-promise caps, the backend's), so a pool never fills up to a `CapacityError`; a caller's create still
  takes the room of ready members first (docs/performance.md);
* **bounded by a memory budget**: idle members together use at most `memory_share` of the machine's memory,
  counted at `member_memory` each (an idle member's agent, cgroup charge and kernel objects, with margin); and at
  most `ceiling` members whatever the machine;
* **shrinking when idle**: a burst older than `window` no longer counts, and the filler gives back members over
  the target.

`DemandHistory` keeps the demand in one-second buckets over the window (bounded memory, whatever the rate);
`pool_target` is the decision. The filler (`Pools` in `_pool.py`) records demand at each claim and miss and asks
for the target at every step, passing the time and the machine's figures in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .._exceptions import InvalidRequestError

__all__ = ["AutoSize", "DemandHistory", "PoolRoom", "pool_target"]

_MiB = 1024**2


@dataclass(frozen=True)
class AutoSize:
    """The knobs of a self-sizing pool (the defaults are `corral serve`'s).

    * **rest** - members kept when no burst came within `window`.
    * **ceiling** - never more members than this.
    * **window** - seconds a burst keeps the pool at its size.
    * **span** - demand arriving within this many seconds counts as one burst.
    * **memory_share** - the members' memory, `member_memory` each, stays within this share of the machine's.
    * **member_memory** - what one idle member takes (bytes): ~12 MiB of agent RSS plus its cgroup's charge and
      kernel objects (`corral bench density`), with margin.
    """

    rest: int = 4
    ceiling: int = 200
    window: float = 600.0
    span: float = 5.0
    memory_share: float = 0.1
    member_memory: int = 32 * _MiB

    def __post_init__(self) -> None:
        if not 0 <= self.rest <= self.ceiling:
            raise InvalidRequestError(f"a self-sizing pool's rest size ({self.rest}) must be between 0 and its "
                                      f"ceiling ({self.ceiling})")
        if not self.span >= 1 or not self.window >= self.span:
            raise InvalidRequestError(f"a self-sizing pool needs span >= 1 s and window >= span (span {self.span:g}, "
                                      f"window {self.window:g})")
        if not 0 < self.memory_share <= 1 or self.member_memory <= 0:
            raise InvalidRequestError("a self-sizing pool's memory share must be in (0, 1] and its member memory "
                                      "positive")


class DemandHistory:
    """Demand per one-second bucket over the last `window` seconds: the buckets of seconds with demand, oldest
    first, as `(second, count)`. Times are the caller's (monotonic seconds)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._buckets: deque[tuple[int, int]] = deque()

    def record(self, now: float, count: int = 1) -> None:
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1] = (second, self._buckets[-1][1] + count)
        else:
            self._buckets.append((second, count))
        self._forget(now)

    def _forget(self, now: float) -> None:
        oldest = math.floor(now - self.window)
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def peak(self, now: float, span: float) -> int:
        """The most demand that arrived within any `span` seconds (whole buckets) of the last `window`."""
        self._forget(now)
        width = max(1, math.ceil(span))
        best = total = 0
        start = 0
        buckets = self._buckets
        for second, count in buckets:
            total += count
            while buckets[start][0] <= second - width:
                total -= buckets[start][1]
                start += 1
            best = max(best, total)
        return best

    def last(self) -> int | None:
        """The second of the latest demand still in the window (None: none)."""
        return self._buckets[-1][0] if self._buckets else None


@dataclass(frozen=True)
class PoolRoom:
    """The machine's figures for one pool, taken by the filler just before it asks.

    * **held** - members the pool has now, ready or starting.
    * **free** - how many more sandboxes of the pool's spec the machine takes beside everything it holds (members
      included); None: no count or memory-promise bound.
    * **memory_total** - the backend's memory (bytes); None: unknown (no memory budget then).
    """

    held: int
    free: int | None
    memory_total: int | None


def pool_target(policy: AutoSize, history: DemandHistory, room: PoolRoom, now: float) -> int:
    """How many members the pool should keep now: the largest burst of the window (at least `rest`), within the
    ceiling, the machine's room and the memory budget."""
    wanted = max(policy.rest, history.peak(now, policy.span))
    bound = policy.ceiling
    if room.free is not None:
        bound = min(bound, room.held + max(0, room.free))
    if room.memory_total is not None:
        bound = min(bound, int(policy.memory_share * room.memory_total) // policy.member_memory)
    return max(0, min(wanted, bound))
