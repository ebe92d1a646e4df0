"""The summary of an evaluation run: everything a report shows, computed once (`summarize`): totals and pass
rates by category and family, failure modes ranked by severity, the failed and skipped tasks, and latency spreads;
and the percentile rule (Hyndman & Fan type 7, see `_report.py`)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._formatting import _format_time, _round
from ._result import RunResults, TaskResult
from ._task import CATEGORIES, SEVERITIES
from ._taxonomy import MODES, FailureMode


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values` by linear interpolation (type 7); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, not {q}")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Spread:
    """p50, p95 and max of some timings, in seconds (None for none)."""

    n: int
    p50: float | None
    p95: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        xs = sorted(values)
        return cls(len(xs), percentile(xs, 50), percentile(xs, 95), xs[-1] if xs else None)

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "p50": _round(self.p50), "p95": _round(self.p95), "max": _round(self.max)}


@dataclass(frozen=True)
class Group:
    """Tasks that share a category or a family (or the whole run): their counts and timings."""

    name: str
    passed: int
    failed: int
    skipped: int
    duration: Spread  # task duration of the tasks that ran
    create: Spread  # sandbox create time of the tasks that ran and reported one

    @classmethod
    def of(cls, name: str, results: Sequence[TaskResult]) -> Group:
        counts = Counter(r.status for r in results)
        ran = [r for r in results if r.status != "skip"]
        return cls(
            name, counts["pass"], counts["fail"], counts["skip"],
            Spread.of(r.duration for r in ran),
            Spread.of(r.create_seconds for r in ran if r.create_seconds is not None),
        )

    @property
    def ran(self) -> int:
        return self.passed + self.failed

    @property
    def total(self) -> int:
        return self.ran + self.skipped

    @property
    def rate(self) -> float | None:
        """Passed / ran; None when nothing ran (all skipped), which is not 0%."""
        return self.passed / self.ran if self.ran else None

    def to_json(self, *, latency: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "tasks": self.total, "passed": self.passed, "failed": self.failed, "skipped": self.skipped,
            "ran": self.ran, "pass_rate": _round(self.rate, 6),
        }
        if latency:
            data["duration"] = self.duration.to_json()
            data["create"] = self.create.to_json()
        return data


@dataclass(frozen=True)
class ModeCount:
    """A failure mode and the failed tasks whose first failure it was."""

    mode: FailureMode
    tasks: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.tasks)


def _mode_info(name: str) -> FailureMode:
    """The taxonomy's entry, or a stand-in for a mode this version does not know (a newer runner wrote it)."""
    return MODES.get(name) or FailureMode(name, "medium", name, "(not in this version's failure taxonomy)")


def _severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)


def primary_mode(r: TaskResult) -> str:
    """The mode a failed task counts under: its first failure's."""
    return r.mode or (r.failures[0].mode if r.failures else "unclassified")


# --------------------------------------------------------------------------------------------------------------
# Summary: everything a report shows, computed once


@dataclass(frozen=True)
class Summary:
    """One run, summarised: the numbers every renderer shows."""

    run: RunResults
    total: Group
    categories: tuple[Group, ...]  # in CATEGORIES order, then unknown ones by name; only those present
    families: tuple[Group, ...]  # by name
    modes: tuple[ModeCount, ...]  # by severity, then count (most first), then name
    failed: tuple[TaskResult, ...]  # in the order of their modes, then by id
    skipped: tuple[tuple[str, tuple[str, ...]], ...]  # (reason, task ids), largest group first

    @property
    def adapter(self) -> str:
        return self.run.adapter

    @property
    def started(self) -> str:
        return _format_time(self.run.header.get("started"))

    @property
    def label(self) -> str:
        """How a comparison names this run: adapter and start time."""
        return f"{self.adapter} {self.started}"

    @property
    def complete(self) -> bool:
        return self.run.complete

    @property
    def wall_seconds(self) -> float | None:
        value = (self.run.end or {}).get("wall_seconds")
        return float(value) if isinstance(value, int | float) else None

    @property
    def planned(self) -> int | None:
        """How many tasks the header says the run set out to do."""
        value = self.run.header.get("tasks")
        return value if isinstance(value, int) else None

    def category(self, name: str) -> Group | None:
        return next((g for g in self.categories if g.name == name), None)


def summarize(run: RunResults) -> Summary:
    """Count, rank and time one run's results."""
    modes = _rank_modes(run.results)
    return Summary(
        run=run,
        total=Group.of("all", run.results),
        categories=_groups(run.results, lambda r: r.category, _category_order),
        families=_groups(run.results, lambda r: r.family, lambda name: (0, name)),
        modes=modes,
        failed=_failed_in_mode_order(run.results, modes),
        skipped=_skip_groups(run.results),
    )


def _category_order(name: str) -> tuple[int, str]:
    return (CATEGORIES.index(name) if name in CATEGORIES else len(CATEGORIES), name)


def _groups(results: Sequence[TaskResult], key: Callable[[TaskResult], str],
            order: Callable[[str], tuple[int, str]]) -> tuple[Group, ...]:
    by: dict[str, list[TaskResult]] = defaultdict(list)
    for r in results:
        by[key(r)].append(r)
    return tuple(Group.of(name, by[name]) for name in sorted(by, key=order))


def _rank_modes(results: Sequence[TaskResult]) -> tuple[ModeCount, ...]:
    by: dict[str, list[str]] = defaultdict(list)
    for r in results:
        if r.status == "fail":
            by[primary_mode(r)].append(r.id)
    counts = [ModeCount(_mode_info(name), tuple(ids)) for name, ids in by.items()]
    return tuple(sorted(counts, key=lambda m: (_severity_rank(m.mode.severity), -m.count, m.mode.name)))


def _failed_in_mode_order(results: Sequence[TaskResult], modes: Sequence[ModeCount]) -> tuple[TaskResult, ...]:
    rank = {m.mode.name: n for n, m in enumerate(modes)}
    failed = [r for r in results if r.status == "fail"]
    return tuple(sorted(failed, key=lambda r: (rank[primary_mode(r)], r.id)))


def _skip_groups(results: Sequence[TaskResult]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    by: dict[str, list[str]] = defaultdict(list)
    for r in results:
        if r.status == "skip":
            by[r.skip_reason.strip() or "(no reason given)"].append(r.id)
    ranked = sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return tuple((reason, tuple(sorted(ids))) for reason, ids in ranked)


def _interrupted_note(s: Summary) -> str:
    planned = f" of {s.planned} planned" if s.planned is not None else ""
    return (f"Interrupted: the results file has no end line. {s.total.total}{planned} tasks were recorded; "
            "the numbers below cover those only.")
