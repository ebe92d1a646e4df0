"""`AsyncAdmin` in-process against the real app (httpx.ASGITransport) with a ControlStore on a temp SQLite DB.

No sandbox is started, so no runtime is needed; the live follow stream is checked over a real socket in
tests/test_cli.py (ASGITransport buffers whole responses, and a follow never ends).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from corral import Admin, AsyncAdmin, AuthenticationError, NotFoundError, PermissionDeniedError, ServerError
from corral._sdk import _admin
from corral.control import AuditEntry, ControlStore, verify_chain
from corral.engine import Engine
from corral.server import _admin as admin_routes
from corral.server import create_app

pytestmark = pytest.mark.anyio

URL = "http://corral.test"


@pytest.fixture
async def app_and_key(tmp_path: Path) -> AsyncIterator[tuple[object, str, ControlStore]]:
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        await store.bootstrap_admin(None)
        key = (tmp_path / "admin.key").read_text().strip()
        # The engine is never started: ASGITransport runs no lifespan, and these routes never touch it.
        yield create_app(Engine(tmp_path), store), key, store
    finally:
        await store.close()


def connect(app: object, key: str) -> AsyncAdmin:
    return AsyncAdmin(api_key=key, base_url=URL, transport=httpx.ASGITransport(app=app))  # type: ignore[arg-type]


async def test_tenants_keys_and_quotas(app_and_key: tuple[object, str, ControlStore]) -> None:
    app, key, _ = app_and_key
    async with connect(app, key) as admin:
        acme = await admin.tenants.create("acme")
        assert acme.name == "acme" and not acme.disabled and acme.quotas["max_sandboxes"] is None
        assert [t.name for t in await admin.tenants.list()] == ["acme", "admin"]
        updated = await admin.tenants.update("acme", quotas={"max_sandboxes": 3, "max_cpus": 2.5})
        assert (updated.quotas["max_sandboxes"], updated.quotas["max_cpus"]) == (3, 2.5)
        updated = await admin.tenants.update(acme.id, quotas={"max_cpus": None})  # by id; others kept
        assert (updated.quotas["max_sandboxes"], updated.quotas["max_cpus"]) == (3, None)

        new = await admin.keys.create("acme", "developer", name="agent")
        assert new.key not in repr(new) and new.tenant == "acme"
        listed = await admin.keys.list("acme")
        assert [(k.id, k.role, k.name, k.tenant, k.revoked) for k in listed] == [
            (new.id, "developer", "agent", "acme", False)]
        assert len(await admin.keys.list()) == 2  # every tenant's, the bootstrap admin key too
        async with connect(app, new.key) as dev:
            with pytest.raises(PermissionDeniedError):
                await dev.keys.list()
        await admin.keys.revoke(new.id)
        assert (await admin.keys.list("acme"))[0].revoked

        assert (await admin.tenants.update("acme", disabled=True)).disabled
        with pytest.raises(NotFoundError):
            await admin.tenants.update("nobody", disabled=True)
        with pytest.raises(Exception, match="own tenant"):
            await admin.tenants.update("admin", disabled=True)  # would lock every admin out


async def test_private_grants(app_and_key: tuple[object, str, ControlStore]) -> None:
    app, key, _ = app_and_key
    async with connect(app, key) as admin:
        await admin.tenants.create("acme")
        op = await admin.keys.create("acme", "operator")
        granted = await admin.tenants.grant_private("acme", "[fd00::5]:443")
        assert [g["destination"] for g in granted] == ["[fd00::5]:443"] and granted[0]["key_id"]
        async with connect(app, op.key) as operator:
            assert [g["destination"] for g in await operator.tenants.grants("acme")] == ["[fd00::5]:443"]
            assert (await operator.tenants.set_egress("acme", private=["[fd00::5]:443"]))["private"] \
                == ["[fd00::5]:443"]
            with pytest.raises(PermissionDeniedError, match="not granted"):
                await operator.tenants.set_egress("acme", private=["10.0.0.5:5432"])
            with pytest.raises(PermissionDeniedError):
                await operator.tenants.grant_private("acme", "10.0.0.5:5432")
        assert await admin.tenants.revoke_private("acme", "[fd00::5]:443") == []  # brackets and colons in a path
        assert await admin.tenants.grants("acme") == []


async def test_audit_query_verify_and_export(app_and_key: tuple[object, str, ControlStore]) -> None:
    app, key, store = app_and_key
    async with connect(app, key) as admin:
        await admin.tenants.create("acme")
        await admin.keys.create("acme", "auditor")
        records = await admin.audit.query(action="tenant.create")
        assert [(r.action, r.params) for r in records] == [("tenant.create", {"name": "acme"})]
        head = await admin.audit.head()
        verification = await admin.audit.verify(head)
        assert verification.ok and verification.head == head and verification.problem is None

        out = io.StringIO()
        count = await admin.audit.export(out)
        lines = out.getvalue().splitlines()
        assert count == len(lines) == int(head.split(":")[0])
        exported = [AuditEntry.from_json(line) for line in lines]
        assert verify_chain(exported, keys=store.audit.keys).ok  # the export verifies offline, with the key
        assert [json.loads(line)["action"] for line in lines] == [r.action for r in await admin.audit.query()]

        # A head from the future: the newest records look deleted.
        seq, digest = head.split(":")
        gone = await admin.audit.verify(f"{int(seq) + 5}:{digest}")
        assert not gone.ok and gone.problem is not None and gone.problem.kind == "deleted"


async def test_non_admins_read_only_their_own_tenants_trail(app_and_key: tuple[object, str, ControlStore]) -> None:
    app, key, _ = app_and_key
    async with connect(app, key) as admin:
        acme = await admin.tenants.create("acme")
        auditor_key = (await admin.keys.create("acme", "auditor")).key
    async with connect(app, auditor_key) as auditor:
        with pytest.raises(PermissionDeniedError):
            await auditor.tenants.list()  # refused, and recorded against acme
        out = io.StringIO()
        assert await auditor.audit.export(out) == 1
        assert json.loads(out.getvalue())["tenant_id"] == acme.id
        with pytest.raises(PermissionDeniedError):
            await auditor.audit.export(io.StringIO(), tenant="admin")
        with pytest.raises(PermissionDeniedError):
            async for _ in auditor.audit.follow(tenant="admin"):
                pass
        with pytest.raises(PermissionDeniedError):
            await auditor.kill_all(tenant="acme")


async def test_errors_are_corral_errors(app_and_key: tuple[object, str, ControlStore]) -> None:
    app, _, _ = app_and_key
    async with connect(app, "corral_" + "0" * 8 + "_" + "A" * 43) as stranger:
        with pytest.raises(AuthenticationError):
            await stranger.tenants.list()
    with pytest.raises(ValueError, match="exactly one"):
        _admin._kill_body(None, None, False)
    with pytest.raises(ServerError, match="malformed"):
        _admin.TenantInfo.from_wire({"name": "no id"})


def test_sync_and_async_admin_have_the_same_methods() -> None:
    for sync, aio in [(Admin, AsyncAdmin), (_admin.Tenants, _admin.AsyncTenants), (_admin.Keys, _admin.AsyncKeys),
                      (_admin.Audit, _admin.AsyncAudit)]:
        public = {n for n in vars(sync) if not n.startswith("_")}
        assert public == {n for n in vars(aio) if not n.startswith("_")}, sync
        for name in public:
            assert inspect.signature(getattr(sync, name)).parameters.keys() == \
                inspect.signature(getattr(aio, name)).parameters.keys(), name


async def test_follow_stream_sends_keepalives_between_records() -> None:
    async def records() -> AsyncIterator[AuditEntry]:
        await asyncio.sleep(0.5)
        yield AuditEntry.from_dict({"seq": 1, "time": "2030-01-01T00:00:00+00:00", "tenant_id": None, "key_id": None,
                                    "role": None, "action": "x", "target": None, "params": {}, "outcome": {},
                                    "prev_hash": "0" * 64, "hash": "1" * 64})
        await asyncio.sleep(3600)

    stream = admin_routes._with_keepalive(records(), 0.1)
    lines = [await anext(stream)]
    while lines[-1] == b"\n":
        lines.append(await anext(stream))
    await stream.aclose()  # the client left: the pump task is cancelled with it
    assert len(lines) >= 3 and json.loads(lines[-1])["seq"] == 1  # keep-alives while idle, then the record
