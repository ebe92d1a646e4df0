"""The Kubernetes backend: each sandbox is a Pod (docs/kubernetes-backend.md).

`corral serve --backend kubernetes` runs sandboxes as Pods of one namespace, through the official asyncio client
(`corral[kubernetes]`, `_api`). A sandbox is three objects named alike (`_objects` builds them): the Pod (the
template's image by digest, the agent as PID 1 listening on TCP), a NetworkPolicy (ingress to the agent's port
from the control plane's Pods only; egress to the egress proxy's Pods only) and a Secret holding the agent's
token, mounted read-only.

Order of creation: the Pod first, then the NetworkPolicy, then the Secret. The Pod cannot start before its
Secret volume exists (the kubelet waits for it), so it never runs without its NetworkPolicy; the Pod's uid is
known before the other two are made, so they carry an ownerReference to it from birth (the garbage collector
removes them with the Pod, whoever deletes it) and the token can bind that uid (`_tokens`). A crash between the
steps leaves a Pod waiting for its Secret, which `sweep` finds by label.

Warm Pods: with `pool={"default": 2}`, that many ready Pods per template wait, labelled `corral.dev/pool=<key of
their image>`; `create` claims one with a conditional merge patch (its `resourceVersion`: two replicas never
claim the same Pod) that swaps the pool label for the sandbox's and sets the Pod's deadline from the sandbox's
timeout, and a background task makes a new one. A warm Pod's token is made before any sandbox id exists: it binds
the Pod alone, and the record keeps it. Only a sandbox with the pool's shape (default limits, no volumes) is
served warm; any other is made cold.

Egress: sandboxes reach only the egress proxy's Service (NetworkPolicy), at its ClusterIP (no cluster DNS from
sandboxes), with `<sandbox id>:<credential>@` in the proxy URL: the proxy knows a sandbox by that credential,
never by its IP. The engine puts these variables into every command's environment (`egress_env`, the
`RemoteEgress` capability of the contract), which is also why a warm Pod, made before its sandbox id was known,
needs nothing changed to get them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..._exceptions import ConflictError, InvalidRequestError, NotFoundError, RuntimeUnavailableError, ServerError
from ..._settings import k8s_backend, k8s_images, replica_id
from ...templates import Template
from .._contract import (
    CHECKPOINTS_LIMITATION,
    JSON,
    ROOT_LIMITATION,
    AgentAddress,
    BackendCapacity,
    BackendRecord,
    SandboxUsage,
    SnapshotArtifact,
    TCPEndpoint,
    UnixEndpoint,
)
from .._spec import Limits, SandboxSpec
from ._api import KubeAPI
from ._objects import ClusterSettings, sandbox_objects
from ._tokens import TokenKey

__all__ = ["LIMITATIONS", "KubernetesBackend", "KubernetesRecord"]

logger = logging.getLogger("corral.backends.kubernetes")

LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_INSTANCE = "corral.dev/instance"  # one Corral deployment's objects (replicas share it)
LABEL_OWNER = "corral.dev/owner"  # the replica that made a sandbox, when replicas say who they are (`owner`)
LABEL_SANDBOX = "corral.dev/sandbox"
LABEL_POOL = "corral.dev/pool"
READY_TIMEOUT = 120.0  # a cold Pod: scheduling and an image pull
AGENT_READY_TIMEOUT = 30.0
CAPACITY_TTL = 30.0
POOL_INTERVAL = 2.0  # seconds between looks at the warm pools when nothing asks for a refill
_POOL_BATCH = 8  # warm Pods made per pool per round: a burst of claims never becomes a burst of creates
_DEADLINE_GRACE = 60  # seconds past the sandbox's timeout before the kubelet ends the Pod (Corral reaps first)
_SAFE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,48}[a-z0-9])?")
_MIB = 1024**2
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")

LIMITATIONS: dict[str, str] = {
    ROOT_LIMITATION: (
        "no sandbox with root (root=True): Pods run under Pod Security `restricted` (runAsNonRoot, no "
        "capabilities), which is what keeps a Pod from reaching its node"),
    "user_namespace": (
        "no per-sandbox user namespace of Corral's own: isolation is the RuntimeClass's (gVisor by default, "
        "its own kernel) and Pod Security `restricted`; CORRAL_K8S_USER_NAMESPACE=1 asks Kubernetes for one per "
        "Pod (hostUsers: false) where the runtime supports it"),
    "agent_tcp": (
        "the agent listens on TCP at the Pod's IP (a Unix socket cannot leave the Pod), the one non-loopback "
        "listener of a sandbox: each request carries a per-sandbox token (an HMAC of the sandbox and the Pod), and "
        "the NetworkPolicy admits only the control plane's Pods to the port; sandbox code, which shares the "
        "agent's uid, can read its own token, which opens only its own agent"),
    "snapshots": "no snapshots, pause or pause to disk on Kubernetes yet: a Pod's filesystem is not kept",
    "volumes": "no volumes on Kubernetes yet (they would be PersistentVolumeClaims)",
    CHECKPOINTS_LIMITATION: (
        "no checkpoints or in-place restore on Kubernetes yet: a Pod's writable layer is the node's container "
        "runtime's, out of the control plane's reach, and a Pod cannot be stopped and started again on it"),
}


@dataclass(frozen=True)
class KubernetesRecord(BackendRecord):
    """One sandbox's Pod: its name and uid (a Pod made again under the name is another Pod), its IP (fixed for
    the Pod's life), its agent's token, and the egress proxy it was given ("" for none)."""

    pod: str
    uid: str
    ip: str
    token: str
    template: str = ""
    proxy: str = ""  # host:port of the egress proxy Service

    def to_json(self) -> JSON:
        return {"backend": "kubernetes", "sandbox_id": self.sandbox_id, "pod": self.pod, "uid": self.uid,
                "ip": self.ip, "token": self.token, "template": self.template, "proxy": self.proxy}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KubernetesRecord:
        """`ValueError` unless `data` is what `to_json` made."""
        if not isinstance(data, Mapping) or data.get("backend") != "kubernetes":
            raise ValueError("not a Kubernetes backend record")
        keys = ("sandbox_id", "pod", "uid", "ip", "token", "template", "proxy")
        try:
            fields = {key: data[key] for key in keys}
        except KeyError as exc:
            raise ValueError(f"not a Kubernetes backend record: {exc!r} is missing") from None
        if not all(isinstance(value, str) for value in fields.values()):
            raise ValueError("not a Kubernetes backend record: every field is a string")
        if not _SAFE_NAME.fullmatch(fields["pod"]):
            raise ValueError(f"not a Kubernetes backend record: pod name {fields['pod']!r}")
        return cls(**fields)


class KubernetesBackend:
    """Sandboxes as Pods of one namespace; see docs/kubernetes-backend.md.

    **Parameters:**
    * **home** - the state directory (the token key, `k8s-agent.key`, unless `CORRAL_ACCESS_SECRET` is set; the
      image map `kubernetes/images.json`).
    * **namespace**, **runtime_class**, **agent_port**, **control_namespace** - see `ClusterSettings`.
    * **images** - template name or digest -> image reference by digest (`corral templates push` makes them);
      default `$CORRAL_K8S_IMAGES` (JSON, or a file of it), else `<home>/kubernetes/images.json`.
    * **pool** - template name -> how many warm Pods to keep ready.
    * **kubeconfig**, **context** - default: `$KUBECONFIG` or `~/.kube/config`, else the in-cluster account.
    * **egress_proxy** - `host:port` of the egress proxy's Service; default: the ClusterIP of the Service in the
      control namespace labelled as `ClusterSettings.egress_labels`.
    * **instance** - the value of `corral.dev/instance` on every object: `sweep` touches only its own.
    * **owner** - this replica's stable name (`corral.dev/owner`; default `$CORRAL_REPLICA_ID`): with it, `sweep`
      and the warm pool touch only this replica's objects. Without it (one server), `sweep` removes every sandbox
      of the instance that this engine does not know: replicas that share an instance must each have one.
    * **ready_timeout** - seconds a cold Pod may take to run.
    """

    name = "kubernetes"
    limitations: Mapping[str, str] = MappingProxyType(LIMITATIONS)  # `DeclaresLimitations`

    def __init__(self, home: Path, *, namespace: str | None = None, runtime_class: str | None = "gvisor",
                 agent_port: int = 7771, control_namespace: str = "corral", images: Mapping[str, str] | None = None,
                 pool: Mapping[str, int] | None = None, kubeconfig: str | Path | None = None,
                 context: str | None = None, egress_proxy: str | None = None, instance: str = "default",
                 owner: str = "", ready_timeout: float = READY_TIMEOUT, user_namespace: bool | None = None,
                 settings: ClusterSettings | None = None) -> None:
        self.home = Path(home)
        env = k8s_backend()  # what `corral serve` cannot pass as options; an option given wins
        if "runtime_class" in env and runtime_class == "gvisor":
            runtime_class = None if env["runtime_class"] == "none" else env["runtime_class"]
        if pool is None and "pool" in env:
            pool = _parse_pool(env["pool"])
        self.settings = settings or ClusterSettings(
            namespace=namespace or env.get("namespace", "corral-sandboxes"),
            control_namespace=env.get("control_namespace", control_namespace) if control_namespace == "corral"
            else control_namespace,
            runtime_class=runtime_class, agent_port=agent_port,
            user_namespace=_flag(env.get("user_namespace", "0")) if user_namespace is None else user_namespace)
        self.api = KubeAPI(self.settings.namespace, kubeconfig=kubeconfig, context=context)
        self.images = dict(images) if images is not None else _load_images(self.home)
        self.pool_sizes = {name: size for name, size in (pool or {}).items() if size > 0}
        self.instance = instance
        # A replica's objects are its own (docs/replicas.md): its id is the owner unless one is given.
        self.owner = owner or replica_id() or ""
        self._ready_timeout = ready_timeout
        self._egress_proxy = egress_proxy
        self._key: TokenKey | None = None
        self._refill = asyncio.Event()
        self._pool_task: asyncio.Task[None] | None = None
        self._capacity: tuple[float, BackendCapacity] | None = None

    # -- the contract ------------------------------------------------------------------------------

    async def check(self, spec: SandboxSpec) -> None:
        _refuse_unsupported(spec)

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template,
                     source: SnapshotArtifact | None = None) -> KubernetesRecord:
        if source is not None:
            raise RuntimeUnavailableError(f"snapshots are not available on the Kubernetes backend: "
                                          f"{LIMITATIONS['snapshots']}", details={"backend": self.name})
        _refuse_unsupported(spec)
        image = self._image(template)
        await self._proxy()  # looked up (once) before anything is made: a refusal leaves nothing behind
        self._start_pool()
        if (record := await self._claim(sandbox_id, spec, template, image)) is not None:
            return record
        return await self._create_cold(sandbox_id, spec, template, image)

    def agent_address(self, record: BackendRecord) -> AgentAddress:
        rec = _k8s(record)
        return AgentAddress(TCPEndpoint(rec.ip, self.settings.agent_port), rec.token)

    def ready_timeout(self, record: BackendRecord) -> float:
        return AGENT_READY_TIMEOUT

    def egress_endpoint(self, record: BackendRecord) -> UnixEndpoint:
        raise RuntimeUnavailableError("the Kubernetes backend has no local egress socket: its sandboxes reach the "
                                      "egress proxy Service (`egress_env`)")

    def egress_env(self, record: BackendRecord, *, packages: bool = False) -> Mapping[str, str]:
        """`RemoteEgress`: the proxy variables of every command, with the sandbox's credential in the URL;
        none when no proxy is known (the NetworkPolicy lets nothing else out). With `packages`, pip's index is
        the proxy's package mirror, asked directly (the proxy is in NO_PROXY), with the same credential."""
        rec = _k8s(record)
        if not rec.proxy:
            return {}
        credential = self._tokens().egress_credential(rec.sandbox_id)  # derived: never stored
        url = f"http://{rec.sandbox_id}:{credential}@{rec.proxy}"
        no_proxy = ",".join(["localhost", "127.0.0.1", "::1", rec.proxy.rpartition(":")[0]])
        env = {**dict.fromkeys(_PROXY_VARS, url), "NO_PROXY": no_proxy, "no_proxy": no_proxy}
        if packages:  # npm's tarball URLs are absolute and carry no credential: npm goes through the proxy
            env["PIP_INDEX_URL"] = f"{url}/pypi/simple/"
        return env

    async def diagnostics(self, record: BackendRecord) -> str:
        rec = _k8s(record)
        pod = await self.api.get_pod(rec.pod)
        if pod is None:
            return f"pod {rec.pod} does not exist"
        return f"pod {rec.pod}: {_pod_state(pod)}"

    async def pause(self, record: BackendRecord) -> None:
        raise _unsupported("pause")

    async def resume(self, record: BackendRecord) -> None:
        raise _unsupported("resume")

    async def stop(self, record: BackendRecord) -> None:
        raise _unsupported("pause to disk")

    async def boot(self, record: BackendRecord, spec: SandboxSpec) -> BackendRecord:
        raise _unsupported("boot")

    async def snapshot(self, record: BackendRecord, snapshot_id: str) -> SnapshotArtifact:
        raise _unsupported("snapshot")

    async def delete_snapshot(self, snapshot: SnapshotArtifact) -> None:
        raise _unsupported("snapshot")

    async def create_volume(self, volume_id: str, size: int) -> None:
        raise _unsupported("volumes", "volumes")

    async def delete_volume(self, volume_id: str) -> None:
        raise _unsupported("volumes", "volumes")

    async def volume_used(self, volume_id: str) -> int:
        raise _unsupported("volumes", "volumes")

    async def destroy(self, record: BackendRecord) -> None:
        await self._delete_all(_k8s(record).pod)

    async def alive(self, record: BackendRecord) -> bool:
        rec = _k8s(record)
        pod = await self.api.get_pod(rec.pod)
        return pod is not None and pod["metadata"].get("uid") == rec.uid and _phase(pod) == "Running"

    async def frozen(self, record: BackendRecord) -> bool:
        return False  # a Pod cannot be frozen (`pause` is refused): nothing to find frozen after a restart

    async def oom_kills(self, record: BackendRecord) -> int:
        return 0  # the kubelet reports OOMKilled per container restart, not per process: no counter to read

    async def usage(self, record: BackendRecord) -> SandboxUsage | None:
        return None  # the metrics API is not part of the core API; no figure rather than a wrong one

    def restore(self, data: JSON) -> KubernetesRecord:
        return KubernetesRecord.from_json(data)

    async def adopt(self, record: BackendRecord) -> None:
        """Nothing to reserve: the Pod is named by the record; a Pod replaced under its name (another uid) is
        not this sandbox, and the engine will find it not alive."""
        _k8s(record)

    async def sweep(self, known: set[str]) -> list[str]:
        """Delete the Pods of sandboxes `known` does not name (this replica's, with an `owner`), warm Pods that
        ended, and Secrets and NetworkPolicies whose Pod is gone (a create interrupted between its steps)."""
        # Secrets and NetworkPolicies first: a Pod is made before them, so one listed now whose Pod is missing
        # from the later list of Pods is an orphan, never the object of a create (another replica's) in flight.
        leftovers = [(kind, obj["metadata"]["name"]) for kind in ("Secret", "NetworkPolicy")
                     for obj in await self.api.list_objects(kind, self._selector())]
        removed: list[str] = []
        names: set[str] = set()
        for pod in await self.api.list_objects("Pod", self._selector()):
            if (gone := await self._sweep_pod(pod, known)) is None:
                names.add(pod["metadata"]["name"])
            elif gone:
                removed.append(gone)
        for kind, name in leftovers:
            if name not in names:
                await self.api.delete(kind, name)
        return sorted(removed)

    async def _sweep_pod(self, pod: Mapping[str, Any], known: set[str]) -> str | None:
        """Delete `pod` if it is this replica's and unknown (its sandbox id) or a warm Pod nothing will claim
        (""); None if it stays."""
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        if self.owner and labels.get(LABEL_OWNER) != self.owner:
            return None  # another replica's: only it knows whether it is known
        sandbox = labels.get(LABEL_SANDBOX)
        if sandbox is not None and sandbox not in known:
            await self._delete_all(meta["name"])
            return str(sandbox)
        # Warm Pods wait across restarts, ready for the next engine, unless they ended or no pool wants their
        # image any more (a template pushed again, a pool removed): nothing would ever claim them.
        if LABEL_POOL in labels and (_phase(pod) in ("Failed", "Succeeded") or labels[LABEL_POOL] not in
                                     self._pool_keys()):
            await self._delete_all(meta["name"])
            return ""
        return None

    def _pool_keys(self) -> set[str]:
        return {_pool_key(self.images[name]) for name in self.pool_sizes if name in self.images}

    async def capacity(self) -> BackendCapacity:
        """The nodes' allocatable memory and pods, if the server's account may list nodes (a cluster-wide
        read many operators will not grant): no figure otherwise. Read at most every `CAPACITY_TTL` seconds: the
        engine asks on every create, and a node list is one of the API server's heavier reads."""
        now = time.monotonic()
        if self._capacity is None or now - self._capacity[0] > CAPACITY_TTL:
            self._capacity = (now, await self._read_capacity())
        return self._capacity[1]

    async def _read_capacity(self) -> BackendCapacity:
        try:
            nodes = await self.api.nodes()
        except RuntimeUnavailableError:
            return BackendCapacity()
        allocatable = [(n.get("status") or {}).get("allocatable") or {} for n in nodes]
        memory = sum(_quantity(a.get("memory", "0")) for a in allocatable)
        pods = sum(int(_quantity(a.get("pods", "0"))) for a in allocatable)
        return BackendCapacity(memory_total=int(memory) or None, sandboxes_max=pods or None)

    async def close(self) -> None:
        task, self._pool_task = self._pool_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.api.close()

    # -- beyond the contract -------------------------------------------------------------------------

    async def warm_pods(self, template: str) -> list[dict[str, Any]]:
        """The warm Pods of `template`'s pool that are ready to be claimed (for tests and operators)."""
        image = self.images.get(template)
        if image is None:
            return []
        pods = await self.api.list_objects("Pod", f"{self._selector()},{LABEL_POOL}={_pool_key(image)}")
        return [pod for pod in pods if _is_ready(pod)]

    async def fill_pools(self) -> None:
        """One round of refilling every pool (the background task runs it; tests may too)."""
        for template, size in self.pool_sizes.items():
            image = self.images.get(template)
            if image is None:
                logger.warning("k8s.pool.no_image", extra={"template": template})
                continue
            pods = await self.api.list_objects("Pod", f"{self._selector(own=True)},{LABEL_POOL}={_pool_key(image)}")
            live = [p for p in pods if _phase(p) not in ("Failed", "Succeeded")
                    and not p["metadata"].get("deletionTimestamp")]
            for _ in range(min(size - len(live), _POOL_BATCH)):
                await self._create_warm(template, image)

    # -- helpers -------------------------------------------------------------------------------------

    def _selector(self, *, own: bool = False) -> str:
        """This instance's objects; `own`: only this replica's, when it has an `owner` name."""
        mine = f",{LABEL_OWNER}={self.owner}" if own and self.owner else ""
        return f"{LABEL_MANAGED}=corral,{LABEL_INSTANCE}={self.instance}{mine}"

    def _labels(self, **more: str) -> dict[str, str]:
        return {LABEL_INSTANCE: self.instance, **({LABEL_OWNER: self.owner} if self.owner else {}), **more}

    def _tokens(self) -> TokenKey:
        if self._key is None:
            self._key = TokenKey.load(self.home)
        return self._key

    def _image(self, template: Template) -> str:
        image = self.images.get(template.digest) or self.images.get(template.name)
        if image is None:
            raise RuntimeUnavailableError(
                f"template {template.name} ({template.digest[:12]}) has no image for the Kubernetes backend: "
                f"publish it (`corral templates push {template.name} REGISTRY/REPO`) and map it in "
                "CORRAL_K8S_IMAGES", details={"template": template.name})
        return image

    async def _create_cold(self, sandbox_id: str, spec: SandboxSpec, template: Template,
                           image: str) -> KubernetesRecord:
        name = _pod_name(sandbox_id)
        labels = self._labels(**{LABEL_SANDBOX: sandbox_id})
        deadline = int(spec.timeout) + _DEADLINE_GRACE
        pod, token = await self._make_pod(name, spec, image, labels, sandbox_id, deadline)
        try:
            pod = await self.api.wait_pod(name, self._ready_timeout, _ready_or_failed)
            return await self._record(sandbox_id, pod, token, template.digest)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._delete_all(name))
            raise

    async def _make_pod(self, name: str, spec: SandboxSpec, image: str, labels: Mapping[str, str],
                        sandbox_id: str, deadline: int | None) -> tuple[dict[str, Any], str]:
        """Pod, then NetworkPolicy, then Secret (see the module's docstring); the Pod and its agent's token.
        Whatever of them was made is deleted if a step fails."""
        objects = sandbox_objects(name, spec, image=image, settings=self.settings, labels=labels,
                                  secrets={"token": ""}, env={}, deadline_seconds=deadline)
        pod = await self.api.create(objects.pod)
        try:
            uid = str(pod["metadata"]["uid"])
            owner = [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "controller": False,
                      "blockOwnerDeletion": False}]
            token = self._tokens().agent_token(sandbox_id, name, uid)
            policy = _owned(objects.network_policy, owner)
            secret = _owned(objects.secret, owner)
            secret.pop("data", None)
            secret["stringData"] = {"token": token}
            await self.api.create(policy)
            await self.api.create(secret)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._delete_all(name))
            raise
        return pod, token

    async def _record(self, sandbox_id: str, pod: dict[str, Any], token: str, template: str) -> KubernetesRecord:
        uid = str(pod["metadata"]["uid"])
        proxy = await self._proxy()
        return KubernetesRecord(sandbox_id=sandbox_id, pod=str(pod["metadata"]["name"]), uid=uid,
                                ip=str(pod["status"]["podIP"]), token=token, template=template, proxy=proxy)

    async def _proxy(self) -> str:
        """`host:port` of the egress proxy Service, looked up once; "" if there is none."""
        if self._egress_proxy is None:
            selector = ",".join(f"{k}={v}" for k, v in self.settings.egress_labels.items())
            services = await self.api.services(self.settings.control_namespace, selector)
            ips = [s["spec"].get("clusterIP") for s in services if (s.get("spec") or {}).get("clusterIP")]
            ips = [ip for ip in ips if ip != "None"]
            self._egress_proxy = f"{ips[0]}:{self.settings.egress_port}" if ips else ""
        return self._egress_proxy

    async def _delete_all(self, name: str) -> None:
        """The Pod, its NetworkPolicy and its Secret (their ownerReferences would take them too, later)."""
        for kind in ("Pod", "NetworkPolicy", "Secret"):
            await self.api.delete(kind, name)

    # -- warm Pods -----------------------------------------------------------------------------------

    def _start_pool(self) -> None:
        if self.pool_sizes and self._pool_task is None:
            self._pool_task = asyncio.create_task(self._pool_loop(), name="corral-k8s-pool")
        self._refill.set()

    async def _pool_loop(self) -> None:
        while True:
            try:
                await self.fill_pools()
            except Exception as exc:  # the pool is an optimisation: a failing round waits for the next
                logger.warning("k8s.pool.refill_failed", extra={"error": str(exc)})
            self._refill.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POOL_INTERVAL):
                    await self._refill.wait()

    async def _create_warm(self, template: str, image: str) -> None:
        name = f"corral-warm-{secrets.token_hex(6)}"
        labels = self._labels(**{LABEL_POOL: _pool_key(image)})
        await self._make_pod(name, SandboxSpec(template=template), image, labels, "", None)

    async def _claim(self, sandbox_id: str, spec: SandboxSpec, template: Template,
                     image: str) -> KubernetesRecord | None:
        """A warm Pod relabelled as the sandbox's, or None (no pool, none ready, or a spec of another shape)."""
        if template.name not in self.pool_sizes or not _pool_shaped(spec):
            return None
        candidates = await self.api.list_objects("Pod", f"{self._selector()},{LABEL_POOL}={_pool_key(image)}")
        for pod in (p for p in candidates if _is_ready(p)):
            meta = pod["metadata"]
            started = _started_seconds_ago(pod)
            patch = {"metadata": {"resourceVersion": meta["resourceVersion"],
                                  "labels": {LABEL_POOL: None, LABEL_SANDBOX: sandbox_id,
                                             LABEL_OWNER: self.owner or None}},
                     "spec": {"activeDeadlineSeconds": started + int(spec.timeout) + _DEADLINE_GRACE}}
            try:
                claimed = await self.api.patch_pod(meta["name"], patch)
            except (NotFoundError, ConflictError):
                continue  # another create (maybe another replica's) took it, or it went
            self._refill.set()
            token = self._tokens().agent_token("", meta["name"], str(meta["uid"]))
            try:
                return await self._record(sandbox_id, claimed, token, template.digest)
            except BaseException:  # the Pod is the sandbox's now: it goes with the failed create
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._delete_all(meta["name"]))
                raise
        return None


