"""Results: one JSON line per task, between a `run` header and an `end` footer, streamed as tasks finish.

```
{"type": "run", "adapter": "corral", "started": "...", "tasks": 1000, "concurrency": 50, "seed": 1, ...}
{"type": "task", "id": "...", "status": "pass" | "fail" | "skip", "mode": null | "<failure mode>", ...}
...
{"type": "end", "finished": "...", "wall_seconds": 612.3, "counts": {"pass": 998, "fail": 2, "skip": 0}}
```

A file whose `end` line is missing (the run was interrupted) still loads: `RunResults.complete` says so.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["RunResults", "StepRecord", "TaskFailure", "TaskResult"]

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class TaskFailure:
    step: int  # index of the step (-1: setup, the sandbox itself or the whole task)
    mode: str
    detail: str


@dataclass(frozen=True)
class StepRecord:
    kind: str
    duration: float
    summary: str
    output: str = ""  # for a step that failed: the tail of its stdout and stderr, to see what happened


@dataclass(frozen=True)
class TaskResult:
    id: str
    family: str
    category: str
    severity: str
    status: Status
    duration: float  # seconds, sandbox create to destroy
    mode: str | None = None  # the first failure's mode
    failures: tuple[TaskFailure, ...] = ()
    steps: tuple[StepRecord, ...] = ()
    create_seconds: float | None = None
    tags: tuple[str, ...] = ()
    checklist: tuple[int, ...] = ()
    skip_reason: str = ""
    attempts: int = 1
    title: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["type"] = "task"
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskResult:
        return cls(
            id=str(data["id"]), family=str(data["family"]), category=str(data["category"]),
            severity=str(data.get("severity") or "high"), status=data["status"],
            duration=float(data.get("duration") or 0.0), mode=data.get("mode"),
            failures=tuple(TaskFailure(int(f["step"]), str(f["mode"]), str(f["detail"]))
                           for f in data.get("failures") or ()),
            steps=tuple(StepRecord(str(s["kind"]), float(s["duration"]), str(s["summary"]),
                                   str(s.get("output") or "")) for s in data.get("steps") or ()),
            create_seconds=data.get("create_seconds"), tags=tuple(data.get("tags") or ()),
            checklist=tuple(int(n) for n in data.get("checklist") or ()),
            skip_reason=str(data.get("skip_reason") or ""), attempts=int(data.get("attempts") or 1),
            title=str(data.get("title") or ""),
        )


@dataclass
class RunResults:
    """A run read back: its header, every task's result, and its footer (None if the run was cut short)."""

    header: dict[str, Any]
    results: list[TaskResult] = field(default_factory=list)
    end: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.end is not None

    @property
    def adapter(self) -> str:
        return str(self.header.get("adapter") or "?")

    def counts(self) -> Counter[str]:
        return Counter(r.status for r in self.results)

    def pass_rate(self, results: Iterable[TaskResult] | None = None) -> float:
        """Passed / (passed + failed); skipped tasks do not count either way."""
        rs = list(self.results if results is None else results)
        ran = [r for r in rs if r.status != "skip"]
        return sum(r.status == "pass" for r in ran) / len(ran) if ran else 0.0

    @classmethod
    def load(cls, path: str | Path) -> RunResults:
        header: dict[str, Any] = {}
        run = cls(header)
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line: {exc}") from exc
                kind = data.get("type")
                if kind == "run":
                    run.header = data
                elif kind == "task":
                    run.results.append(TaskResult.from_json(data))
                elif kind == "end":
                    run.end = data
                else:
                    raise ValueError(f"{path}:{n}: unknown line type {kind!r}")
        if not run.header:
            raise ValueError(f"{path}: no 'run' header line: not a `corral eval` results file")
        return run
