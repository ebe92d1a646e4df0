"""The Kubernetes backend, driven for real: the official asyncio client against the in-process fake API server
(`tests/kube_fake.py`), whose fake kubelet runs a real agent per Pod, reached over TCP with its token.

This proves how the backend uses the client (CRUD, selectors, watch with resource versions and 410, merge patches,
error Status bodies) and the agent path over TCP; it does not prove Kubernetes itself (admission, scheduling,
NetworkPolicy enforcement, gVisor, image pulls): the `k8s` tier (tests/test_k8s_cluster.py) does, on a real
cluster. Needs root (the fake kubelet runs each agent in its own PID namespace as uid 1000) and `corral[kubernetes]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes_asyncio", reason="the Kubernetes backend needs corral[kubernetes]")
import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
    pytest.skip("the fake kubelet needs root, unshare and setpriv to run agents as PID 1",
                allow_module_level=True)

from corral import AuthenticationError
from corral._exceptions import (
    ConflictError,
    CorralError,
    InvalidRequestError,
    NotFoundError,
    RuntimeUnavailableError,
    ServerError,
)
from corral.agent import protocol
from corral.backends import Limits, SandboxSpec, TCPEndpoint, backend_limitations, load_backend, supports_root
from corral.backends.kubernetes._api import k8s_errors
from corral.backends.kubernetes._backend import LIMITATIONS, KubernetesBackend, KubernetesRecord
from corral.backends.kubernetes._tokens import KEY_FILE, TokenKey
from corral.check._backend import LIMITATION_ITEMS
from corral.check._host import AGENT_TCP_LIMITATION, exposed_listeners
from corral.control import ControlStore, Role, TenantEgress
from corral.egress import EgressProxy
from corral.engine import Adoption, Engine
from corral.engine._agent_client import AgentClient
from corral.service import EgressDirectory
from corral.service._egress import recorded_denials
from corral.templates import Template

from .fakes import FakeTemplates
from .kube_fake import FakeKube, Kubelet, selector_matches, serve, write_kubeconfig

pytestmark = [pytest.mark.anyio, pytest.mark.k8s_fake]

IMAGE = "registry.example/corral/default@sha256:" + "ab" * 32
NAMESPACE = "corral-sandboxes"
PROXY_IP = "10.96.0.30"


def template(name: str = "default") -> Template:
    return Template(name=name, digest="d" * 64, rootfs=Path("/nonexistent"), env={}, created_at=datetime.now(UTC),
                    size_bytes=0, source="debootstrap", spec={})


@dataclass
class Cluster:
    fake: FakeKube
    kubeconfig: Path
    home: Path

    def backend(self, **options: object) -> KubernetesBackend:
        made = KubernetesBackend(self.home, kubeconfig=self.kubeconfig, images={"default": IMAGE},
                                 ready_timeout=20, **options)  # type: ignore[arg-type]
        return made


@pytest.fixture(scope="module")
def kubelet() -> Iterator[Kubelet]:
    # Not under pytest's tmp_path (root's, 0700): the agents run as uid 1000 and must reach their code.
    work = Path(tempfile.mkdtemp(prefix="corral-kubelet-"))
    os.chmod(work, 0o755)
    try:
        yield Kubelet(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
async def cluster(tmp_path: Path, kubelet: Kubelet) -> AsyncIterator[Cluster]:
    fake = FakeKube(kubelet=kubelet)
    fake.objects[("services", "corral", "corral-egress")] = {
        "metadata": {"name": "corral-egress", "namespace": "corral", "resourceVersion": "1",
                     "labels": {"app.kubernetes.io/name": "corral-egress"}},
        "spec": {"clusterIP": PROXY_IP, "ports": [{"port": 3128}]}}
    async with serve(fake, tmp_path) as kubeconfig:
        yield Cluster(fake, kubeconfig, tmp_path / "home")
    assert not kubelet.running, "an agent outlived its Pod"


@pytest.fixture
async def backend(cluster: Cluster) -> AsyncIterator[KubernetesBackend]:
    made = cluster.backend()
    try:
        yield made
    finally:
        await made.sweep(set())  # every sandbox a test left: their agents are killed with their Pods
        await made.close()


def agent(backend: KubernetesBackend, record: KubernetesRecord, token: str | None = None) -> AgentClient:
    address = backend.agent_address(record)
    return AgentClient(address.endpoint, token if token is not None else address.token, label=record.sandbox_id)


def new_id() -> str:
    return f"sb-{uuid.uuid4().hex[:16]}"


async def test_load_backend_finds_it_by_name(tmp_path: Path) -> None:
    made = load_backend("kubernetes", tmp_path, images={})
    assert isinstance(made, KubernetesBackend)
    assert not supports_root(made)
    assert "snapshots" in backend_limitations(made)


async def test_create_exec_files_destroy_over_tcp(cluster: Cluster, backend: KubernetesBackend) -> None:
    sid = new_id()
    record = await backend.create(sid, SandboxSpec(), template())
    assert isinstance(backend.agent_address(record).endpoint, TCPEndpoint)
    pod = cluster.fake.get("pods", NAMESPACE, record.pod)
    assert pod is not None and pod["metadata"]["labels"]["corral.dev/sandbox"] == sid
    # The Pod first: the Secret and the NetworkPolicy are owned by it from birth.
    for plural in ("secrets", "networkpolicies"):
        owned = cluster.fake.get(plural, NAMESPACE, record.pod)
        assert owned is not None
        assert owned["metadata"]["ownerReferences"][0]["uid"] == record.uid
    client = agent(backend, record)
    result = await client.exec("echo $$ hi; id -u", cwd="/tmp")
    assert result.exit_code == 0
    assert result.stdout_bytes.split()[1:] == [b"hi", b"1000"]
    assert await backend.alive(record)

    # Bytes in are bytes out over TCP: NUL, invalid UTF-8, empty, and more than one frame.
    workdir = f"/tmp/corral-k8s-{uuid.uuid4().hex}"
    await client.exec(["mkdir", "-p", workdir], cwd="/tmp")
    payloads = {"nul": b"a\x00b\x00\x00", "bad-utf8": b"\xff\xfe\xc3(", "empty": b"",
                "large": os.urandom(9 * 1024 * 1024 + 7)}
    try:
        for name, data in payloads.items():
            assert await client.write_file(f"{workdir}/{name}", data) == len(data)
            assert await client.read_file(f"{workdir}/{name}") == data
        echoed = await client.exec("cat", cwd="/tmp", stdin=payloads["bad-utf8"] + payloads["nul"])
        assert echoed.stdout_bytes == payloads["bad-utf8"] + payloads["nul"]
    finally:
        await client.exec(["rm", "-rf", workdir], cwd="/tmp")

    await backend.destroy(record)
    assert cluster.fake.get("pods", NAMESPACE, record.pod) is None
    assert cluster.fake.get("secrets", NAMESPACE, record.pod) is None
    assert cluster.fake.get("networkpolicies", NAMESPACE, record.pod) is None
    assert not await backend.alive(record)
    await backend.destroy(record)  # idempotent


async def test_a_wrong_token_is_refused_over_tcp(cluster: Cluster, backend: KubernetesBackend) -> None:
    record = await backend.create(new_id(), SandboxSpec(), template())
    other = await backend.create(new_id(), SandboxSpec(), template())
    with pytest.raises(AuthenticationError):
        await agent(backend, record, token="not-" + record.token).ping()
    with pytest.raises(AuthenticationError):  # one sandbox's token opens no other's agent
        await agent(backend, other, token=record.token).ping()
    assert (await agent(backend, record).ping()) is not None
    # The token binds the sandbox and the Pod's identity (name and uid), under the home's key.
    key = TokenKey.load(cluster.home)
    assert record.token == key.agent_token(record.sandbox_id, record.pod, record.uid)
    assert (cluster.home / KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_the_token_key_comes_from_the_shared_access_secret_when_set(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_ACCESS_SECRET", "shared by every replica")
    a, b = TokenKey.load(tmp_path / "a"), TokenKey.load(tmp_path / "b")
    assert a.agent_token("sb-1", "corral-sb-1", "uid-1") == b.agent_token("sb-1", "corral-sb-1", "uid-1")
    assert a.agent_token("sb-1", "corral-sb-1", "uid-1") != a.agent_token("sb-1", "corral-sb-1", "uid-2")
    assert a.agent_token("sb-1", "p", "u") != a.egress_credential("sb-1")
    assert not (tmp_path / "a").exists()  # no key file of its own


async def test_frames_split_into_single_bytes_still_parse(backend: KubernetesBackend) -> None:
    """The framed protocol over TCP: a request dribbled one byte per segment (partial reads) is read whole."""
    record = await backend.create(new_id(), SandboxSpec(), template())
    endpoint = backend.agent_address(record).endpoint
    assert isinstance(endpoint, TCPEndpoint)
    request = protocol.encode_json(protocol.REQUEST, {"op": "ping", "token": record.token})

    def talk() -> tuple[int, bytes]:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for byte in request:
                sock.sendall(bytes([byte]))
            header = sock.recv(protocol.HEADER.size, socket.MSG_WAITALL)
            length, kind = struct.unpack(">IB", header)
            return kind, sock.recv(length - 1, socket.MSG_WAITALL) if length > 1 else b""

    kind, payload = await asyncio.to_thread(talk)
    assert kind == protocol.EVENT, payload


async def test_sweep_removes_unknown_sandboxes_and_stray_objects(cluster: Cluster,
                                                                 backend: KubernetesBackend) -> None:
    kept = await backend.create(new_id(), SandboxSpec(), template())
    orphan = await backend.create(new_id(), SandboxSpec(), template())
    # What a crash between the steps of a create leaves: a Secret whose Pod is gone.
    ours = {"app.kubernetes.io/managed-by": "corral", "corral.dev/instance": "default"}
    stray: dict[str, Any] = {"metadata": {"name": "corral-sb-stray", "labels": ours}, "data": {"token": ""}}
    await cluster.fake.put("secrets", NAMESPACE, stray, "ADDED")
    stray["metadata"]["namespace"] = NAMESPACE
    # Another deployment's sandbox in the same namespace is not ours to sweep.
    other = cluster.backend(instance="other")
    theirs = await other.create(new_id(), SandboxSpec(), template())
    try:
        assert await backend.sweep({kept.sandbox_id}) == [orphan.sandbox_id]
        assert cluster.fake.get("pods", NAMESPACE, orphan.pod) is None
        assert cluster.fake.get("secrets", NAMESPACE, "corral-sb-stray") is None
        assert await backend.alive(kept) and await other.alive(theirs)
    finally:
        await other.sweep(set())
        await other.close()


async def test_replicas_with_owner_names_sweep_only_their_own(cluster: Cluster) -> None:
    a, b = cluster.backend(owner="replica-a"), cluster.backend(owner="replica-b")
    try:
        mine = await a.create(new_id(), SandboxSpec(), template())
        theirs = await b.create(new_id(), SandboxSpec(), template())
        assert await a.sweep(set()) == [mine.sandbox_id]
        assert await b.alive(theirs) and not await a.alive(mine)
    finally:
        for backend in (a, b):
            await backend.sweep(set())
            await backend.close()


async def test_a_replica_owns_its_pods_by_its_id(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """`corral serve` passes no backend options: a replica's id (`CORRAL_REPLICA_ID`, which the reference
    deployment sets to the Pod's name) is what keeps replicas' sweeps apart."""
    monkeypatch.setenv("CORRAL_REPLICA_ID", "corral-server-abc12")
    mine = cluster.backend()
    other = cluster.backend(owner="replica-b")
    try:
        assert mine.owner == "corral-server-abc12"
        record = await mine.create(new_id(), SandboxSpec(), template())
        assert await other.sweep(set()) == [] and await mine.alive(record)
    finally:
        for backend in (mine, other):
            await backend.sweep(set())
            await backend.close()


async def test_restore_and_adopt_after_a_new_backend(cluster: Cluster, backend: KubernetesBackend) -> None:
    record = await backend.create(new_id(), SandboxSpec(), template())
    await backend.close()
    again = cluster.backend()
    try:
        restored = again.restore(record.to_json())
        assert restored == record
        await again.adopt(restored)
        assert await again.alive(restored)
        assert (await agent(again, restored).exec("echo back", cwd="/tmp")).stdout_bytes == b"back\n"
        with pytest.raises(ValueError):
            again.restore({**record.to_json(), "backend": "docker"})
    finally:
        await again.destroy(record)
        await again.close()


async def test_a_watch_answered_410_lists_again(cluster: Cluster, backend: KubernetesBackend) -> None:
    cluster.fake.force_gone = 1
    cluster.fake.pod_start_delay = 0.3  # so that the wait reaches its watch before the Pod runs
    record = await backend.create(new_id(), SandboxSpec(), template())
    assert cluster.fake.gone_sent == 1
    assert await backend.alive(record)


async def test_a_taken_name_is_a_conflict(cluster: Cluster, backend: KubernetesBackend) -> None:
    sid = new_id()
    await backend.create(sid, SandboxSpec(), template())
    with pytest.raises(ConflictError, match="already exists"):
        await backend.create(sid, SandboxSpec(), template())


async def test_a_missing_rbac_permission_is_named(cluster: Cluster, backend: KubernetesBackend) -> None:
    cluster.fake.forbid("create", "secrets")
    with pytest.raises(RuntimeUnavailableError, match=r"RBAC permission to create secrets in namespace") as info:
        await backend.create(new_id(), SandboxSpec(), template())
    assert info.value.details["kubernetes_status"] == 403
    assert 'cannot create resource "secrets"' in info.value.message
    # Nothing of the half-made sandbox is left.
    assert not cluster.fake.pods(NAMESPACE)
    assert not [k for k in cluster.fake.objects if k[0] == "networkpolicies"]


async def test_an_invalid_object_is_an_invalid_request(backend: KubernetesBackend) -> None:
    with pytest.raises(InvalidRequestError, match="RFC 1123"):
        await backend.api.create({"kind": "Secret", "metadata": {"name": "Not_Valid"}, "data": {}})


async def test_unsupported_operations_say_why(backend: KubernetesBackend) -> None:
    record = KubernetesRecord(sandbox_id="sb-x", pod="corral-sb-x", uid="u", ip="127.0.0.9", token="t")
    for call in (backend.pause(record), backend.stop(record), backend.snapshot(record, "s"),
                 backend.create_volume("v", 1)):
        with pytest.raises(RuntimeUnavailableError, match="not available on the Kubernetes backend"):
            await call
    with pytest.raises(InvalidRequestError, match="root"):
        await backend.create(new_id(), SandboxSpec(root=True), template())


async def test_egress_env_names_the_proxy_service_with_a_credential(backend: KubernetesBackend) -> None:
    record = await backend.create(new_id(), SandboxSpec(), template())
    env = backend.egress_env(record)
    prefix = f"http://{record.sandbox_id}:"
    assert env["HTTP_PROXY"] == env["https_proxy"] and env["HTTP_PROXY"].startswith(prefix)
    assert env["HTTP_PROXY"].endswith(f"@{PROXY_IP}:3128")
    credential = env["HTTP_PROXY"][len(prefix):].partition("@")[0]
    assert len(credential) >= 40 and credential not in record.token
    assert credential not in str(record.to_json())  # derived when needed, never stored
    # The proxy checks it with the key alone; another sandbox's credential does not pass for this one.
    key = TokenKey.load(backend.home)
    assert key.verify_egress(record.sandbox_id, credential)
    other = dataclasses.replace(record, sandbox_id=new_id())
    assert not key.verify_egress(other.sandbox_id, credential)
    assert backend.egress_env(other)["HTTP_PROXY"] != env["HTTP_PROXY"]
    # The proxy itself is asked directly (its package mirror); pip's index only when @packages is granted.
    assert PROXY_IP in env["NO_PROXY"].split(",") and "PIP_INDEX_URL" not in env
    packages = backend.egress_env(record, packages=True)
    assert packages["PIP_INDEX_URL"] == env["HTTP_PROXY"] + "/pypi/simple/"


async def test_capacity_from_node_allocatable(cluster: Cluster, backend: KubernetesBackend) -> None:
    cluster.fake.nodes = [{"metadata": {"name": f"n{i}"}, "status": {"allocatable": {"memory": "16Gi",
                                                                                    "pods": "110"}}}
                          for i in range(2)]
    found = await backend.capacity()
    assert found.memory_total == 32 * 1024**3 and found.sandboxes_max == 220
    asked = cluster.fake.requests.count(("list", "nodes"))
    assert await backend.capacity() == found and cluster.fake.requests.count(("list", "nodes")) == asked  # kept
    cluster.fake.forbid("list", "nodes")
    fresh = cluster.backend()
    try:
        assert (await fresh.capacity()).memory_total is None
    finally:
        await fresh.close()


async def test_a_warm_pod_serves_create_and_the_pool_refills(cluster: Cluster) -> None:
    backend = cluster.backend(pool={"default": 1})
    try:
        await backend.fill_pools()
        warm = await _wait_warm(backend, 1)
        record = await backend.create(new_id(), SandboxSpec(), template())
        assert record.pod == warm[0]["metadata"]["name"]
        pod = cluster.fake.get("pods", NAMESPACE, record.pod)
        assert pod is not None and "corral.dev/pool" not in pod["metadata"]["labels"]
        assert pod["spec"]["activeDeadlineSeconds"] >= 300
        assert (await agent(backend, record).exec("echo warm", cwd="/tmp")).stdout_bytes == b"warm\n"
        refilled = await _wait_warm(backend, 1)  # the background task makes another
        assert refilled[0]["metadata"]["name"] != record.pod
        # A sandbox of another shape is made cold, and leaves the warm Pod alone.
        cold = await backend.create(new_id(), SandboxSpec(limits=Limits(memory=256 * 1024**2)), template())
        assert not cold.pod.startswith("corral-warm-")
    finally:
        await backend.sweep(set())
        for pod in cluster.fake.pods(NAMESPACE):
            await cluster.fake.remove("pods", NAMESPACE, pod["metadata"]["name"])
        await backend.close()


async def _wait_warm(backend: KubernetesBackend, count: int) -> list[dict[str, Any]]:
    for _ in range(200):
        ready = await backend.warm_pods("default")
        if len(ready) >= count:
            return ready
        await asyncio.sleep(0.05)
    raise AssertionError("the warm pool did not fill in 10 s")


async def test_the_engine_runs_sandboxes_on_it(cluster: Cluster, backend: KubernetesBackend) -> None:
    engine = Engine(cluster.home, backend=backend, templates=FakeTemplates())  # type: ignore[arg-type]
    await engine.start()
    try:
        sb = await engine.create(SandboxSpec(template="default"))
        result = await engine.get(sb.id).exec("echo $HTTP_PROXY", cwd="/tmp")
        assert result.exit_code == 0
        assert result.stdout_bytes.decode().startswith(f"http://{sb.id}:")
        await engine.destroy(sb.id)
        assert not cluster.fake.pods(NAMESPACE)
    finally:
        await engine.close(destroy_all=True)


# -- the agent's TCP mode, alone ----------------------------------------------------------------------------------


def _agent_alone(kubelet: Kubelet, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """The agent as the fake kubelet runs it (uid 1000, PID 1 of its namespace), expected to refuse at once."""
    argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "setpriv", "--reuid=1000",
            "--regid=1000", "--clear-groups", "/usr/bin/python3", "-S", "-B", "-c",
            "from agent.__main__ import main; main()"]
    return subprocess.run(argv, cwd=kubelet.agent_dir.parent, env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, timeout=30, check=False)


def test_an_unreadable_token_file_refuses_to_serve(kubelet: Kubelet) -> None:
    done = _agent_alone(kubelet, {"CORRAL_AGENT_TCP": "127.0.0.251:7771",
                                  "CORRAL_AGENT_TOKEN_FILE": "/nonexistent/token"})
    assert done.returncode == 2
    assert b"cannot read the token file /nonexistent/token" in done.stderr
    assert b"no token given; refusing to serve" in done.stderr


def test_an_empty_token_file_refuses_to_serve(kubelet: Kubelet) -> None:
    token = Path(tempfile.mkdtemp(prefix="corral-token-")) / "token"
    try:
        token.write_text("\n")
        os.chmod(token.parent, 0o755)
        os.chmod(token, 0o444)
        done = _agent_alone(kubelet, {"CORRAL_AGENT_TCP": "127.0.0.251:7771",
                                      "CORRAL_AGENT_TOKEN_FILE": str(token)})
    finally:
        shutil.rmtree(token.parent)
    assert done.returncode == 2 and b"no token given" in done.stderr


def test_a_bad_tcp_address_refuses_to_serve(kubelet: Kubelet) -> None:
    done = _agent_alone(kubelet, {"CORRAL_AGENT_TCP": "127.0.0.251:not-a-port", "CORRAL_AGENT_TOKEN": "t"})
    assert done.returncode == 2 and b"cannot listen on '127.0.0.251:not-a-port'" in done.stderr


def test_serve_settings_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_K8S_NAMESPACE", "sandboxes-a")
    monkeypatch.setenv("CORRAL_K8S_RUNTIME_CLASS", "none")
    monkeypatch.setenv("CORRAL_K8S_POOL", "default=3, python=1")
    monkeypatch.setenv("CORRAL_K8S_IMAGES", '{"default": "r.example/d@sha256:00"}')
    made = KubernetesBackend(tmp_path)
    assert made.settings.namespace == "sandboxes-a" and made.settings.runtime_class is None
    assert made.pool_sizes == {"default": 3, "python": 1}
    assert made.images == {"default": "r.example/d@sha256:00"}
    assert KubernetesBackend(tmp_path, namespace="explicit", runtime_class="kata").settings.runtime_class == "kata"
    assert not made.settings.user_namespace
    monkeypatch.setenv("CORRAL_K8S_USER_NAMESPACE", "1")
    assert KubernetesBackend(tmp_path).settings.user_namespace
    assert not KubernetesBackend(tmp_path, user_namespace=False).settings.user_namespace  # an option wins
    monkeypatch.setenv("CORRAL_K8S_USER_NAMESPACE", "maybe")
    with pytest.raises(InvalidRequestError, match="CORRAL_K8S_USER_NAMESPACE must be 1 or 0"):
        KubernetesBackend(tmp_path)


async def test_two_creates_racing_for_one_warm_pod_both_succeed(cluster: Cluster) -> None:
    """The claim is conditional on the Pod's resourceVersion: one create wins it, the other makes a cold Pod."""
    backend = cluster.backend(pool={"default": 1})
    try:
        await backend.fill_pools()
        warm = (await _wait_warm(backend, 1))[0]["metadata"]["name"]
        first, second = await asyncio.gather(*(backend.create(new_id(), SandboxSpec(), template())
                                               for _ in range(2)))
        assert sorted([first.pod == warm, second.pod == warm]) == [False, True]
        for record in (first, second):
            assert (await agent(backend, record).exec("echo ok", cwd="/tmp")).stdout_bytes == b"ok\n"
    finally:
        await backend.sweep(set())
        await backend.close()


