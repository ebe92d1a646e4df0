"""`corral bench code`: code sessions (docs/code.md) against a fresh `python3 -c` in the same sandbox, through
the engine in-process and through the HTTP API (a real `corral serve` subprocess, the SDK over loopback).

Figures (median and p95), each for the engine and for the API:
- session start: the first `1+1` of a new session (start the kernel, run the cell), target <= 500 ms
- `1+1` round trip in a warm session (API target: p50 <= 10 ms)
- baseline: `python3 -c "print(1+1)"` through exec, a fresh interpreter per call
- a cell printing 1 MB to stdout
- a matplotlib chart (pyplot already imported), rendered to PNG after the cell
- engine only: a C hello world (`language="c"`: write, gcc -O2, run), per call
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from corral import Admin, Sandbox
from corral.backends.local import LocalBackend
from corral.engine import Engine, SandboxSpec
from corral.server import ServerProcess
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

TARGETS = {"session_start_p50_ms": 500, "api_warm_1p1_p50_ms": 10}
STDOUT_1MB = "print('x' * (1 << 20))"
CHART = "plt.plot([1, 2, 3])"
FRESH = ["python3", "-c", "print(1+1)"]
C_HELLO = '#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n'


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}


def _ok(r: Any, what: str) -> None:
    if getattr(r, "error", None) is not None or getattr(r, "exit_code", 0) not in (0, None):
        raise RuntimeError(f"benchmark step {what!r} failed: {r}")


async def _atimed(n: int, what: str, progress: Progress, fn: Callable[[int], Awaitable[object]]) -> list[float]:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        r = await fn(i)
        samples.append(time.perf_counter() - t)
        _ok(r, what)
        progress(what, i + 1, n)
    return samples


def _timed(n: int, what: str, progress: Progress, fn: Callable[[int], object]) -> list[float]:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        r = fn(i)
        samples.append(time.perf_counter() - t)
        _ok(r, what)
        progress(what, i + 1, n)
    return samples


async def _engine_figures(home: Path, store: TemplateStore, template: str, n: int,
                          progress: Progress) -> dict[str, Any]:
    engine = Engine(home, backend=LocalBackend(home, cgroup_parent="corral-bench"), templates=store)
    await engine.start()
    out: dict[str, Any] = {}
    try:
        sb = await engine.create(SandboxSpec(template=template))
        await sb.run_code("1+1", session="warm")
        out["session_start_1p1"] = summary(await _atimed(
            n, "engine: session start", progress, lambda i: sb.run_code("1+1", session=f"s{i}")))
        out["warm_1p1"] = summary(await _atimed(
            n, "engine: 1+1 warm", progress, lambda i: sb.run_code("1+1", session="warm")))
        out["fresh_python3_c"] = summary(await _atimed(
            n, "engine: fresh python3 -c", progress, lambda i: sb.exec(FRESH)))
        out["stdout_1mb"] = summary(await _atimed(
            n, "engine: 1 MB stdout", progress, lambda i: sb.run_code(STDOUT_1MB, session="warm")))
        await sb.run_code("import matplotlib.pyplot as plt", session="warm")
        out["matplotlib_chart"] = summary(await _atimed(
            n, "engine: matplotlib chart", progress, lambda i: sb.run_code(CHART, session="warm")))
        c_n = max(5, n // 3)
        out["c_hello_compile_run"] = summary(await _atimed(
            c_n, "engine: C hello (gcc + run)", progress, lambda i: sb.run_code(C_HELLO, language="c")))
        await sb.destroy()
    finally:
        await engine.close(destroy_all=True)
    return out


def _api_figures(home: Path, template_home: Path, template: str, n: int, progress: Progress) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Leaving the block stops the server and destroys whatever this run left behind.
    with ServerProcess(home, template_home=template_home) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("bench")
            key = admin.keys.create("bench", "developer").key
        sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=server.url)
        try:
            sb.run_code("1+1", session="warm")
            sb.commands.run(FRESH)
            out["session_start_1p1"] = summary(_timed(
                n, "api: session start", progress, lambda i: sb.run_code("1+1", session=f"s{i}")))
            out["warm_1p1"] = summary(_timed(
                max(n, 100), "api: 1+1 warm", progress, lambda i: sb.run_code("1+1", session="warm")))
            out["fresh_python3_c"] = summary(_timed(
                n, "api: fresh python3 -c", progress, lambda i: sb.commands.run(FRESH)))
            out["stdout_1mb"] = summary(_timed(
                n, "api: 1 MB stdout", progress, lambda i: sb.run_code(STDOUT_1MB, session="warm")))
            sb.run_code("import matplotlib.pyplot as plt", session="warm")
            out["matplotlib_chart"] = summary(_timed(
                n, "api: matplotlib chart", progress, lambda i: sb.run_code(CHART, session="warm")))
        finally:
            sb.kill()
    return out


def _ratios(figures: dict[str, Any]) -> dict[str, float]:
    base = figures["fresh_python3_c"]["p50_ms"]
    return {key: round(figures[key]["p50_ms"] / base, 2)
            for key in ("session_start_1p1", "warm_1p1", "stdout_1mb", "matplotlib_chart")}


def run(*, home: Path, template_home: Path, template: str = "default", n: int = 30,
        progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    store = TemplateStore(template_home)
    store.get(template)
    results: dict[str, Any] = {"template": template, "n": n, "cpus": os.cpu_count(), "targets": TARGETS}
    try:
        results["engine"] = asyncio.run(_engine_figures(home / "engine", store, template, n, progress))
        results["api"] = _api_figures(home / "server", template_home, template, n, progress)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    eng, api = results["engine"], results["api"]
    results["vs_fresh_python3_c_p50"] = {"engine": _ratios(eng), "api": _ratios(api)}
    results["api_overhead_p50_ms"] = {key: round(api[key]["p50_ms"] - eng[key]["p50_ms"], 2)
                                      for key in api}
    results["meets_targets"] = {
        "engine_session_start": eng["session_start_1p1"]["p50_ms"] <= TARGETS["session_start_p50_ms"],
        "api_session_start": api["session_start_1p1"]["p50_ms"] <= TARGETS["session_start_p50_ms"],
        "api_warm_1p1": api["warm_1p1"]["p50_ms"] <= TARGETS["api_warm_1p1_p50_ms"],
    }
    return results
