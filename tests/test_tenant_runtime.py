"""A tenant's required runtime (docs/security.md, "Runtime policy"): set by admins only, audited with the old and
new value, and enforced by the service on every path that starts a sandbox, against the fake backend. The same
on a real gVisor sandbox: tests/test_runsc.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from corral import AsyncAdmin, InvalidRequestError, PermissionDeniedError, RuntimeUnavailableError
from corral._sdk import _admin
from corral.backends import Runtime
from corral.cli import app
from corral.control import ControlStore
from corral.engine import Engine, SandboxSpec, WarmPool
from corral.engine._pool import PoolState
from corral.mcp._args import CreateArgs
from corral.mcp._progress import Progress
from corral.mcp._tools import Call, create_sandbox
from corral.server import create_app
from corral.service import CreateSandbox, ForkSandbox

from .test_service import Setup, _create
from .test_service import setup as setup  # the fixture: a Service over FakeBackend, tenants a and b

pytestmark = pytest.mark.anyio

URL = "http://corral.test"


async def _require_runsc(s: Setup, tenant: str = "a") -> None:
    await s.service.tenants.update(s.who["admin"], tenant, required_runtime="runsc")


# -- enforcement ---------------------------------------------------------------------------------------------


async def test_a_create_asking_for_runc_is_upgraded_and_the_audit_says_so(setup: Setup) -> None:
    s = setup
    assert (await s.store.get_sandbox(await _create(s))).spec.runtime is Runtime.RUNC  # no policy: as asked
    await _require_runsc(s)
    record = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox())  # the default: runc
    assert record.spec.runtime is Runtime.RUNSC
    assert s.engine.spec(record.id).runtime is Runtime.RUNSC  # what the backend was given
    audit = await s.last("sandbox.create")
    assert audit.params["runtime"] == "runc" and audit.outcome["runtime_upgraded"] == {"asked": "runc",
                                                                                     "runtime": "runsc"}
    asked = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox(runtime="runsc"))
    assert asked.spec.runtime is Runtime.RUNSC and "runtime_upgraded" not in (await s.last("sandbox.create")).outcome
    other = await s.service.sandboxes.create(s.who["b_dev"], CreateSandbox())  # another tenant: as asked
    assert other.spec.runtime is Runtime.RUNC


async def test_mcp_create_sandbox_is_upgraded_too(setup: Setup) -> None:
    """MCP's tool cannot even ask for a runtime; the E2B API's create goes through the same service call."""
    s = setup
    await _require_runsc(s)

    async def report(progress: float, total: float | None, message: str | None) -> None:
        pass

    await create_sandbox(Call(s.service, s.who["a_dev"], Progress(report)), CreateArgs.model_validate({}))
    [record] = await s.store.list_sandboxes(s.tenants["a"])
    assert record.spec.runtime is Runtime.RUNSC
    assert (await s.last("sandbox.create")).outcome["runtime_upgraded"]["runtime"] == "runsc"


async def test_a_fork_of_a_runc_sandbox_starts_on_the_required_runtime(setup: Setup) -> None:
    s = setup
    parent = await _create(s)  # before the policy: runc
    await _require_runsc(s)
    children = await s.service.sandboxes.fork(s.who["a_dev"], parent, ForkSandbox(count=2))
    assert [c.spec.runtime for c in children] == [Runtime.RUNSC, Runtime.RUNSC]
    assert all(s.engine.spec(c.id).runtime is Runtime.RUNSC for c in children)
    assert (await s.last("sandbox.fork")).outcome["runtime_upgraded"] == {"asked": "runc", "runtime": "runsc"}


async def test_a_sandbox_started_from_a_snapshot_runs_on_the_required_runtime(setup: Setup) -> None:
    s = setup
    snapshot = await s.service.snapshots.create(s.who["a_dev"], await _create(s))
    await _require_runsc(s)
    record = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox(template=snapshot.id))
    assert record.spec.runtime is Runtime.RUNSC and s.engine.spec(record.id).runtime is Runtime.RUNSC


async def test_a_backend_without_runsc_refuses_naming_the_policy_and_starts_nothing(setup: Setup) -> None:
    s = setup
    await _require_runsc(s)
    s.backend.limitations = {"runtime_runsc": "no gVisor here"}  # type: ignore[attr-defined]
    before = s.backend.called("create")
    with pytest.raises(RuntimeUnavailableError, match="tenant's policy requires the runsc runtime") as caught:
        await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox())
    assert caught.value.details["required_runtime"] == "runsc"
    assert s.backend.called("create") == before and await s.store.list_sandboxes(s.tenants["a"]) == []
    assert (await s.last("sandbox.create")).outcome["error"] == "runtime_unavailable"
    assert (await s.service.sandboxes.create(s.who["b_dev"], CreateSandbox())).spec.runtime is Runtime.RUNC


async def test_the_warm_pool_never_hands_a_required_runsc_tenant_a_runc_sandbox(setup: Setup) -> None:
    s = setup
    await _require_runsc(s)
    # A pooled runc sandbox of the default spec: taken only by a spec of the same pool key (runtime included).
    handle = await s.engine.create()
    member = s.engine.runtime.sandboxes.pop(handle.id)  # stand in for the pool filler: a pool of one, this sandbox
    state = PoolState(WarmPool(SandboxSpec(), 1), members=[member.id])
    s.engine.pool.states[s.engine.pool.key(SandboxSpec())] = state
    s.engine.pool.ready[member.id] = member
    record = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox())
    assert record.spec.runtime is Runtime.RUNSC and record.id != handle.id
    assert list(s.engine.pool.ready) == [handle.id] and state.stats.claimed == 0  # the runc one is still there
    assert s.engine.spec(record.id).runtime is Runtime.RUNSC


# -- the setting: admins only, validated, audited -------------------------------------------------------------


async def test_only_admins_set_it_and_bad_values_change_nothing(setup: Setup) -> None:
    s = setup
    for who in ("a_dev", "a_operator", "a_auditor"):
        with pytest.raises(PermissionDeniedError):
            await s.service.tenants.update(s.who[who], "a", required_runtime="runsc")
    for bad in ("runc", "gvisor", ""):
        with pytest.raises(InvalidRequestError, match="required_runtime"):
            await s.service.tenants.update(s.who["admin"], "a", quotas={"max_sandboxes": 1}, required_runtime=bad)
    tenant = await s.store.get_tenant(s.tenants["a"])
    assert tenant.required_runtime is None and tenant.quotas.max_sandboxes is None  # nothing changed
    with pytest.raises(InvalidRequestError):
        await s.service.tenants.create(s.who["admin"], "c", required_runtime="runc")
    assert "c" not in [t.name for t in await s.store.list_tenants()]
    await _require_runsc(s)
    audit = await s.last("tenant.update")
    assert audit.outcome["required_runtime"] == {"old": None, "new": "runsc"}
    await s.service.tenants.update(s.who["admin"], "a", required_runtime=None)
    assert (await s.last("tenant.update")).outcome["required_runtime"] == {"old": "runsc", "new": None}
    assert (await s.store.get_tenant(s.tenants["a"])).required_runtime is None


@pytest.fixture
async def app_and_key(tmp_path: Path) -> AsyncIterator[tuple[object, str, ControlStore]]:
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        await store.bootstrap_admin(None)
        key = (tmp_path / "admin.key").read_text().strip()
        yield create_app(Engine(tmp_path), store), key, store  # the engine is never started: no sandbox here
    finally:
        await store.close()


async def test_the_rest_api_and_the_sdk_set_show_and_clear_it(app_and_key: tuple[object, str, ControlStore]) -> None:
    app, key, store = app_and_key
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with AsyncAdmin(api_key=key, base_url=URL, transport=transport) as admin:
        acme = await admin.tenants.create("acme", required_runtime="runsc")
        assert acme.required_runtime == "runsc"
        plain = await admin.tenants.create("plain")
        assert plain.required_runtime is None
        assert (await admin.tenants.update("acme", quotas={"max_sandboxes": 2})).required_runtime == "runsc"  # kept
        assert (await admin.tenants.update("acme", required_runtime="any")).required_runtime is None  # cleared
        assert (await admin.tenants.update("plain", required_runtime="runsc")).required_runtime == "runsc"
        assert {t.name: t.required_runtime for t in await admin.tenants.list()} == {
            "acme": None, "plain": "runsc", "admin": None}
        dev = await admin.keys.create("acme", "developer")
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=transport, base_url=URL) as http:
        for body in ({"required_runtime": "runc"}, {"required_runtime": 1}):
            response = await http.patch("/v1/tenants/acme", json=body, headers=headers)
            assert response.status_code == 400, response.text
        response = await http.patch("/v1/tenants/acme", json={"required_runtime": "runsc"},
                                    headers={"Authorization": f"Bearer {dev.key}"})
        assert response.status_code == 403
        response = await http.post("/v1/tenants", json={"name": "x", "required_runtime": "runsc"},
                                   headers={"Authorization": f"Bearer {dev.key}"})
        assert response.status_code == 403
        response = await http.get("/v1/tenants", headers=headers)
        assert {t["name"]: t["required_runtime"] for t in response.json()["tenants"]} == {
            "acme": None, "plain": "runsc", "admin": None}  # nothing the refused calls asked for
    assert (await store.tenant_by_name("acme")).required_runtime is None


def test_the_sdk_and_cli_spell_no_requirement_any() -> None:
    assert _admin._tenant_create("t", None) == {"name": "t"}
    assert _admin._tenant_create("t", "runsc") == {"name": "t", "required_runtime": "runsc"}
    assert _admin._tenant_patch(None, None) == {}  # left out: kept
    assert _admin._tenant_patch(None, None, "any") == {"required_runtime": None}
    assert _admin._tenant_patch(None, None, "runsc") == {"required_runtime": "runsc"}
    for command in ("create", "update"):
        result = CliRunner().invoke(app, ["tenants", command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "--runtime" in result.output and "gVisor" in result.output
    result = CliRunner().invoke(app, ["tenants", "update", "acme"], env={"CORRAL_URL": URL})
    assert result.exit_code == 2 and "--runtime" in result.output
