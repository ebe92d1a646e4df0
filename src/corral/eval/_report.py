"""Reports of an evaluation run (Markdown, one self-contained HTML page, JSON), and of two runs compared.

**What a report contains** (`render_markdown`, `render_html`, `render_json`; `write_report` writes all three):

* The run: adapter, start date, tasks recorded (and planned, from the header), wall time, and the overall pass
  rate, passed / (passed + failed). Skipped tasks (an adapter without a capability) count neither way. A run
  whose results file has no `end` line was interrupted, and the report says so first.
* Pass rate by category (passed, failed, skipped, rate, p50/p95 task duration), and by family.
* Failure modes (`_taxonomy.py`) ranked by severity (critical first), then by how many tasks failed with them,
  each with its title and what the user would have seen. A failed task counts once, under its first failure's
  mode, so the counts add up to the failed tasks.
* The failed tasks (id, mode, where and the first failure's detail, shortened to one line), and the skipped
  tasks grouped by reason.
* Latency per category: p50, p95 and max of the task duration (sandbox create to destroy) and of the sandbox
  create time (`create_seconds`), over the tasks that ran.

The HTML page has no external resources: inline CSS, and charts drawn here as inline SVG (pass rate by
category, failure modes coloured by severity, latency on a log axis). Every string that comes from a results
file (task ids, failure details, reasons, even the header) is escaped: it comes from untrusted sandboxes.

**Comparison** (`compare`, `render_compare_*`, `write_comparison`): two runs side by side (before/after, or two
adapters), columns labelled with each run's adapter and start time: pass rate per category with the delta in
percentage points, failure-mode counts, the tasks that went pass->fail and fail->pass (only tasks that ran in
both; tasks in one run only are counted apart), and p50/p95 task duration per category with the ratio b/a.

**Percentiles** use linear interpolation between closest ranks (Hyndman & Fan type 7, NumPy's default): for
sorted values x[0..n-1], the q-th percentile is at rank h = (n - 1) * q / 100, between x[floor(h)] and
x[floor(h) + 1]. p50 of [1, 2, 3, 4] is 2.5; p95 of 1..20 is 19.05; the max is p100. An empty group has no
percentile: it renders as "-" (null in JSON).
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._result import RunResults, TaskResult
from ._task import CATEGORIES, SEVERITIES
from ._taxonomy import MODES, FailureMode

__all__ = [
    "Comparison",
    "Flip",
    "Group",
    "ModeCount",
    "Spread",
    "Summary",
    "compare",
    "percentile",
    "render_compare_html",
    "render_compare_json",
    "render_compare_markdown",
    "render_html",
    "render_json",
    "render_markdown",
    "summarize",
    "write_comparison",
    "write_report",
]

REPORT_FORMAT = "corral-eval-report/1"
COMPARISON_FORMAT = "corral-eval-comparison/1"
DETAIL_CHARS = 160  # failure details are shortened to one line of this many characters
SAMPLE_IDS = 5  # task ids listed inline for a group (skip reason, tasks in one run only)


# --------------------------------------------------------------------------------------------------------------
# Numbers


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


# --------------------------------------------------------------------------------------------------------------
# Comparison


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


# --------------------------------------------------------------------------------------------------------------
# Formatting shared by the renderers


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def oneline(text: str, limit: int = DETAIL_CHARS) -> str:
    """`text` on one line: control characters shown as escapes (a sandbox may print terminal escapes),
    whitespace runs collapsed, cut to `limit` characters with an ellipsis."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def fmt_rate(rate: float | None) -> str:
    """A pass rate as a percentage; 99.96% is shown as 99.9%, never as a 100.0% that has failures."""
    if rate is None:
        return "-"
    text = f"{rate * 100:.1f}%"
    return "99.9%" if rate < 1 and text == "100.0%" else text


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def fmt_delta(delta: float | None) -> str:
    """A change of pass rate in percentage points."""
    if delta is None:
        return "-"
    points = delta * 100
    return "±0.0 pp" if abs(points) < 0.05 else f"{points:+.1f} pp"


def fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _format_time(value: object) -> str:
    """An ISO timestamp as `YYYY-MM-DD HH:MM UTC`; anything else as it is (it is escaped where shown)."""
    if not isinstance(value, str) or not value:
        return "?"
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return oneline(value, 40)
    if when.tzinfo is None:
        return when.strftime("%Y-%m-%d %H:%M")
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _where(r: TaskResult) -> str:
    if not r.failures:
        return ""
    step = r.failures[0].step
    return "setup" if step < 0 else f"step {step}"


def _detail(r: TaskResult) -> str:
    return oneline(r.failures[0].detail) if r.failures else ""


def _sample(ids: Sequence[str], n: int = SAMPLE_IDS) -> list[str]:
    return [oneline(i, 80) for i in ids[:n]]


def _interrupted_note(s: Summary) -> str:
    planned = f" of {s.planned} planned" if s.planned is not None else ""
    return (f"Interrupted: the results file has no end line. {s.total.total}{planned} tasks were recorded; "
            "the numbers below cover those only.")