class _LocalProxyNotForPods:
    """An engine's local egress proxy: a backend with `RemoteEgress` must never be attached to it."""

    def __init__(self) -> None:
        self.detached: list[str] = []

    async def attach(self, *args: object) -> None:
        raise AssertionError("a Kubernetes sandbox was attached to the engine's local egress proxy")

    async def detach(self, sandbox_id: str) -> None:
        self.detached.append(sandbox_id)

    def denials(self, sandbox_id: str, since: float) -> list[object]:
        return []

    def set_policy(self, *args: object) -> None:
        pass


async def test_the_engine_gives_remote_egress_instead_of_its_local_proxy(cluster: Cluster,
                                                                        backend: KubernetesBackend) -> None:
    proxy = _LocalProxyNotForPods()
    engine = Engine(cluster.home, backend=backend, templates=FakeTemplates(),  # type: ignore[arg-type]
                    egress=proxy)  # type: ignore[arg-type]
    await engine.start()
    try:
        sb = await engine.create(SandboxSpec(template="default", network="internet"))
        result = await engine.get(sb.id).exec("env | grep -iE '^https?_proxy=' | sort", cwd="/tmp")
        lines = result.stdout_bytes.decode().splitlines()
        assert len(lines) == 4 and all(f"=http://{sb.id}:" in line and f"@{PROXY_IP}:3128" in line
                                       for line in lines), lines
        assert "127.0.0.1:3128" not in result.stdout_bytes.decode()  # neither the local proxy nor its mirror
        await engine.destroy(sb.id)
    finally:
        await engine.close(destroy_all=True)


