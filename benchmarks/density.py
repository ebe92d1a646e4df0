"""`corral bench density`: how many idle sandboxes one machine holds, and what create and exec cost at that density.

Idle sandboxes are created in steps (0, 100, 250, 500, 1000 by default; `max` and `step` change them) on the local
runc backend through the Engine in-process. At each step, with that many idle sandboxes running:

- create p50/p95 (`engine.create()` of one more sandbox, destroyed after each sample) and its ratio to step 0 of
  the same run (the goal: 1,000 idle sandboxes with create p50 <= 2x its value on an empty machine); beside it a
  fixed piece of pure-Python work timed the same way (`cpu_reference`), whose ratio to step 0 shows how much of a
  change is the shared machine's load rather than density;
- exec `true` p50/p95 on idle sandboxes picked across the whole population;
- memory: MemAvailable and Slab (and their change per sandbox since step 0), the agents' RSS and PSS (every process
  of every sandbox's cgroup), the sandboxes' cgroup memory (their parent cgroup's usage);
- the engine process's open file descriptors against its RLIMIT_NOFILE (with an egress proxy in the same process,
  as `corral serve` has; `egress=False` leaves it out); the host's loop devices in use and mount table size; pids
  (tasks on the host against pid_max); inotify instances and watches;
- the engine's per-sandbox bookkeeping: one pass over every sandbox of what each create's capacity check does
  (`usage()`, `backend.capacity()`), the usage figures of every sandbox (`sandbox_usage`, what telemetry
  reads), `backend.alive` of every sandbox and one `runc state`, and the event loop's lag (how late a 10 ms sleep
  wakes) while idle;
- at the last step, a restart: the engine closed (its sandboxes keep running) and a new one started on the same
  home, which reattaches every sandbox (`restart`).

It stops early, with the reason in the figures (`stopped`), when MemAvailable would fall under `min_available_gib`
(4 GiB by default) or a process or kernel limit is about to be hit (open files, pids). Every
sandbox it made is destroyed whatever happens (a failure, Ctrl-C), a few at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.backends.local import LocalBackend, LocalRecord
from corral.egress import EgressProxy
from corral.engine import Capacity, Engine, Limits, SandboxSession, SandboxSpec
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

GIB = 2**30
MIB = 2**20
CGROUP_PARENT = "corral-bench-density"
STEPS = (0, 100, 250, 500, 1000)
MARGIN = 0.9  # stop when a count reaches this fraction of its limit
DESTROY_AT_ONCE = 8


class Stop(Exception):
    """A limit is near: stop adding sandboxes (the reason is reported)."""


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}


def steps_to(maximum: int, step: int | None) -> list[int]:
    if step:
        return list(range(0, maximum + 1, step)) + ([maximum] if maximum % step else [])
    return [s for s in STEPS if s < maximum] + [maximum]


# -- what the host shows -----------------------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        out[name] = int(rest.split()[0]) * 1024
    return out


def _int(path: str) -> int:
    return int(Path(path).read_text().split()[0])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def host_tasks() -> int:
    """Threads on the host (what pid_max bounds): the `procs_running`-independent count from /proc/loadavg."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def loop_devices() -> dict[str, int]:
    nodes = [p for p in os.listdir("/dev") if p.startswith("loop") and p[4:].isdigit()]
    used = sum(1 for n in nodes if os.path.exists(f"/sys/block/{n}/loop/backing_file"))
    return {"in_use": used, "nodes": len(nodes)}


def mounts() -> int:
    with open("/proc/self/mountinfo", "rb") as f:
        return sum(1 for _ in f)


def inotify() -> dict[str, int]:
    """inotify instances and watches on the whole host, and root's instances (the per-user limit that matters to
    the engine; the sandboxes' processes run as their own host uids)."""
    instances = watches = root_instances = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                    continue
                text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
            except OSError:
                continue
            instances += 1
            root_instances += uid == 0
            watches += text.count("inotify wd:")
    return {"instances": instances, "watches": watches, "root_instances": root_instances,
            "max_user_instances": _int("/proc/sys/fs/inotify/max_user_instances"),
            "max_user_watches": _int("/proc/sys/fs/inotify/max_user_watches")}


