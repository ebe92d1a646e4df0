"""The runner: tasks through an adapter, N at a time, each within its budget, results streamed as JSON lines.

For each task: skip it (and say why) if the adapter lacks a capability it needs; else open a sandbox, run the
steps in order, verify each step's checks, and stop at the first step that fails (later steps would only fail
for the same reason). The whole task, sandbox creation and teardown included, runs under its `budget`; going
over it is the failure mode `hang`. A result line is written the moment a task finishes, so an interrupted run
keeps everything it finished. Retries are off by default: a flaky task is a finding, not noise to hide.

Order and CPU: tasks start round-robin across families (the corpus groups them, a real population of agents
does not), and CPU-heavy tasks (`is_heavy`: ML training, data analysis, package installs, compiles, resource
abuse) run at most `heavy_concurrency` at once (default: two per core) within the overall `concurrency`. Fifty
sklearn fits at the same instant on two cores would only time each other out; the same work spread out
finishes as fast and keeps every task's own timeouts meaningful.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import platform
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from ._adapter import Adapter, Session, SetupError
from ._checks import Fails, Failure, Ok
from ._outcome import Outcome
from ._result import RunResults, StepRecord, TaskFailure, TaskResult
from ._task import Code, Exec, SetNetwork, Setup, Step, Task

__all__ = ["evaluate", "resolve", "run_tasks"]

# Closing a sandbox is given this long beyond the task's budget before the runner moves on.
_CLOSE_SECONDS = 30.0


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def resolve(task: Task, server: str | None) -> Task:
    """The task with `{server}` replaced by the loopback server's `host:port` everywhere it may appear."""
    if server is None:
        return task

    def sub(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace("{server}", server)
        if isinstance(value, tuple):
            return tuple(sub(v) for v in value)
        return value

    steps: list[Step] = []
    for step in task.steps:
        if isinstance(step, Exec):
            steps.append(dataclasses.replace(step, cmd=sub(step.cmd)))
        elif isinstance(step, Code):
            steps.append(dataclasses.replace(step, code=sub(step.code)))
        elif isinstance(step, SetNetwork):
            steps.append(dataclasses.replace(step, network=sub(step.network)))
        else:
            steps.append(step)
    setup: Setup = dataclasses.replace(task.setup, network=sub(task.setup.network))
    return dataclasses.replace(task, steps=tuple(steps), setup=setup)


def evaluate(step: Step, outcome: Outcome) -> list[Failure]:
    """Every check of `step` that `outcome` fails. An error nobody expected fails with the `Ok` check's mode."""
    expects_error = any(isinstance(c, Fails) for c in step.checks)
    if outcome.error is not None and not expects_error:
        ok = next((c for c in step.checks if isinstance(c, Ok)), Ok())
        failure = ok.verify(outcome)
        return [failure] if failure is not None else []
    return [f for c in step.checks if (f := c.verify(outcome)) is not None]


class _Attempt:
    """What one attempt at a task recorded, filled in as it goes (so a timeout keeps what happened)."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.failures: list[TaskFailure] = []
        self.create_seconds: float | None = None
        self.current = -1


async def _attempt(task: Task, adapter: Adapter, rec: _Attempt) -> None:
    try:
        session: Session = await adapter.open(task)
    except SetupError as exc:
        rec.create_seconds = exc.seconds
        rec.failures.append(TaskFailure(-1, "sandbox_unavailable", f"creating the sandbox: {exc}"))
        return
    rec.create_seconds = getattr(session, "create_seconds", None)
    try:
        for i, step in enumerate(task.steps):
            rec.current = i
            outcome = await session.run(step)
            found = evaluate(step, outcome)
            rec.steps.append(StepRecord(step.kind, round(outcome.duration, 4), outcome.summary()[:300],
                                        _excerpt(outcome) if found else ""))
            if found:
                rec.failures.extend(TaskFailure(i, f.mode, f.detail[:2000]) for f in found)
                return
    finally:
        # Shielded: a budget expiring must not leave the sandbox behind.
        await asyncio.shield(asyncio.wait_for(session.close(), _CLOSE_SECONDS))


def _excerpt(o: Outcome, limit: int = 400) -> str:
    parts = []
    for name, data in (("stdout", o.stdout), ("stderr", o.stderr)):
        if data:
            text = data[-limit:].decode("utf-8", "replace")
            parts.append(f"{name}: {'...' if len(data) > limit else ''}{text}")
    return "\n".join(parts)


async def run_one(task: Task, adapter: Adapter, *, server: str | None, retries: int = 0) -> TaskResult:
    """One task, with up to `retries` further attempts if it fails."""
    missing = task.needs() - adapter.capabilities
    if "loopback_server" in task.needs() and server is None:
        missing |= {"loopback_server"}
    if missing:
        return _result(task, "skip", 0.0, _Attempt(), skip_reason=f"{adapter.name} lacks {', '.join(sorted(missing))}")
    task = resolve(task, server)
    attempts = 0
    while True:
        attempts += 1
        rec = _Attempt()
        started = time.monotonic()
        try:
            async with asyncio.timeout(task.budget):
                await _attempt(task, adapter, rec)
        except TimeoutError:
            where = f"step {rec.current + 1} of {len(task.steps)}" if rec.current >= 0 else "creating the sandbox"
            rec.failures.append(TaskFailure(rec.current, "hang", f"no result within the task's budget of "
                                                                 f"{task.budget:.0f} s (stuck at {where})"))
        except Exception as exc:  # an adapter bug is this task's failure, never the run's end
            rec.failures.append(TaskFailure(rec.current, "sandbox_unavailable",
                                            f"the adapter raised {type(exc).__name__}: {exc}"[:2000]))
        seconds = time.monotonic() - started
        if not rec.failures or attempts > retries:
            return _result(task, "fail" if rec.failures else "pass", seconds, rec, attempts=attempts)


def _result(task: Task, status: Any, seconds: float, rec: _Attempt, *, skip_reason: str = "",
            attempts: int = 1) -> TaskResult:
    return TaskResult(
        id=task.id, family=task.family, category=task.category, severity=task.severity, status=status,
        duration=round(seconds, 4), mode=rec.failures[0].mode if rec.failures else None,
        failures=tuple(rec.failures), steps=tuple(rec.steps),
        create_seconds=round(rec.create_seconds, 4) if rec.create_seconds is not None else None,
        tags=task.tags, checklist=task.checklist, skip_reason=skip_reason, attempts=attempts, title=task.title,
    )


async def run_tasks(
    tasks: Sequence[Task],
    adapter: Adapter,
    *,
    concurrency: int = 50,
    retries: int = 0,
    server: str | None = None,
    out: TextIO | None = None,
    progress: Callable[[TaskResult], None] | None = None,
    header: dict[str, Any] | None = None,
    heavy_concurrency: int | None = None,
) -> RunResults:
    """Run `tasks` on `adapter`, at most `concurrency` at once (CPU-heavy ones at most `heavy_concurrency`);
    `server` is the loopback server's `host:port`.

    Each result is written to `out` as a JSON line (after a `run` header, before an `end` footer) the moment its
    task finishes, and passed to `progress`.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    heavy_limit = heavy_concurrency or max(2, 2 * _cpus())
    head = {"type": "run", "adapter": adapter.name, "started": now(), "tasks": len(tasks),
            "concurrency": concurrency, "heavy_concurrency": heavy_limit, "retries": retries,
            "host": platform.node(),
            "cpus": _cpus(), **(header or {})}
    run = RunResults(head)
    _emit(out, head)
    limiter = asyncio.Semaphore(concurrency)
    heavy = asyncio.Semaphore(heavy_limit)
    started = time.monotonic()

    async def one(task: Task) -> None:
        # A heavy task waits for its own slot before it takes a general one, so waiting never blocks light work.
        async with heavy if is_heavy(task) else contextlib.nullcontext():
            async with limiter:
                result = await run_one(task, adapter, server=server, retries=retries)
        run.results.append(result)
        _emit(out, result.to_json())
        if progress is not None:
            progress(result)

    async with asyncio.TaskGroup() as group:
        for task in interleave(tasks):
            group.create_task(one(task))
    order = {t.id: i for i, t in enumerate(tasks)}
    run.results.sort(key=lambda r: order.get(r.id, 0))
    counts = Counter(r.status for r in run.results)
    run.end = {"type": "end", "finished": now(), "wall_seconds": round(time.monotonic() - started, 2),
               "counts": {k: counts.get(k, 0) for k in ("pass", "fail", "skip")}}
    _emit(out, run.end)
    return run


HEAVY_CATEGORIES = frozenset({"ml_training", "data_analysis", "packages", "multi_language", "resource_abuse"})


def is_heavy(task: Task) -> bool:
    """Mostly CPU: model fits, pandas imports, pip resolving, compilers (or tagged `heavy`)."""
    return task.category in HEAVY_CATEGORIES or task.setup.template == "polyglot" or "heavy" in task.tags


def interleave(tasks: Sequence[Task]) -> list[Task]:
    """Round-robin across families, each family in its own order: the same input gives the same order."""
    families: dict[str, list[Task]] = {}
    for t in tasks:
        families.setdefault(t.family, []).append(t)
    queues = list(families.values())
    order: list[Task] = []
    for i in range(max((len(q) for q in queues), default=0)):
        order.extend(q[i] for q in queues if i < len(q))
    return order


def _emit(out: TextIO | None, data: dict[str, Any]) -> None:
    if out is not None:
        out.write(json.dumps(data, ensure_ascii=False) + "\n")
        out.flush()


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
