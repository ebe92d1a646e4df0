"""`corral bench api`: the HTTP API (a real `corral serve` subprocess, the SDK over a loopback socket), compared
with the engine in-process in the same run so the API's own overhead is visible.

Figures:
- exec round trip of `true` (argv), the three layers interleaved sample by sample so that the machine's noise hits
  them alike: through the API (the SDK's `commands.run`), through the engine in-process (`SandboxSession.exec`), and
  on the agent's socket (a blocking client sending the engine's exec request: the agent's own cost, the floor);
  p50 and p95 of each and the ratios of their p50s, and the server's CPU time per exec (`exec_true`; `--exec-only`
  runs just this)
- one agent-like step (write a file, run a command that reads it, read its output): API and engine
- 100 MiB uploads and downloads through the SDK into a fresh sandbox (`disk="2G"`): p50 and p95 MB/s over several
  rounds, byte-for-byte checked; uploads over an existing file; the server's RSS growth (VmRSS before each
  transfer, and its peak sampled during it); and the ratio to a host-only baseline of the same run (`cp` of the
  same file into the sandbox's directory on the host, a write + fsync, and reading it back into bytes)
- 100 MiB uploads in every input form `files.write` takes (bytes, bytearray, memoryview, str, an open file, a
  BytesIO, a generator of 1 MiB chunks), sync and async SDK, rounds interleaved form by form: p50/p95 MB/s of
  each and its ratio to the open-file form of the same run (the form that was always streamed in chunks)
- N concurrent clients (threads, sync SDK), each driving its own sandbox through an S-step agent-like loop:
  errors, throughput (steps/s) and p95 per step
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from corral import Admin, AsyncSandbox, Sandbox
from corral.agent import protocol
from corral.backends import UnixEndpoint
from corral.backends.local import LocalBackend
from corral.engine import Engine, SandboxSession, SandboxSpec
from corral.server import ServerProcess
from corral.templates import TemplateStore

Progress = Callable[[str, int, int], None]  # (what, done, total)

MIB = 2**20
TARGETS = {"exec_p50_ms": 3, "transfer_mb_s": 300, "server_rss_growth_mib": 50, "concurrent_errors": 0}


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


# -- exec `true`: agent socket, engine, API, interleaved -------------------------------------------------------


def _agent_exec_true(path: str, request: bytes) -> None:
    """One exec on the agent's socket with a plain blocking client: the request the engine sends, frames read up
    to the exit event."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(request)
        with sock.makefile("rb") as f:
            while True:
                kind, length = protocol.parse_header(f.read(protocol.HEADER.size))
                payload = f.read(length)
                if kind == protocol.ERROR:
                    raise RuntimeError(f"agent error: {payload!r}")
                if kind == protocol.EVENT and protocol.decode_json(payload).get("event") == "exit":
                    if protocol.decode_json(payload).get("exit_code") != 0:
                        raise RuntimeError(f"benchmark command failed: {payload!r}")
                    return


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user + system, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _exec_true(loop: asyncio.AbstractEventLoop, engine: Engine, handle: SandboxSession, api_sb: Sandbox,
               server_pid: int, n: int, progress: Progress) -> dict[str, Any]:
    """`true` through the three layers, one sample of each in turn (same sandbox for the engine and the socket;
    the API's sandbox is the server's). The engine lives in `loop`, run only while it serves a sample. Also the
    server's CPU time per exec (it serves only these requests meanwhile): less sensitive to a busy machine than
    the wall-clock figures, which include waiting for a CPU."""
    agent = engine.agent(handle.id)
    if not isinstance(agent.endpoint, UnixEndpoint):
        raise RuntimeError("the agent socket baseline needs a local (Unix socket) agent")
    fields = {"op": "exec", "token": agent.token, "cmd": ["true"], "cwd": None, "env": engine.sandbox_env(handle.id),
              "timeout": None, "max_output": None, "stdin": False, "heartbeat": agent.liveness.heartbeat_interval}
    request = protocol.encode_json(protocol.REQUEST, fields)
    samples: dict[str, list[float]] = {"api": [], "engine": [], "agent_socket": []}
    for _ in range(5):  # warm: connections, caches, the agent's first fork
        _check(api_sb.commands.run(["true"]))
        _check(loop.run_until_complete(handle.exec(["true"])))
        _agent_exec_true(agent.endpoint.path, request)
    server_cpu = cpu_seconds(server_pid)
    for i in range(n):
        t = time.perf_counter()
        _check(api_sb.commands.run(["true"]))
        samples["api"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _check(loop.run_until_complete(handle.exec(["true"])))
        samples["engine"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _agent_exec_true(agent.endpoint.path, request)
        samples["agent_socket"].append(time.perf_counter() - t)
        progress("exec true: api, engine, agent socket", i + 1, n)
    server_cpu = cpu_seconds(server_pid) - server_cpu
    out: dict[str, Any] = {name: summary(values) for name, values in samples.items()}
    out["api_server_cpu_ms_per_exec"] = round(server_cpu * 1000 / n, 3)
    api, eng, sock = (out[k]["p50_ms"] for k in ("api", "engine", "agent_socket"))
    out["ratio_p50"] = {"api_to_engine": round(api / eng, 2), "api_to_agent_socket": round(api / sock, 2),
                        "engine_to_agent_socket": round(eng / sock, 2)}
    out["api_overhead_p50_ms"] = round(api - eng, 2)
    return out


async def _engine_sandbox(home: Path, store: TemplateStore, spec: SandboxSpec) -> tuple[Engine, SandboxSession]:
    engine = Engine(home, backend=LocalBackend(home, cgroup_parent="corral-bench"), templates=store)
    await engine.start()
    try:
        return engine, await engine.create(spec)
    except BaseException:
        await engine.close(destroy_all=True)
        raise


def _exec_figures(home: Path, store: TemplateStore, spec: SandboxSpec, server: ServerProcess, key: str,
                  template: str, n: int, progress: Progress) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    try:
        engine, handle = loop.run_until_complete(_engine_sandbox(home / "engine-exec", store, spec))
        try:
            sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=server.url)
            try:
                return _exec_true(loop, engine, handle, sb, server.pid, n, progress)
            finally:
                sb.kill()
        finally:
            loop.run_until_complete(engine.close(destroy_all=True))
    finally:
        loop.close()


# -- the API ---------------------------------------------------------------------------------------------------


def _mb_s(size: int, seconds: list[float]) -> dict[str, float]:
    """Throughput figures of transfers of `size` bytes: p50 is the median time, p95 the slow end."""
    secs = sorted(seconds)
    slow = secs[min(len(secs) - 1, round(0.95 * (len(secs) - 1)))]
    return {"n": len(secs), "p50_mb_s": round(size / statistics.median(secs) / 1e6, 1),
            "p95_mb_s": round(size / slow / 1e6, 1), "best_mb_s": round(size / secs[0] / 1e6, 1)}


def _host_dir(server: ServerProcess, sb: Sandbox, work: Path) -> Path:
    """The sandbox's directory on the host (where its disk image lives), else the work directory: same disk."""
    found = sorted(server.home.glob(f"**/sandboxes/{sb.id}"))
    return found[0] if found else work


def _baseline(src: Path, where: Path, rounds: int) -> dict[str, Any]:
    """The same bytes moved by the host alone, in the same run, into the sandbox's directory on the host:
    `cp` (shutil.copyfile: page cache, no fsync, like an upload), a write + fsync, and reading the copy back
    into one bytes object (what `files.read` returns)."""
    dest = where / "bench-baseline.bin"
    cp, synced, read = [], [], []
    try:
        for _ in range(rounds):
            dest.unlink(missing_ok=True)
            t = time.perf_counter()
            shutil.copyfile(src, dest)
            cp.append(time.perf_counter() - t)
            t = time.perf_counter()
            data = dest.read_bytes()
            read.append(time.perf_counter() - t)
            dest.unlink()
            t = time.perf_counter()
            with open(dest, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            synced.append(time.perf_counter() - t)
            del data
    finally:
        dest.unlink(missing_ok=True)
    size = src.stat().st_size
    return {"where": str(where), "cp": _mb_s(size, cp), "write_fsync": _mb_s(size, synced),
            "read_bytes": _mb_s(size, read)}


def _timed(pid: int, fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Run `fn`: its seconds, the server's RSS growth while it ran (MiB, its peak over before) and its result."""
    with peak_rss(pid) as rss:
        t = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t
    return seconds, (rss["peak"] - rss["before"]) / 1024, out


def _upload(sb: Sandbox, src: Path, path: str) -> int:
    with open(src, "rb") as f:
        return sb.files.write(path, f).size


def _round_trips(sb: Sandbox, pid: int, src: Path, rounds: int, progress: Progress) -> dict[str, list[float]]:
    """Upload `src` to a new file, download it, check every byte, remove it; then upload over one existing file."""
    expected = src.read_bytes()
    out: dict[str, list[float]] = {k: [] for k in ("up", "down", "over", "rss_up", "rss_down")}
    for i in range(rounds):
        path = f"/workspace/big-{i}.bin"
        secs, rss, size = _timed(pid, partial(_upload, sb, src, path))
        if size != len(expected):
            raise RuntimeError(f"upload wrote {size} bytes, not {len(expected)}")
        out["up"].append(secs)
        out["rss_up"].append(rss)
        secs, rss, data = _timed(pid, partial(sb.files.read, path))
        if data != expected:
            raise RuntimeError(f"download of {path} differs from the upload ({len(data)} bytes)")
        out["down"].append(secs)
        out["rss_down"].append(rss)
        del data
        sb.files.remove(path)
        progress("100 MiB transfers", 2 * i + 2, 3 * rounds)
    for i in range(rounds):  # the same path each time: the rename into place replaces a file
        secs, rss, _ = _timed(pid, partial(_upload, sb, src, "/workspace/big.bin"))
        out["over"].append(secs)
        out["rss_up"].append(rss)
        progress("100 MiB transfers", 2 * rounds + i + 1, 3 * rounds)
    return out


def _transfers(sb: Sandbox, server: ServerProcess, work: Path, size_mib: int, rounds: int,
               progress: Progress) -> dict[str, Any]:
    """Round trips of `size_mib` MiB of random bytes through the API, then the host-only baseline."""
    src = work / "upload.bin"
    with open(src, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(MIB))
    size, idle, load = size_mib * MIB, rss_kib(server.pid), os.getloadavg()[0]
    try:
        t = _round_trips(sb, server.pid, src, rounds, progress)
        base = _baseline(src, _host_dir(server, sb, work), rounds)
    finally:
        src.unlink(missing_ok=True)
    upload, download = _mb_s(size, t["up"]), _mb_s(size, t["down"])
    return {
        "size_mib": size_mib, "rounds": rounds, "load_avg_1m_before": load,
        "upload": upload, "download": download, "upload_over_existing_file": _mb_s(size, t["over"]),
        "baseline": base,
        "ratio_to_baseline_p50": {
            "upload_vs_cp": round(upload["p50_mb_s"] / base["cp"]["p50_mb_s"], 2),
            "upload_vs_write_fsync": round(upload["p50_mb_s"] / base["write_fsync"]["p50_mb_s"], 2),
            "download_vs_read_bytes": round(download["p50_mb_s"] / base["read_bytes"]["p50_mb_s"], 2)},
        "server_rss_idle_mib": round(idle / 1024, 1),
        "server_rss_growth_mib": {"max": round(max(t["rss_up"] + t["rss_down"]), 1),
                                  "upload_max": round(max(t["rss_up"]), 1),
                                  "download_max": round(max(t["rss_down"]), 1),
                                  "download_p50": round(statistics.median(t["rss_down"]), 1)},
        "upload_seconds": [round(x, 3) for x in t["up"]], "download_seconds": [round(x, 3) for x in t["down"]],
    }


def _forms(data: bytes, src: Path) -> dict[str, Callable[[], Any]]:
    def chunks() -> Iterator[bytes]:
        for i in range(0, len(data), MIB):
            yield data[i:i + MIB]

    text = data.decode("latin-1")
    return {"open_file": partial(open, src, "rb"), "bytes": lambda: data, "bytearray": partial(bytearray, data),
            "memoryview": partial(memoryview, data), "str": lambda: text, "bytes_io": partial(io.BytesIO, data),
            "generator": chunks}


def _close(body: Any) -> None:
    if isinstance(body, io.IOBase):
        body.close()


def _upload_forms(sb: Sandbox, key: str, url: str, work: Path, size_mib: int, rounds: int,
                  progress: Progress) -> dict[str, Any]:
    """Every input form, sync then async, one round of all of them at a time (the machine's noise hits them
    alike); sizes checked. str is ASCII-only text of the same size (its UTF-8 is as long)."""
    data = bytes(b % 128 for b in os.urandom(size_mib * MIB))
    src = work / "forms.bin"
    src.write_bytes(data)
    forms = _forms(data, src)
    secs: dict[str, list[float]] = {f"{mode}_{name}": [] for mode in ("sync", "async") for name in forms}
    loop = asyncio.new_event_loop()
    try:
        asb = loop.run_until_complete(AsyncSandbox.connect(sb.id, api_key=key, base_url=url))
        for r in range(rounds):
            for name, make in forms.items():
                body = make()
                t = time.perf_counter()
                size = sb.files.write("/workspace/form.bin", body).size
                secs[f"sync_{name}"].append(time.perf_counter() - t)
                _close(body)
                body = make()
                t = time.perf_counter()
                size2 = loop.run_until_complete(asb.files.write("/workspace/form.bin", body)).size
                secs[f"async_{name}"].append(time.perf_counter() - t)
                _close(body)
                if size != len(data) or size2 != len(data):
                    raise RuntimeError(f"{name}: wrote {size}/{size2} bytes, not {len(data)}")
            progress("100 MiB uploads, every input form", r + 1, rounds)
        loop.run_until_complete(asb.close())
    finally:
        loop.close()
        src.unlink(missing_ok=True)
    out: dict[str, Any] = {k: _mb_s(len(data), v) for k, v in secs.items()}
    out["ratio_p50_to_open_file"] = {
        k: round(out[k]["p50_mb_s"] / out[f"{k.split('_', 1)[0]}_open_file"]["p50_mb_s"], 2) for k in secs}
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
        steps: int = 20, size_mib: int = 100, rounds: int = 10, exec_only: bool = False,
        progress: Progress | None = None) -> dict[str, Any]:
    """Every figure (see the module docstring); with `exec_only`, only the interleaved exec of `true`."""
    progress = progress or (lambda what, done, total: None)
    store = TemplateStore(template_home)
    store.get(template)
    spec = SandboxSpec(template=template)
    results: dict[str, Any] = {"template": template, "n": n, "cpus": os.cpu_count(), "targets": TARGETS,
                               "load_avg_1m_at_start": os.getloadavg()[0]}

    if not exec_only:
        results["engine"] = asyncio.run(_engine_figures(home / "engine", store, spec, n, progress))

    # Leaving the block stops the server (SIGTERM, then SIGKILL) and destroys whatever this run left behind.
    with ServerProcess(home / "server", template_home=template_home) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("bench")
            key = admin.keys.create("bench", "developer").key
        results["exec_true"] = _exec_figures(home, store, spec, server, key, template, n, progress)
        if not exec_only:
            results["api"] = _api_figures(server, key, template, home, n, clients, steps, size_mib, rounds,
                                          progress)

    results["load_avg_1m_at_end"] = os.getloadavg()[0]  # other work on the machine shows up in every figure
    exec_true = results["exec_true"]
    results["meets_targets"] = {"exec_p50": exec_true["api"]["p50_ms"] <= TARGETS["exec_p50_ms"]}
    if exec_only:
        return results
    eng, api = results["engine"], results["api"]
    results["api_overhead"] = {
        "exec_true_argv": {"p50_ms": exec_true["api_overhead_p50_ms"],
                           "ratio_p50": exec_true["ratio_p50"]["api_to_engine"]},
        "agent_step": {"p50_ms": round(api["agent_step"]["p50_ms"] - eng["agent_step"]["p50_ms"], 2),
                       "ratio_p50": round(api["agent_step"]["p50_ms"] / eng["agent_step"]["p50_ms"], 2)},
    }
    tr = api["transfers"]
    results["meets_targets"].update({
        "upload_p50_mb_s": tr["upload"]["p50_mb_s"] >= TARGETS["transfer_mb_s"],
        "download_p50_mb_s": tr["download"]["p50_mb_s"] >= TARGETS["transfer_mb_s"],
        "server_rss_growth": tr["server_rss_growth_mib"]["max"] <= TARGETS["server_rss_growth_mib"],
        "concurrent_errors": api["concurrent"]["errors"] == TARGETS["concurrent_errors"],
    })
    return results


def _api_figures(server: ServerProcess, key: str, template: str, home: Path, n: int, clients: int, steps: int,
                 size_mib: int, rounds: int, progress: Progress) -> dict[str, Any]:
    api: dict[str, Any] = {"server_rss_idle_mib": round(rss_kib(server.pid) / 1024, 1)}
    sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=server.url)
    try:
        sb.commands.run(["true"])
        samples = []
        agent_n = max(20, n // 5)
        for i in range(agent_n):
            t = time.perf_counter()
            _api_step(sb, i)
            samples.append(time.perf_counter() - t)
            progress("api: agent step", i + 1, agent_n)
        api["agent_step"] = summary(samples)
    finally:
        sb.kill()
    sb = Sandbox.create(template=template, timeout=600, api_key=key, base_url=server.url, limits={"disk": "2G"})
    try:
        api["transfers"] = _transfers(sb, server, home, size_mib, rounds, progress)
        api["upload_forms"] = _upload_forms(sb, key, server.url, home, size_mib, rounds, progress)
    finally:
        sb.kill()
    api["concurrent"] = _concurrent(server, key, template, clients, steps, progress)
    api["server_rss_end_mib"] = round(rss_kib(server.pid) / 1024, 1)
    return api


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(home=Path(f"/var/tmp/corral-bench-api-{os.getpid()}"),
                         template_home=Path(os.environ.get("CORRAL_HOME", "/var/lib/corral"))), indent=2))
    shutil.rmtree(f"/var/tmp/corral-bench-api-{os.getpid()}", ignore_errors=True)