def sandboxes_memory(records: list[LocalRecord]) -> dict[str, float]:
    """RSS and PSS of every process in the sandboxes' cgroups, and the cgroups' charged memory."""
    rss = pss = procs = 0
    for rec in records:
        for pid in _cgroup_pids(rec.cgroups_path):
            try:
                text = Path(f"/proc/{pid}/smaps_rollup").read_text()
            except OSError:
                continue
            procs += 1
            for line in text.splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
    n = max(1, len(records))
    charged = _parent_memory()
    return {"processes": procs, "rss_total_mib": round(rss / MIB, 1), "pss_total_mib": round(pss / MIB, 1),
            "rss_per_sandbox_mib": round(rss / n / MIB, 2), "pss_per_sandbox_mib": round(pss / n / MIB, 2),
            "cgroup_total_mib": round(charged / MIB, 1), "cgroup_per_sandbox_mib": round(charged / n / MIB, 2)}


def _cgroup_pids(cgroups_path: str) -> list[int]:
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        procs = base / cgroups_path.lstrip("/") / "cgroup.procs"
        with contextlib.suppress(OSError):
            return [int(x) for x in procs.read_text().split()]
    return []


def _parent_memory() -> int:
    for path in (f"/sys/fs/cgroup/memory/{CGROUP_PARENT}/memory.usage_in_bytes",
                 f"/sys/fs/cgroup/{CGROUP_PARENT}/memory.current"):
        with contextlib.suppress(OSError, ValueError):
            return _int(path)
    return 0


# -- limits: stop before any is hit ------------------------------------------------------------------------------


def check_room(min_available: int, per_sandbox: int) -> None:
    """Raise `Stop` if one more sandbox could take MemAvailable under `min_available`, or a count is at
    `MARGIN` of its limit."""
    available = meminfo()["MemAvailable"]
    if available - per_sandbox < min_available:
        raise Stop(f"MemAvailable is {available / GIB:.2f} GiB: one more sandbox (~{per_sandbox / MIB:.0f} MiB) "
                   f"would take it under {min_available / GIB:g} GiB")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if open_fds() > soft * MARGIN:
        raise Stop(f"the engine holds {open_fds()} open files of its RLIMIT_NOFILE soft limit {soft}")
    pid_max = min(_int("/proc/sys/kernel/pid_max"), _int("/proc/sys/kernel/threads-max"))
    if host_tasks() > pid_max * MARGIN:
        raise Stop(f"{host_tasks()} tasks on the host, near pid_max/threads-max {pid_max}")


# -- measurements at one density ---------------------------------------------------------------------------------


async def _creates(engine: Engine, spec: SandboxSpec, n: int, what: str,
                   progress: Progress) -> tuple[list[float], list[float]]:
    creates, destroys = [], []
    for i in range(n):
        t = time.perf_counter()
        sb = await engine.create(spec)
        creates.append(time.perf_counter() - t)
        t = time.perf_counter()
        await sb.destroy()
        destroys.append(time.perf_counter() - t)
        progress(what, i + 1, n)
    return creates, destroys


async def _execs(idle: list[SandboxSession], n: int, what: str, progress: Progress) -> list[float]:
    rng = random.Random(len(idle))
    samples = []
    for i in range(n):
        sb = rng.choice(idle)
        t = time.perf_counter()
        r = await sb.exec(["true"])
        samples.append(time.perf_counter() - t)
        if r.exit_code != 0:
            raise RuntimeError(f"exec true failed in {sb.id}: {r}")
        progress(what, i + 1, n)
    return samples


def cpu_reference(n: int = 7) -> dict[str, float]:
    """A fixed piece of pure-Python work (no I/O, no kernel objects), timed like the creates: how busy the shared
    machine is at this step. Its ratio to step 0 tells a density effect from a noisy neighbour."""
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        samples.append(time.perf_counter() - t)
    return summary(samples)


async def loop_lag(seconds: float = 1.0, period: float = 0.01) -> dict[str, float]:
    """How late a `period` sleep wakes, over `seconds`: the engine's background work shows up here."""
    lags = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - t - period)
    return summary(lags)