def _owned(obj: Mapping[str, Any], owner: list[dict[str, Any]]) -> dict[str, Any]:
    copy = json.loads(json.dumps(obj))
    copy["metadata"]["ownerReferences"] = owner
    return dict(copy)


def _refuse_unsupported(spec: SandboxSpec) -> None:
    if spec.root:
        raise InvalidRequestError(f"root=True is refused on the Kubernetes backend: {LIMITATIONS[ROOT_LIMITATION]}")
    if spec.volumes:
        raise RuntimeUnavailableError(f"volumes are not available on the Kubernetes backend: "
                                      f"{LIMITATIONS['volumes']}", details={"backend": "kubernetes"})


def _unsupported(what: str, key: str = "snapshots") -> RuntimeUnavailableError:
    return RuntimeUnavailableError(f"{what} is not available on the Kubernetes backend: {LIMITATIONS[key]}",
                                   details={"backend": "kubernetes", "limitation": key})


def _pool_shaped(spec: SandboxSpec) -> bool:
    """Whether a warm Pod (made with the default limits, no volumes) can serve `spec`: limits are the Pod's
    resources, fixed at its creation. Environment and network policy travel with each command and the egress
    proxy, so they do not matter."""
    return spec.limits == Limits() and not spec.volumes and not spec.root


