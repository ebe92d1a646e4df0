"""`corral bench k8s`: create from a warm Pod against a cold Pod, through the fake API server (tests/kube_fake.py).

The backend drives the official client against the in-process fake, whose kubelet runs a real agent per Pod
(its own PID namespace, uid 1000) reached over TCP with its token. Figures (median and p95; the ratio cold/warm):

- cold: `create` (Pod, NetworkPolicy, Secret, a watch until the Pod runs) + the agent's first answer (an exec)
- warm: `create` served from a ready warm Pod (a conditional merge patch) + the agent's first answer
- exec: one `echo` round trip over TCP to a running agent

What this measures is the backend's own path and the agent over TCP, with an API server that answers at once
and a "kubelet" that starts a process, not a container: on a real cluster a cold Pod costs scheduling, a
sandbox and an image check (seconds under gVisor), which a warm Pod has already paid. Needs root.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from corral.backends import SandboxSpec
from corral.backends.kubernetes._backend import KubernetesBackend, KubernetesRecord
from corral.engine._agent_client import AgentClient
from corral.templates import Template

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fake lives with the tests
from tests.kube_fake import FakeKube, Kubelet, serve

Progress = Callable[[str, int, int], None]
IMAGE = "registry.example/corral/default@sha256:" + "ab" * 32


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(p95, 2),
            "min_ms": round(ms[0], 2), "max_ms": round(ms[-1], 2)}


def _template() -> Template:
    return Template(name="default", digest="d" * 64, rootfs=Path("/nonexistent"), env={},
                    created_at=datetime.now(UTC), size_bytes=0, source="debootstrap", spec={})


async def _first_answer(backend: KubernetesBackend, record: KubernetesRecord) -> None:
    address = backend.agent_address(record)
    result = await AgentClient(address.endpoint, address.token).exec("true", cwd="/tmp")
    if result.exit_code != 0:
        raise RuntimeError(f"the first exec failed: {result!r}")


async def _creates(backend: KubernetesBackend, n: int, what: str, progress: Progress,
                   before: Callable[[], Any] | None = None) -> list[float]:
    samples: list[float] = []
    for i in range(n):
        if before is not None:
            await before()
        started = time.perf_counter()
        record = await backend.create(f"sb-{uuid.uuid4().hex[:16]}", SandboxSpec(), _template())
        await _first_answer(backend, record)
        samples.append(time.perf_counter() - started)
        await backend.destroy(record)
        progress(what, i + 1, n)
    return samples


async def _warm_ready(backend: KubernetesBackend) -> None:
    """Wait (bounded) until the pool has a ready Pod again: each sample measures a create served warm."""
    for _ in range(400):
        if await backend.warm_pods("default"):
            return
        await asyncio.sleep(0.025)
    raise RuntimeError("the warm pool did not refill in 10 s")


async def run(*, home: Path, template_home: Path, progress: Progress, n: int = 30) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise SystemExit("corral bench k8s needs root: the fake kubelet runs each agent in its own PID namespace")
    work = Path(tempfile.mkdtemp(prefix="corral-bench-kubelet-"))
    os.chmod(work, 0o755)
    try:
        fake = FakeKube(kubelet=Kubelet(work))
        async with serve(fake, work) as kubeconfig:
            cold = KubernetesBackend(home, kubeconfig=kubeconfig, images={"default": IMAGE}, egress_proxy="")
            warm = KubernetesBackend(home, kubeconfig=kubeconfig, images={"default": IMAGE}, egress_proxy="",
                                     pool={"default": 2}, instance="warm")
            try:
                cold_samples = await _creates(cold, n, "cold Pod create + first exec", progress)
                await warm.fill_pools()
                warm_samples = await _creates(warm, n, "warm Pod create + first exec", progress,
                                              before=lambda: _warm_ready(warm))
                record = await cold.create("sb-exec-bench", SandboxSpec(), _template())
                address = cold.agent_address(record)
                client = AgentClient(address.endpoint, address.token)
                execs: list[float] = []
                for i in range(n * 5):
                    started = time.perf_counter()
                    await client.exec("echo hi", cwd="/tmp")
                    execs.append(time.perf_counter() - started)
                    progress("exec round trip over TCP", i + 1, n * 5)
            finally:
                for backend in (cold, warm):
                    await backend.sweep(set())
                    await backend.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cold_s, warm_s = summary(cold_samples), summary(warm_samples)
    return {"cold_create": cold_s, "warm_create": warm_s, "exec_tcp": summary(execs),
            "cold_over_warm_p50": round(cold_s["p50_ms"] / warm_s["p50_ms"], 2),
            "note": "fake API server and fake kubelet (a process, not a container): the backend's path only"}