async def bookkeeping(engine: Engine, backend: LocalBackend) -> dict[str, Any]:
    """The cost of the engine's per-sandbox work once over every sandbox (what a tick or a create pays)."""
    out: dict[str, Any] = {}
    t = time.perf_counter()
    engine.usage()
    out["scan_ms"] = round((time.perf_counter() - t) * 1000, 3)
    t = time.perf_counter()
    await backend.capacity()
    out["capacity_ms"] = round((time.perf_counter() - t) * 1000, 3)
    t = time.perf_counter()
    for sid in list(engine.runtime.sandboxes):
        await engine.sandbox_usage(sid)
    out["usage_all_ms"] = round((time.perf_counter() - t) * 1000, 2)
    t = time.perf_counter()
    await asyncio.to_thread(mounts)
    out["read_mount_table_ms"] = round((time.perf_counter() - t) * 1000, 2)
    records = [sb.record for sb in engine.runtime.sandboxes.values()]
    if records:  # what an engine's restart asks of each sandbox, and what `runc state` costs at this density
        t = time.perf_counter()
        for record in records:
            await backend.alive(record)
        out["alive_all_ms"] = round((time.perf_counter() - t) * 1000, 2)
        runc = backend.runtimes[records[0].runtime]  # type: ignore[attr-defined]
        samples = []
        for _ in range(3):
            t = time.perf_counter()
            await runc.state(records[0].sandbox_id)
            samples.append(time.perf_counter() - t)
        out["runc_state_ms"] = round(statistics.median(samples) * 1000, 2)
    out["loop_lag"] = await loop_lag()
    return out


async def measure(engine: Engine, backend: LocalBackend, spec: SandboxSpec, idle: list[SandboxSession],
                  samples: int, base: dict[str, int], progress: Progress) -> dict[str, Any]:
    n = len(idle)
    await asyncio.sleep(1.0)  # the last creates settle (agents finish starting)
    mem = meminfo()
    records = [r for r in (engine.runtime.sandboxes[sb.id].record for sb in idle) if isinstance(r, LocalRecord)]
    out: dict[str, Any] = {"sandboxes": n}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out["memory"] = {
        "mem_available_gib": round(mem["MemAvailable"] / GIB, 2),
        "mem_free_gib": round(mem["MemFree"] / GIB, 2),
        "slab_mib": round(mem["Slab"] / MIB, 1),
        **({"available_drop_per_sandbox_mib": round((base["available"] - mem["MemAvailable"]) / n / MIB, 2),
            "slab_growth_per_sandbox_kib": round((mem["Slab"] - base["slab"]) / n / 1024, 1)} if n else {}),
        **await asyncio.to_thread(sandboxes_memory, records),
    }
    out["engine_fds"] = {"open": open_fds(), "soft_limit": soft, "hard_limit": hard,
                         **({"per_sandbox": round((open_fds() - base["fds"]) / n, 2)} if n else {})}
    out["host"] = {"loop_devices": loop_devices(), "mounts": mounts(), "tasks": host_tasks(),
                   "pid_max": _int("/proc/sys/kernel/pid_max"), "inotify": await asyncio.to_thread(inotify)}
    out["bookkeeping"] = await bookkeeping(engine, backend)
    out["cpu_reference"] = cpu_reference()
    creates, destroys = await _creates(engine, spec, samples, f"{n} idle: create", progress)
    out["create"] = summary(creates)
    out["destroy"] = summary(destroys)
    if idle:
        out["exec_true"] = summary(await _execs(idle, samples * 3, f"{n} idle: exec true", progress))
    return out


# -- the run -------------------------------------------------------------------------------------------------


