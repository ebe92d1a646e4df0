"""`corral bench engine`: run a benchmark from `benchmarks/` with a progress bar; print and save figures."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .._settings import corral_home

bench_app = typer.Typer(help="Benchmarks (medians, p95 and ratios to a baseline measured in the same run).",
                        no_args_is_help=True)
console = Console(stderr=True)


def _benchmarks_dir() -> Path:
    # A source checkout (src layout): <repo>/src/corral/cli/_bench.py -> <repo>/benchmarks
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "benchmarks"
        if (candidate / "engine.py").is_file():
            return candidate
    raise typer.BadParameter("benchmarks/ not found: run `corral bench` from a source checkout of Corral")


def _load(name: str) -> ModuleType:
    path = _benchmarks_dir() / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"corral_benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(name: str, out: Path, **kwargs: Any) -> None:
    """Run `benchmarks/<name>.py`'s `run()` (sync or async) with a progress bar; print and save its figures."""
    module = _load(name)
    home = Path(f"/var/tmp/corral-bench-{name}-{int(time.time())}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        tasks: dict[str, Any] = {}

        def progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(what, total=total)
            bar.update(tasks[what], completed=done)

        try:
            results = module.run(home=home, template_home=corral_home(), progress=progress, **kwargs)
            if asyncio.iscoroutine(results):
                results = asyncio.run(results)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    typer.echo(json.dumps(results, indent=2))
    console.print(f"[dim]written to {out}[/dim]")


@bench_app.command("engine")
def engine(
    n: int = typer.Option(30, help="Samples per measurement."),
    concurrent: int = typer.Option(50, help="Sandboxes created at once."),
    pool: int = typer.Option(4, help="Warm pool size."),
    template: str = typer.Option("default"),
    docker: bool = typer.Option(False, "--docker", help="Also the Docker backend (corral[docker], a running "
                                "dockerd), against bare `docker run --rm <image> true`."),
    out: Path = typer.Option(Path("bench-results/engine.json"), help="Where to write the JSON figures."),
) -> None:
    """Sandbox create, exec, idle memory and concurrency, against bare `runc run` (and, with --docker, the Docker
    backend against bare `docker run`)."""
    _run("engine", out, template=template, n=n, concurrent=concurrent, pool=pool, docker=docker)


@bench_app.command("burst")
def burst(
    n: int = typer.Option(50, help="Agents that create a sandbox and run `true` at the same instant."),
    serial: int = typer.Option(20, help="Sandboxes created one after another for the serial baseline."),
    template: str = typer.Option("default"),
    docker: bool = typer.Option(False, "--docker", help="Also `docker run --rm <the template's image> true`, serial "
                                "and N at once, as the peer (corral[docker], a running dockerd)."),
    out: Path = typer.Option(Path("bench-results/burst.json"), help="Where to write the JSON figures."),
) -> None:
    """A burst of N creates through the API, in the bench's form (threads, argv) and the user's (the async SDK in one
    event loop, a shell line), without a pool, with one pinned at N and on the README's server (its self-sizing
    pool: a first burst, then a second), against the serial rate of the same run."""
    _run("burst", out, template=template, n=n, serial=serial, docker=docker)


@bench_app.command("api")
def api(
    n: int = typer.Option(200, help="Samples per latency measurement."),
    clients: int = typer.Option(50, help="Concurrent clients, each with its own sandbox."),
    steps: int = typer.Option(20, help="Agent-like steps per client."),
    size_mib: int = typer.Option(100, help="Upload/download size in MiB."),
    rounds: int = typer.Option(10, help="Uploads and downloads of that size (p50 and p95 over them)."),
    template: str = typer.Option("default"),
    exec_only: bool = typer.Option(False, "--exec-only", help="Only exec `true` through the API, the engine and "
                                   "the agent's socket, interleaved."),
    out: Path = typer.Option(Path("bench-results/api.json"), help="Where to write the JSON figures."),
) -> None:
    """The HTTP API (a real `corral serve`, the SDK over loopback) against the engine in-process."""
    _run("api", out, template=template, n=n, clients=clients, steps=steps, size_mib=size_mib, rounds=rounds,
         exec_only=exec_only)


@bench_app.command("metrics")
def metrics(
    n: int = typer.Option(300, help="Exec round trips per server."),
    creates: int = typer.Option(30, help="Sandbox creates per server."),
    template: str = typer.Option("default"),
    out: Path = typer.Option(Path("bench-results/metrics.json"), help="Where to write the JSON figures."),
) -> None:
    """What counting Prometheus metrics costs: exec and create latency of a server with metrics against one with
    --no-metrics, alternating in the same run; and the cost of a scrape."""
    _run("metrics", out, template=template, n=n, creates=creates)


@bench_app.command("net")
def net(
    n: int = typer.Option(300, help="Samples per latency measurement."),
    size_mib: int = typer.Option(200, help="Download size in MiB for the throughput figures."),
    rounds: int = typer.Option(20, help="Downloads per path (best, p50 and p95 over them, each with its ratio to "
                               "direct in the same run)."),
    in_sandbox: bool = typer.Option(True, "--in-sandbox/--host-only", help="Also measure from inside a runc "
                                    "sandbox: urllib GETs, curl downloads, pip through the package mirror."),
    out: Path = typer.Option(Path("bench-results/net.json"), help="Where to write the JSON figures."),
) -> None:
    """The egress proxy (absolute-form HTTP and CONNECT) against direct loopback connections."""
    _run("net", out, n=n, size_mib=size_mib, rounds=rounds, in_sandbox_too=in_sandbox)


@bench_app.command("k8s")
def k8s(
    n: int = typer.Option(30, help="Samples per measurement (exec round trips: five times as many)."),
    out: Path = typer.Option(Path("bench-results/k8s.json"), help="Where to write the JSON figures."),
) -> None:
    """The Kubernetes backend through the fake API server: create from a warm Pod against a cold Pod (needs root
    and corral[kubernetes]; the backend's own path, not a real cluster's)."""
    _run("k8s", out, n=n)


@bench_app.command("code")
def code(
    template: str = typer.Option("default", help="Template to benchmark (needs python3 with matplotlib)."),
    n: int = typer.Option(30, help="Samples per measurement."),
    wire_only: bool = typer.Option(False, "--wire-only", help="Only the 1 MB cell through the API against the "
                                   "engine (interleaved, n samples each)."),
    out: Path = typer.Option(Path("bench-results/code.json"), help="Where to write the JSON figures."),
) -> None:
    """Code sessions: start, 1+1, 1 MB of stdout, a matplotlib chart, against a fresh `python3 -c`; and the 1 MB cell
    through the API against the engine, interleaved."""
    _run("code", out, template=template, n=n, wire_only=wire_only)


@bench_app.command("lifecycle")
def lifecycle(
    n: int = typer.Option(20, help="Samples per measurement (the port round trips take 10 times as many)."),
    files: int = typer.Option(2000, help="Small files in the snapshotted sandbox (beside one 16 MiB file)."),
    ports: bool = typer.Option(True, "--ports/--no-ports", help="Also the port round trip through a real "
                               "`corral serve` against the same request inside the sandbox, and the command that "
                               "wakes an auto-resume sandbox against resume() then that command."),
    template: str = typer.Option("default"),
    out: Path = typer.Option(Path("bench-results/lifecycle.json"), help="Where to write the JSON figures."),
) -> None:
    """Snapshot, create from a snapshot, fork, pause to disk and resume, against a template create; ports through
    `get_host` against the same GET inside the sandbox."""
    _run("lifecycle", out, template=template, n=n, files=files, ports=ports)


@bench_app.command("e2b")
def e2b(
    n: int = typer.Option(100, help="Samples per latency measurement (a quarter of them for creates)."),
    size_mib: int = typer.Option(100, help="File size in MiB for the transfer figures."),
    rounds: int = typer.Option(5, help="Uploads and downloads of that size per SDK."),
    template: str = typer.Option("default"),
    out: Path = typer.Option(Path("bench-results/e2b.json"), help="Where to write the JSON figures."),
) -> None:
    """E2B's SDKs against Corral's E2B API, beside Corral's own SDK on the same server in the same run."""
    _run("e2b", out, template=template, n=n, size_mib=size_mib, rounds=rounds)


@bench_app.command("eval")
def eval_(
    concurrency: int = typer.Option(50, help="Concurrent agents (tasks at once)."),
    sample: int | None = typer.Option(None, help="A seeded sample instead of the whole corpus."),
    seed: int = typer.Option(0, help="Seed of the sample."),
    pool: int = typer.Option(0, help="Warm pool of this many `default` sandboxes (and a fifth as many with root) "
                             "on the server (docs/performance.md); 0: none."),
    out: Path = typer.Option(Path("bench-results/eval.json"), help="Where to write the JSON figures."),
) -> None:
    """The whole eval corpus against a real server: wall time, per-category latency, against empty tasks."""
    _run("eval", out, concurrency=concurrency, sample=sample, seed=seed, pool=pool)


@bench_app.command("density")
def density(
    max_sandboxes: int = typer.Option(1000, "--max", help="Idle sandboxes to reach."),
    step: int | None = typer.Option(None, help="Measure every STEP sandboxes (default: 0, 100, 250, 500, 1000)."),
    samples: int = typer.Option(10, help="Creates per step (three times as many execs)."),
    memory: str = typer.Option("64M", help="Memory limit of each sandbox."),
    min_available_gib: float = typer.Option(4.0, help="Stop (and clean up) before MemAvailable falls under this."),
    egress: bool = typer.Option(True, "--egress/--no-egress", help="An egress proxy in the engine's process, as "
                                "`corral serve` has (a listening socket per sandbox)."),
    template: str = typer.Option("default"),
    out: Path = typer.Option(Path("bench-results/density.json"), help="Where to write the JSON figures."),
) -> None:
    """Idle sandboxes in steps up to --max: create and exec latency at each density against an empty machine,
    memory, open files, loop devices, mounts, pids and inotify. Stops before a limit; destroys all it made."""
    _run("density", out, template=template, max_sandboxes=max_sandboxes, step=step, samples=samples,
         memory=memory, min_available_gib=min_available_gib, egress=egress)


@bench_app.command("checkpoints")
def checkpoints(
    n: int = typer.Option(20, help="Samples per measurement."),
    files: int = typer.Option(1000, help="Files the measured change rewrites."),
    size_mib: int = typer.Option(100, help="MiB the change writes, over all its files."),
    sample: int = typer.Option(150, help="Eval tasks run without and with automatic checkpoints (0: skip that)."),
    seed: int = typer.Option(20261130, help="Seed of that sample."),
    concurrency: int = typer.Option(20, help="Eval tasks at once."),
    template: str = typer.Option("default"),
    out: Path = typer.Option(Path("bench-results/checkpoints.json"), help="Where to write the JSON figures."),
) -> None:
    """Checkpoint (unchanged, after a change of N files), restore in place and `changes`, against a same-run
    `cp -a` of the changed files inside the sandbox; and the eval corpus without and with automatic checkpoints."""
    _run("checkpoints", out, template=template, n=n, files=files, size_mib=size_mib, sample=sample, seed=seed,
         concurrency=concurrency)
