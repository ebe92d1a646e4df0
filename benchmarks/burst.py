"""`corral bench burst`: N agents ask for a sandbox in the same instant and run `true` in it (the SDK against one
`corral serve`), in the bench's form and in the user's, on a server without a pool, with one pinned at N and on the
README's server (`corral serve` as is: the self-sizing pool), against the serial rate measured in the same run.

Two forms of the same burst, each on a server that has already served an earlier one (where a server's uptime and
history would show):
- bench: N threads released by a barrier, each `Sandbox.create` + `commands.run(["true"])` (argv);
- user: one event loop, N tasks each `await AsyncSandbox.create()` + `await commands.run("true")` (a shell line),
  the form issue 25 item 7 measured.
Each burst: the wall time until the last agent answered, errors, p50/p95 per agent, and per agent the create and
the first exec apart (where the time goes).

Figures:
- without a pool (`--no-pool`): serial, one client creating a sandbox and running `true` one after another (p50/p95,
  the rate, and the machine's CPU time per create from /proc/stat, whose inverse times the cores bounds a burst
  that has to start every sandbox): the baseline every burst is compared with; then bench, user, bench, user
  bursts on the same server (form against form, first round against the second: history);
- with `--pool <template>=N` (filled before each burst): serial create to first exec from the pool, a bench and a
  user burst;
- the README's server (no pool option: the self-sizing pool of the default template): a first user burst, the time
  the pool takes to grow to it, a second user burst (the goal: all answered within 1.5 s), the pool's target;
- the pools' own counters from /metrics (claimed, missed, made, target) so a burst half-served from a pool shows;
- `docker run --rm <the template's image> true`, serial and N at once, as the peer (`--docker`, a running dockerd).
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

from corral import Admin, AsyncSandbox, Sandbox
from corral.server import ServerProcess
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

GOALS = {"burst_wall_s": 1.5, "readme_second_burst_wall_s": 1.5, "pool_create_to_exec_p50_ms": 5.0, "errors": 0}
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


def _burst_figures(n: int, wall: float, samples: list[tuple[float, float]], errors: list[str]) -> dict[str, Any]:
    """One burst's figures from each answered agent's (create, first exec) seconds."""
    out: dict[str, Any] = {"n": n, "wall_s": round(wall, 3), "errors": len(errors), "error_samples": errors[:3],
                           "rate_per_s": round(len(samples) / wall, 1)}
    if samples:
        out["per_agent"] = summary([create + run for create, run in samples])
        out["create"] = summary([create for create, _ in samples])
        out["first_exec"] = summary([run for _, run in samples])
    return out


def _bench_burst(key: str, url: str, template: str, n: int, progress: Progress, label: str) -> dict[str, Any]:
    """The bench's form: N threads released by a barrier, the sync SDK, argv `["true"]`."""
    barrier = threading.Barrier(n + 1)
    lock = threading.Lock()
    samples: list[tuple[float, float]] = []
    errors: list[str] = []
    made: list[Sandbox] = []

    def agent() -> None:
        try:
            barrier.wait(120)
        except threading.BrokenBarrierError:
            return
        try:
            t = time.perf_counter()
            sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=url)
            created = time.perf_counter()
            with lock:
                made.append(sb)
            result = sb.commands.run(["true"])
            if result.exit_code != 0:
                raise RuntimeError(f"`true` exited {result.exit_code}")
        except Exception as e:  # every failure is a figure
            with lock:
                errors.append(repr(e)[:300])
            return
        with lock:
            samples.append((created - t, time.perf_counter() - created))
            progress(label, len(samples) + len(errors), n)

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
    return _burst_figures(n, wall, samples, errors)