async def test_commands_in_pods_go_out_through_the_standalone_proxy_and_see_its_refusals(
        cluster: Cluster, tmp_path: Path) -> None:
    """The whole egress path of a Pod: the proxy URL in the command's environment -> `corral egress-proxy`'s
    listener (here on loopback; the fake kubelet's agents share the host's network) -> the policy from the shared
    database -> the refusal recorded before it is answered -> the command's result lists it."""
    store = ControlStore(f"sqlite+aiosqlite:///{tmp_path / 'corral.db'}", home=tmp_path)
    await store.start()
    upstream = await asyncio.start_server(_answer_ok, "127.0.0.2", 0)  # not 127.0.0.1: that is in NO_PROXY
    up_port = upstream.sockets[0].getsockname()[1]
    tenant = await store.create_tenant("acme")
    await store.grants.grant(tenant.id, f"127.0.0.2:{up_port}")  # an admin's grant (docs/egress.md)
    await store.set_tenant_egress(tenant.id, TenantEgress(private=[f"127.0.0.2:{up_port}"]))
    principal = await store.key_principal((await store.create_key(tenant.id, Role.OPERATOR)).info.id)
    directory = EgressDirectory(store, TokenKey.load(cluster.home).verify_egress)
    proxy = EgressProxy(on_event=directory.record)
    (_, proxy_port), *_ = await proxy.listen("127.0.0.1", 0, directory.policy)
    backend = cluster.backend(egress_proxy=f"127.0.0.1:{proxy_port}")
    engine = Engine(cluster.home, backend=backend, templates=FakeTemplates())  # type: ignore[arg-type]
    engine.remote_denials = lambda sandbox_id, since: recorded_denials(store, sandbox_id, since)
    await engine.start()
    try:
        spec = SandboxSpec(template="default", network=["127.0.0.2"])
        record = await store.reserve_sandbox(principal, spec, sandbox_id=new_id())  # the service's kind of id
        sb = await engine.create(spec, sandbox_id=record.id)
        await store.mark_running(sb.id)
        curl = "curl -sS -o /dev/null -w '%{http_code}' --max-time 10 "
        allowed = await engine.get(sb.id).exec(curl + f"http://127.0.0.2:{up_port}/", cwd="/tmp")
        assert allowed.stdout_bytes == b"200" and allowed.egress_denials == (), allowed
        refused = await engine.get(sb.id).exec(curl + "http://blocked.example/ https://pypi.org/", cwd="/tmp")
        assert refused.stdout_bytes.startswith(b"403"), refused
        assert [(d.host, d.port) for d in refused.egress_denials] == [("blocked.example", 80), ("pypi.org", 443)]
        assert "not in this sandbox's allowlist" in refused.egress_denials[0].reason
        await engine.destroy(sb.id)
    finally:
        await engine.close(destroy_all=True)
        await backend.close()
        await proxy.close()
        upstream.close()
        await store.close()


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
    writer.close()


