"""`/metrics` (docs/operations.md): scraped from a real app (httpx's ASGI transport) and parsed with
prometheus_client's own text parser. The counters move for real operations: over the fake backend (tests/fakes.py)
creates, quota and capacity refusals, egress decisions, and an exec and file transfers recorded as the service
records them; over real runc sandboxes (`runc`) a create, execs, an egress denial, an upload, a download and a
quota refusal end to end, scraped on both ports. Only admins
read it on the API port; `--metrics-port` serves it without a key, and `--no-metrics` counts nothing.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral import Admin, QuotaExceededError, Sandbox
from corral.backends import BackendCapacity
from corral.control import ControlStore, Quotas, Role
from corral.egress import RULE_CLASSES, EgressEvent, rule_class
from corral.engine import Capacity, Engine
from corral.server import ServerProcess, create_app
from corral.server._process import free_port
from corral.server._prometheus import metrics_app
from corral.service import Service, Telemetry

from .conftest import TEMPLATE, TEMPLATE_HOME
from .fakes import FakeBackend, FakeTemplates, World

pytestmark = pytest.mark.anyio

BASE = "http://corral.test"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels (the official parser: the format must be valid)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@dataclass
class Served:
    app: Any
    service: Service
    backend: FakeBackend
    keys: dict[str, str]  # "admin", "dev", "auditor", "other" (tenant b's developer) -> raw key
    tenants: dict[str, str]  # "a", "b" -> id

    def client(self, who: str | None = None, **headers: str) -> httpx.AsyncClient:
        if who is not None:
            headers["Authorization"] = f"Bearer {self.keys[who]}"
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=BASE, headers=headers)

    async def scrape(self) -> Samples:
        async with self.client("admin") as client:
            r = await client.get("/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        return parse(r.text)


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cm-", dir="/tmp"))  # short: the fake agents' Unix sockets live here
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _accounts(store: ControlStore) -> tuple[dict[str, str], dict[str, str]]:
    await store.bootstrap_admin(None)
    tenants = {name: (await store.create_tenant(name)).id for name in ("a", "b")}
    keys = {"admin": (store.home / "admin.key").read_text().strip()} if store.home else {}
    for who, tenant, role in (("dev", "a", Role.DEVELOPER), ("auditor", "a", Role.AUDITOR),
                              ("other", "b", Role.DEVELOPER)):
        keys[who] = (await store.create_key(tenants[tenant], role)).key
    return keys, tenants


@pytest.fixture
async def served(home: Path) -> AsyncIterator[Served]:
    world = World(home / "world")
    world.dir.mkdir()
    backend = FakeBackend(home, world)
    engine = Engine(home, backend, templates=FakeTemplates(),  # type: ignore[arg-type]
                    capacity=Capacity(max_sandboxes=3))
    store = ControlStore(home=home)
    app = create_app(engine, store)
    try:
        async with app.router.lifespan_context(app):
            keys, tenants = await _accounts(store)
            yield Served(app, app.state.corral, backend, keys, tenants)
    finally:
        await engine.close(destroy_all=True)
        for server in world.agents.values():
            server.close()


# -- who may read it ---------------------------------------------------------------------------------------------


async def test_only_an_admin_key_reads_the_metrics_on_the_api_port(served: Served) -> None:
    async with served.client() as anonymous:
        r = await anonymous.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    for who in ("dev", "auditor"):
        async with served.client(who) as client:
            r = await client.get("/metrics")
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", who
    samples = await served.scrape()
    assert value(samples, "corral_pool_size") == 0
    assert value(samples, "corral_operations_total", action="auth.denied", outcome="unauthenticated") == 1


async def test_the_metrics_port_app_serves_them_without_a_key(served: Served) -> None:
    transport = httpx.ASGITransport(app=metrics_app(served.service))
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as client:
        r = await client.get("/metrics")
        assert r.status_code == 200
        assert ("corral_pool_ready", frozenset()) in parse(r.text)
        assert (await client.get("/v1/sandboxes")).status_code == 404  # the metrics, nothing else


async def test_a_server_without_metrics_counts_nothing_and_has_no_route(home: Path) -> None:
    engine = Engine(home, FakeBackend(home), templates=FakeTemplates())  # type: ignore[arg-type]
    app = create_app(engine, ControlStore(home=home), metrics=False)
    async with app.router.lifespan_context(app):
        await app.state.corral.store.bootstrap_admin(None)
        admin = (home / "admin.key").read_text().strip()
        assert app.state.corral.telemetry is None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE,
                                     headers={"Authorization": f"Bearer {admin}"}) as client:
            assert (await client.get("/metrics")).status_code == 404
    await engine.close(destroy_all=True)


async def test_each_app_counts_in_a_registry_of_its_own(served: Served) -> None:
    other = Telemetry(served.service.store, served.service.engine, served.service.replica)
    other.operations.labels("sandbox.get", "ok").inc()
    assert value(await served.scrape(), "corral_operations_total", action="sandbox.get", outcome="ok") == 0


# -- what moves the counters ---------------------------------------------------------------------------------------


async def test_creates_count_by_tenant_and_outcome_with_their_latency_and_the_sandboxes_by_state(
        served: Served) -> None:
    async with served.client("dev") as client:
        created = await client.post("/v1/sandboxes", json={"template": "default"})
        assert created.status_code == 201, created.text
        assert (await client.post("/v1/sandboxes", json={"template": "default", "bogus": 1})).status_code == 400
    samples = await served.scrape()
    a = served.tenants["a"]
    assert value(samples, "corral_sandbox_creates_total", tenant=a, outcome="ok") == 1
    assert value(samples, "corral_sandbox_create_duration_seconds_count") == 1
    assert 0 < value(samples, "corral_sandbox_create_duration_seconds_sum") < 30
    assert value(samples, "corral_operations_total", action="sandbox.create", outcome="ok") == 1
    assert value(samples, "corral_operations_total", action="request.invalid", outcome="invalid_request") == 1
    assert value(samples, "corral_sandboxes", tenant=a, state="running") == 1
    assert value(samples, "corral_machine_sandboxes") == 1
    assert value(samples, "corral_capacity_max_sandboxes") == 3
    assert value(samples, "process_resident_memory_bytes") > 0  # the process collector is there too
    assert not any(created.json()["id"] in str(labels) for _, labels in samples)  # never a sandbox id

    async with served.client("dev") as client:
        assert (await client.delete(f"/v1/sandboxes/{created.json()['id']}")).status_code == 204
    samples = await served.scrape()
    assert value(samples, "corral_sandboxes", tenant=a, state="running") == 0
    assert value(samples, "corral_operations_total", action="sandbox.kill", outcome="ok") == 1


async def test_quota_and_capacity_refusals_count_by_limit_and_resource(served: Served) -> None:
    await served.service.store.set_quotas(served.tenants["a"], Quotas(max_sandboxes=1))
    async with served.client("dev") as client:
        assert (await client.post("/v1/sandboxes", json={})).status_code == 201
        refused = await client.post("/v1/sandboxes", json={})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "quota_exceeded"
    served.backend.figures = BackendCapacity(sandboxes_max=1)  # the machine is full now, whatever the quota
    async with served.client("other") as client:
        full = await client.post("/v1/sandboxes", json={})
        assert full.status_code == 503 and full.json()["error"]["code"] == "capacity_exceeded"
    samples = await served.scrape()
    a, b = served.tenants["a"], served.tenants["b"]
    assert value(samples, "corral_quota_refusals_total", tenant=a, limit="max_sandboxes") == 1
    assert value(samples, "corral_capacity_refusals_total", resource="sandboxes_max") == 1
    assert value(samples, "corral_sandbox_creates_total", tenant=a, outcome="quota_exceeded") == 1
    assert value(samples, "corral_sandbox_creates_total", tenant=b, outcome="capacity_exceeded") == 1
    assert value(samples, "corral_sandbox_create_duration_seconds_count") == 3  # refusals take time too


async def test_egress_decisions_count_by_rule_class_and_bytes_by_direction_never_by_host(served: Served) -> None:
    async with served.client("dev") as client:
        sandbox_id = (await client.post("/v1/sandboxes", json={})).json()["id"]
    now = time.time()
    events = [EgressEvent(now, sandbox_id, "connect", "CONNECT", "pypi.org", 443, True, "allow pypi.org",
                          bytes_up=100, bytes_down=5000),
              EgressEvent(now, sandbox_id, "connect", "CONNECT", "evil.example", 443, False, "policy none"),
              EgressEvent(now, sandbox_id, "http", "GET", "10.0.0.1", 80, False,
                          "forbidden address 10.0.0.1 (private)"),
              EgressEvent(now, "sb-gone", "connect", "CONNECT", "x.example", 443, False, "not in allowlist")]
    for event in events:
        await served.service.egress.record_event(event)
    samples = await served.scrape()
    a = served.tenants["a"]
    assert value(samples, "corral_egress_requests_total", tenant=a, decision="allowed", rule="allowlist") == 1
    assert value(samples, "corral_egress_requests_total", tenant=a, decision="denied", rule="policy_none") == 1
    assert value(samples, "corral_egress_requests_total", tenant=a, decision="denied",
                 rule="forbidden_address") == 1
    assert value(samples, "corral_egress_requests_total", tenant="unknown", decision="denied",
                 rule="not_in_allowlist") == 1
    assert value(samples, "corral_egress_bytes_total", tenant=a, direction="up") == 100
    assert value(samples, "corral_egress_bytes_total", tenant=a, direction="down") == 5000
    hosts = {"pypi.org", "evil.example", "10.0.0.1", "x.example"}
    assert not any(v in hosts for _, labels in samples for _, v in labels)


def test_rule_classes_are_a_small_fixed_set_whatever_the_rule_names() -> None:
    rules = {"allow *.example.com": "allowlist", "allow pypi.org:443 + private 10.1.2.3:5432": "private",
             "policy internet + private 10.1.2.3:5432": "private", "policy internet": "internet",
             "forbidden address 169.254.169.254 (link-local)": "forbidden_address", "dns refused": "dns",
             "preset @packages": "packages", "timeout": "timeout", "something new": "other"}
    assert {rule: rule_class(rule) for rule in rules} == rules
    assert set(rules.values()) <= RULE_CLASSES and len(RULE_CLASSES) < 25


async def test_exec_latency_and_file_bytes_come_from_the_operations_records(served: Served) -> None:
    """The fake agent runs nothing: the records an exec and transfers write are replayed through `Audited`, the
    one place every front end's operation is recorded (the runc test below does it for real)."""
    svc = served.service
    principal = await svc.store.authenticate(served.keys["dev"])
    records = [svc.auditor(principal, "sandbox.exec", "sb-x", params={"cmd": "true"}),
               svc.auditor(principal, "sandbox.exec", "sb-x", params={"cmd": "sleep 1d", "detached": True}),
               svc.auditor(principal, "files.write", "sb-x", params={"path": "/workspace/a", "size": 1000}),
               svc.auditor(principal, "archive.write", "sb-x", params={"path": "/workspace", "size": 24}),
               svc.auditor(principal, "files.read", "sb-x", params={"path": "/workspace/a"})]
    records[-1].outcome["size"] = 1000
    for record in records:
        await record.record()
    samples = await served.scrape()
    a = served.tenants["a"]
    assert value(samples, "corral_exec_duration_seconds_count") == 1  # a detached one is not a latency
    assert value(samples, "corral_file_bytes_total", tenant=a, direction="up") == 1024
    assert value(samples, "corral_file_bytes_total", tenant=a, direction="down") == 1000
    assert value(samples, "corral_operations_total", action="sandbox.exec", outcome="ok") == 2


