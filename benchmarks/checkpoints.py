"""`corral bench checkpoints`: checkpoints, in-place restore and `changes` (issue 26, docs/lifecycle.md), against
a same-run `cp -a` of the changed files inside the sandbox; and what automatic checkpoints cost the eval corpus.

Figures (median and p95; goals from the issue):
- checkpoint of an unchanged sandbox (goal <= 10 ms), through the engine (the backend's own cost)
- checkpoint after a change of `files` files, `size_mib` MiB in all (default 1,000 files, 100 MiB: goal <= 300 ms),
  against `cp -a` of those files inside the sandbox, timed there, in the same round
- restore to the checkpoint before the change, the sandbox running (stopped, files put back, booted: <= 300 ms)
- `changes` between the two (<= 100 ms)
- the eval corpus (a seeded sample, the `undo` category left out) on one real `corral serve`, with
  `checkpoints="auto"` and without, alternating halves in the same run (goal: at most 10% more wall time)
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.backends.local import LocalBackend
from corral.engine import Engine, SandboxSession, SandboxSpec
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

GOALS_MS = {"checkpoint_unchanged": 10.0, "checkpoint_after_change": 300.0, "restore_after_change": 300.0,
            "changes_after_change": 100.0}
GOAL_AUTO_OVERHEAD = 0.10

_CHANGE = """python3 - <<'EOF'
import os
os.makedirs("/workspace/change", exist_ok=True)
size = {size} // {files}
for i in range({files}):
    with open("/workspace/change/f%d.bin" % i, "wb") as f:
        f.write(os.urandom(size))
