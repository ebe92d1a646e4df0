"""Two evaluation runs compared (`compare`): pass rates and latency per category side by side, failure-mode
counts, and the tasks that flipped (pass->fail, fail->pass) among those that ran in both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._result import RunResults, TaskResult
from ._summary import Group, Summary, _category_order, _mode_info, _severity_rank, summarize
from ._taxonomy import FailureMode


@dataclass(frozen=True)
class Flip:
    """A task that ran in both runs and changed status."""

    id: str
    category: str
    before: TaskResult
    after: TaskResult


@dataclass(frozen=True)
class Comparison:
    """Two runs side by side: `a` (before, or the reference) and `b`."""

    a: Summary
    b: Summary
    categories: tuple[tuple[str, Group | None, Group | None], ...]  # every category in either run
    modes: tuple[tuple[FailureMode, int, int], ...]  # every mode in either run, ranked as in a report
    pass_to_fail: tuple[Flip, ...]
    fail_to_pass: tuple[Flip, ...]
    only_a: tuple[str, ...]  # task ids recorded in a but not in b
    only_b: tuple[str, ...]

    @property
    def labels(self) -> tuple[str, str]:
        """Column labels: adapter and start time, told apart if the two are the same."""
        la, lb = self.a.label, self.b.label
        return (f"{la} (A)", f"{lb} (B)") if la == lb else (la, lb)


def compare(a: RunResults, b: RunResults) -> Comparison:
    """Compare run `b` with run `a`: category rates, mode counts, flipped tasks, latency."""
    sa, sb = summarize(a), summarize(b)
    by_a = {r.id: r for r in a.results}
    by_b = {r.id: r for r in b.results}
    both = sorted(by_a.keys() & by_b.keys())
    return Comparison(
        a=sa, b=sb,
        categories=tuple((name, sa.category(name), sb.category(name))
                         for name in sorted({g.name for g in sa.categories + sb.categories}, key=_category_order)),
        modes=_compare_modes(sa, sb),
        pass_to_fail=_flips(both, by_a, by_b, "pass", "fail"),
        fail_to_pass=_flips(both, by_a, by_b, "fail", "pass"),
        only_a=tuple(sorted(by_a.keys() - by_b.keys())),
        only_b=tuple(sorted(by_b.keys() - by_a.keys())),
    )


def _compare_modes(sa: Summary, sb: Summary) -> tuple[tuple[FailureMode, int, int], ...]:
    ca = {m.mode.name: m.count for m in sa.modes}
    cb = {m.mode.name: m.count for m in sb.modes}
    rows = [(_mode_info(name), ca.get(name, 0), cb.get(name, 0)) for name in ca.keys() | cb.keys()]
    return tuple(sorted(rows, key=lambda row: (_severity_rank(row[0].severity), -max(row[1], row[2]),
                                               -row[2], row[0].name)))


def _flips(ids: Sequence[str], by_a: dict[str, TaskResult], by_b: dict[str, TaskResult],
           before: str, after: str) -> tuple[Flip, ...]:
    return tuple(Flip(i, by_b[i].category, by_a[i], by_b[i]) for i in ids
                 if by_a[i].status == before and by_b[i].status == after)


def _ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def _delta(a: float | None, b: float | None) -> float | None:
    return b - a if a is not None and b is not None else None
