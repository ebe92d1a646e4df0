"""A run's report as JSON (`render_json`, format `corral-eval-report/1`)."""

from __future__ import annotations

from typing import Any

from ._result import RunResults, TaskResult
from ._summary import ModeCount, primary_mode, summarize

REPORT_FORMAT = "corral-eval-report/1"




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
