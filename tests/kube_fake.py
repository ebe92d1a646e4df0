"""An in-process fake of the Kubernetes API server, with a fake kubelet that runs a real agent per Pod.

Enough of the REST API for the Kubernetes backend, spoken over a real socket so that the official client
(`kubernetes_asyncio`, configured from a kubeconfig file the normal way) is what drives it:

* core/v1 pods, secrets and services, networking.k8s.io/v1 networkpolicies (namespaced CRUD), nodes (list),
  `/version`;
* every write bumps one global `resourceVersion`; objects get a `uid` and `creationTimestamp`;
* `labelSelector` (`=`, `==`, `!=`, `in (...)`, `notin (...)`, `key`, `!key`) and `fieldSelector=metadata.name=`;
* `?watch=true` streams JSON lines from a `resourceVersion`, and an `ERROR` event with a 410 Status when that
  version is older than the kept history (or once on demand: `force_gone`), as the API server does;
* PATCH as JSON merge patch (and strategic merge patch, which for labels and scalar fields is the same),
  conditional on a `metadata.resourceVersion` in the patch (409 Conflict if the object moved);
* 404/409/403/422 answers with the `Status` bodies the API server sends; `forbid(verb, plural)` makes one RBAC
  permission missing.

What this proves is how the backend uses the client and the agent over TCP, not Kubernetes: no admission, no
scheduling, no NetworkPolicy enforcement, no garbage collection by ownerReference (the backend deletes all three
objects itself anyway).

The kubelet: once a Pod's Secret exists (a real kubelet waits for a secret volume likewise), it writes the
Secret's `token` to a file and starts the real agent (`corral/agent`, installed as the backends install it) in its
own PID namespace (`unshare --pid --fork --kill-child --mount-proc`: the agent expects to be PID 1 and reaps with
waitpid(-1)) as uid 1000 (as Pod Security `restricted` runs it), listening on the Pod's own loopback address
127.0.0.X at the port of its `CORRAL_AGENT_TCP`. It shares the host's network namespace (a fake Pod network of
its own would be unreachable without veth plumbing), so its egress bridge and DNS responder are not tested here.
Deleting the Pod kills the agent and everything it started.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from corral.backends.local._agent_files import install_agent

Obj = dict[str, Any]
KINDS = {"pods": ("Pod", "v1"), "secrets": ("Secret", "v1"), "services": ("Service", "v1"),
         "networkpolicies": ("NetworkPolicy", "networking.k8s.io/v1")}
HISTORY = 200  # watch events kept; a watch from before them gets 410 Gone
SANDBOX_UID = 1000
_AGENT_ARGV = ["/usr/bin/python3", "-S", "-B", "-c", "from agent.__main__ import main; main()"]


def status(code: int, reason: str, message: str, **details: Any) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    if details:
        body["details"] = details
    return web.json_response(body, status=code)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- label selectors ---------------------------------------------------------------------------------------------

_SET = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> Iterator[str]:
    """Top-level commas only: `a in (x,y),b=c` is two requirements."""
    depth, start = 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in (t.strip() for t in _split_selector(selector or "")):
        if not term:
            continue
        if m := _SET.match(term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            found = key in labels and labels[key] in values
            if found != (op == "in"):  # `notin` also holds for a label that is absent
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# -- the fake kubelet --------------------------------------------------------------------------------------------

@dataclass
class RunningPod:
    process: subprocess.Popen[bytes]
    dir: Path
    ip: str


class Kubelet:
    """Starts a real agent for each Pod whose Secret exists; kills it when the Pod goes."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.agent_dir = install_agent(workdir / "home")
        self.running: dict[str, RunningPod] = {}
        self._addresses = itertools.cycle(range(2, 250))

    def next_ip(self) -> str:
        return f"127.0.0.{next(self._addresses)}"

    def start(self, pod: Obj, token: str, ip: str) -> None:
        name = pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e.get("value", "") for e in container.get("env") or []}
        port = int(env.get("CORRAL_AGENT_TCP", "0.0.0.0:7771").rpartition(":")[2])
        podir = self.workdir / "pods" / name
        podir.mkdir(parents=True, exist_ok=True)
        (podir / "token").write_text(token + "\n")
        for path in (podir, podir / "token"):
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
        os.chmod(podir / "token", 0o400)
        os.chmod(podir, 0o700)
        # What the runtime would give the container: its env (the token file at its path here), its IP.
        env |= {"CORRAL_AGENT_TCP": f"{ip}:{port}", "CORRAL_AGENT_TOKEN_FILE": str(podir / "token"),
                "PATH": "/usr/local/bin:/usr/bin:/bin"}
        argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "setpriv",
                f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", *_AGENT_ARGV]
        with open(podir / "agent.log", "wb") as log:  # the child has its own copy of the descriptor
            process = subprocess.Popen(argv, cwd=self.agent_dir.parent, env=env, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=log, start_new_session=True)
        self.running[name] = RunningPod(process, podir, ip)
        self._wait_listening(name, ip, port)

    def _wait_listening(self, name: str, ip: str, port: int) -> None:
        """What a readiness probe on the agent's port would wait for (bounded); the agent's log if it died."""
        pod = self.running[name]
        for _ in range(500):
            if pod.process.poll() is not None:
                raise RuntimeError(f"the agent of pod {name} exited: {(pod.dir / 'agent.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection((ip, port), timeout=1):
                return
            time.sleep(0.01)
        raise RuntimeError(f"the agent of pod {name} did not listen on {ip}:{port} in 5 s")

    def stop(self, name: str) -> None:
        pod = self.running.pop(name, None)
        if pod is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pod.process.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.process.wait(10)
        shutil.rmtree(pod.dir, ignore_errors=True)

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


# -- the API server ----------------------------------------------------------------------------------------------

@dataclass
class Event:
    version: int
    type: str
    plural: str
    obj: Obj


@dataclass
class FakeKube:
    """The fake API server's state and its aiohttp app. `kubelet` None: Pods never run (tests of the API)."""

    kubelet: Kubelet | None = None
    objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    nodes: list[Obj] = field(default_factory=list)
    version: int = 1000
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    force_gone: int = 0  # the next N watches answer 410 Gone whatever their version
    gone_sent: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)
    pod_start_delay: float = 0.0
    crash_next_pod: str = ""  # the next Pod's container exits at once with this message (as an image that fails)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def forbid(self, verb: str, plural: str) -> None:
        self.forbidden.add((verb, plural))

    def app(self) -> web.Application:
        app = web.Application()
        for prefix in ("/api/v1", "/apis/networking.k8s.io/v1"):
            app.router.add_route("*", prefix + "/namespaces/{ns}/{plural}", self._collection)
            app.router.add_route("*", prefix + "/namespaces/{ns}/{plural}/{name}", self._item)
        app.router.add_get("/api/v1/nodes", self._nodes)
        app.router.add_get("/version/", self._version)  # the path the client asks, slash and all
        return app

    def pods(self, namespace: str | None = None) -> list[Obj]:
        return [o for (p, ns, _), o in self.objects.items() if p == "pods" and namespace in (None, ns)]

    def get(self, plural: str, namespace: str, name: str) -> Obj | None:
        return self.objects.get((plural, namespace, name))

    # -- storage -----------------------------------------------------------------------------------------

    async def _record(self, type_: str, plural: str, obj: Obj) -> None:
        self.events.append(Event(self.version, type_, plural, copy.deepcopy(obj)))
        del self.events[:-HISTORY]
        async with self._changed:
            self._changed.notify_all()

    def _bump(self, obj: Obj) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)

    async def put(self, plural: str, namespace: str, obj: Obj, type_: str) -> Obj:
        self._bump(obj)
        self.objects[(plural, namespace, obj["metadata"]["name"])] = obj
        await self._record(type_, plural, obj)
        return obj

    async def remove(self, plural: str, namespace: str, name: str) -> Obj | None:
        obj = self.objects.pop((plural, namespace, name), None)
        if obj is None:
            return None
        self._bump(obj)
        await self._record("DELETED", plural, obj)
        if plural == "pods" and self.kubelet is not None:
            await asyncio.to_thread(self.kubelet.stop, name)
        return obj

    # -- handlers ----------------------------------------------------------------------------------------

    def _denied(self, verb: str, plural: str, namespace: str | None) -> web.Response | None:
        self.requests.append((verb, plural))
        if (verb, plural) not in self.forbidden:
            return None
        where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
        group = "networking.k8s.io" if plural == "networkpolicies" else ""
        return status(403, "Forbidden", f'{plural} is forbidden: User "system:serviceaccount:corral:corral-server" '
                      f'cannot {verb} resource "{plural}" in API group "{group}"{where}', kind=plural)

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        ns, plural = request.match_info["ns"], request.match_info["plural"]
        if plural not in KINDS:
            return status(404, "NotFound", "the server could not find the requested resource")
        if request.method == "POST":
            return await self._create(request, ns, plural)
        watching = request.query.get("watch", "").lower() in ("true", "1", "t")  # Go's ParseBool
        if denied := self._denied("watch" if watching else "list", plural, ns):
            return denied
        if watching:
            return await self._watch(request, ns, plural)
        items = [o for (p, n, _), o in self.objects.items() if p == plural and n == ns and self._selected(request, o)]
        kind, api_version = KINDS[plural]
        return web.json_response({"kind": f"{kind}List", "apiVersion": api_version,
                                  "metadata": {"resourceVersion": str(self.version)}, "items": items})

    def _selected(self, request: web.Request, obj: Obj) -> bool:
        labels = obj["metadata"].get("labels") or {}
        if not selector_matches(request.query.get("labelSelector", ""), labels):
            return False
        fields = request.query.get("fieldSelector", "")
        for term in filter(None, fields.split(",")):
            key, _, value = term.partition("=")
            if key == "metadata.name" and obj["metadata"]["name"] != value:
                return False
        return True

    async def _create(self, request: web.Request, ns: str, plural: str) -> web.Response:
        if denied := self._denied("create", plural, ns):
            return denied
        obj = await request.json()
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) or len(name) > 253:
            kind = KINDS[plural][0]
            return status(422, "Invalid", f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": a '
                          "lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                          "'.'", name=name, kind=plural)
        if (plural, ns, name) in self.objects:
            return status(409, "AlreadyExists", f'{plural} "{name}" already exists', name=name, kind=plural)
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        if plural == "secrets" and "stringData" in obj:
            data = obj.setdefault("data", {})
            for key, value in obj.pop("stringData").items():
                data[key] = base64.b64encode(value.encode()).decode()
        if plural == "pods":
            obj["status"] = {"phase": "Pending"}
        await self.put(plural, ns, obj, "ADDED")
        if plural == "pods" and self.kubelet is not None:
            self._spawn(self._run_pod(ns, name, meta["uid"]))
        if plural == "secrets":
            async with self._changed:
                self._changed.notify_all()
        return web.json_response(obj, status=201)

    async def _item(self, request: web.Request) -> web.StreamResponse:
        ns, plural, name = request.match_info["ns"], request.match_info["plural"], request.match_info["name"]
        if plural not in KINDS:
            return status(404, "NotFound", "the server could not find the requested resource")
        verb = {"GET": "get", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(request.method, "get")
        if denied := self._denied(verb, plural, ns):
            return denied
        obj = self.objects.get((plural, ns, name))
        if obj is None:
            return status(404, "NotFound", f'{plural} "{name}" not found', name=name, kind=plural)
        if request.method == "GET":
            return web.json_response(obj)
        if request.method == "DELETE":
            gone = await self.remove(plural, ns, name)
            return web.json_response(gone)
        if request.method == "PATCH":
            return await self._patch(request, ns, plural, obj)
        return status(405, "MethodNotAllowed", "the fake supports GET, DELETE and PATCH on objects")

    async def _patch(self, request: web.Request, ns: str, plural: str, obj: Obj) -> web.Response:
        kind = request.content_type
        if kind not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            return status(415, "UnsupportedMediaType", f"the fake takes merge patches only, not {kind}")
        patch = await request.json()
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        name = obj["metadata"]["name"]
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            return status(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": the object has '
                          "been modified; please apply your changes to the latest version and try again",
                          name=name, kind=plural)
        patched = merge_patch(obj, patch)
        await self.put(plural, ns, patched, "MODIFIED")
        return web.json_response(patched)

    async def _nodes(self, request: web.Request) -> web.Response:
        if denied := self._denied("list", "nodes", None):
            return denied
        return web.json_response({"kind": "NodeList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.version)}, "items": self.nodes})

    async def _version(self, request: web.Request) -> web.Response:
        if denied := self._denied("get", "version", None):  # a real API server lets everyone read it
            return denied
        return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "gitCommit": "fake",
                                  "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24",
                                  "compiler": "gc", "platform": "linux/amd64"})

    async def _watch(self, request: web.Request, ns: str, plural: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        since = int(request.query.get("resourceVersion") or self.version)
        oldest = self.events[0].version if self.events else self.version
        if self.force_gone > 0 or (len(self.events) >= HISTORY and since < oldest - 1):
            self.force_gone = max(0, self.force_gone - 1)
            self.gone_sent += 1
            gone = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": f"too old resource version: {since} ({oldest})", "reason": "Expired", "code": 410}
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return response
        end = asyncio.get_running_loop().time() + float(request.query.get("timeoutSeconds") or 30)
        with contextlib.suppress(ConnectionError):  # the client hung up: the watch ends
            await self._stream_events(request, response, ns, plural, since, end)
        return response

    async def _stream_events(self, request: web.Request, response: web.StreamResponse, ns: str, plural: str,
                             since: int, end: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < end:
            for event in [e for e in self.events if e.version > since]:
                since = event.version
                if event.plural == plural and event.obj["metadata"].get("namespace") == ns \
                        and self._selected(request, event.obj):
                    line = {"type": event.type, "object": event.obj}
                    await response.write(json.dumps(line).encode() + b"\n")
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(0.0, min(1.0, end - loop.time())))

    # -- the kubelet's side ------------------------------------------------------------------------------

    def _spawn(self, job: Any) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_pod(self, ns: str, name: str, uid: str) -> None:
        """Wait (bounded) for the Pod's Secret, start its agent, mark it Running with its IP."""
        assert self.kubelet is not None
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        token = None
        while loop.time() < end:
            pod = self.objects.get(("pods", ns, name))
            if pod is None or pod["metadata"]["uid"] != uid:
                return
            secret_name = next((v["secret"]["secretName"] for v in pod["spec"].get("volumes") or []
                                if "secret" in v), None)
            secret = self.objects.get(("secrets", ns, secret_name)) if secret_name else None
            if secret is not None:
                token = base64.b64decode(secret["data"]["token"]).decode()
                break
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 0.5)
        if token is None:
            return
        await asyncio.sleep(self.pod_start_delay)
        pod = self.objects.get(("pods", ns, name))
        if pod is None or pod["metadata"]["uid"] != uid:
            return
        ip = self.kubelet.next_ip()
        pod = copy.deepcopy(pod)
        try:
            if self.crash_next_pod:
                crash, self.crash_next_pod = self.crash_next_pod, ""
                raise RuntimeError(crash)
            await asyncio.to_thread(self.kubelet.start, pod, token, ip)
        except RuntimeError as exc:  # as a container that exited at once: the Pod fails, saying why
            pod["status"] = {"phase": "Failed", "reason": "Error", "message": str(exc)}
            await self.put("pods", ns, pod, "MODIFIED")
            return
        pod["status"] = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "startTime": _now(),
                         "containerStatuses": [{"name": "sandbox", "ready": True, "restartCount": 0,
                                                "image": pod["spec"]["containers"][0]["image"], "imageID": "",
                                                "state": {"running": {"startedAt": _now()}}}]}
        await self.put("pods", ns, pod, "MODIFIED")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.kubelet is not None:
            await asyncio.to_thread(self.kubelet.stop_all)


def write_kubeconfig(path: Path, url: str) -> Path:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
              "clusters": [{"name": "fake", "cluster": {"server": url}}],
              "users": [{"name": "fake", "user": {"token": "fake-token"}}],
              "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}
    path.write_text(json.dumps(config))
    return path


@contextlib.asynccontextmanager
async def serve(fake: FakeKube, workdir: Path) -> Any:
    """Run `fake` on a free loopback port; yields the path of a kubeconfig that points at it."""
    runner = web.AppRunner(fake.app(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield write_kubeconfig(workdir / "kubeconfig", f"http://127.0.0.1:{port}")
    finally:
        await fake.close()
        await runner.cleanup()
