"""The evaluation runs this server keeps, and their reports (`GET /v1/eval/runs`; docs/eval.md).

A run is a directory under `$CORRAL_HOME/eval/` holding what `corral eval report` (or `corral eval run
--report`) wrote there: `report.json` (its summary is listed) and `report.html` (served as it is). The server
only reads them; runs get there by being written there, for example
`corral eval run --local --out $CORRAL_HOME/eval/nightly.jsonl` (the report goes to `.../eval/nightly/`).

Reading is authorized (admins and auditors: the runs are the server's, not a tenant's) and not recorded, as
reading the audit trail is not.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._exceptions import InvalidRequestError, NotFoundError
from ..control import Action, Principal, authorize

__all__ = ["EVAL_DIR", "EvalReports", "EvalRun"]

EVAL_DIR = "eval"  # under the server's home
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_SUMMARY = ("adapter", "started", "finished", "complete", "wall_seconds", "planned", "totals")


@dataclass(frozen=True)
class EvalRun:
    name: str  # the directory's name
    summary: dict[str, Any]  # report.json's run-level fields (`_SUMMARY`); {} when it has none or is unreadable
    html: bool  # whether report.html is there
    error: str | None = None  # why report.json could not be read, if it could not


class EvalReports:
    def __init__(self, home: Path) -> None:
        self.root = home / EVAL_DIR  # the server's home

    async def list(self, principal: Principal) -> builtins.list[EvalRun]:
        """Every run directory with a report, newest first (by its start time, then by name)."""
        authorize(principal, Action.EVAL_READ, principal.tenant_id)
        return await asyncio.to_thread(_runs, self.root)

    async def html(self, principal: Principal, name: str) -> bytes:
        """The run's report.html, as `corral eval report` wrote it (self-contained, every string escaped)."""
        authorize(principal, Action.EVAL_READ, principal.tenant_id)
        if not _NAME.fullmatch(name):
            raise InvalidRequestError(f"{name!r} is not a run name (letters, digits, '.', '_', '-')")
        path = self.root / name / "report.html"
        try:
            return await asyncio.to_thread(path.read_bytes)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"no evaluation report {name!r}") from None


def _runs(root: Path) -> list[EvalRun]:
    if not root.is_dir():
        return []
    runs = [_read(d) for d in sorted(root.iterdir()) if _NAME.fullmatch(d.name) and d.is_dir()]
    found = [r for r in runs if r.summary or r.html or r.error]
    found.sort(key=lambda r: (str(r.summary.get("started") or ""), r.name), reverse=True)
    return found


def _read(directory: Path) -> EvalRun:
    html = (directory / "report.html").is_file()
    path = directory / "report.json"
    if not path.is_file():
        return EvalRun(directory.name, {}, html)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return EvalRun(directory.name, {}, html, f"report.json is unreadable: {exc}")
    if not isinstance(data, dict):
        return EvalRun(directory.name, {}, html, "report.json is not a JSON object")
    return EvalRun(directory.name, {k: data[k] for k in _SUMMARY if k in data}, html)
