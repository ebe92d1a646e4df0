"""`corral bench api`: the HTTP API (a real `corral serve` subprocess, the SDK over a loopback socket), compared
with the engine in-process in the same run so the API's own overhead is visible.

Figures:
- exec round trip of `true` (argv): through the API, and through the engine in-process (median and p95)
- one agent-like step (write a file, run a command that reads it, read its output): API and engine
- 100 MiB upload and download through the SDK (MB/s), with the server's RSS growth (VmRSS before, and its peak
  sampled during each transfer)
- N concurrent clients (threads, sync SDK), each driving its own sandbox through an S-step agent-like loop:
  errors, throughput (steps/s) and p95 per step
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from corral import Admin, Sandbox
from corral.backends.local import LocalBackend
from corral.engine import Engine, SandboxSpec
from corral.server import ServerProcess
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

MIB = 2**20
TARGETS = {"exec_p50_ms": 10, "transfer_mb_s": 200, "server_rss_growth_mib": 50, "concurrent_errors": 0}


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextmanager
def peak_rss(pid: int, every: float = 0.005) -> Iterator[dict[str, int]]:
    """Sample the process's VmRSS in a thread while the block runs; yields {"before", "peak"} in KiB."""
    out = {"before": rss_kib(pid), "peak": 0}
    out["peak"] = out["before"]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                out["peak"] = max(out["peak"], rss_kib(pid))
            except OSError:
                return
            stop.wait(every)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out["peak"] = max(out["peak"], rss_kib(pid))


def _check(r: Any) -> None:
    if r.exit_code != 0:
        raise RuntimeError(f"benchmark command failed: {r}")


STEP_CMD = ["sh", "-c", "tr a-z A-Z < /workspace/in.txt > /workspace/out.txt"]


def _api_step(sb: Sandbox, i: int) -> None:
    text = f"step {i} of an agent loop\n" * 8
    sb.files.write("/workspace/in.txt", text)
    _check(sb.commands.run(STEP_CMD))
    if sb.files.read("/workspace/out.txt") != text.upper().encode():
        raise RuntimeError(f"wrong output at step {i}")


# -- engine in-process, for comparison ------------------------------------------------------------------------


async def _engine_figures(home: Path, store: TemplateStore, spec: SandboxSpec, n: int,
                          progress: Progress) -> dict[str, Any]:
    backend = LocalBackend(home, cgroup_parent="corral-bench")
    engine = Engine(home, backend=backend, templates=store)
    await engine.start()
    out: dict[str, Any] = {}
    try:
        sb = await engine.create(spec)
        try:
            await sb.exec(["true"])
            samples = []
            for i in range(n):
                t = time.perf_counter()
                _check(await sb.exec(["true"]))
                samples.append(time.perf_counter() - t)
                progress("engine: exec true", i + 1, n)
            out["exec_true_argv"] = summary(samples)
            samples = []
            steps = max(20, n // 5)
            for i in range(steps):
                text = f"step {i} of an agent loop\n" * 8
                t = time.perf_counter()
                await sb.files.write("/workspace/in.txt", text.encode())
                _check(await sb.exec(STEP_CMD))
                if await sb.files.read("/workspace/out.txt") != text.upper().encode():
                    raise RuntimeError(f"wrong output at step {i}")
                samples.append(time.perf_counter() - t)
                progress("engine: agent step", i + 1, steps)
            out["agent_step"] = summary(samples)
        finally:
            await sb.destroy()
    finally:
        await engine.close(destroy_all=True)
    return out


# -- the API ---------------------------------------------------------------------------------------------------


def _transfers(sb: Sandbox, server: ServerProcess, work: Path, size_mib: int, progress: Progress) -> dict[str, Any]:
    src = work / "upload.bin"
    with open(src, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(MIB))
    size = size_mib * MIB
    out: dict[str, Any] = {"size_mib": size_mib}
    try:
        with peak_rss(server.pid) as up_rss, open(src, "rb") as f:
            t = time.perf_counter()
            entry = sb.files.write("/workspace/big.bin", f)
            up_s = time.perf_counter() - t
        if entry.size != size:
            raise RuntimeError(f"upload wrote {entry.size} bytes, not {size}")
        progress("100 MiB upload + download", 1, 2)
        with peak_rss(server.pid) as down_rss:
            t = time.perf_counter()
            data = sb.files.read("/workspace/big.bin")
            down_s = time.perf_counter() - t
        progress("100 MiB upload + download", 2, 2)
        if len(data) != size:
            raise RuntimeError(f"download gave {len(data)} bytes, not {size}")
        with open(src, "rb") as f:
            if f.read() != data:
                raise RuntimeError("download differs from the upload")
        del data
    finally:
        src.unlink(missing_ok=True)
    for name, secs, rss in (("upload", up_s, up_rss), ("download", down_s, down_rss)):
        out[name] = {"seconds": round(secs, 3), "mb_s": round(size / secs / 1e6, 1),
                     "mib_s": round(size / secs / MIB, 1),
                     "server_rss_before_mib": round(rss["before"] / 1024, 1),
                     "server_rss_peak_mib": round(rss["peak"] / 1024, 1),
                     "server_rss_growth_mib": round((rss["peak"] - rss["before"]) / 1024, 1)}
    return out


def _concurrent(server: ServerProcess, key: str, template: str, clients: int, steps: int,
                progress: Progress) -> dict[str, Any]:
    barrier = threading.Barrier(clients + 1)
    lock = threading.Lock()
    step_times: list[float] = []
    errors: list[str] = []
    done = [0]
    sandboxes: list[Sandbox] = []

    def client() -> None:
        sb = None
        try:
            sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=server.url)
            with lock:
                sandboxes.append(sb)
        except Exception as e:  # every failure is a figure
            with lock:
                errors.append(f"create: {e!r}")
        try:
            barrier.wait(300)
        except threading.BrokenBarrierError:
            return
        if sb is None:
            return
        mine = []
        for i in range(steps):
            t = time.perf_counter()
            try:
                _api_step(sb, i)
                mine.append(time.perf_counter() - t)
            except Exception as e:
                with lock:
                    errors.append(f"step {i}: {e!r}")
            with lock:
                done[0] += 1
                progress(f"{clients} clients x {steps} steps", done[0], clients * steps)
        with lock:
            step_times.extend(mine)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t_create = time.perf_counter()
    for t in threads:
        t.start()
    try:
        barrier.wait(300)
        start = time.perf_counter()
        create_wall = start - t_create
        for t in threads:
            t.join(600)
        wall = time.perf_counter() - start
    finally:
        for sb in sandboxes:
            try:
                sb.kill()
            except Exception as e:
                errors.append(f"kill: {e!r}")
    return {"clients": clients, "steps_per_client": steps, "errors": len(errors), "error_samples": errors[:3],
            "create_wall_s": round(create_wall, 2), "loop_wall_s": round(wall, 2),
            "steps_ok": len(step_times), "throughput_steps_s": round(len(step_times) / wall, 1),
            "per_step": summary(step_times) if step_times else {}}


