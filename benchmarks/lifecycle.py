"""`corral bench lifecycle`: snapshots, forks, pause to disk and a sandbox's ports, against a template create and
the same request made inside the sandbox, measured in the same run (docs/lifecycle.md).

Figures (median and p95; ratios to the baseline of the same run):
- baseline: create from the template (no warm pool) + first exec, as a caller sees it
- snapshot of a sandbox holding a "dependencies installed" tree (`files` small files and 16 MiB in one file):
  after a change (the layer is copied) and unchanged (its last layer is taken again)
- create from that snapshot + first exec, and the ratio to the baseline
- fork + first exec in the child; 10 forks one after the other against 10 creates from the template, and
  `fork(count=10)` (one freeze and copy, children started together) against 10 creates started together
- pause to disk (memory released) and resume from it (+ first exec); pause in memory and resume
- ports: an HTTP GET through `get_host` (server -> agent -> the port) against the same GET made inside the
  sandbox on loopback, through a real `corral serve`
- auto-resume: the first command on a paused `auto_resume` sandbox (in memory, to disk) against `resume()` and
  then the same command, alternated on one sandbox of a real `corral serve`
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from corral.backends.local import LocalBackend
from corral.engine import Engine, SandboxSession, SandboxSpec
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

_DEPS = """
mkdir -p ~/.local/lib/deps && cd ~/.local/lib/deps
python3 - <<'EOF'
import os
for i in range({files}):
    d = f"pkg{{i // 100}}"
    os.makedirs(d, exist_ok=True)
    with open(f"{{d}}/mod{{i}}.py", "w") as f:
        f.write("VALUE = %d\\n" % i * 20)
with open("blob.bin", "wb") as f:
    f.write(os.urandom(16 * 2**20))
