"""`corral check --backend`: the checklist against a private server the command starts on a backend.

On Kubernetes it asks the cluster first: no configuration, or a server that does not answer, is a skip (exit 3,
one line saying why, nothing reported as passed); a server that answers and refuses is an error. Options that
belong to a running deployment (`--url`, `--api-key`, `--home`) cannot be mixed with `--backend`, and a refusal
starts nothing. End to end, `corral check --backend kubernetes --item N` runs against the fake API server of
tests/kube_fake.py, whose kubelet runs real agents (root), and leaves no Pod, Secret or NetworkPolicy behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

pytest.importorskip("kubernetes_asyncio", reason="the Kubernetes backend needs corral[kubernetes]")

from corral.check import CLUSTER_TIMEOUT, SKIPPED
from corral.cli import _check, app
from corral.templates import TemplateStore

from .fakes import silent_server
from .kube_fake import FakeKube, Kubelet, serve, write_kubeconfig

IMAGE = "registry.example/corral/default@sha256:" + "ab" * 32
NAMESPACE = "corral-check-sandboxes"


def invoke(*args: str, env: dict[str, str | None]) -> Result:
    return CliRunner().invoke(app, ["check", *args], env=env)


def flat(text: str) -> str:
    """Output without rich's box and line wrapping, to search for a sentence."""
    return re.sub(r"[\s│╭╮╰╯─]+", " ", text)


def closed_port() -> int:
    with socket.socket() as probe:  # bound and closed again: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- skipped: no cluster ------------------------------------------------------------------------------------------


def test_without_kubeconfig_outside_a_pod_the_check_is_skipped_and_says_why(tmp_path: Path) -> None:
    result = invoke("--backend", "kubernetes", env={"KUBECONFIG": None, "HOME": str(tmp_path)})
    assert result.exit_code == SKIPPED == 3, result.output
    assert result.stdout.startswith("SKIPPED: the checklist did not run on the kubernetes backend: ")
    assert "KUBECONFIG is not set and this is not a Pod" in result.stdout
    assert f"{tmp_path}/.kube/config does not exist" in result.stdout
    assert "passed" not in result.output and "PASS" not in result.output


def test_a_skip_is_a_json_document_with_json(tmp_path: Path) -> None:
    result = invoke("--backend", "kubernetes", "--json", env={"KUBECONFIG": None, "HOME": str(tmp_path)})
    assert result.exit_code == SKIPPED
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["skipped"] is True and doc["backend"] == "kubernetes"
    assert "KUBECONFIG is not set" in doc["reason"]


def test_a_kubeconfig_naming_a_closed_port_is_a_skip_that_names_the_server(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{closed_port()}"
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server)
    result = invoke("--backend", "kubernetes", env={"KUBECONFIG": str(kubeconfig)})
    assert result.exit_code == SKIPPED, result.output
    line = result.stdout.strip()
    assert line.startswith("SKIPPED: ") and f"no Kubernetes API server answers at {server}" in line
    assert f"KUBECONFIG={kubeconfig}" in line and "Cannot connect" in line


def test_a_kubeconfig_naming_a_missing_file_is_a_skip_that_names_it(tmp_path: Path) -> None:
    result = invoke("--backend", "kubernetes", env={"KUBECONFIG": str(tmp_path / "nothing")})
    assert result.exit_code == SKIPPED
    assert f"{tmp_path}/nothing does not exist" in result.stdout


@pytest.mark.slow
def test_a_server_that_never_answers_is_a_skip_after_the_timeout(tmp_path: Path) -> None:
    with silent_server() as address:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", f"http://{address}")
        result = invoke("--backend", "kubernetes", env={"KUBECONFIG": str(kubeconfig)})
    assert result.exit_code == SKIPPED, result.output
    assert f"no Kubernetes API server answers at http://{address}" in result.stdout
    assert f"within {CLUSTER_TIMEOUT:g} s" in result.stdout


