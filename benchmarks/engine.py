"""`corral bench engine`: the sandbox engine against bare `runc run`, measured in the same run.

Figures (median and p95, and the ratio to the baseline):
- baseline: `runc run` of `/bin/true` in a minimal bundle on the same template (create + start + wait + delete)
- create-to-first-exec: `engine.create()` then `exec(["true"])`, as a caller sees it
- create from the warm pool
- exec round trip of `true` (argv, and `bash -lc true`)
- destroy
- idle overhead: the agent's RSS and the sandbox cgroup's memory use
- N sandboxes created at once, each running a short Python task: errors and wall time

With `docker=True` (`corral bench engine --docker`), a `docker` section beside those figures: the Docker backend
(`corral[docker]` and a running dockerd) against bare `docker run --rm <image> true` on the template's image,
measured in the same run: create-to-first-exec, exec round trips, destroy and idle memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from corral.backends.local import LocalBackend, LocalRecord
from corral.engine import Engine, SandboxSession, SandboxSpec
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}



async def _lifecycle(engine: Engine, spec: SandboxSpec, n: int, progress: Progress, label: str,
                     results: dict[str, Any]) -> SandboxSession:
    """Create + first exec and destroy `n` times, then exec round trips on one sandbox, which is returned (the
    caller measures more on it and destroys it). The same loop for every backend, so their figures compare."""
    create_exec, destroy = [], []
    for i in range(n):
        t = time.perf_counter()
        sb = await engine.create(spec)
        await sb.exec(["true"])
        create_exec.append(time.perf_counter() - t)
        t = time.perf_counter()
        await sb.destroy()
        destroy.append(time.perf_counter() - t)
        progress(f"{label}create + first exec", i + 1, n)
    results["create_to_first_exec"] = summary(create_exec)
    results["destroy"] = summary(destroy)
    sb = await engine.create(spec)
    await sb.exec(["true"])
    results["exec_true_argv"] = summary(await _timed(n * 5, lambda: _ok(sb.exec(["true"])),
                                                     f"{label}exec true", progress))
    results["exec_true_shell"] = summary(await _timed(n * 2, lambda: _ok(sb.exec("true")),
                                                      f"{label}exec bash -lc true", progress))
    return sb

async def _timed(n: int, fn: Callable[[], Awaitable[None]], what: str, progress: Progress) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
        progress(what, i + 1, n)
    return out


def bare_runc(rootfs: Path, n: int, progress: Progress) -> list[float]:
    """The floor: the OCI runtime alone, no Corral, on the same root filesystem."""
    work = Path(tempfile.mkdtemp(prefix="corral-bench-runc-"))
    state = work / "state"
    subprocess.run(["runc", "spec", "--bundle", str(work)], check=True)
    config = json.loads((work / "config.json").read_text())
    config["root"] = {"path": str(rootfs), "readonly": True}
    config["process"]["args"] = ["/bin/true"]
    config["process"]["terminal"] = False
    (work / "config.json").write_text(json.dumps(config))
    samples = []
    try:
        for i in range(n):
            cid = f"corral-bench-{os.getpid()}-{i}"
            t = time.perf_counter()
            subprocess.run(["runc", "--root", str(state), "run", "--bundle", str(work), cid], check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            samples.append(time.perf_counter() - t)
            subprocess.run(["runc", "--root", str(state), "delete", "--force", cid], capture_output=True)
            progress("bare runc run /bin/true", i + 1, n)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return samples


async def run(*, home: Path, template_home: Path, template: str = "default", n: int = 30,
              concurrent: int = 50, pool: int = 4, docker: bool = False,
              progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    store = TemplateStore(template_home)
    tpl = store.get(template)
    spec = SandboxSpec(template=template)
    results: dict[str, Any] = {"template": template, "n": n, "cpus": os.cpu_count()}

    base = bare_runc(tpl.rootfs, n, progress)
    results["bare_runc_run_true"] = summary(base)

    backend = LocalBackend(home, cgroup_parent="corral-bench")
    engine = Engine(home, backend=backend, templates=store)
    await engine.start()
    try:
        # Warm the golden disk image once, so every sample measures the steady state.
        warm = await engine.create(spec)
        await warm.destroy()

        sb = await _lifecycle(engine, spec, n, progress, "", results)
        results["idle"] = await _idle(engine, sb.id)
        await sb.destroy()

        results["concurrent"] = await _concurrent(engine, spec, concurrent, progress)
    finally:
        await engine.close(destroy_all=True)

    results["pool"] = await _pool(home, store, spec, pool, n, progress)
    bare_p50 = results["bare_runc_run_true"]["p50_ms"]
    for key in ("create_to_first_exec", "destroy"):
        results[key]["ratio_to_bare_runc_p50"] = round(results[key]["p50_ms"] / bare_p50, 2)
    results["pool"]["create"]["ratio_to_bare_runc_p50"] = round(results["pool"]["create"]["p50_ms"] / bare_p50, 3)
    if docker:
        results["docker"] = await docker_section(home, store, spec, n, progress)
        for key in ("create_to_first_exec", "exec_true_argv"):
            results["docker"][key]["ratio_to_local_p50"] = round(
                results["docker"][key]["p50_ms"] / results[key]["p50_ms"], 2)
    return results


async def _ok(coro: Awaitable[Any]) -> None:
    r = await coro
    if r.exit_code != 0:
        raise RuntimeError(f"benchmark command failed: {r}")


async def _idle(engine: Engine, sandbox_id: str) -> dict[str, float]:
    await asyncio.sleep(1.0)
    record, backend = engine.runtime.sandboxes[sandbox_id].record, engine.backend
    if not isinstance(backend, LocalBackend) or not isinstance(record, LocalRecord):
        return {}  # the figures below are read from the local backend's host processes and cgroups
    pid = int((record.dir / "pid").read_text())
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    usage = await backend.memory_usage(record)
    return {"agent_rss_mib": round(rss_kib / 1024, 1), "cgroup_memory_mib": round(usage / 2**20, 1)}


async def _concurrent(engine: Engine, spec: SandboxSpec, count: int, progress: Progress) -> dict[str, Any]:
    done = 0

    async def one() -> float:
        nonlocal done
        t = time.perf_counter()
        sb = await engine.create(spec)
        try:
            r = await sb.exec(["python3", "-c", "print(sum(range(10**6)))"], timeout=120)
            if r.stdout.strip() != str(sum(range(10**6))):
                raise RuntimeError(f"wrong output: {r.stdout!r} {r.stderr!r}")
            return time.perf_counter() - t
        finally:
            await sb.destroy()
            done += 1
            progress(f"{count} concurrent sandboxes", done, count)

    t = time.perf_counter()
    outcomes = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
    wall = time.perf_counter() - t
    errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
    ok = [o for o in outcomes if isinstance(o, float)]
    return {"sandboxes": count, "errors": len(errors), "error_samples": errors[:3], "wall_s": round(wall, 2),
            "per_sandbox": summary(ok) if ok else {}}


async def _pool(home: Path, store: TemplateStore, spec: SandboxSpec, size: int, n: int,
                progress: Progress) -> dict[str, Any]:
    backend = LocalBackend(home, cgroup_parent="corral-bench")
    engine = Engine(home, backend=backend, templates=store, pool_size=size, pool_spec=spec)
    await engine.start()
    samples = []
    try:
        for i in range(n):
            deadline = time.monotonic() + 60
            while engine.pool_ready < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            t = time.perf_counter()
            sb = await engine.create(spec)
            samples.append(time.perf_counter() - t)
            await sb.destroy()
            progress("create from warm pool", i + 1, n)
    finally:
        await engine.close(destroy_all=True)
    return {"size": size, "create": summary(samples)}


# -- the Docker backend ------------------------------------------------------------------------------------------


def bare_docker(image: str, n: int, progress: Progress) -> list[float]:
    """The Docker floor: `docker run --rm <image> true` (the CLI and daemon alone, no Corral), same image."""
    samples = []
    for i in range(n):
        t = time.perf_counter()
        subprocess.run(["docker", "run", "--rm", image, "true"], check=True, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL)
        samples.append(time.perf_counter() - t)
        progress("bare docker run --rm true", i + 1, n)
    return samples


async def docker_section(home: Path, store: TemplateStore, spec: SandboxSpec, n: int,
                         progress: Progress) -> dict[str, Any]:
    # Imported only here: the Docker SDK is an optional dependency (corral[docker]), needed only with --docker.
    from corral.backends.docker import DockerBackend, DockerRecord

    backend = DockerBackend(home)
    tpl = store.get(spec.template)
    t = time.perf_counter()
    image = await backend.images.ensure(tpl)  # imported once per template digest, then cached by the daemon
    results: dict[str, Any] = {"image": image, "image_ready_s": round(time.perf_counter() - t, 2)}
    results["bare_docker_run_true"] = summary(bare_docker(image, n, progress))

    engine = Engine(home, backend=backend, templates=store)
    await engine.start()
    try:
        warm = await engine.create(spec)  # the golden disk image and the agent's files, made once
        await warm.destroy()
        sb = await _lifecycle(engine, spec, n, progress, "docker: ", results)
        await asyncio.sleep(1.0)
        record = engine.runtime.sandboxes[sb.id].record
        assert isinstance(record, DockerRecord)
        found = await backend.api.inspect(record.name) or {}
        results["idle"] = {"agent_rss_mib": round(_rss_kib(int(found["State"]["Pid"])) / 1024, 1),
                           "cgroup_memory_mib": round(await backend.memory_usage(record) / 2**20, 1)}
        await sb.destroy()
    finally:
        await engine.close(destroy_all=True)
    bare_p50 = results["bare_docker_run_true"]["p50_ms"]
    for key in ("create_to_first_exec", "destroy"):
        results[key]["ratio_to_bare_docker_p50"] = round(results[key]["p50_ms"] / bare_p50, 2)
    return results


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0