EOF
"""


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}


def _ratio(a: dict[str, float], b: dict[str, float]) -> float:
    return round(a["p50_ms"] / b["p50_ms"], 2)


async def _ok(aw: Awaitable[Any]) -> None:
    result = await aw
    if getattr(result, "exit_code", 0) != 0:
        raise RuntimeError(f"benchmark step failed: {result!r}")


async def _each(n: int, what: str, progress: Progress, step: Callable[[], Awaitable[float]]) -> list[float]:
    out = []
    for i in range(n):
        out.append(await step())
        progress(what, i + 1, n)
    return out


async def _created_and_used(make: Callable[[], Awaitable[SandboxSession]]) -> tuple[float, SandboxSession]:
    t = time.perf_counter()
    sb = await make()
    await _ok(sb.exec(["true"]))
    return time.perf_counter() - t, sb


async def _engine_figures(engine: Engine, spec: SandboxSpec, n: int, files: int,
                          progress: Progress) -> dict[str, Any]:
    results: dict[str, Any] = {}

    async def template_create() -> float:
        took, sb = await _created_and_used(lambda: engine.create(spec))
        await sb.destroy()
        return took

    results["baseline_template_create_first_exec"] = summary(
        await _each(n, "create from the template", progress, template_create))

    parent = await engine.create(spec)
    try:
        await _ok(parent.exec(_DEPS.format(files=files)))
        artifacts = []

        async def snapshot() -> float:
            t = time.perf_counter()
            artifacts.append(await engine.snapshot(parent.id))
            return time.perf_counter() - t

        async def snapshot_changed() -> float:
            await _ok(parent.exec(["sh", "-c", "date +%s%N > /home/user/.local/lib/deps/stamp"]))
            return await snapshot()

        # A changed disk is copied (the whole layer: the tree above, not only the change); an unchanged one
        # takes its last layer again (docs/lifecycle.md, "Fork").
        results["snapshot_after_a_change"] = summary(await _each(n, "snapshot after a change", progress,
                                                                 snapshot_changed))
        results["snapshot_after_a_change"]["bytes"] = artifacts[-1].size_bytes
        results["snapshot_unchanged"] = summary(await _each(n, "snapshot, unchanged", progress, snapshot))
        source = artifacts[-1]

        async def from_snapshot() -> float:
            took, sb = await _created_and_used(lambda: engine.create(spec, source=source))
            await sb.destroy()
            return took

        results["create_from_snapshot_first_exec"] = summary(
            await _each(n, "create from the snapshot", progress, from_snapshot))
        for art in artifacts:
            await engine.delete_snapshot(art)

        async def fork() -> float:
            took, sb = await _created_and_used(lambda: engine.fork(parent.id))
            await sb.destroy()
            return took

        results["fork_first_exec"] = summary(await _each(n, "fork", progress, fork))
        results["ten_forks_vs_ten_creates"] = await _ten(engine, spec, parent, _DEPS.format(files=files), progress)

        for memory, label in ((False, "to_disk"), (True, "in_memory")):
            pauses, resumes = await _pause_cycles(engine, parent, memory, n, progress)
            results[f"pause_{label}"] = summary(pauses)
            results[f"resume_{'from_disk' if not memory else 'in_memory'}_first_exec"] = summary(resumes)
    finally:
        await parent.destroy()
    base = results["baseline_template_create_first_exec"]
    for key in ("create_from_snapshot_first_exec", "fork_first_exec", "resume_from_disk_first_exec"):
        results[key]["ratio_to_template_create"] = _ratio(results[key], base)
    return results


async def _pause_cycles(engine: Engine, sb: SandboxSession, memory: bool, n: int,
                        progress: Progress) -> tuple[list[float], list[float]]:
    """`n` pauses (in memory or to disk) each followed by a resume and a first exec: both timed."""
    pauses: list[float] = []
    resumes: list[float] = []
    for i in range(n):
        t = time.perf_counter()
        await engine.pause(sb.id, memory=memory)
        pauses.append(time.perf_counter() - t)
        resumes.append(await _resumed(engine, sb))
        progress(f"pause {'in memory' if memory else 'to disk'}, resume", i + 1, n)
    return pauses, resumes


async def _resumed(engine: Engine, sb: SandboxSession) -> float:
    t = time.perf_counter()
    await engine.resume(sb.id)
    await _ok(sb.exec(["true"]))
    return time.perf_counter() - t


async def _ten(engine: Engine, spec: SandboxSpec, parent: SandboxSession, setup: str,
               progress: Progress) -> dict[str, Any]:
    """10 forks of one sandbox, one after the other, against 10 creates from the template (both until the
    first exec in each), and against 10 creates that each run the parent's setup again (what forking saves);
    all destroyed after the clock stops."""
    made: list[SandboxSession] = []
    t = time.perf_counter()
    for i in range(10):
        made.append((await _created_and_used(lambda: engine.fork(parent.id)))[1])
        progress("10 forks", i + 1, 10)
    forks = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(10):
        made.append((await _created_and_used(lambda: engine.create(spec)))[1])
        progress("10 creates", i + 1, 10)
    creates = time.perf_counter() - t
    for sb in made:
        await sb.destroy()
    t = time.perf_counter()
    for i in range(10):
        sb = await engine.create(spec)
        await _ok(sb.exec(setup))
        made.append(sb)
        progress("10 creates + setup", i + 1, 10)
    with_setup = time.perf_counter() - t
    for sb in made[20:]:
        await sb.destroy()
    # One call for ten forks (`fork(count=10)`: one freeze and copy, the children started together), against
    # ten creates started together: the fair baseline for children that start at once.
    t = time.perf_counter()
    batch = await engine.fork_many(parent.id, [f"sb-{i:016x}" for i in range(10)])
    await asyncio.gather(*(_ok(sb.exec(["true"])) for sb in batch))
    batch_s = time.perf_counter() - t
    progress("fork(count=10)", 1, 1)
    t = time.perf_counter()
    together = await asyncio.gather(*(engine.create(spec) for _ in range(10)))
    await asyncio.gather(*(_ok(sb.exec(["true"])) for sb in together))
    together_s = time.perf_counter() - t
    progress("10 creates at once", 1, 1)
    for sb in [*batch, *together]:
        await sb.destroy()
    return {"forks_s": round(forks, 3), "creates_s": round(creates, 3), "ratio": round(forks / creates, 2),
            "creates_with_setup_s": round(with_setup, 3), "ratio_to_creates_with_setup": round(forks / with_setup, 2),
            "fork_count_10_s": round(batch_s, 3), "creates_at_once_s": round(together_s, 3),
            "fork_count_10_ratio_to_creates": round(batch_s / creates, 2),
            "fork_count_10_ratio_to_creates_at_once": round(batch_s / together_s, 2)}


def _port_figures(home: Path, template_home: Path, template: str, n: int, progress: Progress) -> dict[str, Any]:
    """An HTTP GET through the server's port forwarding against the same GET on loopback inside the sandbox."""
    import httpx

    from corral import Sandbox
    from corral.server import ServerProcess

    with ServerProcess(home / "server", template_home=template_home) as server, \
            Sandbox.create(template, api_key=server.admin_key, base_url=server.url) as sb:
        sb.commands.run("mkdir -p /workspace/www && echo hello > /workspace/www/index.html")
        sb.commands.run("cd /workspace/www && python3 -m http.server 8000 >/dev/null 2>&1 &")
        inside = sb.commands.run(_INSIDE.format(n=n), timeout=120)
        if inside.exit_code != 0:
            raise RuntimeError(f"the in-sandbox baseline failed: {inside.stderr}")
        baseline = [float(x) for x in inside.stdout.split()]
        host = sb.get_host(8000)
        samples: list[float] = []
        headers = {"Host": host, "Authorization": f"Bearer {server.admin_key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
            for attempt in range(50):  # the server in the sandbox may still be starting
                if client.get("/index.html").status_code == 200:
                    break
                time.sleep(0.1 * (attempt + 1))
            for i in range(n):
                t = time.perf_counter()
                r = client.get("/index.html")
                samples.append(time.perf_counter() - t)
                if r.text != "hello\n":
                    raise RuntimeError(f"port forwarding returned {r.status_code}: {r.text[:200]}")
                progress("GET through get_host", i + 1, n)
    through, local = summary(samples), summary(baseline)
    return {"baseline_inside_sandbox": local, "through_get_host": through,
            "overhead_p50_ms": round(through["p50_ms"] - local["p50_ms"], 2)}


def _auto_resume_figures(home: Path, template_home: Path, template: str, n: int,
                         progress: Progress) -> dict[str, Any]:
    """A command that wakes a paused sandbox, against an explicit `resume()` then the same command."""
    from corral import Sandbox
    from corral.server import ServerProcess

    results: dict[str, Any] = {}
    with ServerProcess(home / "server-auto", template_home=template_home) as server, \
            Sandbox.create(template, auto_resume=True, api_key=server.admin_key, base_url=server.url) as sb:
        for memory, label in ((True, "in_memory"), (False, "to_disk")):
            woken: list[float] = []
            explicit: list[float] = []
            for i in range(n):
                sb.pause(memory=memory)
                t = time.perf_counter()
                sb.resume()
                sb.commands.run("true")
                explicit.append(time.perf_counter() - t)
                sb.pause(memory=memory)
                t = time.perf_counter()
                if sb.commands.run("true").exit_code != 0:
                    raise RuntimeError("the command that woke the sandbox failed")
                woken.append(time.perf_counter() - t)
                progress(f"auto-resume {label.replace('_', ' ')}", i + 1, n)
            auto, baseline = summary(woken), summary(explicit)
            results[label] = {"resume_then_exec": baseline, "exec_that_wakes": auto,
                              "ratio_to_resume_then_exec": _ratio(auto, baseline)}
    return results


# Each GET on a new connection, as httpx above keeps one: both sides pay one request per sample, not a handshake.
_INSIDE = """python3 - <<'EOF'
import http.client, time
for attempt in range(50):
    try:
        c = http.client.HTTPConnection("127.0.0.1", 8000, timeout=5); c.request("GET", "/index.html")
        c.getresponse().read(); break
    except OSError:
        time.sleep(0.1 * (attempt + 1))
for _ in range({n}):
    t = time.perf_counter(); c.request("GET", "/index.html"); c.getresponse().read()
    print(time.perf_counter() - t)
EOF
"""


def run(*, home: Path, template_home: Path, template: str = "default", n: int = 20, files: int = 2000,
        ports: bool = True, progress: Progress) -> dict[str, Any]:
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o711)

    async def engine_part() -> dict[str, Any]:
        engine = Engine(home / "engine", backend=LocalBackend(home / "engine"), templates=TemplateStore(template_home))
        async with engine:
            return await _engine_figures(engine, SandboxSpec(template=template), n, files, progress)

    (home / "engine").mkdir(mode=0o711, exist_ok=True)
    results: dict[str, Any] = {"backend": "local", "runtime": "runc", "template": template,
                               "engine": asyncio.run(engine_part())}
    if ports:
        results["ports"] = _port_figures(home, template_home, template, n * 10, progress)
        results["auto_resume"] = _auto_resume_figures(home, template_home, template, n, progress)
    return results