@pytest.mark.anyio
async def test_a_cluster_that_answers_and_refuses_is_an_error_not_a_skip(tmp_path: Path) -> None:
    fake = FakeKube()
    fake.forbid("get", "version")
    async with serve(fake, tmp_path) as kubeconfig:
        result = await asyncio.to_thread(invoke, "--backend", "kubernetes", env={"KUBECONFIG": str(kubeconfig)})
    assert result.exit_code == 1, result.output
    assert "SKIPPED" not in result.output
    assert "error: runtime_unavailable: get version: forbidden" in flat(result.output)
    assert fake.requests == [("get", "version")]  # asked once, and nothing was created


# -- usage errors start nothing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "complaint"), [
    (["--backend", "kubernetes", "--url", "http://127.0.0.1:9"],
     "Invalid value for --url: --url names a running deployment and --backend starts a private one: give one"),
    (["--backend", "local", "--api-key", "k"], "Invalid value for --api-key: --api-key names a running deployment"),
    (["--backend", "docker", "--home", "/var/lib/corral"], "Invalid value for --home: --home names a running"),
    (["--backend", "nowhere"], "Invalid value for --backend: choose one of local, docker, kubernetes"),
    (["--backend", "local", "--namespace", "x"], "--namespace applies to --backend kubernetes"),
    (["--namespace", "x"], "--namespace applies to --backend kubernetes: a running deployment's namespace"),
    (["--backend", "kubernetes", "--item", "99"], "no checklist item 99"),
])
def test_bad_parameters_are_usage_errors_that_start_nothing(monkeypatch: pytest.MonkeyPatch, args: list[str],
                                                            complaint: str) -> None:
    def never(*_: object, **__: object) -> Any:
        raise AssertionError("a cluster was asked or a server started although the parameters were refused")

    monkeypatch.setattr(_check, "cluster_missing", never)
    monkeypatch.setattr(_check, "private_target", never)
    result = invoke(*args, env={"CORRAL_API_KEY": "admin-key", "KUBECONFIG": None})
    assert result.exit_code == 2, result.output
    assert complaint in flat(result.output)


# -- end to end against the fake API server ------------------------------------------------------------------------

needs_kubelet = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
    reason="the fake kubelet needs root, unshare and setpriv to run agents as PID 1")