# --------------------------------------------------------------------------------------------------------------
# Markdown


_MD_SPECIAL = re.compile(r"([\\`*\[\]|])")


def _md(text: object) -> str:
    """Text for a Markdown table cell: one line, no HTML, links, code or emphasis, no cell breaks."""
    s = oneline(str(text), 10_000)
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", s)


def _md_table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: Iterable[int] = ()) -> list[str]:
    """A Markdown table; columns whose index is in `right` are right-aligned (numbers)."""
    right = set(right)
    lines = ["| " + " | ".join(_md(h) for h in headers) + " |",
             "|" + "|".join("---:" if n in right else "---" for n in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(run: RunResults) -> str:
    """The report of one run as Markdown."""
    s = summarize(run)
    sections = [_md_title(s), _md_categories(s), _md_modes(s), _md_failed(s), _md_skipped(s), _md_latency(s),
                _md_families(s)]
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"


def _md_title(s: Summary) -> list[str]:
    t = s.total
    lines = [f"# Corral eval: {_md(s.adapter)}, {_md(s.started)}", ""]
    if not s.complete:
        lines += [f"> **{_md(_interrupted_note(s))}**", ""]
    planned = f" (of {s.planned} planned)" if s.planned is not None and s.planned != t.total else ""
    lines += [
        f"- Adapter: {_md(s.adapter)}; started {_md(s.started)}",
        f"- Tasks: {t.total}{planned}; wall time {fmt_seconds(s.wall_seconds)}",
        f"- **Pass rate: {fmt_rate(t.rate)}** ({t.passed} passed of {t.ran} ran; {t.failed} failed, "
        f"{t.skipped} skipped and not counted)",
    ]
    return lines


def _md_categories(s: Summary) -> list[str]:
    rows = [(g.name, g.passed, g.failed, g.skipped, fmt_rate(g.rate), fmt_seconds(g.duration.p50),
             fmt_seconds(g.duration.p95)) for g in (*s.categories, s.total)]
    return ["## Pass rate by category", "",
            *_md_table(("Category", "Passed", "Failed", "Skipped", "Rate", "p50", "p95"), rows, range(1, 7))]


def _md_modes(s: Summary) -> list[str]:
    if not s.modes:
        return ["## Failure modes", "", "No task failed."]
    lines = ["## Failure modes", "", "Ranked by severity, then by the number of tasks that failed this way.", ""]
    for m in s.modes:
        plural = "task" if m.count == 1 else "tasks"
        lines.append(f"- **{_md(m.mode.title)}** ({_md(m.mode.name)}): {m.count} {plural}, "
                     f"severity {_md(m.mode.severity)}. The user saw: {_md(m.mode.seen)}.")
    return lines


def _md_failed(s: Summary) -> list[str]:
    if not s.failed:
        return []
    rows = [(r.id, primary_mode(r), _where(r), _detail(r)) for r in s.failed]
    return [f"## Failed tasks ({len(s.failed)})", "", *_md_table(("Task", "Mode", "Where", "First failure"), rows)]


def _md_skipped(s: Summary) -> list[str]:
    if not s.skipped:
        return []
    lines = [f"## Skipped tasks ({s.total.skipped})", ""]
    for reason, ids in s.skipped:
        more = f", and {len(ids) - SAMPLE_IDS} more" if len(ids) > SAMPLE_IDS else ""
        lines.append(f"- {_md(reason)}: {len(ids)} ({', '.join(_md(i) for i in _sample(ids))}{more})")
    return lines


def _md_latency(s: Summary) -> list[str]:
    rows = [(g.name, g.ran, *(fmt_seconds(v) for v in (g.duration.p50, g.duration.p95, g.duration.max,
                                                       g.create.p50, g.create.p95, g.create.max)))
            for g in (*s.categories, s.total)]
    headers = ("Category", "Ran", "Task p50", "Task p95", "Task max", "Create p50", "Create p95", "Create max")
    return ["## Latency", "", "Task duration is sandbox create to destroy; create is the sandbox create call alone.",
            "", *_md_table(headers, rows, range(1, 8))]


def _md_families(s: Summary) -> list[str]:
    failing = [g for g in s.families if g.failed]
    if not failing:
        return []
    rows = [(g.name, g.passed, g.failed, g.skipped, fmt_rate(g.rate)) for g in failing]
    return [f"## Families with failures ({len(failing)} of {len(s.families)})", "",
            *_md_table(("Family", "Passed", "Failed", "Skipped", "Rate"), rows, range(1, 5))]


# --------------------------------------------------------------------------------------------------------------
# JSON


def render_json(run: RunResults) -> dict[str, Any]:
    """The report of one run for machines; keys are stable, values JSON-serialisable (None for "no data")."""
    s = summarize(run)
    return {
        "format": REPORT_FORMAT,
        "adapter": s.adapter,
        "started": run.header.get("started"),
        "finished": (run.end or {}).get("finished"),
        "complete": s.complete,
        "wall_seconds": s.wall_seconds,
        "planned": s.planned,
        "totals": s.total.to_json(),
        "categories": {g.name: g.to_json() for g in s.categories},
        "families": {g.name: g.to_json(latency=False) for g in s.families},
        "modes": [_mode_json(m) for m in s.modes],
        "failed": [_failed_json(r) for r in s.failed],
        "skipped": {reason: list(ids) for reason, ids in s.skipped},
    }


def _mode_json(m: ModeCount) -> dict[str, Any]:
    return {"name": m.mode.name, "severity": m.mode.severity, "title": m.mode.title, "seen": m.mode.seen,
            "count": m.count, "tasks": list(m.tasks)}


def _failed_json(r: TaskResult) -> dict[str, Any]:
    first = r.failures[0] if r.failures else None
    return {"id": r.id, "family": r.family, "category": r.category, "mode": primary_mode(r),
            "step": first.step if first else None, "detail": first.detail if first else ""}


# --------------------------------------------------------------------------------------------------------------
# HTML: helpers and SVG charts


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


SEVERITY_COLORS = {"critical": "#b4232c", "high": "#e8590c", "medium": "#d49a00", "low": "#7a8594"}
_CHART_WIDTH = 760


def _rate_class(rate: float | None) -> str:
    if rate is None:
        return "none"
    return "good" if rate >= 0.99 else "fair" if rate >= 0.9 else "poor"


def _svg(height: int, body: list[str], label: str) -> str:
    return (f'<svg class="chart" role="img" aria-label="{_e(label)}" viewBox="0 0 {_CHART_WIDTH} {height}" '
            f'width="100%" preserveAspectRatio="xMinYMin meet" xmlns="http://www.w3.org/2000/svg">'
            f'<title>{_e(label)}</title>{"".join(body)}</svg>')


def _svg_text(x: float, y: float, text: str, cls: str = "", anchor: str = "start") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" class="{cls}" text-anchor="{anchor}" '
            f'dominant-baseline="middle">{_e(text)}</text>')


def svg_pass_rates(groups: Sequence[Group]) -> str:
    """Horizontal bars, one per category that ran, on a 0..100% axis; a category whose tasks were all
    skipped gets a label and no bar."""
    left, width, row = 150, 460, 30
    top = 22
    height = top + row * len(groups) + 8
    body = [_axis_percent(left, width, top, height - 6)]
    for n, g in enumerate(groups):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, g.name, "label", "end"))
        body.append(f'<rect class="track" x="{left}" y="{y + 6}" width="{width}" height="{row - 12}" rx="3"/>')
        if g.rate is not None:
            tip = f"{g.name}: {fmt_rate(g.rate)} ({g.passed} of {g.ran} passed)"
            body.append(f'<rect class="bar rate-{_rate_class(g.rate)}" data-label="{_e(g.name)}" '
                        f'data-value="{g.rate:.6f}" x="{left}" y="{y + 6}" width="{g.rate * width:.1f}" '
                        f'height="{row - 12}" rx="3"><title>{_e(tip)}</title></rect>')
        value = f"{fmt_rate(g.rate)}  {g.passed}/{g.ran}" if g.rate is not None else "all skipped"
        body.append(_svg_text(left + width + 10, y + row / 2, value, "value"))
    return _svg(height, body, "Pass rate by category")


