"""`corral bench code`: code sessions (docs/code.md) against a fresh `python3 -c` in the same sandbox.

Figures (median and p95):
- session start: the first `1+1` of a new session (start the kernel, run the cell), target <= 500 ms
- `1+1` round trip in a warm session
- baseline: `exec(["python3", "-c", "print(1+1)"])`, a fresh interpreter per call
- a cell printing 1 MB to stdout
- a matplotlib chart (pyplot already imported), rendered to PNG after the cell
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from corral.backends.local import LocalBackend
from corral.engine import Engine, SandboxSpec
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}


async def _timed(n: int, what: str, progress: Progress, fn: Callable[[int], Awaitable[object]]) -> list[float]:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        await fn(i)
        samples.append(time.perf_counter() - t)
        progress(what, i + 1, n)
    return samples


async def run(*, home: Path, template_home: Path, template: str = "default", n: int = 30,
              progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    engine = Engine(home, backend=LocalBackend(home, cgroup_parent="corral-bench"),
                    templates=TemplateStore(template_home))
    await engine.start()
    results: dict[str, Any] = {"template": template, "n": n}
    try:
        sb = await engine.create(SandboxSpec(template=template))
        await sb.run_code("1+1", session="warm")
        results["session_start_1p1"] = summary(await _timed(
            n, "session start", progress, lambda i: sb.run_code("1+1", session=f"s{i}")))
        results["warm_1p1"] = summary(await _timed(n, "1+1 warm", progress, lambda i: sb.run_code("1+1",
                                                                                                   session="warm")))
        results["fresh_python3_c"] = summary(await _timed(
            n, "fresh python3 -c", progress, lambda i: sb.exec(["python3", "-c", "print(1+1)"])))
        results["stdout_1mb"] = summary(await _timed(
            n, "1 MB stdout", progress, lambda i: sb.run_code("print('x' * (1 << 20))", session="warm")))
        await sb.run_code("import matplotlib.pyplot as plt", session="warm")
        results["matplotlib_chart"] = summary(await _timed(
            n, "matplotlib chart", progress, lambda i: sb.run_code("plt.plot([1, 2, 3])", session="warm")))
        results["start_vs_fresh_python"] = round(results["session_start_1p1"]["p50_ms"]
                                                 / results["fresh_python3_c"]["p50_ms"], 2)
        await sb.destroy()
    finally:
        await engine.close(destroy_all=True)
    return results