EOF"""
_CP = ("t=$(date +%s%N); cp -a /workspace/change /workspace/copy; e=$(date +%s%N); "
       "rm -rf /workspace/copy; echo $(( (e - t) / 1000 ))")


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}


def _cid() -> str:
    return f"ckpt-{secrets.token_hex(8)}"


async def _ok(sb: SandboxSession, cmd: str) -> str:
    r = await sb.exec(cmd, timeout=600)
    if r.exit_code != 0:
        raise RuntimeError(f"benchmark step failed ({cmd[:80]}): {r.stderr_bytes[-500:]!r}")
    return r.stdout_bytes.decode()


async def _engine_figures(engine: Engine, spec: SandboxSpec, n: int, files: int, size_mib: int,
                          progress: Progress) -> dict[str, Any]:
    sb = await engine.create(spec)
    try:
        kept = [await engine.checkpoint(sb.id, _cid())]
        unchanged = []
        for i in range(n):
            t = time.perf_counter()
            kept.append(await engine.checkpoint(sb.id, _cid()))
            unchanged.append(time.perf_counter() - t)
            progress("checkpoint, unchanged", i + 1, n)
        after, restores, changes, copies, sizes, counts = [], [], [], [], [], []
        for i in range(n):
            before = await engine.checkpoint(sb.id, _cid())
            await _ok(sb, _CHANGE.format(files=files, size=size_mib << 20))
            t = time.perf_counter()
            changed = await engine.checkpoint(sb.id, _cid())
            after.append(time.perf_counter() - t)
            sizes.append(changed.size_bytes)
            t = time.perf_counter()
            found = await engine.checkpoint_changes(sb.id, before, changed)
            changes.append(time.perf_counter() - t)
            counts.append(len(found))
            copies.append(int((await _ok(sb, _CP)).split()[-1]) / 1e6)
            t = time.perf_counter()
            await engine.restore_checkpoint(sb.id, before)
            restores.append(time.perf_counter() - t)
            await _ok(sb, "test ! -e /workspace/change")  # the change is gone: the restore did its work
            for art in (changed, before):
                await engine.delete_checkpoint(sb.id, art)
            progress(f"{files} files, {size_mib} MiB: checkpoint, changes, cp -a, restore", i + 1, n)
        for art in kept:
            await engine.delete_checkpoint(sb.id, art)
    finally:
        await sb.destroy()
    results: dict[str, Any] = {
        "checkpoint_unchanged": summary(unchanged),
        "checkpoint_after_change": summary(after) | {"bytes": max(sizes)},
        "baseline_cp_a_of_the_change": summary(copies),
        "restore_after_change": summary(restores),
        "changes_after_change": summary(changes) | {"paths": max(counts)},
    }
    base = results["baseline_cp_a_of_the_change"]["p50_ms"]
    for key in ("checkpoint_after_change", "restore_after_change"):
        results[key]["ratio_to_cp_a"] = round(results[key]["p50_ms"] / base, 2) if base else None
    for key, goal in GOALS_MS.items():
        results[key]["goal_ms"] = goal
        results[key]["met"] = results[key]["p50_ms"] <= goal
    return results


def _auto_cost(home: Path, template_home: Path, sample: int, seed: int, concurrency: int,
               progress: Progress) -> dict[str, Any]:
    """The corpus sample without and with `checkpoints="auto"`, in alternating halves on one server, so that
    whatever else the machine does weighs on both alike."""
    from corral.eval import load_corpus, select
    from corral.eval._deployment import local_capabilities, run_on_corral
    from corral.server import ServerProcess

    tasks = [t for t in select(load_corpus(), sample=sample, seed=seed) if t.category != "undo"]
    auto = [dataclasses.replace(t, setup=dataclasses.replace(t.setup, checkpoints="auto")) for t in tasks]
    half = (len(tasks) + 1) // 2
    walls = {"manual": 0.0, "auto": 0.0}
    passed = {"manual": 0, "auto": 0}
    done = 0
    with ServerProcess(home / "server", template_home=template_home) as server:
        for part in (slice(0, half), slice(half, None)):
            for mode, chosen in (("manual", tasks[part]), ("auto", auto[part])):
                def tick(_: Any) -> None:
                    nonlocal done
                    done += 1
                    progress("corpus sample, without and with automatic checkpoints", done, 2 * len(tasks))

                run = asyncio.run(run_on_corral(chosen, base_url=server.url, admin_key=server.admin_key,
                                                concurrency=concurrency, capabilities=local_capabilities(),
                                                progress=tick))
                walls[mode] += float(run.end["wall_seconds"]) if run.end else 0.0
                passed[mode] += run.counts().get("pass", 0)
    overhead = walls["auto"] / walls["manual"] - 1 if walls["manual"] else None
    return {"tasks": len(tasks), "concurrency": concurrency, "wall_s_without": round(walls["manual"], 2),
            "wall_s_with_auto": round(walls["auto"], 2), "passed_without": passed["manual"],
            "passed_with_auto": passed["auto"],
            "overhead": round(overhead, 3) if overhead is not None else None, "goal": GOAL_AUTO_OVERHEAD,
            "met": overhead is not None and overhead <= GOAL_AUTO_OVERHEAD}


def run(*, home: Path, template_home: Path, progress: Progress, template: str = "default", n: int = 20,
        files: int = 1000, size_mib: int = 100, sample: int = 150, seed: int = 20261130,
        concurrency: int = 20) -> dict[str, Any]:
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o711)
    (home / "engine").mkdir(mode=0o711, exist_ok=True)
    spec = SandboxSpec(template=template, limits={"disk": f"{max(2, 4 * size_mib // 1024 + 2)}G"})

    async def engine_part() -> dict[str, Any]:
        engine = Engine(home / "engine", backend=LocalBackend(home / "engine"), templates=TemplateStore(template_home))
        async with engine:
            return await _engine_figures(engine, spec, n, files, size_mib, progress)

    results: dict[str, Any] = {"backend": "local", "runtime": "runc", "template": template, "files": files,
                               "size_mib": size_mib, "engine": asyncio.run(engine_part())}
    if sample:
        results["auto_on_the_eval_corpus"] = _auto_cost(home, template_home, sample, seed, concurrency, progress)
    return results