def _axis_percent(left: int, width: int, top: int, bottom: int) -> str:
    parts = []
    for pct in (0, 25, 50, 75, 100):
        x = left + width * pct / 100
        parts.append(f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}"/>')
        parts.append(_svg_text(x, top - 10, f"{pct}%", "tick", "middle"))
    return "".join(parts)


def svg_modes(modes: Sequence[ModeCount]) -> str:
    """Horizontal bars, one per failure mode, as long as its count and coloured by its severity."""
    left, width, row = 290, 380, 28
    top = 8
    height = top + row * len(modes) + 8
    most = max((m.count for m in modes), default=1)
    body: list[str] = []
    for n, m in enumerate(modes):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, oneline(m.mode.title, 42), "label", "end"))
        tip = f"{m.mode.title} ({m.mode.severity}): {m.count}. The user saw: {m.mode.seen}"
        body.append(f'<rect class="bar sev-{_e(m.mode.severity)}" data-label="{_e(m.mode.name)}" '
                    f'data-value="{m.count}" data-severity="{_e(m.mode.severity)}" x="{left}" y="{y + 5}" '
                    f'width="{max(2.0, width * m.count / most):.1f}" height="{row - 10}" rx="3" '
                    f'fill="{SEVERITY_COLORS.get(m.mode.severity, "#888")}"><title>{_e(tip)}</title></rect>')
        body.append(_svg_text(left + width * m.count / most + 8, y + row / 2, str(m.count), "value"))
    return _svg(height, body, "Failure modes by severity and count")


def _log_domain(groups: Sequence[Group]) -> tuple[float, float] | None:
    """Powers of ten that hold every positive timing, or None when there is none."""
    values = [v for g in groups for sp in (g.duration, g.create) for v in (sp.p50, sp.p95, sp.max)
              if v is not None and v > 0]
    if not values:
        return None
    lo = 10.0 ** math.floor(math.log10(max(min(values), 0.001)))
    hi = 10.0 ** math.ceil(math.log10(max(values)))
    return (lo, hi if hi > lo else lo * 10)