# -- the fake itself, where the backend's tests rely on it ----------------------------------------------------------


@pytest.mark.parametrize(("selector", "expected"), [
    ("", True), ("a=1", True), ("a==1", True), ("a=2", False), ("a!=2", True), ("a!=1", False),
    ("a in (1, 2)", True), ("a in (2,3)", False), ("a notin (2)", True), ("a notin (1)", False),
    ("z notin (1)", True), ("a", True), ("z", False), ("!z", True), ("!a", False), ("a=1,b in (x,y)", True),
    ("a=1,b=z", False),
])
def test_the_fake_label_selectors(selector: str, expected: bool) -> None:
    assert selector_matches(selector, {"a": "1", "b": "x"}) is expected


async def test_an_unreachable_api_server_is_runtime_unavailable(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    backend = KubernetesBackend(tmp_path, kubeconfig=write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}"),
                                images={"default": IMAGE})
    try:
        with pytest.raises(RuntimeUnavailableError, match=r"not reachable|failed"):
            await backend.create(new_id(), SandboxSpec(), template())
    finally:
        await backend.close()


async def test_deleting_the_pod_ends_every_process_of_the_sandbox(cluster: Cluster,
                                                                 backend: KubernetesBackend) -> None:
    record = await backend.create(new_id(), SandboxSpec(), template())
    marker = f"{uuid.uuid4().int % 10**9 + 10**9}"
    await agent(backend, record).exec(f"setsid nohup sleep {marker} >/dev/null 2>&1 &", cwd="/tmp")
    found = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, check=False)
    assert found.returncode == 0, "the background process did not start"
    await backend.destroy(record)
    for _ in range(100):
        if subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, check=False).returncode:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("a process of the deleted Pod outlived it")


