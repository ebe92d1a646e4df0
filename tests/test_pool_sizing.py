"""The self-sizing warm pool's policy (engine/_pool_sizing.py): pure arithmetic over a demand history, the
machine's room and a memory budget. No sandbox, no clock: every time is given."""

from __future__ import annotations

import pytest

from corral import InvalidRequestError
from corral.engine._pool_sizing import AutoSize, DemandHistory, PoolRoom, pool_target

GiB = 1024**3
MiB = 1024**2
ROOMY = PoolRoom(held=0, free=None, memory_total=None)  # no bound from the machine
T0 = 10_000.0  # a monotonic clock's reading, far from 0 (a window reaching before it must not matter)


def _history(*events: tuple[float, int], window: float = 600.0) -> DemandHistory:
    history = DemandHistory(window)
    for at, count in events:
        for _ in range(count):
            history.record(T0 + at)
    return history


def _target(history: DemandHistory, at: float, room: PoolRoom = ROOMY, **knobs: object) -> int:
    return pool_target(AutoSize(**knobs), history, room, T0 + at)  # type: ignore[arg-type]


# -- at rest, and growing to the peak -------------------------------------------------------------------------


def test_without_demand_the_pool_keeps_its_rest_size() -> None:
    assert _target(DemandHistory(600), 0) == 4
    assert _target(DemandHistory(600), 0, rest=2) == 2
    assert _target(DemandHistory(600), 0, rest=0) == 0


def test_a_burst_raises_the_target_to_its_size() -> None:
    burst = _history((0.1, 50))
    assert _target(burst, 0.5) == 50
    assert _target(burst, 30) == 50, "the next burst a little later finds the pool at its size"


def test_a_burst_smaller_than_the_rest_size_leaves_the_rest_size() -> None:
    assert _target(_history((0.0, 3)), 1) == 4


def test_demand_spread_over_the_span_counts_as_one_burst_and_demand_apart_does_not() -> None:
    spread = _history((0.0, 10), (1.5, 10), (3.9, 10))  # 30 within 4 s: one burst
    assert _target(spread, 10) == 30
    apart = _history((0.0, 10), (20.0, 10), (40.0, 10))  # 10 at a time, 20 s apart
    assert _target(apart, 50) == 10
    assert _target(apart, 50, span=60) == 30, "a wider span counts them together"


def test_the_largest_burst_of_the_window_wins_over_a_later_smaller_one() -> None:
    history = _history((0.0, 50), (120.0, 8))
    assert _target(history, 130) == 50


def test_peak_counts_whole_one_second_buckets_across_a_second_boundary() -> None:
    history = _history((0.9, 20), (1.1, 20))  # 40 within 0.2 s, in two buckets
    assert history.peak(T0 + 2, span=1) == 20, "a span of one bucket sees one second at a time"
    assert history.peak(T0 + 2, span=2) == 40


# -- shrinking when idle --------------------------------------------------------------------------------------


def test_the_target_falls_back_to_rest_once_the_burst_leaves_the_window() -> None:
    burst = _history((0.0, 50), window=600)
    assert _target(burst, 590) == 50
    assert _target(burst, 602) == 4
    assert burst.last() is None, "nothing left in the window"


def test_history_memory_is_bounded_by_the_window_whatever_the_rate() -> None:
    history = DemandHistory(window=60)
    for i in range(10_000):  # 10 creates a second for 1000 s
        history.record(T0 + i / 10)
    assert len(history._buckets) <= 62
    assert history.peak(T0 + 1000, span=5) == 50  # the steady rate over one span


# -- bounds --------------------------------------------------------------------------------------------------


def test_never_more_members_than_the_machine_has_room_for() -> None:
    burst = _history((0.0, 50))
    assert _target(burst, 1, PoolRoom(held=4, free=10, memory_total=None)) == 14, "held plus what still fits"
    assert _target(burst, 1, PoolRoom(held=4, free=0, memory_total=None)) == 4, "a full machine: keep what it has"
    assert _target(burst, 1, PoolRoom(held=0, free=0, memory_total=None)) == 0, "even below the rest size"
    assert _target(burst, 1, PoolRoom(held=3, free=-2, memory_total=None)) == 3, "overfull: no negative room"


def test_the_memory_budget_bounds_the_members() -> None:
    burst = _history((0.0, 500))
    # 10% of 8 GiB at 32 MiB a member: 25 members.
    assert _target(burst, 1, PoolRoom(held=0, free=None, memory_total=8 * GiB)) == 25
    assert _target(burst, 1, PoolRoom(held=0, free=None, memory_total=8 * GiB), memory_share=0.5) == 128
    assert _target(burst, 1, PoolRoom(held=0, free=None, memory_total=8 * GiB), member_memory=64 * MiB) == 12
    # A tiny machine: the budget wins even over the rest size.
    assert _target(DemandHistory(600), 0, PoolRoom(held=0, free=None, memory_total=512 * MiB)) == 1


def test_the_ceiling_bounds_a_huge_burst_on_a_huge_machine() -> None:
    burst = _history((0.0, 5000))
    assert _target(burst, 1, PoolRoom(held=0, free=None, memory_total=1024 * GiB)) == 200
    assert _target(burst, 1, ceiling=60) == 60


def test_the_tightest_bound_wins() -> None:
    burst = _history((0.0, 100))
    room = PoolRoom(held=10, free=20, memory_total=8 * GiB)  # room 30, budget 25, ceiling 200
    assert _target(burst, 1, room) == 25
    assert _target(burst, 1, room, ceiling=12) == 12


# -- configuration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("knobs", [{"rest": -1}, {"rest": 5, "ceiling": 4}, {"span": 0.5}, {"window": 2, "span": 5},
                                   {"memory_share": 0}, {"memory_share": 1.5}, {"member_memory": 0}])
def test_bad_knobs_are_refused_with_a_clear_error(knobs: dict[str, float]) -> None:
    with pytest.raises(InvalidRequestError, match="self-sizing pool"):
        AutoSize(**knobs)  # type: ignore[arg-type]