async def _user_burst_async(key: str, url: str, template: str, n: int, progress: Progress,
                            label: str) -> dict[str, Any]:
    samples: list[tuple[float, float]] = []
    errors: list[str] = []
    made: list[AsyncSandbox] = []

    async def agent() -> None:
        try:
            t = time.perf_counter()
            sb = await AsyncSandbox.create(template=template, timeout=600, api_key=key, base_url=url)
            created = time.perf_counter()
            made.append(sb)
            result = await sb.commands.run("true")
            if result.exit_code != 0:
                raise RuntimeError(f"`true` exited {result.exit_code}")
        except Exception as e:  # every failure is a figure
            errors.append(repr(e)[:300])
            return
        samples.append((created - t, time.perf_counter() - created))
        progress(label, len(samples) + len(errors), n)

    start = time.perf_counter()
    await asyncio.gather(*(agent() for _ in range(n)))
    wall = time.perf_counter() - start
    for outcome in await asyncio.gather(*(sb.kill() for sb in made), return_exceptions=True):
        if isinstance(outcome, Exception):
            errors.append(f"kill: {outcome!r}"[:300])
    await asyncio.gather(*(sb.close() for sb in made), return_exceptions=True)
    return _burst_figures(n, wall, samples, errors)


def _user_burst(key: str, url: str, template: str, n: int, progress: Progress, label: str) -> dict[str, Any]:
    """The user's form (issue 25 item 7): one event loop, N tasks, the async SDK, the shell line `"true"`."""
    return asyncio.run(_user_burst_async(key, url, template, n, progress, label))