async def test_no_permission_to_find_the_egress_proxy_is_named_before_anything_is_made(
        cluster: Cluster, backend: KubernetesBackend) -> None:
    cluster.fake.forbid("list", "services")
    with pytest.raises(RuntimeUnavailableError, match="RBAC permission to list services in namespace corral"):
        await backend.create(new_id(), SandboxSpec(), template())
    assert not cluster.fake.pods(NAMESPACE)


async def test_a_restarted_engine_reattaches_its_pods_and_sweeps_the_rest(cluster: Cluster) -> None:
    first = Engine(cluster.home, backend=cluster.backend(), templates=FakeTemplates())  # type: ignore[arg-type]
    await first.start()
    try:
        kept = await first.create(SandboxSpec(template="default"))
    finally:
        await first.close()  # the sandboxes outlive it
    outsider = cluster.backend()
    try:
        orphan = await outsider.create(new_id(), SandboxSpec(), template())  # no engine knows it
    finally:
        await outsider.close()
    second = Engine(cluster.home, backend=cluster.backend(), templates=FakeTemplates())  # type: ignore[arg-type]
    await second.start(adopt={kept.id: Adoption(spec=SandboxSpec(template="default"))})  # the store's word
    try:
        assert [info.id for info in second.list()] == [kept.id]
        assert (await second.get(kept.id).exec("echo again", cwd="/tmp")).stdout_bytes == b"again\n"
        assert cluster.fake.get("pods", NAMESPACE, orphan.pod) is None  # swept at start
    finally:
        await second.close(destroy_all=True)
    assert not cluster.fake.pods(NAMESPACE)


