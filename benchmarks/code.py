"""`corral bench code`: code sessions (docs/code.md) against a fresh `python3 -c` in the same sandbox, through
the engine in-process and through the HTTP API (a real `corral serve` subprocess, the SDK over loopback).

Figures (median and p95), each for the engine and for the API:
- session start: the first `1+1` of a new session (start the kernel, run the cell), target <= 500 ms
- `1+1` round trip in a warm session (API target: p50 <= 10 ms)
- baseline: `python3 -c "print(1+1)"` through exec, a fresh interpreter per call
- a cell printing 1 MB to stdout
- a matplotlib chart (pyplot already imported), rendered to PNG after the cell
- engine only: a C hello world (`language="c"`: write, gcc -O2, run), per call

And the 1 MB cell on the wire (`wire_1mb`, target: API p50 <= 15 ms), interleaved sample by sample so that a noisy
machine slows every variant alike: the engine in-process (the baseline), the SDK through the API (binary frames),
the same cell as an old client gets it (a JSON body with base64 output, decoded as the SDK before frames did),
the SDK with an `on_stdout` callback (frames streamed as produced), and `1+1` through the engine and the API (what
every request costs, whatever its size). Each output is checked byte for byte.
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

import httpx

from corral import Admin, Execution, Sandbox
from corral.backends.local import LocalBackend
from corral.engine import Engine, SandboxSpec
from corral.server import ServerProcess
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

TARGETS = {"session_start_p50_ms": 500, "api_warm_1p1_p50_ms": 10, "api_stdout_1mb_p50_ms": 15}
STDOUT_1MB = "print('x' * (1 << 20))"
OUT_1MB = b"x" * (1 << 20) + b"\n"
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


def _check_1mb(r: Any, what: str) -> None:
    if getattr(r, "stdout_bytes", None) != OUT_1MB:
        raise RuntimeError(f"benchmark step {what!r}: the 1 MB of output did not arrive byte for byte")


def _json_cell(http: httpx.Client, sandbox_id: str) -> Execution:
    """The cell as a client without frames gets it: one JSON body, output in base64 (the SDK before frames)."""
    r = http.post(f"/v1/sandboxes/{sandbox_id}/code", json={"code": STDOUT_1MB, "session": "warm", "timeout": 60},
                  headers={"Accept": "application/json"})
    r.raise_for_status()
    return Execution.from_wire(r.json())


def _wire_figures(home: Path, template_home: Path, store: TemplateStore, template: str, n: int,
                  progress: Progress) -> dict[str, Any]:
    """The 1 MB cell through the engine and through the API, one sample of each variant per round."""
    # Leaving the block stops the server and destroys whatever this run left behind (outside any event loop).
    with ServerProcess(home / "server", template_home=template_home) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("bench")
            key = admin.keys.create("bench", "developer").key
        sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=server.url)
        try:
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
                samples = asyncio.run(_beside_engine(home / "engine", store, template, sb, http, n, progress))
        finally:
            sb.kill()
    out: dict[str, Any] = {name: summary(times) for name, times in samples.items()}
    engine_p50, api_p50 = out["engine"]["p50_ms"], out["api"]["p50_ms"]
    out["api_vs_engine_p50"] = round(api_p50 / engine_p50, 2)
    out["api_json_vs_engine_p50"] = round(out["api_json"]["p50_ms"] / engine_p50, 2)
    out["api_overhead_p50_ms"] = round(api_p50 - engine_p50, 2)
    out["request_overhead_p50_ms"] = round(out["api_1p1"]["p50_ms"] - out["engine_1p1"]["p50_ms"], 2)
    return out


async def _beside_engine(home: Path, store: TemplateStore, template: str, sb: Sandbox, http: httpx.Client, n: int,
                         progress: Progress) -> dict[str, list[float]]:
    engine = Engine(home, backend=LocalBackend(home, cgroup_parent="corral-bench"), templates=store)
    await engine.start()
    try:
        local = await engine.create(SandboxSpec(template=template))
        chunks: list[bytes] = []

        def streamed() -> Execution:
            chunks.clear()
            return sb.run_code(STDOUT_1MB, session="warm", on_stdout=chunks.append)

        variants: dict[str, Callable[[], Any]] = {
            "engine": lambda: local.run_code(STDOUT_1MB, session="warm"),
            "api": lambda: sb.run_code(STDOUT_1MB, session="warm"),
            "api_json": lambda: _json_cell(http, sb.id),
            "api_streamed": streamed,
            "engine_1p1": lambda: local.run_code("1+1", session="warm"),
            "api_1p1": lambda: sb.run_code("1+1", session="warm"),
        }
        samples = await _interleaved(variants, n, progress, chunks)
        await local.destroy()
    finally:
        await engine.close(destroy_all=True)
    return samples


async def _call(fn: Callable[[], Any]) -> Any:
    r = fn()  # the SDK's calls are synchronous: they hold the loop, which has nothing else to do meanwhile
    return await r if asyncio.iscoroutine(r) else r


async def _interleaved(variants: dict[str, Callable[[], Any]], n: int, progress: Progress,
                       chunks: list[bytes]) -> dict[str, list[float]]:
    for fn in variants.values():  # warm every path once (sessions, connections)
        await _call(fn)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(n):
        for name in names[i % len(names):] + names[:i % len(names)]:  # a different variant first each round
            t = time.perf_counter()
            r = await _call(variants[name])
            samples[name].append(time.perf_counter() - t)
            _ok(r, name)
            if not name.endswith("1p1"):
                _check_1mb(r, name)
        if b"".join(chunks) != OUT_1MB:
            raise RuntimeError("benchmark step 'api_streamed': the callback did not get the 1 MB byte for byte")
        progress("wire: 1 MB cell, engine and API interleaved", i + 1, n)
    return samples


def _ratios(figures: dict[str, Any]) -> dict[str, float]:
    base = figures["fresh_python3_c"]["p50_ms"]
    return {key: round(figures[key]["p50_ms"] / base, 2)
            for key in ("session_start_1p1", "warm_1p1", "stdout_1mb", "matplotlib_chart")}


def run(*, home: Path, template_home: Path, template: str = "default", n: int = 30, wire_only: bool = False,
        progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    store = TemplateStore(template_home)
    store.get(template)
    results: dict[str, Any] = {"template": template, "n": n, "cpus": os.cpu_count(), "targets": TARGETS}
    if wire_only:
        try:
            results["wire_1mb"] = _wire_figures(home, template_home, store, template, n, progress)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        results["meets_targets"] = {
            "api_stdout_1mb": results["wire_1mb"]["api"]["p50_ms"] <= TARGETS["api_stdout_1mb_p50_ms"]}
        return results
    try:
        results["engine"] = asyncio.run(_engine_figures(home / "engine", store, template, n, progress))
        results["api"] = _api_figures(home / "server", template_home, template, n, progress)
        results["wire_1mb"] = _wire_figures(home / "wire", template_home, store, template, max(n, 60), progress)
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
        "api_stdout_1mb": results["wire_1mb"]["api"]["p50_ms"] <= TARGETS["api_stdout_1mb_p50_ms"],
    }
    return results