def run(*, home: Path, template_home: Path, template: str = "default", n: int = 200, clients: int = 50,
        steps: int = 20, size_mib: int = 100, progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    store = TemplateStore(template_home)
    store.get(template)
    spec = SandboxSpec(template=template)
    results: dict[str, Any] = {"template": template, "n": n, "cpus": os.cpu_count(), "targets": TARGETS}

    results["engine"] = asyncio.run(_engine_figures(home / "engine", store, spec, n, progress))

    # Leaving the block stops the server (SIGTERM, then SIGKILL) and destroys whatever this run left behind.
    with ServerProcess(home / "server", template_home=template_home) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("bench")
            key = admin.keys.create("bench", "developer").key
        api: dict[str, Any] = {"server_rss_idle_mib": round(rss_kib(server.pid) / 1024, 1)}
        results["api"] = api
        sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=server.url)
        try:
            sb.commands.run(["true"])
            samples = []
            for i in range(n):
                t = time.perf_counter()
                _check(sb.commands.run(["true"]))
                samples.append(time.perf_counter() - t)
                progress("api: exec true", i + 1, n)
            api["exec_true_argv"] = summary(samples)
            samples = []
            agent_n = max(20, n // 5)
            for i in range(agent_n):
                t = time.perf_counter()
                _api_step(sb, i)
                samples.append(time.perf_counter() - t)
                progress("api: agent step", i + 1, agent_n)
            api["agent_step"] = summary(samples)
            api["transfers"] = _transfers(sb, server, home, size_mib, progress)
        finally:
            sb.kill()
        api["concurrent"] = _concurrent(server, key, template, clients, steps, progress)
        api["server_rss_end_mib"] = round(rss_kib(server.pid) / 1024, 1)

    eng, api = results["engine"], results["api"]
    results["api_overhead"] = {
        key: {"p50_ms": round(api[key]["p50_ms"] - eng[key]["p50_ms"], 2),
              "ratio_p50": round(api[key]["p50_ms"] / eng[key]["p50_ms"], 2)}
        for key in ("exec_true_argv", "agent_step")
    }
    tr = api["transfers"]
    results["meets_targets"] = {
        "exec_p50": api["exec_true_argv"]["p50_ms"] <= TARGETS["exec_p50_ms"],
        "upload_mb_s": tr["upload"]["mb_s"] >= TARGETS["transfer_mb_s"],
        "download_mb_s": tr["download"]["mb_s"] >= TARGETS["transfer_mb_s"],
        "server_rss_growth": max(tr["upload"]["server_rss_growth_mib"], tr["download"]["server_rss_growth_mib"])
        <= TARGETS["server_rss_growth_mib"],
        "concurrent_errors": api["concurrent"]["errors"] == TARGETS["concurrent_errors"],
    }
    return results


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(home=Path(f"/var/tmp/corral-bench-api-{os.getpid()}"),
                         template_home=Path(os.environ.get("CORRAL_HOME", "/var/lib/corral"))), indent=2))
    shutil.rmtree(f"/var/tmp/corral-bench-api-{os.getpid()}", ignore_errors=True)