async def test_a_sweep_leaves_what_another_replica_claimed_from_its_pool(cluster: Cluster) -> None:
    """A warm Pod made by replica A and claimed by B is B's: A's sweep must not delete it, nor (worse: the
    sandbox's network would open) its NetworkPolicy, which still carries A's owner label."""
    a = cluster.backend(owner="replica-a", pool={"default": 1})
    b = cluster.backend(owner="replica-b", pool={"default": 1})
    try:
        await a.fill_pools()
        warm = (await _wait_warm(a, 1))[0]["metadata"]["name"]
        record = await b.create(new_id(), SandboxSpec(), template())
        assert record.pod == warm
        await a.close()  # its pool stops refilling
        assert await a.sweep(set()) == []
        assert cluster.fake.get("networkpolicies", NAMESPACE, record.pod) is not None
        assert cluster.fake.get("secrets", NAMESPACE, record.pod) is not None
        assert await b.alive(record)
        assert await b.sweep(set()) == [record.sandbox_id]
    finally:
        for backend in (a, b):
            await backend.sweep(set())
            await backend.close()


async def test_warm_pods_outlive_a_restart_unless_no_pool_wants_them(cluster: Cluster) -> None:
    first = cluster.backend(pool={"default": 1})
    try:
        await first.fill_pools()
        warm = (await _wait_warm(first, 1))[0]["metadata"]["name"]
    finally:
        await first.close()
    same = cluster.backend(pool={"default": 1})
    try:
        await same.sweep(set())
        assert cluster.fake.get("pods", NAMESPACE, warm) is not None  # ready for the next create
    finally:
        await same.close()
    repushed = KubernetesBackend(cluster.home, kubeconfig=cluster.kubeconfig, pool={"default": 1},
                                 images={"default": IMAGE.replace("ab", "cd")})
    try:
        await repushed.sweep(set())
        assert cluster.fake.get("pods", NAMESPACE, warm) is None  # an old image nothing will claim
        assert cluster.fake.get("secrets", NAMESPACE, warm) is None
    finally:
        await repushed.close()