def _pod_name(sandbox_id: str) -> str:
    """`corral-<id>` for ids that are DNS labels already (the engine's `sb-<hex>`), else of a digest."""
    if _SAFE_NAME.fullmatch(sandbox_id) and len(sandbox_id) <= 40:
        return f"corral-{sandbox_id}"
    return f"corral-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:16]}"


def _pool_key(image: str) -> str:
    """A label value naming the image: a warm Pod serves only sandboxes of that very image."""
    return hashlib.sha256(image.encode()).hexdigest()[:16]


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _is_ready(pod: Mapping[str, Any]) -> bool:
    return (_phase(pod) == "Running" and bool((pod.get("status") or {}).get("podIP"))
            and not pod["metadata"].get("deletionTimestamp"))


def _ready_or_failed(pod: Mapping[str, Any]) -> bool:
    if _phase(pod) in ("Failed", "Succeeded"):
        raise ServerError(f"pod {pod['metadata']['name']} ended before it served: {_pod_state(pod)}")
    return _is_ready(pod)


def _pod_state(pod: Mapping[str, Any]) -> str:
    status = pod.get("status") or {}
    parts = [f"phase {_phase(pod)}"]
    if status.get("reason") or status.get("message"):
        parts.append(f"{status.get('reason') or ''} {status.get('message') or ''}".strip())
    for container in status.get("containerStatuses") or []:
        for state, info in (container.get("state") or {}).items():
            if info and state != "running":
                parts.append(f"container {container.get('name')} {state}: {info.get('reason') or ''} "
                             f"{info.get('message') or ''}".strip())
    return "; ".join(parts)


