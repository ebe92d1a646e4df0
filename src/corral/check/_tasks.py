"""The in-sandbox part of the checklist: the corpus's tasks tagged with checklist items, run by the eval runner
in the check's tenant, and what their results say about each item.

Per item: any failed task fails it (naming the task, its failure mode and what it saw); otherwise it passes when
at least one task passed, and the tasks that could not run here (an adapter capability this deployment lacks)
are named as not applicable.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..eval._corral import CorralAdapter
from ..eval._result import RunResults, TaskResult
from ..eval._runner import run_tasks
from ..eval._select import select
from ..eval._task import CAPABILITIES, Task
from ..eval.corpus import load_corpus
from ..eval.corpus.security import CHECKLIST_FIXES
from ._context import CheckContext
from ._model import Verdict

__all__ = ["checklist_tasks", "run_checklist_tasks", "task_fixes", "task_verdicts"]

_SHOWN_FAILURES = 3  # per item; the JSON report and `corral eval` have every one


def checklist_tasks() -> tuple[Task, ...]:
    """Every corpus task that proves a checklist item."""
    return tuple(select(load_corpus(), checklist=True))


def task_fixes() -> dict[int, str]:
    """The fix hint of each item the tasks probe (`CHECKLIST_FIXES` of the security corpus)."""
    return dict(CHECKLIST_FIXES)


def capabilities(ctx: CheckContext) -> frozenset[str]:
    """What this deployment can do for the runner: the loopback server only when the tenant may reach it, the
    `polyglot` template only when the server's template store on this machine has it."""
    caps = set(CAPABILITIES)
    if ctx.loopback is None:
        caps.discard("loopback_server")
    if ctx.home is None or not _has_template(ctx.home, "polyglot"):
        caps.discard("polyglot")
    return frozenset(caps)


def _has_template(home: Path, name: str) -> bool:
    from ..templates import TemplateStore

    try:
        return TemplateStore(home).exists(name)
    except OSError:
        return False


async def run_checklist_tasks(ctx: CheckContext, tasks: Sequence[Task], *, concurrency: int,
                              progress: Callable[[TaskResult], None] | None = None) -> RunResults:
    """Run `tasks` as the check tenant's developer; every sandbox is killed when its task ends."""
    adapter = CorralAdapter(base_url=ctx.url, api_key=ctx.keys["developer"], capabilities=capabilities(ctx))
    return await run_tasks(tasks, adapter, concurrency=concurrency, server=ctx.loopback, progress=progress,
                           header={"check": ctx.tenant})


def _failure(r: TaskResult) -> str:
    first = r.failures[0] if r.failures else None
    where = f" at step {first.step + 1}" if first is not None and first.step >= 0 else ""
    return f"task {r.id} ({r.mode}{where}): {first.detail if first else 'failed'}"


def task_verdicts(results: Iterable[TaskResult]) -> dict[int, list[Verdict]]:
    """Each item's verdicts from its tasks' results: at most one PASS or FAIL, and one N/A for skipped tasks."""
    by_item: dict[int, list[TaskResult]] = defaultdict(list)
    for r in results:
        for number in r.checklist:
            by_item[number].append(r)
    verdicts: dict[int, list[Verdict]] = {}
    for number, rs in by_item.items():
        ids = tuple(r.id for r in rs if r.status != "skip")
        seconds = sum(r.duration for r in rs)
        failed = [r for r in rs if r.status == "fail"]
        passed = [r for r in rs if r.status == "pass"]
        skipped = [r for r in rs if r.status == "skip"]
        found: list[Verdict] = []
        if failed:
            more = f"; and {len(failed) - _SHOWN_FAILURES} more" if len(failed) > _SHOWN_FAILURES else ""
            detail = "; ".join(_failure(r) for r in failed[:_SHOWN_FAILURES]) + more
            found.append(Verdict("FAIL", f"{len(failed)} of {len(ids)} tasks failed: {detail}", tasks=ids,
                                 seconds=seconds))
        elif passed:
            found.append(Verdict("PASS", f"{len(passed)} tasks passed", tasks=ids, seconds=seconds))
        if skipped:
            reasons = "; ".join(dict.fromkeys(r.skip_reason for r in skipped))
            found.append(Verdict("N/A", f"{len(skipped)} tasks skipped ({reasons})"))
        verdicts[number] = found
    return verdicts
