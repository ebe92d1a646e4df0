"""`corral bench eval`: the whole corpus (`corral eval`) against a real `corral serve`, N agents at once.

With `pool`, the server keeps warm pools (`--pool default=N --pool default/root=N/5`).

Figures: wall time of the full run (target: 1,000+ tasks with 50 concurrent agents in <= 15 minutes on 2 cores),
tasks per second, pass counts, per-category task duration and sandbox-create time (median, p95), and a baseline
measured in the same run on the same server: as many "empty" tasks (create a sandbox, run `true`, destroy it)
at the same concurrency, i.e. what the sandbox lifecycle alone costs. `ratio_to_empty` is the full run's wall time
over the baseline's.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.eval import Exec, ExitCode, Task, TaskResult, load_corpus
from corral.eval._deployment import local_capabilities, run_on_corral
from corral.eval._select import select
from corral.server import ServerProcess

Progress = Callable[[str, int, int], None]  # (what, done, total)
TARGET_SECONDS = 15 * 60


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_s": round(statistics.median(values), 3) if values else 0.0, "p95_s": round(pct(values, 0.95), 3),
            "n": len(values)}


def empty_tasks(n: int) -> list[Task]:
    return [Task(f"baseline.empty/{i}", "baseline.empty", "file_io", "create, run true, destroy",
                 (Exec(["true"], (ExitCode(0),)),)) for i in range(n)]


async def _run(tasks: list[Task], server: ServerProcess, concurrency: int, what: str,
               progress: Progress) -> tuple[Any, float]:
    done = 0

    def tick(_: TaskResult) -> None:
        nonlocal done
        done += 1
        progress(what, done, len(tasks))

    run = await run_on_corral(tasks, base_url=server.url, admin_key=server.admin_key, concurrency=concurrency,
                              capabilities=local_capabilities(), progress=tick)
    return run, float(run.end["wall_seconds"]) if run.end else 0.0


def run(*, home: Path, template_home: Path, progress: Progress, concurrency: int = 50,
        sample: int | None = None, seed: int = 0, pool: int = 0) -> dict[str, Any]:
    tasks = select(load_corpus(), sample=sample, seed=seed)
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o755)
    # Warm pools of the templates and shapes the corpus asks for most (docs/performance.md): plain and root.
    args = ["--pool", f"default={pool}", "--pool", f"default/root={max(1, pool // 5)}"] if pool else []
    with ServerProcess(home, template_home=template_home, args=args) as server:
        full, wall = asyncio.run(_run(tasks, server, concurrency, "corpus", progress))
        _, empty_wall = asyncio.run(_run(empty_tasks(len(tasks)), server, concurrency, "baseline", progress))
    results: list[TaskResult] = full.results
    by_category: dict[str, dict[str, Any]] = {}
    for category in sorted({r.category for r in results}):
        rs = [r for r in results if r.category == category and r.status != "skip"]
        by_category[category] = {
            "tasks": len(rs), "passed": sum(r.status == "pass" for r in rs),
            "duration": summary([r.duration for r in rs]),
            "create": summary([r.create_seconds for r in rs if r.create_seconds is not None]),
        }
    counts = full.counts()
    return {
        "tasks": len(results), "concurrency": concurrency, "server_args": args, "wall_seconds": wall,
        "target_seconds": TARGET_SECONDS, "met": wall <= TARGET_SECONDS,
        "tasks_per_second": round(len(results) / wall, 2) if wall else 0.0,
        "passed": counts.get("pass", 0), "failed": counts.get("fail", 0), "skipped": counts.get("skip", 0),
        "failures": [f"{r.id}: {r.mode}: {r.failures[0].detail[:200]}" for r in results if r.status == "fail"],
        "baseline_empty_tasks_wall_seconds": empty_wall,
        "ratio_to_empty": round(wall / empty_wall, 2) if empty_wall else None,
        "by_category": by_category,
    }
