"""`corral bench k8s`: create from a warm Pod against a cold Pod, through the fake API server (tests/kube_fake.py).

The backend drives the official client against the in-process fake, whose kubelet runs a real agent per Pod
(its own PID namespace, uid 1000) reached over TCP with its token. Figures (median and p95; the ratio cold/warm):

- cold: `create` (Pod, NetworkPolicy, Secret, a watch until the Pod runs) + the agent's first answer (an exec)
- warm: `create` served from a ready warm Pod (a conditional merge patch) + the agent's first answer
- exec: one `echo` round trip over TCP to a running agent
- egress: one HTTP request (a new connection each) through `corral egress-proxy`'s listener (TCP, the sandbox's
  credential, its policy from the database: cached, and with `--cache-ttl 0` read every request) against the
  same request through the one-host proxy's Unix socket (the baseline), to an origin on loopback

What this measures is the backend's own path and the agent over TCP, with an API server that answers at once
and a "kubelet" that starts a process, not a container: on a real cluster a cold Pod costs scheduling, a
sandbox and an image check (seconds under gVisor), which a warm Pod has already paid. Needs root.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import secrets
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
from corral.backends.kubernetes import TokenKey
from corral.backends.kubernetes._backend import KubernetesBackend, KubernetesRecord
from corral.control import ControlStore, Role, TenantEgress
from corral.egress import EgressPolicy, EgressProxy
from corral.engine._agent_client import AgentClient
from corral.service import EgressDirectory
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
    egress = await _egress(home, n * 10, progress)
    cold_s, warm_s = summary(cold_samples), summary(warm_samples)
    return {"cold_create": cold_s, "warm_create": warm_s, "exec_tcp": summary(execs),
            "cold_over_warm_p50": round(cold_s["p50_ms"] / warm_s["p50_ms"], 2), **egress,
            "note": "fake API server and fake kubelet (a process, not a container): the backend's path only"}


async def _origin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _requests(open_connection: Callable[[], Any], request: bytes, n: int, what: str,
                    progress: Progress) -> list[float]:
    samples: list[float] = []
    for i in range(n):
        started = time.perf_counter()
        reader, writer = await open_connection()
        writer.write(request)
        answer = await reader.read()
        writer.close()
        samples.append(time.perf_counter() - started)
        if not answer.startswith(b"HTTP/1.1 200 OK"):
            raise RuntimeError(f"{what}: {answer[:200]!r}")
        progress(what, i + 1, n)
    return samples


async def _egress(home: Path, n: int, progress: Progress) -> dict[str, Any]:
    """The standalone proxy's request latency (cached and uncached policy) against the one-host proxy's."""
    origin = await asyncio.start_server(_origin, "127.0.0.1", 0)
    port = origin.sockets[0].getsockname()[1]
    store = ControlStore(f"sqlite+aiosqlite:///{home / 'bench-egress.db'}", home=home)
    await store.start()
    proxies: list[EgressProxy] = []
    try:
        tenant = await store.create_tenant(f"bench-{secrets.token_hex(4)}")
        await store.set_tenant_egress(tenant.id, TenantEgress(private=[f"127.0.0.1:{port}"]))
        principal = await store.key_principal((await store.create_key(tenant.id, Role.OPERATOR)).info.id)
        sandbox = f"sb-{secrets.token_hex(8)}"
        await store.reserve_sandbox(principal, SandboxSpec(network=("127.0.0.1",)), sandbox_id=sandbox)
        key = TokenKey(secrets.token_bytes(32))
        credential = base64.b64encode(f"{sandbox}:{key.egress_credential(sandbox)}".encode()).decode()
        request = (f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                   f"Proxy-Authorization: Basic {credential}\r\n\r\n").encode()
        # Both write the same audit record per attempt (after it ends), as the server's own proxy does.
        local = EgressProxy(on_event=EgressDirectory(store, key.verify_egress).record)
        proxies.append(local)
        socket_path = home / "bench-egress.sock"
        await local.attach(sandbox, socket_path, EgressPolicy.parse(["127.0.0.1"], private=[f"127.0.0.1:{port}"]))
        figures: dict[str, Any] = {}
        base = await _requests(lambda: asyncio.open_unix_connection(str(socket_path)), request, n,
                               "egress: one-host proxy (Unix socket)", progress)
        figures["egress_local"] = summary(base)
        for name, ttl in (("egress_standalone", 2.0), ("egress_standalone_uncached", 0.0)):
            directory = EgressDirectory(store, key.verify_egress, cache_ttl=ttl)
            remote = EgressProxy(on_event=directory.record)
            proxies.append(remote)
            (_, remote_port), *_ = await remote.listen("127.0.0.1", 0, directory.policy)
            samples = await _requests(functools.partial(asyncio.open_connection, "127.0.0.1", remote_port), request, n,
                                      f"egress: standalone proxy (TCP, cache TTL {ttl:g} s)", progress)
            figures[name] = summary(samples)
            figures[f"{name}_over_local_p50"] = round(figures[name]["p50_ms"] / figures["egress_local"]["p50_ms"], 2)
        return figures
    finally:
        for proxy in proxies:
            await proxy.close()
        origin.close()
        await store.close()
        (home / "bench-egress.db").unlink(missing_ok=True)