async def run(*, home: Path, template_home: Path, template: str = "default", max_sandboxes: int = 1000,
              step: int | None = None, samples: int = 10, memory: str = "64M", min_available_gib: float = 4.0,
              egress: bool = True, progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    store = TemplateStore(template_home)
    # Idle, all of them, for the whole run: a day of timeout.
    spec = SandboxSpec(template=template, limits=Limits.model_validate({"memory": memory}), timeout=24 * 3600)
    min_available = int(min_available_gib * GIB)
    steps = steps_to(max_sandboxes, step)
    results: dict[str, Any] = {"template": template, "memory_limit": memory, "samples": samples, "steps": steps,
                               "egress_proxy": egress,
                               "min_available_gib": min_available_gib, "cpus": os.cpu_count(),
                               "mem_total_gib": round(meminfo()["MemTotal"] / GIB, 1),
                               "rlimit_nofile_before": list(resource.getrlimit(resource.RLIMIT_NOFILE))}
    backend = LocalBackend(home, cgroup_parent=CGROUP_PARENT)
    results["rlimit_nofile"] = list(resource.getrlimit(resource.RLIMIT_NOFILE))
    # Memory limits of 1,000 sandboxes may add up past 4x this machine: this benchmark is about what idle sandboxes
    # really take, so promises are not what stops it (MemAvailable is).
    # As `corral serve` runs it: with an egress proxy, which listens on a socket per sandbox.
    proxy = EgressProxy() if egress else None
    if proxy is not None:
        await proxy.start()
    engine = Engine(home, backend=backend, templates=store, capacity=Capacity(memory_overcommit=1000.0),
                    egress=proxy)
    await engine.start()  # no pools: every sandbox counted is the bench's
    idle: list[SandboxSession] = []
    at: list[dict[str, Any]] = []
    results["at"] = at
    try:
        for _ in range(3):  # the golden disk image and the agent's files, made once; then the steady state
            warm = await engine.create(spec)
            await warm.destroy()
        mem = meminfo()
        base = {"available": mem["MemAvailable"], "slab": mem["Slab"], "fds": open_fds()}
        per_sandbox = 64 * MIB  # a guess until the first step measures it
        for target in steps:
            try:
                while len(idle) < target:
                    check_room(min_available, per_sandbox)
                    idle.append(await engine.create(spec))
                    progress(f"idle sandboxes (to {max_sandboxes})", len(idle), max_sandboxes)
            except Stop as exc:
                results["stopped"] = f"stopped at {len(idle)} idle sandboxes: {exc}"
            figures = await measure(engine, backend, spec, idle, samples, base, progress)
            at.append(figures)
            if idle:
                per_sandbox = max(per_sandbox, int(figures["memory"]["available_drop_per_sandbox_mib"] * MIB * 1.5))
            if "stopped" in results:
                break
        if idle:
            engine, idle, results["restart"] = await _restart(engine, idle, lambda: Engine(
                home, backend=LocalBackend(home, cgroup_parent=CGROUP_PARENT), templates=store,
                capacity=Capacity(memory_overcommit=1000.0), egress=proxy))
        base_p50, base_cpu = at[0]["create"]["p50_ms"], at[0]["cpu_reference"]["p50_ms"]
        for figures in at:
            figures["create"]["ratio_to_empty_p50"] = round(figures["create"]["p50_ms"] / base_p50, 2)
            figures["cpu_reference"]["ratio_to_empty_p50"] = round(figures["cpu_reference"]["p50_ms"] / base_cpu, 2)
        reached = at[-1]
        results["goal"] = {"idle_sandboxes": reached["sandboxes"], "wanted": 1000,
                           "create_ratio": reached["create"]["ratio_to_empty_p50"], "wanted_ratio": 2.0,
                           "met": reached["sandboxes"] >= 1000 and reached["create"]["ratio_to_empty_p50"] <= 2.0}
    finally:
        t = time.perf_counter()
        results["cleanup"] = await asyncio.shield(_destroy_all(engine, idle, progress))
        results["cleanup"]["seconds"] = round(time.perf_counter() - t, 1)
        if proxy is not None:
            await proxy.close()
    return results


async def _restart(engine: Engine, idle: list[SandboxSession],
                   make: Callable[[], Engine]) -> tuple[Engine, list[SandboxSession], dict[str, Any]]:
    """Close the engine (its sandboxes keep running) and start a new one on the same home, which reattaches them
    all: what a server's restart costs at this density. The old engine still holds them if the new one fails."""
    t = time.perf_counter()
    await engine.close()
    new = make()
    await new.start()
    seconds = time.perf_counter() - t
    reattached = {info.id for info in new.list()}
    figures = {"sandboxes": len(idle), "reattached": len(reattached & {sb.id for sb in idle}),
               "seconds": round(seconds, 2), "per_sandbox_ms": round(seconds / len(idle) * 1000, 2)}
    return new, [new.get(sb.id) for sb in idle if sb.id in reattached], figures


async def _destroy_all(engine: Engine, idle: list[SandboxSession], progress: Progress) -> dict[str, Any]:
    """Destroy every sandbox made here, a few at a time (1,000 at once would start 2,000 runc processes), then
    close the engine (which destroys any it still holds)."""
    total, done, errors = len(idle), 0, []
    sem = asyncio.Semaphore(DESTROY_AT_ONCE)

    async def one(sb: SandboxSession) -> None:
        nonlocal done
        async with sem:
            try:
                await sb.destroy()
            except Exception as exc:  # reported; engine.close tries again
                errors.append(repr(exc))
            done += 1
            progress("destroying", done, total)

    await asyncio.gather(*(one(sb) for sb in idle), return_exceptions=True)
    await engine.close(destroy_all=True)
    return {"destroyed": done, "errors": len(errors), "error_samples": errors[:3]}
