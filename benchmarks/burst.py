"""`corral bench burst`: N agents ask for a sandbox in the same instant and run `true` in it (the SDK against one
`corral serve`), without a warm pool and with one of N, against the serial rate measured in the same run.

Figures, each for a server without a pool and for one with `--pool <template>=N` (filled before the burst):
- serial: one client creating a sandbox and running `true`, one after another: p50/p95 and the rate (creates/s);
  the baseline a burst is compared with (a burst on 2 cores should at least beat it); and the machine's CPU time
  per create (/proc/stat), whose inverse times the cores bounds a burst that has to start every sandbox
- burst: N threads released by a barrier, each `Sandbox.create` + `commands.run(["true"])`: the wall time until
  the last one answered, errors, p50/p95 per agent, and the rate against the serial one
- create to first exec of one sandbox alone (p50/p95): cold, and from the pool (claim + first exec)
- the pool's own counters from /metrics (claimed, missed, made) so a burst half-served from the pool shows
- `docker run --rm <the template's image> true`, serial and N at once, as the peer (`--docker`, a running dockerd)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from corral import Admin, Sandbox
from corral.server import ServerProcess
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

GOALS = {"burst_wall_s": 1.5, "pool_create_to_exec_p50_ms": 5.0, "errors": 0}
_POOL_FILL_TIMEOUT = 600.0


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "max_ms": round(ms[-1], 2)}


def _first_exec(key: str, url: str, template: str) -> tuple[float, Sandbox]:
    t = time.perf_counter()
    sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=url)
    result = sb.commands.run(["true"])
    elapsed = time.perf_counter() - t
    if result.exit_code != 0:
        raise RuntimeError(f"`true` exited {result.exit_code}")
    return elapsed, sb


def _cpu_seconds() -> float:
    """CPU time the whole machine has spent (user, nice, system, irq, softirq) since boot, from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6))
    return busy / os.sysconf("SC_CLK_TCK")


def _serial(key: str, url: str, template: str, n: int, progress: Progress, label: str) -> dict[str, Any]:
    samples, cpu = [], 0.0
    start = time.perf_counter()
    for i in range(n):
        before = _cpu_seconds()
        elapsed, sb = _first_exec(key, url, template)
        cpu += _cpu_seconds() - before
        samples.append(elapsed)
        sb.kill()
        progress(label, i + 1, n)
    wall = time.perf_counter() - start
    # The machine's CPU per create (everything: client, server, runc, the agent; and whatever else runs): the
    # cores divided by it bound the rate of a burst that has to start every sandbox.
    cpu_ms = 1000 * cpu / n
    return {**summary(samples), "rate_per_s": round(n / wall, 1), "machine_cpu_ms_per_create": round(cpu_ms, 1),
            "cpu_bound_rate_per_s": round((os.cpu_count() or 1) * 1000 / cpu_ms, 1) if cpu_ms else None}


