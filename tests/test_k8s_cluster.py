"""The `k8s` tier: the Kubernetes backend against a real cluster, which no machine here has.

Runs only when `KUBECONFIG` names a cluster that answers and is not the fake API server of tests/kube_fake.py,
and `CORRAL_K8S_IMAGES` maps the `default` template to an image of it (`corral templates push default
REGISTRY/REPO`); otherwise every test skips, saying which of these was missing. Optional: `CORRAL_K8S_NAMESPACE`
(default `corral-sandboxes`, which must exist, labelled for Pod Security `restricted`),
`CORRAL_K8S_RUNTIME_CLASS` (default `gvisor`; `none` for the cluster's default runtime). The engine must be able
to reach Pod IPs (run it in the cluster, or on a node).

What only this tier proves: admission of the Pods as built (Pod Security `restricted`, the RuntimeClass), image
pulls by digest, the agent's TCP port reachable at the Pod's IP, gVisor's kernel under the agent; and, through
`corral check --backend kubernetes`, the whole checklist on that cluster (the private server it starts reads the
`default` template's name from `$CORRAL_HOME`, its image from `CORRAL_K8S_IMAGES`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

pytest.importorskip("kubernetes_asyncio", reason="the Kubernetes backend needs corral[kubernetes]")

from corral._exceptions import CorralError
from corral._settings import corral_home
from corral.backends import SandboxSpec
from corral.backends.kubernetes._backend import KubernetesBackend
from corral.check import ITEMS, SKIPPED, cluster_missing
from corral.engine._agent_client import AgentClient
from corral.templates import Template, TemplateStore

pytestmark = [pytest.mark.anyio, pytest.mark.k8s]


def _skip_reason() -> str | None:
    path = os.environ.get("KUBECONFIG", "")
    if not path:
        return "no real cluster: KUBECONFIG is not set (the k8s tier runs against a real Kubernetes cluster only)"
    if not Path(path).is_file():
        return f"no real cluster: KUBECONFIG names {path}, which does not exist"
    try:
        config = json.loads(Path(path).read_text())
    except ValueError:
        config = {}  # YAML: a real kubeconfig (the fake writes JSON)
    if isinstance(config, dict) and config.get("current-context") == "fake":
        return "KUBECONFIG names the fake API server of tests/kube_fake.py, not a real cluster"
    if not os.environ.get("CORRAL_K8S_IMAGES"):
        return ("CORRAL_K8S_IMAGES is not set: map the default template to its image "
                "(`corral templates push default REGISTRY/REPO`)")
    try:
        missing = cluster_missing()  # what `corral check --backend kubernetes` asks first
    except CorralError:
        return None  # a cluster answered and refused: the tests run, and fail saying what it refused
    return None if missing is None else f"no real cluster: {missing}"


SKIP = _skip_reason()
if SKIP is not None:
    pytestmark.append(pytest.mark.skip(reason=SKIP))


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[KubernetesBackend]:
    runtime = os.environ.get("CORRAL_K8S_RUNTIME_CLASS", "gvisor")
    made = KubernetesBackend(tmp_path, namespace=os.environ.get("CORRAL_K8S_NAMESPACE", "corral-sandboxes"),
                             runtime_class=None if runtime == "none" else runtime,
                             instance=f"test-{uuid.uuid4().hex[:8]}")
    try:
        yield made
    finally:
        await made.sweep(set())  # this run's own instance label: nothing of anyone else's
        await made.close()


def _template() -> Template:
    return Template(name="default", digest="", rootfs=Path("/nonexistent"), env={}, created_at=datetime.now(UTC),
                    size_bytes=0, source="debootstrap", spec={})


async def test_a_sandbox_pod_runs_and_answers_over_tcp(backend: KubernetesBackend) -> None:
    record = await backend.create(f"sb-{uuid.uuid4().hex[:16]}", SandboxSpec(), _template())
    try:
        address = backend.agent_address(record)
        client = AgentClient(address.endpoint, address.token)
        result = await client.exec("id -u; cat /proc/version", cwd="/tmp")
        assert result.exit_code == 0 and result.stdout_bytes.split(b"\n")[0] == b"1000"
        data = bytes(range(256)) * 4096
        await client.write_file("/tmp/blob", data)
        assert await client.read_file("/tmp/blob") == data
    finally:
        await backend.destroy(record)
    assert not await backend.alive(record)


async def test_a_warm_pod_serves_a_create(tmp_path: Path) -> None:
    runtime = os.environ.get("CORRAL_K8S_RUNTIME_CLASS", "gvisor")
    backend = KubernetesBackend(tmp_path, namespace=os.environ.get("CORRAL_K8S_NAMESPACE", "corral-sandboxes"),
                                runtime_class=None if runtime == "none" else runtime, pool={"default": 1},
                                instance=f"test-{uuid.uuid4().hex[:8]}")
    try:
        await backend.fill_pools()
        for _ in range(600):  # a real Pod: scheduling and an image pull, up to 2 minutes
            if await backend.warm_pods("default"):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("no warm Pod became ready in 2 minutes")
        started = time.perf_counter()
        record = await backend.create(f"sb-{uuid.uuid4().hex[:16]}", SandboxSpec(), _template())
        assert record.pod.startswith("corral-warm-")
        address = backend.agent_address(record)
        assert (await AgentClient(address.endpoint, address.token).exec("echo warm")).stdout_bytes == b"warm\n"
        print(f"create from a warm Pod + first exec: {(time.perf_counter() - started) * 1000:.0f} ms")
    finally:
        await backend.sweep(set())
        for pod in await backend.warm_pods("default"):
            await backend.api.delete("Pod", pod["metadata"]["name"])
        await backend.close()


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_corral_check_backend_kubernetes_passes_on_the_cluster() -> None:
    if not TemplateStore(corral_home()).exists("default"):
        pytest.skip(f"the check's private server finds templates by name in $CORRAL_HOME ({corral_home()}): "
                    "build or import `default` there")
    command = [sys.executable, "-c", "from corral.cli import main; main()", "check", "--backend", "kubernetes",
               "--namespace", os.environ.get("CORRAL_K8S_NAMESPACE", "corral-sandboxes"), "--json"]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=3500,
                                   check=False)
    assert done.returncode != SKIPPED, f"the cluster answered this tier but not the check: {done.stdout}"
    doc = json.loads(done.stdout)
    failed = [f"{i['number']} {i['title']}: {i['detail']} (fix: {i['fix']})" for i in doc["items"]
              if i["status"] == "FAIL" and i["number"] not in NEED_THE_DEPLOYMENTS_PROXY]
    assert failed == [] and doc["cleanup_problems"] == [], "\n".join(failed + doc["cleanup_problems"])
    assert doc["backend"] == "kubernetes" and [i["number"] for i in doc["items"]] == sorted(ITEMS)


# The cluster's egress proxy knows sandboxes from the deployment's shared database, not the private server's
# SQLite: it refuses the check's sandboxes (fail closed), so what needs it to serve them cannot pass here
# (docs/kubernetes.md, "`corral check --backend kubernetes`").
NEED_THE_DEPLOYMENTS_PROXY = {26: "an allowed destination is reachable", 35: "egress refusals are audited"}