def _started_seconds_ago(pod: Mapping[str, Any]) -> int:
    """Seconds since the Pod started (`activeDeadlineSeconds` counts from then); 0 if unknown."""
    started = (pod.get("status") or {}).get("startTime")
    if not started:
        return 0
    try:
        at = datetime.fromisoformat(str(started).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0
    return max(0, int(time.time() - at) + 1)


_SUFFIXES = {"Ki": 1024, "Mi": _MIB, "Gi": 1024**3, "Ti": 1024**4, "k": 1000, "M": 10**6, "G": 10**9, "T": 10**12,
             "m": 0.001}


def _quantity(text: object) -> float:
    """A Kubernetes quantity ("16Gi", "1500m", "110") as a number; 0 for what is not one."""
    value = str(text)
    for suffix, factor in _SUFFIXES.items():
        if value.endswith(suffix):
            try:
                return float(value[: -len(suffix)]) * factor
            except ValueError:
                return 0.0
    try:
        return float(value)
    except ValueError:
        return 0.0


def _flag(text: str) -> bool:
    """`CORRAL_K8S_USER_NAMESPACE`'s value: 1/true/yes or 0/false/no."""
    value = text.strip().lower()
    if value not in ("1", "true", "yes", "0", "false", "no"):
        raise InvalidRequestError(f"CORRAL_K8S_USER_NAMESPACE must be 1 or 0 (true/false), not {text!r}")
    return value in ("1", "true", "yes")


def _parse_pool(text: str) -> dict[str, int]:
    """`default=2,other=1` (`CORRAL_K8S_POOL`)."""
    pool: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        try:
            pool[name.strip()] = int(size)
        except ValueError:
            raise RuntimeUnavailableError(f"CORRAL_K8S_POOL: {part!r} is not TEMPLATE=SIZE") from None
    return pool


def _load_images(home: Path) -> dict[str, str]:
    """The template -> image map from `$CORRAL_K8S_IMAGES` (JSON, or a file of it), else the home's file."""
    text = k8s_images()
    if text is not None and not text.lstrip().startswith("{"):
        text = Path(text).read_text()
    if text is None:
        path = home / "kubernetes" / "images.json"
        text = path.read_text() if path.is_file() else "{}"
    try:
        found = json.loads(text)
    except ValueError as exc:
        raise RuntimeUnavailableError(f"the Kubernetes image map is not JSON: {exc}") from exc
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise RuntimeUnavailableError("the Kubernetes image map must be a JSON object of strings")
    return {str(k): v for k, v in found.items()}


def _k8s(record: BackendRecord) -> KubernetesRecord:
    if not isinstance(record, KubernetesRecord):
        raise TypeError(f"the Kubernetes backend was given a {type(record).__name__}, not one of its own records")
    return record