def svg_latency(groups: Sequence[Group]) -> str:
    """Per category, task duration and sandbox create time on a log axis: a box from p50 to p95, a whisker
    to the max, a tick at p50."""
    domain = _log_domain(groups)
    if domain is None:
        return '<p class="muted">No timings recorded.</p>'
    left, width, row, top = 150, 330, 40, 26
    height = top + row * len(groups) + 10

    def x(v: float) -> float:
        lo, hi = domain
        return left + width * (math.log10(max(v, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    body = [_axis_log(domain, x, top, height - 6)]
    for n, g in enumerate(groups):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, g.name, "label", "end"))
        for series, spread, dy in (("duration", g.duration, 12), ("create", g.create, 28)):
            body.append(_latency_marks(g.name, series, spread, x, y + dy))
        d = g.duration
        text = f"p50 {fmt_seconds(d.p50)} · p95 {fmt_seconds(d.p95)} · max {fmt_seconds(d.max)}"
        body.append(_svg_text(left + width + 16, y + 12, text, "value small"))
        text = f"create p50 {fmt_seconds(g.create.p50)} · p95 {fmt_seconds(g.create.p95)}"
        body.append(_svg_text(left + width + 16, y + 28, text, "value small muted"))
    return _svg(height, body, "Latency by category (log scale)")


def _axis_log(domain: tuple[float, float], x: Callable[[float], float], top: int, bottom: int) -> str:
    parts = []
    decade = domain[0]
    while decade <= domain[1] * 1.0001:
        parts.append(f'<line class="grid" x1="{x(decade):.1f}" y1="{top}" x2="{x(decade):.1f}" y2="{bottom}"/>')
        parts.append(_svg_text(x(decade), top - 12, _decade_label(decade), "tick", "middle"))
        decade *= 10
    return "".join(parts)


def _decade_label(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.0f} s"


def _latency_marks(name: str, series: str, sp: Spread, x: Callable[[float], float], y: float) -> str:
    if sp.p50 is None or sp.p95 is None or sp.max is None:
        return ""
    half = 5 if series == "duration" else 3.5
    tip = f"{name} {series}: p50 {fmt_seconds(sp.p50)}, p95 {fmt_seconds(sp.p95)}, max {fmt_seconds(sp.max)} (n={sp.n})"
    return (f'<g class="lat lat-{series}" data-label="{_e(name)}" data-series="{series}" data-p50="{sp.p50:.6f}" '
            f'data-p95="{sp.p95:.6f}" data-max="{sp.max:.6f}"><title>{_e(tip)}</title>'
            f'<line class="whisker" x1="{x(sp.p95):.1f}" y1="{y:.1f}" x2="{x(sp.max):.1f}" y2="{y:.1f}"/>'
            f'<line class="cap" x1="{x(sp.max):.1f}" y1="{y - half:.1f}" x2="{x(sp.max):.1f}" y2="{y + half:.1f}"/>'
            f'<rect class="box" x="{x(sp.p50):.1f}" y="{y - half:.1f}" width="{max(2.0, x(sp.p95) - x(sp.p50)):.1f}" '
            f'height="{2 * half:.1f}" rx="2"/>'
            f'<line class="median" x1="{x(sp.p50):.1f}" y1="{y - half - 2:.1f}" x2="{x(sp.p50):.1f}" '
            f'y2="{y + half + 2:.1f}"/></g>')


def svg_compare_rates(rows: Sequence[tuple[str, Group | None, Group | None]], labels: tuple[str, str]) -> str:
    """Per category, the pass rate of run A and of run B as two bars, one above the other."""
    left, width, row, top = 150, 440, 40, 40
    height = top + row * len(rows) + 8
    body = [_axis_percent(left, width, top, height - 6), _legend(labels, left)]
    for n, (name, ga, gb) in enumerate(rows):
        y = top + n * row
        body.append(_svg_text(left - 10, y + row / 2, name, "label", "end"))
        for run, g, dy in (("a", ga, 6), ("b", gb, 21)):
            rate = g.rate if g is not None else None
            if rate is not None:
                body.append(f'<rect class="bar run-{run}" data-run="{run}" data-label="{_e(name)}" '
                            f'data-value="{rate:.6f}" x="{left}" y="{y + dy}" width="{rate * width:.1f}" '
                            f'height="13" rx="2"><title>{_e(labels[run == "b"])}: {_e(fmt_rate(rate))}</title></rect>')
            body.append(_svg_text(left + width + 10, y + dy + 6.5, fmt_rate(rate), f"value run-{run}-text"))
    return _svg(height, body, "Pass rate by category, both runs")


def _legend(labels: tuple[str, str], left: int) -> str:
    return (f'<rect class="run-a" x="{left}" y="2" width="12" height="12" rx="2"/>'
            + _svg_text(left + 18, 8, labels[0], "legend")
            + f'<rect class="run-b" x="{left + 330}" y="2" width="12" height="12" rx="2"/>'
            + _svg_text(left + 348, 8, labels[1], "legend"))


# --------------------------------------------------------------------------------------------------------------
# HTML: tables and the page


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: Iterable[int] = (),
           cls: str = "", tone: dict[int, int] | None = None) -> str:
    """An HTML table; every cell is escaped. Columns whose index is in `right` are numbers; a column in `tone`
    is a change, coloured as better or worse by its sign (+1: a rise is better, -1: a rise is worse)."""
    right, tone = set(right), tone or {}

    def cell(tag: str, n: int, value: object) -> str:
        classes = " ".join(c for c in ("num" if n in right else "", _tone(value, tone.get(n, 0))) if c)
        return f'<{tag} class="{classes}">{_e(value)}</{tag}>' if classes else f"<{tag}>{_e(value)}</{tag}>"

    head = "".join(cell("th", n, h) for n, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", n, v) for n, v in enumerate(row)) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_CSS = """
:root{--bg:#f6f7f9;--card:#fff;--ink:#1d2330;--muted:#667085;--line:#e4e7ec;--track:#eef0f4;
--good:#1f9d55;--fair:#d49a00;--poor:#c92a2a;--a:#5b6b8c;--b:#2f6fed;--accent:#2f6fed}
@media (prefers-color-scheme:dark){:root{--bg:#12151b;--card:#1b1f27;--ink:#e6e9ef;--muted:#98a2b3;
--line:#2c323d;--track:#262b35;--a:#8b98b3;--b:#5b8cff}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,sans-serif}
main{max-width:1100px;margin:0 auto;padding:32px 24px 64px}
header h1{font-size:28px;margin:0 0 4px;letter-spacing:-.01em}
header p{margin:0;color:var(--muted)}
h2{font-size:19px;margin:0 0 12px}
section{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:20px 22px;margin:20px 0}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:12px;margin:22px 0}
.card{background:var(--card);border:1px solid var(--line);border-radius:12px;padding:14px 16px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.06em}
.card .v{font-size:26px;font-weight:650;font-variant-numeric:tabular-nums}
.card.hero .v{font-size:34px}
.rate-good{color:var(--good);fill:var(--good)}.rate-fair{color:var(--fair);fill:var(--fair)}
.rate-poor{color:var(--poor);fill:var(--poor)}
.banner{background:#fff4e5;color:#7a4100;border:1px solid #f5c27a;border-radius:10px;padding:12px 16px;
margin:18px 0;font-weight:600}
table{width:100%;border-collapse:collapse;font-size:14px}
th,td{text-align:left;padding:7px 10px;border-bottom:1px solid var(--line);vertical-align:top}
th{color:var(--muted);font-weight:600;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:hover{background:var(--track)}
td{overflow-wrap:anywhere}table.failed td:nth-child(2),table.failed td:nth-child(3){white-space:nowrap}
.muted{color:var(--muted)}
.chart{display:block;max-width:100%;height:auto;margin:4px 0 14px}
.chart text{font-size:12px;fill:var(--ink)}.chart .tick,.chart .muted{fill:var(--muted);font-size:11px}
.chart .value{font-variant-numeric:tabular-nums}.chart .small{font-size:11px}
.chart .track{fill:var(--track)}.chart .grid{stroke:var(--line);stroke-width:1}
.chart .lat-duration .box{fill:var(--accent);opacity:.85}.chart .lat-create .box{fill:#8e6bd6;opacity:.85}
.chart .whisker,.chart .cap{stroke:var(--muted);stroke-width:1.5}.chart .median{stroke:var(--ink);stroke-width:2}
.chart .run-a{fill:var(--a)}.chart .run-b{fill:var(--b)}
.sev{display:inline-block;padding:1px 8px;border-radius:99px;color:#fff;font-size:12px;font-weight:600}
.modes li{margin:0 0 10px;list-style:none}.modes{padding:0;margin:0}
.modes .seen{color:var(--muted)}
.up{color:var(--good)}.down{color:var(--poor)}
details summary{cursor:pointer;color:var(--muted)}
footer{color:var(--muted);font-size:13px;text-align:center;margin-top:28px}
"""


def _tone(value: object, sign: int) -> str:
    text = str(value)
    if not sign or not text.startswith(("+", "-")):  # "0" and "±0.0 pp" are no change
        return ""
    return "up" if (text.startswith("+")) == (sign > 0) else "down"


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>"
            + "".join(body)
            + "<footer>Generated by corral eval report.</footer></main></body></html>\n")


def _section(title: str, *parts: str) -> str:
    return f"<section><h2>{_e(title)}</h2>{''.join(parts)}</section>"


def _card(key: str, value: str, cls: str = "") -> str:
    return f'<div class="card {cls}"><div class="k">{_e(key)}</div><div class="v">{value}</div></div>'


def _severity_badge(severity: str) -> str:
    color = SEVERITY_COLORS.get(severity, "#888")
    return f'<span class="sev" style="background:{color}">{_e(severity)}</span>'


def render_html(run: RunResults) -> str:
    """The report of one run as one self-contained HTML page."""
    s = summarize(run)
    body = [_html_header(s), _html_overview(s), _html_modes(s), _html_failed(s), _html_skipped(s),
            _html_latency(s), _html_families(s)]
    return _page(f"Corral eval: {s.adapter}, {s.started}", body)


def _html_header(s: Summary) -> str:
    t = s.total
    head = (f"<header><h1>Corral eval: {_e(s.adapter)}</h1><p>Started {_e(s.started)} · {t.total} tasks"
            + (f" of {s.planned} planned" if s.planned is not None and s.planned != t.total else "")
            + f" · wall time {_e(fmt_seconds(s.wall_seconds))}</p></header>")
    banner = "" if s.complete else f'<div class="banner" role="alert">{_e(_interrupted_note(s))}</div>'
    cards = ('<div class="cards">'
             + _card("Pass rate", f'<span class="rate-{_rate_class(t.rate)}">{_e(fmt_rate(t.rate))}</span>', "hero")
             + _card("Passed", str(t.passed)) + _card("Failed", str(t.failed))
             + _card("Skipped (not counted)", str(t.skipped))
             + _card("Wall time", _e(fmt_seconds(s.wall_seconds))) + "</div>")
    return head + banner + cards


def _html_overview(s: Summary) -> str:
    rows = [(g.name, g.passed, g.failed, g.skipped, fmt_rate(g.rate), fmt_seconds(g.duration.p50),
             fmt_seconds(g.duration.p95)) for g in (*s.categories, s.total)]
    table = _table(("Category", "Passed", "Failed", "Skipped", "Rate", "p50", "p95"), rows, range(1, 7))
    return _section("Pass rate by category", svg_pass_rates(s.categories), table)


def _html_modes(s: Summary) -> str:
    if not s.modes:
        return _section("Failure modes", '<p class="muted">No task failed.</p>')
    items = "".join(
        f"<li>{_severity_badge(m.mode.severity)} <strong>{_e(m.mode.title)}</strong> "
        f'<span class="muted">({_e(m.mode.name)})</span> · {m.count} {"task" if m.count == 1 else "tasks"}'
        f'<br><span class="seen">The user saw: {_e(m.mode.seen)}.</span></li>'
        for m in s.modes)
    return _section("Failure modes", '<p class="muted">Ranked by severity, then by count.</p>',
                    svg_modes(s.modes), f'<ul class="modes">{items}</ul>')


def _html_failed(s: Summary) -> str:
    if not s.failed:
        return ""
    rows = [(r.id, primary_mode(r), _where(r), _detail(r)) for r in s.failed]
    return _section(f"Failed tasks ({len(s.failed)})",
                    _table(("Task", "Mode", "Where", "First failure"), rows, cls="failed"))


def _html_skipped(s: Summary) -> str:
    if not s.skipped:
        return ""
    rows = [(reason, len(ids), ", ".join(_sample(ids)) + (" …" if len(ids) > SAMPLE_IDS else ""))
            for reason, ids in s.skipped]
    return _section(f"Skipped tasks ({s.total.skipped})", _table(("Reason", "Tasks", "Examples"), rows, (1,)))


def _html_latency(s: Summary) -> str:
    rows = [(g.name, g.ran, *(fmt_seconds(v) for v in (g.duration.p50, g.duration.p95, g.duration.max,
                                                       g.create.p50, g.create.p95, g.create.max)))
            for g in (*s.categories, s.total)]
    headers = ("Category", "Ran", "Task p50", "Task p95", "Task max", "Create p50", "Create p95", "Create max")
    note = ('<p class="muted">Task duration (blue) is sandbox create to destroy; create (purple) is the create '
            "call alone. Box: p50 to p95; whisker: to the max; log scale.</p>")
    return _section("Latency", note, svg_latency(s.categories), _table(headers, rows, range(1, 8)))


def _html_families(s: Summary) -> str:
    rows = [(g.name, g.passed, g.failed, g.skipped, fmt_rate(g.rate))
            for g in sorted(s.families, key=lambda g: (g.rate if g.rate is not None else 2.0, g.name))]
    table = _table(("Family", "Passed", "Failed", "Skipped", "Rate"), rows, range(1, 5))
    return _section(f"Families ({len(s.families)})",
                    f"<details><summary>Pass rate of every family, lowest first</summary>{table}</details>")


# --------------------------------------------------------------------------------------------------------------
# Comparison renderers


def _compare_category_rows(c: Comparison) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, ga, gb in c.categories:
        ra, rb = (ga.rate if ga else None), (gb.rate if gb else None)
        rows.append((name, fmt_rate(ra), fmt_rate(rb), fmt_delta(_delta(ra, rb))))
    ta, tb = c.a.total.rate, c.b.total.rate
    rows.append(("all", fmt_rate(ta), fmt_rate(tb), fmt_delta(_delta(ta, tb))))
    return rows


def _compare_latency_rows(c: Comparison) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for name, ga, gb in (*c.categories, ("all", c.a.total, c.b.total)):
        da, db = (ga.duration if ga else Spread.of(())), (gb.duration if gb else Spread.of(()))
        rows.append((name, fmt_seconds(da.p50), fmt_seconds(db.p50), fmt_ratio(_ratio(da.p50, db.p50)),
                     fmt_seconds(da.p95), fmt_seconds(db.p95), fmt_ratio(_ratio(da.p95, db.p95))))
    return rows


def _compare_headers(c: Comparison) -> dict[str, tuple[str, ...]]:
    la, lb = c.labels
    return {
        "totals": ("", la, lb),
        "categories": ("Category", la, lb, "Delta"),
        "modes": ("Mode", "Severity", la, lb, "Change"),
        "p2f": ("Task", "Category", f"Mode ({lb})", "First failure"),
        "f2p": ("Task", "Category", f"Mode ({la})"),
        "latency": ("Category", f"p50 {la}", f"p50 {lb}", "Ratio", f"p95 {la}", f"p95 {lb}", "Ratio"),
    }


def _compare_totals_rows(c: Comparison) -> list[tuple[str, str, str]]:
    a, b = c.a, c.b
    return [
        ("Pass rate", fmt_rate(a.total.rate), fmt_rate(b.total.rate)),
        ("Passed", str(a.total.passed), str(b.total.passed)),
        ("Failed", str(a.total.failed), str(b.total.failed)),
        ("Skipped", str(a.total.skipped), str(b.total.skipped)),
        ("Tasks", str(a.total.total), str(b.total.total)),
        ("Wall time", fmt_seconds(a.wall_seconds), fmt_seconds(b.wall_seconds)),
        ("Complete", "yes" if a.complete else "no (interrupted)", "yes" if b.complete else "no (interrupted)"),
    ]


def _mode_rows(c: Comparison) -> list[tuple[str, str, int, int, str]]:
    return [(m.title, m.severity, na, nb, f"{nb - na:+d}" if nb != na else "0") for m, na, nb in c.modes]


def _flip_rows(flips: Sequence[Flip], after: bool) -> list[tuple[str, ...]]:
    if after:
        return [(f.id, f.category, primary_mode(f.after), _detail(f.after)) for f in flips]
    return [(f.id, f.category, primary_mode(f.before)) for f in flips]


def _only_line(label: str, ids: Sequence[str]) -> str:
    if not ids:
        return f"Only in {label}: none"
    more = f", and {len(ids) - SAMPLE_IDS} more" if len(ids) > SAMPLE_IDS else ""
    return f"Only in {label}: {len(ids)} ({', '.join(_sample(ids))}{more})"


def render_compare_markdown(c: Comparison) -> str:
    """Two runs side by side, as Markdown."""
    la, lb = c.labels
    h = _compare_headers(c)
    lines = [f"# Corral eval comparison: {_md(la)} vs {_md(lb)}", ""]
    for s in (c.a, c.b):
        if not s.complete:
            lines += [f"> **{_md(s.label)}: {_md(_interrupted_note(s))}**", ""]
    lines += [*_md_table(h["totals"], _compare_totals_rows(c), (1, 2)), ""]
    lines += ["## Pass rate by category", "", *_md_table(h["categories"], _compare_category_rows(c), (1, 2, 3)), ""]
    lines += ["## Failure modes", ""]
    lines += _md_table(h["modes"], _mode_rows(c), (2, 3, 4)) if c.modes else ["No task failed in either run."]
    lines += ["", f"## Pass -> fail ({len(c.pass_to_fail)})", ""]
    lines += _md_table(h["p2f"], _flip_rows(c.pass_to_fail, True)) if c.pass_to_fail else ["None."]
    lines += ["", f"## Fail -> pass ({len(c.fail_to_pass)})", ""]
    lines += _md_table(h["f2p"], _flip_rows(c.fail_to_pass, False)) if c.fail_to_pass else ["None."]
    lines += ["", "## Tasks in one run only", "", f"- {_md(_only_line(la, c.only_a))}",
              f"- {_md(_only_line(lb, c.only_b))}", ""]
    lines += ["## Task duration", "", "Ratio is b/a: above 1 means the second run was slower.", "",
              *_md_table(h["latency"], _compare_latency_rows(c), range(1, 7))]
    return "\n".join(lines) + "\n"


def render_compare_html(c: Comparison) -> str:
    """Two runs side by side, as one self-contained HTML page."""
    la, lb = c.labels
    h = _compare_headers(c)
    banners = "".join(f'<div class="banner" role="alert">{_e(s.label)}: {_e(_interrupted_note(s))}</div>'
                      for s in (c.a, c.b) if not s.complete)
    delta = _delta(c.a.total.rate, c.b.total.rate)
    trend = "" if delta is None or abs(delta) < 0.0005 else ("up" if delta > 0 else "down")
    cards = ('<div class="cards">' + _card(la, _e(fmt_rate(c.a.total.rate))) + _card(lb, _e(fmt_rate(c.b.total.rate)))
             + _card("Change", f'<span class="{trend}">{_e(fmt_delta(delta))}</span>', "hero")
             + _card("Pass → fail", str(len(c.pass_to_fail))) + _card("Fail → pass", str(len(c.fail_to_pass)))
             + "</div>")
    body = [
        f"<header><h1>Corral eval comparison</h1><p>{_e(la)} vs {_e(lb)}</p></header>", banners, cards,
        _section("Totals", _table(h["totals"], _compare_totals_rows(c), (1, 2))),
        _section("Pass rate by category", svg_compare_rates(c.categories, c.labels),
                 _table(h["categories"], _compare_category_rows(c), (1, 2, 3), tone={3: 1})),
        _section("Failure modes", _table(h["modes"], _mode_rows(c), (2, 3, 4), tone={4: -1}) if c.modes
                 else '<p class="muted">No task failed in either run.</p>'),
        _section(f"Pass → fail ({len(c.pass_to_fail)})",
                 _table(h["p2f"], _flip_rows(c.pass_to_fail, True), cls="flips p2f") if c.pass_to_fail
                 else '<p class="muted">None.</p>'),
        _section(f"Fail → pass ({len(c.fail_to_pass)})",
                 _table(h["f2p"], _flip_rows(c.fail_to_pass, False), cls="flips f2p") if c.fail_to_pass
                 else '<p class="muted">None.</p>'),
        _section("Tasks in one run only",
                 f"<p>{_e(_only_line(la, c.only_a))}</p><p>{_e(_only_line(lb, c.only_b))}</p>"),
        _section("Task duration", '<p class="muted">Ratio is b/a: above 1 means the second run was slower.</p>',
                 _table(h["latency"], _compare_latency_rows(c), range(1, 7))),
    ]
    return _page(f"Corral eval comparison: {la} vs {lb}", body)


def render_compare_json(c: Comparison) -> dict[str, Any]:
    """Two runs compared, for machines."""
    return {
        "format": COMPARISON_FORMAT,
        "a": _run_json(c.a, c.labels[0]),
        "b": _run_json(c.b, c.labels[1]),
        "pass_rate": {"a": _round(c.a.total.rate, 6), "b": _round(c.b.total.rate, 6),
                      "delta": _round(_delta(c.a.total.rate, c.b.total.rate), 6)},
        "categories": {name: _category_compare_json(ga, gb) for name, ga, gb in c.categories},
        "modes": [{"name": m.name, "severity": m.severity, "title": m.title, "a": na, "b": nb}
                  for m, na, nb in c.modes],
        "pass_to_fail": [{"id": f.id, "category": f.category, "mode": primary_mode(f.after),
                          "detail": f.after.failures[0].detail if f.after.failures else ""}
                         for f in c.pass_to_fail],
        "fail_to_pass": [{"id": f.id, "category": f.category, "mode": primary_mode(f.before)}
                         for f in c.fail_to_pass],
        "only_in_a": list(c.only_a),
        "only_in_b": list(c.only_b),
    }


def _run_json(s: Summary, label: str) -> dict[str, Any]:
    return {"label": label, "adapter": s.adapter, "started": s.run.header.get("started"), "complete": s.complete,
            "wall_seconds": s.wall_seconds, "totals": s.total.to_json(latency=False)}


def _category_compare_json(ga: Group | None, gb: Group | None) -> dict[str, Any]:
    ra, rb = (ga.rate if ga else None), (gb.rate if gb else None)
    da, db = (ga.duration if ga else Spread.of(())), (gb.duration if gb else Spread.of(()))
    return {
        "pass_rate_a": _round(ra, 6), "pass_rate_b": _round(rb, 6), "delta": _round(_delta(ra, rb), 6),
        "p50_a": _round(da.p50), "p50_b": _round(db.p50), "p50_ratio": _round(_ratio(da.p50, db.p50)),
        "p95_a": _round(da.p95), "p95_b": _round(db.p95), "p95_ratio": _round(_ratio(da.p95, db.p95)),
    }


# --------------------------------------------------------------------------------------------------------------
# Files

FORMATS = ("md", "html", "json")


def _check_formats(formats: Sequence[str]) -> None:
    if unknown := [f for f in formats if f not in FORMATS]:
        raise ValueError(f"unknown report format(s) {unknown}; known: {', '.join(FORMATS)}")


def _write(out_dir: str | Path, stem: str, formats: Sequence[str],
           render: dict[str, Callable[[], str]]) -> list[Path]:
    _check_formats(formats)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out / f"{stem}.{fmt}"
        path.write_text(render[fmt](), encoding="utf-8")
        paths.append(path)
    return paths


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def write_report(run: RunResults, out_dir: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write report.md / report.html / report.json (those in `formats`) under `out_dir`; return their paths."""
    return _write(out_dir, "report", formats, {
        "md": lambda: render_markdown(run), "html": lambda: render_html(run),
        "json": lambda: _dump(render_json(run)),
    })


def write_comparison(a: RunResults, b: RunResults, out_dir: str | Path,
                     formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write comparison.md / .html / .json of run `b` against run `a` under `out_dir`; return their paths."""
    c = compare(a, b)
    return _write(out_dir, "comparison", formats, {
        "md": lambda: render_compare_markdown(c), "html": lambda: render_compare_html(c),
        "json": lambda: _dump(render_compare_json(c)),
    })