async def test_a_failed_exec_is_counted_with_its_error(served: Served) -> None:
    async with served.client("dev") as client:
        r = await client.post("/v1/sandboxes/sb-missing0000/exec", json={"cmd": ["true"]})
        assert r.status_code == 404
    samples = await served.scrape()
    assert value(samples, "corral_operations_total", action="sandbox.exec", outcome="not_found") == 1
    assert value(samples, "corral_exec_duration_seconds_count") == 1


async def test_reconciler_passes_are_counted_with_their_duration(served: Served) -> None:
    served.service.reconciler.interval = 0.01  # from its next pass on (the lifespan started it, at 1 s)
    deadline = time.monotonic() + 10
    samples = await served.scrape()
    while value(samples, "corral_reconciler_runs_total", outcome="ok") < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        samples = await served.scrape()
    assert value(samples, "corral_reconciler_runs_total", outcome="ok") >= 2
    assert value(samples, "corral_reconciler_duration_seconds_count") >= 2


# -- end to end: a real server, real sandboxes ---------------------------------------------------------------------


@pytest.mark.runc
@pytest.mark.slow
def test_a_real_server_counts_a_create_an_exec_and_files_and_serves_its_metrics_port(
        test_home: Path, unique: str) -> None:
    port = free_port()
    with ServerProcess(test_home / f"metrics-{unique}", template_home=TEMPLATE_HOME,
                       args=["--metrics-port", str(port)]) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            tenant = admin.tenants.create(f"m-{unique}").id
            admin.tenants.update(tenant, quotas={"max_sandboxes": 1})
            key = admin.keys.create(f"m-{unique}", "developer").key
        with Sandbox.create(template=TEMPLATE, api_key=key, base_url=server.url) as sb:
            assert sb.commands.run("echo hi").stdout == "hi\n"
            denied = sb.commands.run("curl -sS --max-time 10 http://blocked.example/ ; true")  # network "none"
            assert denied.egress_denials, denied
            sb.files.write("/workspace/data.bin", b"\x00" * 4096)
            assert sb.files.read("/workspace/data.bin") == b"\x00" * 4096
            with pytest.raises(QuotaExceededError):
                Sandbox.create(template=TEMPLATE, api_key=key, base_url=server.url)
            r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.admin_key}"})
            assert r.status_code == 200
            on_api = parse(r.text)
            assert httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 403
            on_port = parse(httpx.get(f"http://127.0.0.1:{port}/metrics").text)  # no key there
        for samples in (on_api, on_port):
            assert value(samples, "corral_exec_duration_seconds_count") == 2
            assert value(samples, "corral_sandbox_creates_total", tenant=tenant, outcome="ok") == 1
            assert value(samples, "corral_sandbox_create_duration_seconds_count") == 2
            assert value(samples, "corral_quota_refusals_total", tenant=tenant, limit="max_sandboxes") == 1
            assert value(samples, "corral_egress_requests_total", tenant=tenant, decision="denied",
                         rule="policy_none") >= 1
            assert value(samples, "corral_file_bytes_total", tenant=tenant, direction="up") == 4096
            assert value(samples, "corral_file_bytes_total", tenant=tenant, direction="down") == 4096
            assert value(samples, "corral_sandboxes", tenant=tenant, state="running") == 1
