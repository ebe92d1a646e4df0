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

**The parts**: `_summary.py` (`summarize`, `percentile`), `_comparison.py` (`compare`), `_formatting.py` (text shared
by the renderers), `_report_markdown.py`, `_report_json.py`, `_report_html.py` with `_report_charts.py` (the SVG),
`_report_compare.py` (a comparison rendered); here the files they are written to, and the names to import.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._comparison import Comparison, Flip, compare
from ._report_compare import render_compare_html, render_compare_json, render_compare_markdown
from ._report_html import render_html
from ._report_json import render_json
from ._report_markdown import render_markdown
from ._result import RunResults
from ._summary import Group, ModeCount, Spread, Summary, percentile, summarize

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
