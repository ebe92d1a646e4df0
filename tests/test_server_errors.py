"""The API's one code -> status table (complete for every error class, and what docs/api.md says), and the audit
records of requests refused before a route runs: `auth.denied` (401) and `request.invalid` (400)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import CorralError, QuotaExceededError
from corral._exceptions import _all_subclasses
from corral.control import AUTH_DENIED, AuditEntry, ControlStore, Role, generate_key, parse_key
from corral.engine import Engine
from corral.server import STATUS_BY_CODE, create_app, status_for
from corral.server._errors import error_response
from corral.service import REQUEST_INVALID


def test_every_error_code_has_a_status() -> None:
    codes = {cls.code for cls in _all_subclasses(CorralError) if cls is not CorralError}
    assert codes == set(STATUS_BY_CODE)


@pytest.mark.parametrize(("code", "status"), [
    ("invalid_request", 400), ("unauthenticated", 401), ("permission_denied", 403), ("not_found", 404),
    ("conflict", 409), ("sandbox_timeout", 410), ("quota_exceeded", 429), ("disk_full", 507),
    ("server_error", 500), ("template_build_failed", 500), ("agent_error", 502), ("runtime_unavailable", 503),
])
def test_status_table_matches_the_contract(code: str, status: int) -> None:
    assert status_for(code) == status


def test_retry_after_only_when_given() -> None:
    plain = error_response(QuotaExceededError("full"))
    assert plain.status_code == 429 and "retry-after" not in plain.headers
    timed = error_response(QuotaExceededError("full", details={"retry_after": 7}))
    assert timed.headers["retry-after"] == "7"


# -- what refused requests leave in the audit trail ------------------------------------------------------------------


@dataclass
class Served:
    app: Any
    store: ControlStore
    admin_key: str

    def client(self, key: str | None = None, address: str = "192.0.2.1") -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        transport = httpx.ASGITransport(app=self.app, client=(address, 40000))
        return httpx.AsyncClient(transport=transport, base_url="http://corral.test", headers=headers)

    async def records(self, action: str) -> list[AuditEntry]:
        return await self.store.audit.query(action=action, limit=None)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """The app over a store only: these requests never reach the engine (it is not even started)."""
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        admin_key = generate_key()
        await store.bootstrap_admin(admin_key)
        yield Served(create_app(Engine(tmp_path / "engine"), store), store, admin_key)
    finally:
        await store.close()


@pytest.mark.anyio
async def test_refused_keys_are_audited_with_their_prefix_only(served: Served) -> None:
    unknown = generate_key()
    attempts = [(None, "198.51.100.1"), ("not-a-key", "198.51.100.2"), (unknown, "198.51.100.3")]
    for key, address in attempts:
        async with served.client(key, address) as c:
            assert (await c.get("/v1/sandboxes")).status_code == 401
    records = await served.records(AUTH_DENIED)
    assert [r.params["client"] for r in records] == [a for _, a in attempts]
    assert [r.params["key_prefix"] for r in records] == [None, None, parse_key(unknown).prefix]
    assert all(r.params["method"] == "GET" and r.params["path"] == "/v1/sandboxes" for r in records)
    reasons = [r.outcome["reason"] for r in records]
    assert reasons[0].startswith("missing API key") and reasons[1].startswith("malformed API key")
    assert reasons[2] == "invalid API key"
    assert all(r.tenant_id is None and r.outcome["status"] == 401 for r in records)
    dump = "".join(r.to_json() for r in await served.store.audit.query(limit=None))
    assert parse_key(unknown).secret not in dump and "not-a-key" not in dump


@pytest.mark.anyio
async def test_revoked_key_is_audited(served: Served) -> None:
    tenant = await served.store.create_tenant("acme")
    new = await served.store.create_key(tenant.id, Role.DEVELOPER)
    async with served.client(new.key) as c:
        assert (await c.get("/v1/sandboxes")).status_code == 200
        await served.store.revoke_key(new.info.id)
        assert (await c.get("/v1/sandboxes")).status_code == 401
    (record,) = await served.records(AUTH_DENIED)
    assert record.params["key_prefix"] == new.info.prefix and record.outcome["reason"] == "this API key was revoked"


@pytest.mark.anyio
async def test_a_401_flood_costs_two_records(served: Served) -> None:
    async with served.client(generate_key(), "203.0.113.9") as c:
        for _ in range(100):
            assert (await c.get("/v1/sandboxes")).status_code == 401
    assert len(await served.records(AUTH_DENIED)) == 1
    await served.store.auth_denials.flush()  # the window's summary (written when the window ends, or at shutdown)
    first, summary = await served.records(AUTH_DENIED)
    assert (first.params["count"], summary.params["count"]) == (1, 99) and summary.outcome["aggregated"]
    assert (await served.store.audit.verify()).ok


@pytest.mark.anyio
@pytest.mark.parametrize(("method", "path", "kwargs", "route", "where"), [
    ("POST", "/v1/tenants", {"json": {"name": ["x"]}}, "/v1/tenants", "body.name"),
    ("POST", "/v1/tenants", {"content": b"{not json", "headers": {"content-type": "application/json"}},
     "/v1/tenants", "body.1"),
    ("POST", "/v1/sandboxes/sb-1/exec", {"json": {"cwd": "/"}}, "/v1/sandboxes/{sandbox_id}/exec", "body.cmd"),
    ("GET", "/v1/audit", {"params": {"limit": "many"}}, "/v1/audit", "query.limit"),
])
async def test_invalid_requests_are_audited(served: Served, method: str, path: str, kwargs: dict[str, Any],
                                            route: str, where: str) -> None:
    async with served.client(served.admin_key) as c:
        r = await c.request(method, path, **kwargs)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    (record,) = await served.records(REQUEST_INVALID)
    admin = await served.store.authenticate(served.admin_key)
    assert (record.tenant_id, record.key_id, record.role) == (admin.tenant_id, admin.key_id, "admin")
    assert record.params["route"] == route and record.params["path"] == path
    assert record.params["method"] == method and record.params["client"] == "192.0.2.1"
    assert where in [p["where"] for p in record.params["problems"]]
    assert record.target == ("sb-1" if "sb-1" in path else None)
    assert record.outcome == {"status": 400, "error": "invalid_request"}


@pytest.mark.anyio
async def test_an_invalid_body_without_a_key_is_a_401(served: Served) -> None:
    """A body refused before the key was checked: authentication still comes first, and is what is recorded."""
    async with served.client(None) as c:
        r = await c.post("/v1/tenants", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    assert await served.records(REQUEST_INVALID) == []
    assert len(await served.records(AUTH_DENIED)) == 1