def _pool_metrics(url: str, admin_key: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
    out: dict[str, float] = {}
    for name in ("members_ready", "target", "claimed_total", "missed_total", "made_total", "evicted_total"):
        match = re.search(rf"^corral_pool_{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name.removesuffix("_total")] = float(match[1]) if match else 0.0
    return out


def _wait_pool(url: str, admin_key: str, size: int | None, progress: Progress, label: str) -> float:
    """Wait until the pool holds `size` ready members (None: its own target, once it has grown past its rest)."""
    start = time.monotonic()
    while time.monotonic() - start < _POOL_FILL_TIMEOUT:
        figures = _pool_metrics(url, admin_key)
        ready, wanted = int(figures["members_ready"]), size or int(figures["target"])
        progress(label, ready, wanted)
        if ready >= wanted > 0:
            return time.monotonic() - start
        time.sleep(0.25)
    raise RuntimeError(f"the pool did not fill ({size or 'its target'}) within {_POOL_FILL_TIMEOUT:g}s")


def _bench_key(server: ServerProcess) -> str:
    with Admin(api_key=server.admin_key, base_url=server.url) as admin:
        admin.tenants.create("bench")
        return admin.keys.create("bench", "developer").key


def _cold_figures(home: Path, template_home: Path, template: str, n: int, serial_n: int,
                  progress: Progress) -> dict[str, Any]:
    """No pool: the serial baseline, then bench, user, bench, user bursts on the one server."""
    args = ["--no-pool"]
    with ServerProcess(home, template_home=template_home, args=args) as server:
        key = _bench_key(server)
        out: dict[str, Any] = {"server_args": args}
        _first_exec(key, server.url, template)[1].kill()  # warm the server's imports and caches
        out["serial"] = _serial(key, server.url, template, serial_n, progress, "no pool: serial")
        for round_ in (1, 2):
            for form, burst in (("bench", _bench_burst), ("user", _user_burst)):
                out[f"{form}_burst_{round_}"] = burst(key, server.url, template, n, progress,
                                                      f"no pool: {form} burst {round_} of {n}")
        return out


def _pinned_figures(home: Path, template_home: Path, template: str, n: int, serial_n: int,
                    progress: Progress) -> dict[str, Any]:
    """`--pool <template>=N`, filled before each burst: create to first exec from the pool, a bench and a user burst."""
    args = ["--pool", f"{template}={n}"]
    with ServerProcess(home, template_home=template_home, args=args) as server:
        key = _bench_key(server)
        out: dict[str, Any] = {"server_args": args}
        _first_exec(key, server.url, template)[1].kill()
        out["pool_fill_s"] = round(_wait_pool(server.url, server.admin_key, n, progress, f"pool {n}: filling"), 2)
        out["serial"] = _serial(key, server.url, template, serial_n, progress, f"pool {n}: serial")
        for form, burst in (("bench", _bench_burst), ("user", _user_burst)):
            _wait_pool(server.url, server.admin_key, n, progress, f"pool {n}: refilling for the {form} burst")
            out[f"{form}_burst"] = burst(key, server.url, template, n, progress, f"pool {n}: {form} burst of {n}")
        out["pool_after"] = _pool_metrics(server.url, server.admin_key)
        return out


def _readme_figures(home: Path, template_home: Path, template: str, n: int, progress: Progress) -> dict[str, Any]:
    """The README's server (`corral serve`, no pool option): a first user burst, the pool growing to it, a second."""
    with ServerProcess(home, template_home=template_home, default_pool=True) as server:
        key = _bench_key(server)
        out: dict[str, Any] = {"server_args": []}
        _first_exec(key, server.url, template)[1].kill()
        out["pool_at_rest"] = _pool_metrics(server.url, server.admin_key)
        out["first_burst"] = _user_burst(key, server.url, template, n, progress, f"README server: burst 1 of {n}")
        out["pool_after_first"] = _pool_metrics(server.url, server.admin_key)
        out["pool_grow_s"] = round(_wait_pool(server.url, server.admin_key, None, progress,
                                              "README server: the pool growing"), 2)
        out["second_burst"] = _user_burst(key, server.url, template, n, progress, f"README server: burst 2 of {n}")
        out["pool_after_second"] = _pool_metrics(server.url, server.admin_key)
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
    results["without_pool"] = cold = _cold_figures(home / "cold", template_home, template, n, serial, progress)
    results["with_pool"] = warm = _pinned_figures(home / "pool", template_home, template, n, serial, progress)
    if template == "default":  # the README's server pools the default template only
        results["readme_server"] = _readme_figures(home / "readme", template_home, template, n, progress)
    if docker:
        results["docker"] = _docker(home / "docker", template_home, template, n, serial, progress)
    results["load_avg_1m_at_end"] = os.getloadavg()[0]
    serial_rate = cold["serial"]["rate_per_s"]
    ratios = {
        "user_to_bench_wall_without_pool": round(
            (cold["user_burst_1"]["wall_s"] + cold["user_burst_2"]["wall_s"])
            / (cold["bench_burst_1"]["wall_s"] + cold["bench_burst_2"]["wall_s"]), 2),
        "second_round_to_first_wall_without_pool": round(
            (cold["bench_burst_2"]["wall_s"] + cold["user_burst_2"]["wall_s"])
            / (cold["bench_burst_1"]["wall_s"] + cold["user_burst_1"]["wall_s"]), 2),
        "user_burst_rate_to_serial_rate_without_pool": round(cold["user_burst_1"]["rate_per_s"] / serial_rate, 2),
        "user_burst_rate_to_serial_rate_with_pool": round(warm["user_burst"]["rate_per_s"] / serial_rate, 2),
        "user_to_bench_wall_with_pool": round(warm["user_burst"]["wall_s"] / warm["bench_burst"]["wall_s"], 2),
        "pool_create_to_exec_to_cold_p50": round(warm["serial"]["p50_ms"] / cold["serial"]["p50_ms"], 3),
    }
    bursts = [cold[f"{form}_burst_{r}"] for form in ("bench", "user") for r in (1, 2)]
    bursts += [warm["bench_burst"], warm["user_burst"]]
    goals = {
        "burst_wall_with_pool": max(warm["bench_burst"]["wall_s"], warm["user_burst"]["wall_s"])
        <= GOALS["burst_wall_s"],
        "pool_create_to_exec_p50": warm["serial"]["p50_ms"] <= GOALS["pool_create_to_exec_p50_ms"],
    }
    readme = results.get("readme_server")
    if readme is not None:
        ratios["readme_second_to_first_burst_wall"] = round(
            readme["second_burst"]["wall_s"] / readme["first_burst"]["wall_s"], 2)
        ratios["readme_second_burst_rate_to_serial_rate"] = round(
            readme["second_burst"]["rate_per_s"] / serial_rate, 2)
        goals["readme_second_burst_wall"] = readme["second_burst"]["wall_s"] <= GOALS["readme_second_burst_wall_s"]
        bursts += [readme["first_burst"], readme["second_burst"]]
    goals["errors"] = sum(burst["errors"] for burst in bursts) == GOALS["errors"]
    results["ratios"], results["meets_goals"] = ratios, goals
    return results