# -- the error boundary ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "error"), [
    (400, InvalidRequestError), (403, RuntimeUnavailableError), (404, NotFoundError), (409, ConflictError),
    (410, ServerError), (422, InvalidRequestError), (429, ServerError), (500, RuntimeUnavailableError),
    (503, RuntimeUnavailableError), (0, RuntimeUnavailableError),
])
def test_every_api_status_becomes_a_corral_error(status: int, error: type[CorralError]) -> None:
    body = json.dumps({"kind": "Status", "message": f"the server's words for {status}", "code": status})
    upstream = ApiException(status=status, reason="Reason")
    upstream.body = body.encode()  # as the client keeps it: the raw response
    with pytest.raises(error) as info, k8s_errors("create", "pods", NAMESPACE, "corral-sb-1"):
        raise upstream
    assert type(info.value) is error and info.value.__cause__ is upstream
    assert f"the server's words for {status}" in info.value.message


@pytest.mark.parametrize("upstream", [aiohttp.ClientConnectionError("refused"), OSError("unreachable"),
                                      TimeoutError()])
def test_transport_failures_are_runtime_unavailable(upstream: Exception) -> None:
    with pytest.raises(RuntimeUnavailableError, match="not reachable"), k8s_errors("list", "pods", NAMESPACE):
        raise upstream


