"""The service layer against a fake backend: every sandbox, kill-switch, tenant, key, egress and audit operation
is allowed for the right role, refused for the others (another tenant's sandbox does not exist), audited either
way, bounded by quotas, and compensated when a step fails. No runtime needed: a real `Engine` and a real
`ControlStore` (SQLite) over `FakeBackend` (tests/fakes.py). The real-runc tests cover the same paths end to end.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from corral import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    ServerError,
)
from corral.backends import SandboxState
from corral.control import AuditEntry, ControlStore, Principal, Quotas, Role
from corral.engine import Engine
from corral.service import AuditFilter, ClientInfo, CreateSandbox, Service

from .fakes import FakeBackend, FakeTemplates, World

pytestmark = pytest.mark.anyio

CLIENT = ClientInfo("127.0.0.1", "POST", "/v1/sandboxes")


@dataclass
class Setup:
    service: Service
    backend: FakeBackend
    tenants: dict[str, str]  # name -> id
    who: dict[str, Principal]  # "a_dev", "a_auditor", "a_operator", "b_dev", "admin"
    keys: dict[str, str]

    @property
    def engine(self) -> Engine:
        return self.service.engine

    @property
    def store(self) -> ControlStore:
        return self.service.store

    async def records(self, action: str) -> list[AuditEntry]:
        return await self.store.audit.query(action=action)

    async def last(self, action: str) -> AuditEntry:
        found = await self.records(action)
        assert found, f"no {action} record"
        return found[-1]


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    home = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))  # short: the fake agents' Unix sockets live here
    world = World(home / "world")
    world.dir.mkdir()
    backend = FakeBackend(home, world)
    engine = Engine(home, backend, templates=FakeTemplates())  # type: ignore[arg-type]
    service = Service(engine, ControlStore(home=home))
    await service.start()
    try:
        tenants, who, keys = {}, {}, {}
        for name in ("a", "b"):
            tenants[name] = (await service.store.create_tenant(name)).id
        admin_tenant = (await service.store.create_tenant("ops")).id
        roles = (("a_dev", tenants["a"], Role.DEVELOPER), ("a_auditor", tenants["a"], Role.AUDITOR),
                 ("a_operator", tenants["a"], Role.OPERATOR), ("b_dev", tenants["b"], Role.DEVELOPER),
                 ("admin", admin_tenant, Role.ADMIN))
        for label, tenant, role in roles:
            new = await service.store.create_key(tenant, role)
            keys[label] = new.key
            who[label] = await service.store.authenticate(new.key)
        yield Setup(service, backend, tenants, who, keys)
    finally:
        await service.close()
        await engine.close(destroy_all=True)
        for server in world.agents.values():
            server.close()
        shutil.rmtree(home, ignore_errors=True)


async def _create(s: Setup, who: str = "a_dev", **fields: Any) -> str:
    record = await s.service.sandboxes.create(s.who[who], CreateSandbox(**fields))
    return record.id


# -- create ------------------------------------------------------------------------------------------------------


async def test_create_records_runs_and_audits_without_env_values(setup: Setup) -> None:
    s = setup
    record = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox(env={"TOKEN": "s3cret"},
                                                                            metadata={"job": "x"}))
    assert record.state is SandboxState.RUNNING and record.tenant_id == s.tenants["a"]
    assert record.spec.env == {} and record.env_names == ("TOKEN",)  # values never reach the store
    assert [i.id for i in s.engine.list()] == [record.id]
    audit = await s.last("sandbox.create")
    assert audit.target == record.id and audit.outcome["status"] == 201
    assert audit.params["env_names"] == ["TOKEN"] and "s3cret" not in audit.to_json()


async def test_an_auditor_cannot_create_and_the_refusal_is_audited(setup: Setup) -> None:
    s = setup
    with pytest.raises(PermissionDeniedError):
        await _create(s, "a_auditor")
    assert s.engine.list() == []
    audit = await s.last("sandbox.create")
    assert audit.outcome == {"status": 403, "error": "permission_denied"} and audit.role == "auditor"


@pytest.mark.parametrize("fields", [{"template": "nope"}, {"limits": {"memory": "1K"}}, {"network": "everywhere"},
                                    {"runtime": "qemu"}, {"file_roots": ["relative"]}])
async def test_an_invalid_spec_is_refused_and_creates_nothing(setup: Setup, fields: dict[str, Any]) -> None:
    s = setup
    s.engine.templates.missing = {"nope"}  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequestError):
        await _create(s, **fields)
    assert s.engine.list() == [] and await s.store.list_sandboxes(s.tenants["a"]) == []
    assert (await s.last("sandbox.create")).outcome["status"] == 400


async def test_a_total_quota_is_429_with_retry_after_and_a_failed_create_stops_counting(setup: Setup) -> None:
    s = setup
    await s.store.set_quotas(s.tenants["a"], Quotas(max_sandboxes=1))
    s.backend.fail_create = True
    with pytest.raises(ServerError):
        await _create(s)  # compensated: the record is FAILED and does not hold the tenant's one sandbox
    (failed,) = await s.store.list_sandboxes(s.tenants["a"], include_destroyed=True)
    assert failed.state is SandboxState.FAILED and not failed.live
    s.backend.fail_create = False
    await _create(s, timeout=30)
    with pytest.raises(QuotaExceededError) as refused:
        await _create(s)
    assert 1 <= refused.value.details["retry_after"] <= 31
    assert (await s.last("sandbox.create")).outcome == {"status": 429, "error": "quota_exceeded"}
    assert len(s.engine.list()) == 1


async def test_the_kill_switch_during_a_create_leaves_nothing_running(setup: Setup) -> None:
    s = setup
    s.backend.agent_delay = 0.5  # the engine waits this long for the agent: the switch is thrown meanwhile
    create = asyncio.create_task(_create(s))
    for _ in range(100):
        if await s.store.list_sandboxes(s.tenants["a"]):
            break
        await asyncio.sleep(0.01)
    report = await s.service.sandboxes.kill_all(s.who["a_operator"], tenant="a")
    assert len(report.killed) == 1
    with pytest.raises(ConflictError, match="kill switch"):
        await create
    assert s.engine.list() == [] and s.backend.world.running == set()


# -- another tenant's sandbox does not exist ------------------------------------------------------------------


@pytest.mark.parametrize("operation", ["get", "kill", "pause", "resume", "timeout", "network"])
async def test_another_tenants_sandbox_is_not_found_for_every_operation(setup: Setup, operation: str) -> None:
    s = setup
    sid = await _create(s, "b_dev")
    sandboxes, dev = s.service.sandboxes, s.who["a_dev"]
    calls: dict[str, Callable[[], Awaitable[object]]] = {
             "get": lambda: sandboxes.get(dev, sid), "kill": lambda: sandboxes.kill(dev, sid),
             "pause": lambda: sandboxes.pause(dev, sid), "resume": lambda: sandboxes.resume(dev, sid),
             "timeout": lambda: sandboxes.set_timeout(dev, sid, 60),
             "network": lambda: sandboxes.set_network(dev, sid, "internet")}
    with pytest.raises(NotFoundError):
        await calls[operation]()
    assert [i.id for i in s.engine.list()] == [sid]
    records = await s.store.audit.query(tenant=s.tenants["a"])
    assert records[-1].target == sid and records[-1].outcome["status"] == 404
    assert await sandboxes.list(dev) == []


async def test_roles_hold_on_a_tenants_own_sandboxes(setup: Setup) -> None:
    s = setup
    sid = await _create(s)
    assert (await s.service.sandboxes.get(s.who["a_operator"], sid)).id == sid
    for attempt in (s.service.sandboxes.get(s.who["a_auditor"], sid), s.service.sandboxes.kill(s.who["a_auditor"], sid),
                    s.service.sandboxes.pause(s.who["a_auditor"], sid)):
        with pytest.raises(PermissionDeniedError):
            await attempt
    assert [i.id for i in s.engine.list()] == [sid]


# -- the rest of the lifecycle ---------------------------------------------------------------------------------


async def test_timeout_network_pause_resume_kill_reach_store_and_engine(setup: Setup) -> None:
    s = setup
    sid = await _create(s)
    sandboxes, dev = s.service.sandboxes, s.who["a_dev"]
    record = await sandboxes.set_timeout(dev, sid, 120)  # the store's alone: the engine keeps no timeout
    assert abs((record.expires_at - datetime.now(UTC)).total_seconds() - 120) < 5
    assert (await s.store.get_sandbox(sid)).expires_at == record.expires_at
    record = await sandboxes.set_network(dev, sid, ["pypi.org"])
    assert record.spec.network == ("pypi.org",) and s.engine.spec(sid).network == ("pypi.org",)
    assert (await sandboxes.pause(dev, sid)).state is SandboxState.PAUSED
    assert ("pause", sid) in s.backend.calls
    assert (await sandboxes.resume(dev, sid)).state is SandboxState.RUNNING
    await sandboxes.kill(dev, sid)
    assert s.engine.list() == [] and await sandboxes.list(dev) == []
    assert [r.action for r in await s.store.audit.query(sandbox=sid)] == [
        "sandbox.create", "sandbox.timeout", "sandbox.network", "sandbox.pause", "sandbox.resume", "sandbox.kill"]


async def test_a_network_beyond_the_tenants_ceiling_is_refused_and_changes_nothing(setup: Setup) -> None:
    s = setup
    await s.service.egress.set(s.who["admin"], "a", ceiling=["*.example.org"])
    sid = await _create(s, network=["api.example.org"])
    with pytest.raises(PermissionDeniedError):
        await s.service.sandboxes.set_network(s.who["a_dev"], sid, "internet")
    assert s.engine.spec(sid).network == ("api.example.org",)
    with pytest.raises(PermissionDeniedError):
        await _create(s, network="internet")


async def test_lowering_the_ceiling_narrows_live_sandboxes(setup: Setup) -> None:
    s = setup
    sid = await _create(s, network="internet")
    _, egress = await s.service.egress.set(s.who["admin"], "a", ceiling="none")
    assert egress.ceiling == "none"
    assert s.engine.spec(sid).network == "none"
    assert (await s.store.get_sandbox(sid)).spec.network == "none"
    with pytest.raises(PermissionDeniedError):  # a developer may not change the ceiling
        await s.service.egress.set(s.who["a_dev"], "a", ceiling="internet")
    with pytest.raises(NotFoundError):  # nor see another tenant's settings
        await s.service.egress.get(s.who["a_operator"], "b")


# -- the kill switch ---------------------------------------------------------------------------------------------


async def test_the_kill_switch_by_key_revokes_first_and_spares_others(setup: Setup) -> None:
    s = setup
    mine, other = await _create(s), await _create(s, "b_dev")
    report = await s.service.sandboxes.kill_all(s.who["admin"], key=s.who["a_dev"].key_id, revoke=True)
    assert report.killed == [mine] and report.revoked
    assert [i.id for i in s.engine.list()] == [other]
    with pytest.raises(AuthenticationError):
        await s.service.authenticate(s.keys["a_dev"], CLIENT)
    with pytest.raises(NotFoundError):  # an operator of tenant a does not see tenant b
        await s.service.sandboxes.kill_all(s.who["a_operator"], tenant="b")
    with pytest.raises(PermissionDeniedError):
        await s.service.sandboxes.kill_all(s.who["b_dev"], tenant="b")
    with pytest.raises(InvalidRequestError):
        await s.service.sandboxes.kill_all(s.who["admin"], tenant="a", revoke=True)


# -- the reconciler ------------------------------------------------------------------------------------------------


async def test_the_reconciler_expires_records_and_removes_orphans(setup: Setup, monkeypatch: Any) -> None:
    s = setup
    short, keep = await _create(s, timeout=1), await _create(s, timeout=300)
    await asyncio.sleep(1.1)
    assert await s.service.reconciler.expire() == [short]
    assert {i.id for i in s.engine.list()} == {keep}
    assert (await s.last("sandbox.expire")).target == short
    orphan = await s.engine.create(sandbox_id="sb-orphan0001")  # what no record claims
    monkeypatch.setattr("corral.service._reconciler.ORPHAN_GRACE", 0.0)
    assert await s.service.reconciler.remove_orphans() == [orphan.id]
    assert {i.id for i in s.engine.list()} == {keep}


# -- callers, accounts and the audit trail ---------------------------------------------------------------------


async def test_authenticate_refuses_and_records_every_denial(setup: Setup) -> None:
    s = setup
    assert (await s.service.authenticate(s.keys["a_dev"], CLIENT)).tenant_id == s.tenants["a"]
    for key in (None, "not-a-key", s.keys["a_dev"] + "x"):
        with pytest.raises(AuthenticationError):
            await s.service.authenticate(key, CLIENT)
    await s.store.auth_denials.flush()
    records = await s.records("auth.denied")  # the first at once, the others summed up when the window closes
    assert sum(r.params["count"] for r in records) == 3
    assert {r.params["client"] for r in records} == {"127.0.0.1"}


async def test_an_invalid_request_is_audited_for_its_caller(setup: Setup) -> None:
    s = setup
    problems = [{"where": "body.timeout", "message": "not a number"}]
    await s.service.record_invalid(s.who["a_dev"], CLIENT, route="/v1/sandboxes", target=None, problems=problems)
    record = await s.last("request.invalid")
    assert record.tenant_id == s.tenants["a"] and record.params["problems"] == problems
    assert record.outcome == {"status": 400, "error": "invalid_request"}


async def test_tenants_and_keys_are_the_admins(setup: Setup) -> None:
    s = setup
    admin, dev = s.who["admin"], s.who["a_dev"]
    tenant = await s.service.tenants.create(admin, "c")
    assert "c" in {t.name for t in await s.service.tenants.list(admin)}
    updated = await s.service.tenants.update(admin, "c", quotas={"max_sandboxes": 3})
    assert updated.quotas.max_sandboxes == 3
    with pytest.raises(InvalidRequestError):  # the admin's own tenant: nobody could undo it
        await s.service.tenants.update(admin, "ops", disabled=True)
    new, found = await s.service.keys.create(admin, "c", "developer", "ci")
    assert found.id == tenant.id and new.key
    assert [k.id for k, name in await s.service.keys.list(admin, "c")] == [new.info.id]
    await s.service.keys.revoke(admin, new.info.id)
    for attempt in (s.service.tenants.create(dev, "d"), s.service.tenants.list(dev),
                    s.service.keys.create(dev, "a", "admin"), s.service.keys.revoke(dev, new.info.id)):
        with pytest.raises(PermissionDeniedError):
            await attempt
    with pytest.raises(InvalidRequestError):
        await s.service.keys.create(admin, "nope", "developer")
    assert [r.outcome["status"] for r in await s.records("key.create")] == [201, 403, 400]


async def test_the_audit_trail_is_read_per_tenant(setup: Setup) -> None:
    s = setup
    await _create(s)
    await _create(s, "b_dev")
    mine = await s.service.audit.query(s.who["a_auditor"], AuditFilter(action="sandbox.create"), limit=100)
    assert {r.tenant_id for r in mine} == {s.tenants["a"]}
    for other in ("b", "no-such-tenant"):  # refused alike: whether tenant b exists does not leak
        with pytest.raises(PermissionDeniedError, match="own tenant"):
            await s.service.audit.query(s.who["a_auditor"], AuditFilter(tenant=other), limit=100)
    everyone = await s.service.audit.query(s.who["admin"], AuditFilter(action="sandbox.create"), limit=100)
    assert {r.tenant_id for r in everyone} == {s.tenants["a"], s.tenants["b"]}
    pages = [page async for page in await s.service.audit.export(s.who["admin"], AuditFilter())]
    assert sum(len(p) for p in pages) == len(await s.store.audit.query(limit=None))
    with pytest.raises(PermissionDeniedError):
        await s.service.audit.query(s.who["a_dev"], AuditFilter(), limit=10)
    assert (await s.service.audit.verify(s.who["a_auditor"])).ok