def _burst(key: str, url: str, template: str, n: int, progress: Progress, label: str) -> dict[str, Any]:
    barrier = threading.Barrier(n + 1)
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    made: list[Sandbox] = []

    def agent() -> None:
        try:
            barrier.wait(120)
        except threading.BrokenBarrierError:
            return
        try:
            elapsed, sb = _first_exec(key, url, template)
        except Exception as e:  # every failure is a figure
            with lock:
                errors.append(repr(e)[:300])
            return
        with lock:
            latencies.append(elapsed)
            made.append(sb)
            progress(label, len(latencies) + len(errors), n)

    threads = [threading.Thread(target=agent, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    barrier.wait(120)
    start = time.perf_counter()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - start
    for sb in made:
        try:
            sb.kill()
        except Exception as e:
            errors.append(f"kill: {e!r}"[:300])
    return {"n": n, "wall_s": round(wall, 3), "errors": len(errors), "error_samples": errors[:3],
            "rate_per_s": round(len(latencies) / wall, 1), "per_agent": summary(latencies) if latencies else {}}


def _pool_metrics(url: str, admin_key: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
    out: dict[str, float] = {}
    for name in ("members_ready", "claimed_total", "missed_total", "made_total", "evicted_total"):
        match = re.search(rf"^corral_pool_{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name.removesuffix("_total")] = float(match[1]) if match else 0.0
    return out


def _wait_pool(url: str, admin_key: str, size: int, progress: Progress, label: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < _POOL_FILL_TIMEOUT:
        ready = int(_pool_metrics(url, admin_key)["members_ready"])
        progress(label, ready, size)
        if ready >= size:
            return time.monotonic() - start
        time.sleep(0.25)
    raise RuntimeError(f"the pool did not fill ({size}) within {_POOL_FILL_TIMEOUT:g}s")


def _server_figures(home: Path, template_home: Path, template: str, n: int, serial_n: int, pool: int,
                    progress: Progress) -> dict[str, Any]:
    label = f"pool {pool}" if pool else "no pool"
    args = ["--pool", f"{template}={pool}"] if pool else []
    with ServerProcess(home, template_home=template_home, args=args) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("bench")
            key = admin.keys.create("bench", "developer").key
        out: dict[str, Any] = {"server_args": args}
        _first_exec(key, server.url, template)[1].kill()  # warm the server's imports and caches
        if pool:
            out["pool_fill_s"] = round(_wait_pool(server.url, server.admin_key, pool, progress,
                                                  f"{label}: filling"), 2)
        out["serial"] = _serial(key, server.url, template, serial_n, progress, f"{label}: serial")
        if pool:
            _wait_pool(server.url, server.admin_key, pool, progress, f"{label}: refilling")
        out["burst"] = _burst(key, server.url, template, n, progress, f"{label}: burst of {n}")
        if pool:
            out["pool_after_burst"] = _pool_metrics(server.url, server.admin_key)
        return out


def _docker_run(image: str) -> float:
    t = time.perf_counter()
    subprocess.run(["docker", "run", "--rm", "--network=none", image, "true"], check=True, capture_output=True)
    return time.perf_counter() - t


def _docker(home: Path, template_home: Path, template: str, n: int, serial: int,
            progress: Progress) -> dict[str, Any]:
    """The peer: `docker run --rm <the template's image> true`, one after another and N at once."""
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
        return {"skipped": "no dockerd answers"}
    from corral.backends.docker import DockerBackend  # corral[docker]: only for this section

    async def ensure() -> str:
        backend = DockerBackend(home)
        try:
            return await backend.images.ensure(TemplateStore(template_home).get(template))
        finally:
            await backend.close()

    image = asyncio.run(ensure())
    samples = []
    for i in range(serial):
        samples.append(_docker_run(image))
        progress("docker run --rm true", i + 1, serial)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        burst = list(pool.map(lambda _: _docker_run(image), range(n)))
    wall = time.perf_counter() - start
    return {"image": image, "serial": {**summary(samples), "rate_per_s": round(serial / sum(samples), 1)},
            "burst": {"n": n, "wall_s": round(wall, 3), "rate_per_s": round(n / wall, 1),
                      "per_agent": summary(burst)}}


def run(*, home: Path, template_home: Path, template: str = "default", n: int = 50, serial: int = 20,
        docker: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    TemplateStore(template_home).get(template)  # a missing template fails here, before any server starts
    results: dict[str, Any] = {"template": template, "n": n, "cpus": os.cpu_count(), "goals": GOALS,
                               "load_avg_1m_at_start": os.getloadavg()[0]}
    results["without_pool"] = _server_figures(home / "cold", template_home, template, n, serial, 0, progress)
    results["with_pool"] = _server_figures(home / "pool", template_home, template, n, serial, n, progress)
    if docker:
        results["docker"] = _docker(home / "docker", template_home, template, n, serial, progress)
    results["load_avg_1m_at_end"] = os.getloadavg()[0]
    cold, warm = results["without_pool"], results["with_pool"]
    results["ratios"] = {
        "burst_rate_to_serial_rate_without_pool": round(cold["burst"]["rate_per_s"] / cold["serial"]["rate_per_s"], 2),
        "burst_rate_to_serial_rate_with_pool": round(warm["burst"]["rate_per_s"] / cold["serial"]["rate_per_s"], 2),
        "pool_create_to_exec_to_cold_p50": round(warm["serial"]["p50_ms"] / cold["serial"]["p50_ms"], 3),
    }
    results["meets_goals"] = {
        "burst_wall_with_pool": warm["burst"]["wall_s"] <= GOALS["burst_wall_s"],
        "pool_create_to_exec_p50": warm["serial"]["p50_ms"] <= GOALS["pool_create_to_exec_p50_ms"],
        "errors": cold["burst"]["errors"] + warm["burst"]["errors"] == GOALS["errors"],
    }
    return results