def test_checklist_item_2_allows_only_the_agents_own_tcp_listener_on_kubernetes() -> None:
    loopback, agent, extra = ["tcp", "0100007F:1F90"], ["tcp", "00000000:1E5B"], ["tcp6", "0" * 32 + ":1F91"]
    declared = {AGENT_TCP_LIMITATION: "the agent listens on the Pod's IP"}
    assert exposed_listeners([loopback, agent], declared) == ([], "tcp 00000000:1E5B")
    assert exposed_listeners([loopback, agent], {})[0] == ["tcp 00000000:1E5B"]  # elsewhere: exposed
    # Two non-loopback listeners: one is not the agent's, so both are reported.
    assert len(exposed_listeners([agent, extra], declared)[0]) == 2
    assert AGENT_TCP_LIMITATION in LIMITATIONS and LIMITATION_ITEMS[AGENT_TCP_LIMITATION] == (2,)


async def test_a_pod_that_fails_is_reported_and_removed(cluster: Cluster, backend: KubernetesBackend) -> None:
    cluster.fake.crash_next_pod = "exec /usr/bin/python3: no such file or directory"
    with pytest.raises(ServerError, match=r"ended before it served: phase Failed.*no such file or directory"):
        await backend.create(new_id(), SandboxSpec(), template())
    assert not [key for key in cluster.fake.objects if key[0] != "services"]


async def test_a_cancelled_create_leaves_nothing(cluster: Cluster, backend: KubernetesBackend) -> None:
    cluster.fake.pod_start_delay = 5.0  # the create is waiting for its Pod when it is cancelled
    task = asyncio.create_task(backend.create(new_id(), SandboxSpec(), template()))
    for _ in range(200):
        if any(key[0] == "secrets" for key in cluster.fake.objects):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the create did not get as far as its Secret")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [key for key in cluster.fake.objects if key[0] != "services"]
