"""`corral check` items 40-42 and 44 against a real server (runc, the local backend), and proof that each probe
fails when its property is broken: the same server behind a tampering transport that opens one hole (a tenant
policy dropped on the way in, a port answered whoever asks, another tenant's mount let through, ENOSPC hidden), and
Pods or NetworkPolicies with one field of the lockdown missing. Items 41 and 42 on Docker: tests/test_docker_live.py;
item 44 on the fake Kubernetes API: tests/test_check_backend.py.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from corral import Admin
from corral.backends.kubernetes import ClusterSettings, sandbox_objects
from corral.check import CheckContext, CheckOptions, Deployment, Target, provision, run_check
from corral.check._kubernetes import egress_problems, item_44_pods_locked_down, pod_problems
from corral.check._lifecycle import PORT, item_41_ports_are_the_tenants, item_42_volumes_bounded
from corral.check._policy import item_40_forced_runtime_holds
from corral.check._probes import Probe, run_probe
from corral.engine import SandboxSpec
from corral.server import ServerProcess

from .test_check import FakeCorral, _context, _verdict, needs_store
from .test_check import server as server  # the fixture: a real `corral serve` (runc) in a temporary home

Edit = Callable[[httpx.Request, dict[str, Any]], httpx.Request | None]
Answer = Callable[[httpx.Request, dict[str, Any], httpx.Response], httpx.Response]


def _json(request: httpx.Request) -> dict[str, Any]:
    if "json" not in request.headers.get("content-type", "") or not request.content:
        return {}
    body = json.loads(request.content)
    return body if isinstance(body, dict) else {}


class Tampering(httpx.AsyncBaseTransport):
    """The real server with one hole: `edit` may rewrite a request on its way in (None: as it is), `answer` the
    response on its way out. Bodies are read whole: the probes make no streamed calls."""

    def __init__(self, edit: Edit | None = None, answer: Answer | None = None) -> None:
        self.edit, self.answer = edit, answer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        body = _json(request)
        if self.edit is not None and (edited := self.edit(request, body)) is not None:
            request = edited
        async with httpx.AsyncHTTPTransport() as inner:  # one per request: clients close the transport they use
            response = await inner.handle_async_request(request)
            content = await response.aread()
        real = httpx.Response(response.status_code, headers=response.headers, content=content, request=request)
        return self.answer(request, body, real) if self.answer is not None else real


def _rebuilt(request: httpx.Request, *, headers: dict[str, str] | None = None,
             body: dict[str, Any] | None = None) -> httpx.Request:
    replaced = {"content-length", *(k.lower() for k in headers or {})}
    new_headers = {k: v for k, v in request.headers.items() if k.lower() not in replaced}
    new_headers.update(headers or {})
    content = json.dumps(body).encode() if body is not None else request.content
    return httpx.Request(request.method, request.url, headers=new_headers, content=content)


def _replaced(response: httpx.Response, body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(response.status_code, json=body, request=response.request)


@asynccontextmanager
async def _live(server: ServerProcess) -> AsyncIterator[CheckContext]:
    async with provision(Target(url=server.url, admin_key=server.admin_key, home=server.home)) as ctx:
        yield ctx


async def _probe(ctx: CheckContext, fn: Any, transport: httpx.AsyncBaseTransport | None = None) -> Any:
    if transport is not None:
        ctx = dataclasses.replace(ctx, target=dataclasses.replace(ctx.target, transport=transport))
    return await run_probe(Probe(0, fn), ctx)


# -- live: the items pass on a real server, and leave nothing behind -----------------------------------------------


@pytest.mark.runc
@pytest.mark.timeout(600)
@needs_store
def test_items_40_to_44_on_a_local_deployment(server: ServerProcess) -> None:
    target = Target(url=server.url, admin_key=server.admin_key, home=server.home)
    report = asyncio.run(run_check(target, CheckOptions(items=frozenset({40, 41, 42, 44}))))
    status = {i.number: (i.status, i.detail) for i in report.items}
    assert [n for n, (s, _) in status.items() if s == "FAIL"] == [], status
    assert status[40] == ("PASS", status[40][1]) and "asked for runc and got gVisor" in status[40][1]
    assert "runtime_upgraded" in status[40][1]
    assert status[41][0] == "PASS" and "no credentials got 401" in status[41][1] and "404" in status[41][1]
    assert status[42][0] == "PASS" and "ENOSPC" in status[42][1] and "on the host its image took" in status[42][1]
    assert status[44] == ("N/A", "Kubernetes Pods: the server runs the local backend")
    assert report.exit_code == 0 and report.cleanup_problems == []
    # The check's three tenants (item 40 made one of its own) are disabled, emptied and without keys; no sandbox,
    # no volume is left on the host.
    assert list((server.home / "sandboxes").iterdir()) == []
    assert list((server.home / "volumes").iterdir()) == []
    with Admin(api_key=server.admin_key, base_url=server.url) as admin:
        ours = {t.name: t for t in admin.tenants.list() if t.name.startswith(report.tenant)}
        assert sorted(ours) == sorted(report.tenant + s for s in ("", "-b", "-runsc"))
        assert ours[report.tenant + "-runsc"].required_runtime == "runsc"
        for tenant in ours.values():
            assert tenant.disabled and admin.kill_all(tenant=tenant.name).killed == []
            assert all(k.revoked for k in admin.keys.list(tenant.name))


# -- each probe fails when its property is broken ------------------------------------------------------------------


@pytest.mark.runc
@pytest.mark.anyio
@pytest.mark.timeout(300)
@needs_store
async def test_40_fails_when_the_server_drops_the_tenants_runtime_policy(server: ServerProcess) -> None:
    # The policy never reaches the server, which still answers as if it kept it: the sandbox runs runc.
    def edit(request: httpx.Request, body: dict[str, Any]) -> httpx.Request | None:
        if request.method == "POST" and request.url.path == "/v1/tenants" and "required_runtime" in body:
            return _rebuilt(request, body={k: v for k, v in body.items() if k != "required_runtime"})
        return None

    def answer(request: httpx.Request, body: dict[str, Any], response: httpx.Response) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/tenants" and response.status_code == 201:
            return _replaced(response, {**response.json(), "required_runtime": "runsc"})
        return response

    async with _live(server) as ctx:
        verdict = await _probe(ctx, item_40_forced_runtime_holds, Tampering(edit, answer))
        async with ctx.admin() as admin:
            [forced] = [t for t in await admin.tenants.list() if t.name == ctx.tenant + "-runsc"]
    assert verdict.status == "FAIL", verdict
    assert "does not run on gVisor" in verdict.detail and "runtime 'runc'" in verdict.detail
    assert "required_runtime" in verdict.fix
    assert forced.disabled  # cleaned up all the same


@pytest.mark.runc
@pytest.mark.anyio
@pytest.mark.timeout(300)
@needs_store
@pytest.mark.parametrize("hole", ["anyone", "other tenants"])
async def test_41_fails_when_a_port_answers_callers_who_are_not_its_tenants(server: ServerProcess,
                                                                            hole: str) -> None:
    async with _live(server) as ctx:
        owner = f"Bearer {ctx.keys['developer']}"

        def edit(request: httpx.Request, body: dict[str, Any]) -> httpx.Request | None:
            # A port host that lets the caller through as the sandbox's owner.
            if not request.headers.get("host", "").startswith(f"{PORT}-"):
                return None
            given = request.headers.get("authorization")
            if (hole == "anyone" and given is None) or (hole == "other tenants" and given not in (None, owner)):
                return _rebuilt(request, headers={"Authorization": owner})
            return None

        verdict = await _probe(ctx, item_41_ports_are_the_tenants, Tampering(edit))
    assert verdict.status == "FAIL", verdict
    expected = "no credentials -> 200" if hole == "anyone" else "another tenant's key -> 200"
    assert "a sandbox's port answered callers who are not its tenant's" in verdict.detail
    assert expected in verdict.detail, verdict.detail


@pytest.mark.runc
@pytest.mark.anyio
@pytest.mark.timeout(300)
@needs_store
@pytest.mark.parametrize("hole", ["another tenant mounts it", "no ENOSPC"])
async def test_42_fails_when_a_volume_is_shared_or_unbounded(server: ServerProcess, hole: str) -> None:
    async with _live(server) as ctx:
        other, owner = f"Bearer {ctx.keys['other']}", f"Bearer {ctx.keys['developer']}"

        def edit(request: httpx.Request, body: dict[str, Any]) -> httpx.Request | None:
            # The other tenant's sandbox calls act as the volume's owner: a volume lookup ignoring the tenant.
            if hole == "another tenant mounts it" and request.url.path.startswith("/v1/sandboxes") \
                    and request.headers.get("authorization") == other:
                return _rebuilt(request, headers={"Authorization": owner})
            return None

        def answer(request: httpx.Request, body: dict[str, Any], response: httpx.Response) -> httpx.Response:
            # The write past the volume's size "succeeds": as a directory of the host's disk would.
            if hole == "no ENOSPC" and request.url.path.endswith("/exec") and str(body.get("cmd")).startswith("dd "):
                return _replaced(response, {**response.json(), "exit_code": 0, "stderr_b64": ""})
            return response

        verdict = await _probe(ctx, item_42_volumes_bounded, Tampering(edit, answer))
    assert verdict.status == "FAIL", verdict
    if hole == "no ENOSPC":
        assert "did not end with ENOSPC: exit 0" in verdict.detail, verdict.detail
    else:
        assert "mounting it in a sandbox of another tenant -> 201" in verdict.detail, verdict.detail
    assert list((server.home / "volumes").iterdir()) == []  # the volume went all the same
    assert list((server.home / "sandboxes").iterdir()) == []


@pytest.mark.anyio
async def test_40_fails_on_a_server_that_does_not_keep_the_policy_and_still_cleans_up() -> None:
    fake = FakeCorral()  # a server from before tenants' runtime policy: the field is dropped
    verdict = await _verdict(item_40_forced_runtime_holds, _context(fake))
    assert verdict.status == "FAIL" and "did not keep the tenant's required runtime" in verdict.detail
    assert "predates tenants' runtime policy" in verdict.fix
    assert fake.tenants["ours-runsc"]["disabled"]
    assert not [k for k in fake.keys.values() if k["tenant"] == "ours-runsc" and not k["revoked_at"]]


# -- not applicable where the deployment cannot ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_40_and_42_are_not_applicable_where_the_backend_cannot_and_say_why() -> None:
    docker = Deployment("docker", ("runc",), {"runtime_runsc": "no gVisor: the Docker backend runs runc only"})
    verdict = await _verdict(item_40_forced_runtime_holds, _context(FakeCorral(), docker))
    assert verdict.status == "N/A"
    assert verdict.detail == ("a tenant's required runtime runsc: gVisor on the docker backend: no gVisor: the Docker "
                              "backend runs runc only")
    kube = Deployment("kubernetes", ("runsc",), {"volumes": "no volumes on Kubernetes yet"})
    verdict = await _verdict(item_42_volumes_bounded, _context(FakeCorral(), kube))
    assert (verdict.status, verdict.detail) == ("N/A", "the kubernetes backend: no volumes on Kubernetes yet")


# -- 44: the Pod's lockdown ------------------------------------------------------------------------------------------


def _objects(**settings: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    found = sandbox_objects("corral-sb-x", SandboxSpec(template="default"), image="registry.invalid/default:1",
                            settings=ClusterSettings(**settings), labels={"corral.dev/sandbox": "sb-x"},
                            secrets={"token": "t"}, env={}, deadline_seconds=60)
    return found.pod, found.network_policy


def test_44_the_backends_own_objects_are_locked_down() -> None:
    pod, policy = _objects()
    assert pod_problems(pod) == [] and egress_problems(pod, [policy]) == []


def _broken(change: Callable[[dict[str, Any], dict[str, Any]], object]) -> list[str]:
    pod, policy = (copy.deepcopy(o) for o in _objects())
    change(pod, policy)
    return pod_problems(pod) + egress_problems(pod, [policy])


@pytest.mark.parametrize(("change", "named"), [
    (lambda pod, _: pod["spec"].pop("runtimeClassName"), "spec.runtimeClassName is not set"),
    (lambda pod, _: pod["spec"].update(automountServiceAccountToken=True),
     "spec.automountServiceAccountToken must be false"),
    (lambda pod, _: pod["spec"]["securityContext"].update(runAsNonRoot=False),
     "spec.securityContext.runAsNonRoot must be true"),
    (lambda pod, _: pod["spec"]["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
     "allowPrivilegeEscalation must be false"),
    (lambda _, policy: policy["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}),
     "reaches more than the egress proxy's Pods"),
    (lambda _, policy: policy["spec"]["egress"][0].pop("ports"), "allows ports all"),
    (lambda _, policy: policy["spec"].update(policyTypes=["Ingress"]), "does not restrict egress"),
    (lambda _, policy: policy["spec"]["podSelector"].update(matchLabels={"corral.dev/pod": "another"}),
     "no NetworkPolicy selects the Pod"),
])
def test_44_each_missing_part_of_the_lockdown_is_named(change: Any, named: str) -> None:
    problems = _broken(change)
    assert any(named in p for p in problems), problems


class KubeFake(FakeCorral):
    """The fake deployment as a Kubernetes one: the sandbox's look for a token and its kernel log answer as
    `mounted` and `kernel` say."""

    mounted: str = "none"
    kernel: str = "[    0.000000] Starting gVisor..."

    def _exec(self, key: dict[str, Any], sid: str, cmd: Any) -> httpx.Response:
        out = {"serviceaccount": f"{self.mounted}\n", "dmesg": f"{self.kernel}\n4.4.0\n"}
        for marker, text in out.items():
            if isinstance(cmd, str) and marker in cmd:
                return httpx.Response(200, json={"exit_code": 0, "stderr_b64": "",
                                                 "stdout_b64": base64.b64encode(text.encode()).decode()})
        return super()._exec(key, sid, cmd)


@pytest.mark.anyio
async def test_44_without_the_cluster_checks_the_built_objects_and_the_sandbox_itself() -> None:
    kube = Deployment("kubernetes", ("runsc",))
    passed = await _verdict(item_44_pods_locked_down, _context(KubeFake(), kube))
    assert passed.status == "PASS", passed
    assert "RuntimeClass gvisor" in passed.detail and "the sandbox runs on gVisor" in passed.detail
    assert "the cluster is not reachable from here" in passed.detail
    token = KubeFake()
    token.mounted = "token\nca.crt"
    failed = await _verdict(item_44_pods_locked_down, _context(token, kube))
    assert failed.status == "FAIL" and "a service-account token is mounted in the sandbox" in failed.detail
    runc = KubeFake()
    runc.kernel = "[    0.000000] Linux version 6.18.0"
    failed = await _verdict(item_44_pods_locked_down, _context(runc, kube))
    assert failed.status == "FAIL" and "does not run on gVisor" in failed.detail
    local = await _verdict(item_44_pods_locked_down, _context(KubeFake()))
    assert (local.status, local.detail) == ("N/A", "Kubernetes Pods: the server runs the local backend")
