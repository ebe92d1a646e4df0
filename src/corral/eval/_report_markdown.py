"""A run's report as Markdown (`render_markdown`): title, categories, failure modes, failed and skipped tasks,
latency and families, every string from the results escaped for Markdown."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ._formatting import SAMPLE_IDS, _detail, _sample, _where, fmt_rate, fmt_seconds, oneline
from ._result import RunResults
from ._summary import Summary, _interrupted_note, primary_mode, summarize

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