@pytest.fixture
def kubelet() -> Iterator[Kubelet]:
    work = Path(tempfile.mkdtemp(prefix="corral-kubelet-"))  # the agents run as uid 1000: not under tmp_path
    os.chmod(work, 0o755)
    try:
        yield Kubelet(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def template_home(home: Path) -> Path:
    """A state directory holding a `default` template: the Kubernetes backend needs its name (for its image),
    never its root filesystem."""
    with TemplateStore(home).staging("d" * 64) as staging:
        staging.rootfs.mkdir()
        staging.publish(name="default", source="debootstrap", spec={}, env={})
    return home


def corral(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from corral.cli import main; main()", *args], env=env,
                          capture_output=True, text=True, timeout=280, check=False)


@pytest.mark.anyio
@pytest.mark.k8s_fake
@pytest.mark.timeout(300)
@needs_kubelet
async def test_check_backend_kubernetes_runs_items_on_pods_and_removes_them(tmp_path: Path,
                                                                            kubelet: Kubelet) -> None:
    # Items that need no /workspace: the fake kubelet runs each agent on this machine's own root filesystem,
    # which has none (a Pod has its image's), so the in-sandbox tasks of the other items cannot run here.
    fake = FakeKube(kubelet=kubelet)
    fake.objects[("services", "corral", "corral-egress")] = {
        "metadata": {"name": "corral-egress", "namespace": "corral", "resourceVersion": "1",
                     "labels": {"app.kubernetes.io/name": "corral-egress"}},
        "spec": {"clusterIP": "10.96.0.30", "ports": [{"port": 3128}]}}
    # A sandbox of a deployment sharing the namespace: the check's private server has a replica id of its own, so
    # neither its start (sweep) nor its clean-up touches this Pod.
    theirs = {"app.kubernetes.io/managed-by": "corral", "corral.dev/instance": "default",
              "corral.dev/owner": "corral-server-0", "corral.dev/sandbox": "sb-theirs"}
    fake.objects[("pods", NAMESPACE, "corral-sb-theirs")] = {
        "metadata": {"name": "corral-sb-theirs", "namespace": NAMESPACE, "resourceVersion": "2", "uid": "theirs",
                     "labels": theirs},
        "spec": {"containers": [{"name": "sandbox", "image": IMAGE}]}, "status": {"phase": "Running"}}
    home = template_home(tmp_path / "home")
    async with serve(fake, tmp_path) as kubeconfig:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "CORRAL_HOME": str(home),
               "CORRAL_K8S_IMAGES": json.dumps({"default": IMAGE}), "CORRAL_K8S_RUNTIME_CLASS": "none"}
        done = await asyncio.to_thread(corral, "check", "--backend", "kubernetes", "--namespace", NAMESPACE,
                                       "-i", "33", "-i", "43", "-i", "36", "--json", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        doc = json.loads(done.stdout)
        assert doc["backend"] == "kubernetes" and doc["ok"] is True and doc["cleanup_problems"] == []
        assert [(i["number"], i["status"]) for i in doc["items"]] == [(33, "PASS"), (36, "N/A"), (43, "PASS")]
        assert "the server runs the kubernetes backend" in doc["items"][1]["detail"]
        left = {key for key in fake.objects if key[1] == NAMESPACE}
        assert ("create", "pods") in fake.requests  # its sandboxes were Pods
        assert left == {("pods", NAMESPACE, "corral-sb-theirs")}, left  # and none of them is left
    assert not kubelet.running, "an agent outlived its Pod"


@pytest.mark.anyio
@pytest.mark.k8s_fake
@pytest.mark.timeout(300)
@needs_kubelet
@pytest.mark.parametrize("runtime_class", ["gvisor", "none"])
async def test_item_44_reads_the_sandbox_pod_and_its_network_policy_from_the_cluster(
        tmp_path: Path, kubelet: Kubelet, runtime_class: str) -> None:
    # The check reaches the cluster its private server uses: the Pod and NetworkPolicy it reads are the live ones.
    # With CORRAL_K8S_RUNTIME_CLASS=none the Pods have no RuntimeClass, and the item fails saying so.
    fake = FakeKube(kubelet=kubelet)
    fake.objects[("services", "corral", "corral-egress")] = {
        "metadata": {"name": "corral-egress", "namespace": "corral", "resourceVersion": "1",
                     "labels": {"app.kubernetes.io/name": "corral-egress"}},
        "spec": {"clusterIP": "10.96.0.30", "ports": [{"port": 3128}]}}
    home = template_home(tmp_path / "home")
    async with serve(fake, tmp_path) as kubeconfig:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "CORRAL_HOME": str(home),
               "CORRAL_K8S_IMAGES": json.dumps({"default": IMAGE}), "CORRAL_K8S_RUNTIME_CLASS": runtime_class}
        done = await asyncio.to_thread(corral, "check", "--backend", "kubernetes", "--namespace", NAMESPACE,
                                       "-i", "44", "--json", env=env)
        doc = json.loads(done.stdout)
        [item] = doc["items"]
        assert ("list", "networkpolicies") in fake.requests and ("list", "pods") in fake.requests
        assert not [key for key in fake.objects if key[1] == NAMESPACE]  # nothing left behind
    if runtime_class == "gvisor":
        assert done.returncode == 0, done.stdout + done.stderr
        assert item["status"] == "PASS" and "RuntimeClass gvisor" in item["detail"]
        assert f"in {NAMESPACE}, read from the cluster" in item["detail"]
    else:
        assert done.returncode == 1, done.stdout + done.stderr
        assert item["status"] == "FAIL" and "spec.runtimeClassName is not set" in item["detail"], item
    assert not kubelet.running, "an agent outlived its Pod"
