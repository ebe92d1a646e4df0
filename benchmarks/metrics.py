"""`corral bench metrics`: what counting Prometheus metrics costs the API (docs/operations.md).

Two real `corral serve` subprocesses in the same run, one with metrics (the default) and one with `--no-metrics`
(the baseline: nothing counted, no /metrics). Their measurements alternate round by round, so drift on a shared
machine lands on both alike:
- exec round trip of `true` (argv) through the SDK: median and p95, and the ratio to the baseline
- sandbox create (through the SDK, `kill` outside the timing): median and p95, and the ratio
- one scrape of /metrics (admin key) with a sandbox running: median and p95, and the exposition's size
- what counting one operation costs in-process (`Telemetry.operation` for an exec, a create and an upload, in a
  loop): microseconds each, a figure the machine's load barely moves, unlike the round trips above
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx

from corral import Admin, Sandbox
from corral.server import ServerProcess
from corral.service import Service, Telemetry

Progress = Callable[[str, int, int], None]  # (what, done, total)

ROUNDS = 10  # alternations between the two servers


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(ms[len(ms) // 2], 3), "p95_ms": round(p95, 3)}


def _key(server: ServerProcess) -> str:
    with Admin(api_key=server.admin_key, base_url=server.url) as admin:
        admin.tenants.create("bench")
        return admin.keys.create("bench", "developer").key


def _execs(sb: Sandbox, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        if sb.commands.run(["true"]).exit_code != 0:
            raise RuntimeError("benchmark command failed")
        out.append(time.perf_counter() - t)
    return out


def _creates(server: ServerProcess, key: str, template: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb = Sandbox.create(template=template, timeout=120, api_key=key, base_url=server.url)
        out.append(time.perf_counter() - t)
        sb.kill()
    return out


def _scrapes(server: ServerProcess, n: int) -> tuple[list[float], int]:
    out, size = [], 0
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.admin_key}"}) as client:
        for _ in range(n):
            t = time.perf_counter()
            r = client.get("/metrics")
            out.append(time.perf_counter() - t)
            r.raise_for_status()
            size = len(r.content)
    return out, size


def counting_cost(n: int = 100_000) -> dict[str, float]:
    """Microseconds per `Telemetry.operation` call of each kind (no server: counting needs no service)."""
    telemetry = Telemetry(cast(Service, None))
    kinds = {"exec": ("sandbox.exec", {"cmd": ["true"]}, {"status": 200, "exit_code": 0}),
             "create": ("sandbox.create", {"template": "default"}, {"status": 201}),
             "upload": ("files.write", {"path": "/workspace/a", "size": 4096}, {"status": 200})}
    out = {}
    for name, (action, params, outcome) in kinds.items():
        t = time.perf_counter()
        for _ in range(n):
            telemetry.operation(action, "tn_bench", 0.012, None, params, outcome)
        out[f"{name}_us"] = round((time.perf_counter() - t) / n * 1e6, 2)
    return out


def _ratios(on: dict[str, float], off: dict[str, float]) -> dict[str, float]:
    return {"p50": round(on["p50_ms"] / off["p50_ms"], 3), "p95": round(on["p95_ms"] / off["p95_ms"], 3)}


def run(*, home: Path, template_home: Path, template: str = "default", n: int = 300, creates: int = 30,
        progress: Progress | None = None) -> dict[str, Any]:
    progress = progress or (lambda what, done, total: None)
    with ServerProcess(home / "on", template_home=template_home) as on, \
            ServerProcess(home / "off", template_home=template_home, args=["--no-metrics"]) as off:
        servers = {"metrics": on, "baseline": off}
        keys = {name: _key(server) for name, server in servers.items()}
        execs: dict[str, list[float]] = {name: [] for name in servers}
        made: dict[str, list[float]] = {name: [] for name in servers}
        boxes = {name: Sandbox.create(template=template, timeout=1800, api_key=keys[name], base_url=s.url)
                 for name, s in servers.items()}
        try:
            for sb in boxes.values():
                _execs(sb, 20)  # warm: connections, the agent
            for i in range(ROUNDS):
                order = list(servers) if i % 2 == 0 else list(reversed(servers))  # neither always goes first
                for name in order:
                    execs[name] += _execs(boxes[name], max(1, n // ROUNDS))
                    made[name] += _creates(servers[name], keys[name], template, max(1, creates // ROUNDS))
                progress("rounds (metrics, baseline)", i + 1, ROUNDS)
            scrapes, size = _scrapes(on, 100)
        finally:
            for sb in boxes.values():
                sb.kill()
    ex = {name: summary(samples) for name, samples in execs.items()}
    cr = {name: summary(samples) for name, samples in made.items()}
    return {"template": template, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "exec_true_argv": {**ex, "ratio_metrics_to_baseline": _ratios(ex["metrics"], ex["baseline"])},
            "create": {**cr, "ratio_metrics_to_baseline": _ratios(cr["metrics"], cr["baseline"])},
            "scrape": {**summary(scrapes), "bytes": size}, "counting_per_operation": counting_cost()}


if __name__ == "__main__":  # pragma: no cover
    where = Path(f"/var/tmp/corral-bench-metrics-{os.getpid()}")
    try:
        print(json.dumps(run(home=where, template_home=Path(os.environ.get("CORRAL_HOME", "/var/lib/corral"))),
                         indent=2))
    finally:
        shutil.rmtree(where, ignore_errors=True)
