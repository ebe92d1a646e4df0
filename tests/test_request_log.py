"""Request ids and the request log (docs/operations.md): every request answers with an `X-Request-Id` (the
client's when it is a sensible one), the audit records of the request carry it, and its log line (one JSON object
with `--log-format json`) carries it with the tenant, key, action, sandbox, outcome, status and duration.

In-process over the fake backend (tests/fakes.py), the log lines caught from the `corral.requests` logger and
formatted by the JSON formatter `corral serve` uses; then a real `corral serve --log-format json`, whose every
line must parse.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import Admin
from corral._logging import JSONFormatter
from corral.control import AuditEntry, ControlStore, Quotas, Role
from corral.engine import Engine
from corral.server import ServerProcess, create_app
from corral.service import Service

from .conftest import TEMPLATE_HOME
from .fakes import FakeBackend, FakeTemplates, World

pytestmark = pytest.mark.anyio

BASE = "http://corral.test"
GENERATED = re.compile(r"[0-9a-f]{32}")


@dataclass
class Served:
    app: Any
    service: Service
    keys: dict[str, str]  # "admin", "dev" (tenant a) -> raw key
    key_ids: dict[str, str]
    tenant: str  # tenant a's id
    log: io.StringIO  # the request log, as JSON lines

    def client(self, who: str | None = "dev", **headers: str | bytes) -> httpx.AsyncClient:
        if who is not None:
            headers["Authorization"] = f"Bearer {self.keys[who]}"
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=BASE, headers=headers)

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.getvalue().splitlines()]

    async def records(self, action: str) -> list[AuditEntry]:
        return await self.service.store.audit.query(action=action)


@pytest.fixture
def request_log() -> Iterator[io.StringIO]:
    """The `corral.requests` logger's lines, formatted as `corral serve --log-format json` formats them."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JSONFormatter())
    log = logging.getLogger("corral.requests")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
async def served(request_log: io.StringIO) -> AsyncIterator[Served]:
    home = Path(tempfile.mkdtemp(prefix="cl-", dir="/tmp"))  # short: the fake agents' Unix sockets live here
    world = World(home / "world")
    world.dir.mkdir()
    engine = Engine(home, FakeBackend(home, world), templates=FakeTemplates())  # type: ignore[arg-type]
    store = ControlStore(home=home)
    app = create_app(engine, store)
    try:
        async with app.router.lifespan_context(app):
            await store.bootstrap_admin(None)
            tenant = (await store.create_tenant("a")).id
            dev = await store.create_key(tenant, Role.DEVELOPER)
            keys = {"admin": (home / "admin.key").read_text().strip(), "dev": dev.key}
            yield Served(app, app.state.corral, keys, {"dev": dev.info.id}, tenant, request_log)
    finally:
        await engine.close(destroy_all=True)
        for server in world.agents.values():
            server.close()
        shutil.rmtree(home, ignore_errors=True)


async def test_the_clients_request_id_is_answered_logged_and_audited(served: Served) -> None:
    async with served.client(**{"X-Request-Id": "job-42/step-7"}) as client:
        r = await client.post("/v1/sandboxes", json={"metadata": {"job": "42"}})
    assert r.status_code == 201 and r.headers["x-request-id"] == "job-42/step-7"
    sandbox_id = r.json()["id"]
    [line] = served.lines()
    assert line["request_id"] == "job-42/step-7" and line["logger"] == "corral.requests"
    assert line["tenant_id"] == served.tenant and line["key_id"] == served.key_ids["dev"]
    assert line["action"] == "sandbox.create" and line["sandbox_id"] == sandbox_id
    assert line["outcome"] == "ok" and line["status"] == 201 and line["method"] == "POST"
    assert line["path"] == "/v1/sandboxes" and 0 < line["duration_ms"] < 60_000
    [record] = await served.records("sandbox.create")
    assert record.request_id == "job-42/step-7" and record.target == sandbox_id


@pytest.mark.parametrize("sent", [None, "", "has spaces", "x" * 129, "ünïcode".encode(), "-starts-with-a-dash"])
async def test_a_missing_or_unfit_request_id_is_replaced_by_a_new_one(served: Served, sent: str | bytes | None) -> None:
    headers = {} if sent is None else {"X-Request-Id": sent}
    async with served.client(**headers) as client:
        r = await client.get("/v1/sandboxes")
    new = r.headers["x-request-id"]
    assert r.status_code == 200 and GENERATED.fullmatch(new) and new != sent
    assert r.headers.get_list("x-request-id") == [new]  # one id, never the client's beside ours
    [line] = served.lines()
    assert line["request_id"] == new and line["action"] == "sandbox.list"
    assert (await served.records("sandbox.list"))[-1].request_id == new


async def test_every_request_gets_its_own_id(served: Served) -> None:
    async with served.client() as client:
        ids = {(await client.get("/v1/sandboxes")).headers["x-request-id"] for _ in range(5)}
    assert len(ids) == 5
    assert {r.request_id for r in await served.records("sandbox.list")} == ids


async def test_a_refused_caller_is_logged_with_its_outcome_and_no_tenant(served: Served) -> None:
    async with served.client(None, Authorization="Bearer nope") as client:
        r = await client.get("/v1/sandboxes")
    assert r.status_code == 401 and GENERATED.fullmatch(r.headers["x-request-id"])
    [line] = served.lines()
    assert line["status"] == 401 and line["outcome"] == "unauthenticated" and line["action"] == "auth.denied"
    assert line["tenant_id"] is None and line["key_id"] is None


async def test_a_refusal_is_logged_and_audited_with_its_error_code(served: Served) -> None:
    await served.service.store.set_quotas(served.tenant, Quotas(max_sandboxes=0))
    async with served.client(**{"X-Request-Id": "quota-1"}) as client:
        r = await client.post("/v1/sandboxes", json={})
    assert r.status_code == 429 and r.headers["x-request-id"] == "quota-1"
    [line] = served.lines()
    assert (line["outcome"], line["status"], line["action"]) == ("quota_exceeded", 429, "sandbox.create")
    [record] = await served.records("sandbox.create")
    assert record.request_id == "quota-1" and record.outcome["error"] == "quota_exceeded"


async def test_a_body_refused_by_validation_is_audited_with_the_request_id(served: Served) -> None:
    async with served.client(**{"X-Request-Id": "bad-body"}) as client:
        r = await client.post("/v1/sandboxes", json={"bogus": True})
    assert r.status_code == 400
    [record] = await served.records("request.invalid")
    assert record.request_id == "bad-body"
    assert served.lines()[0]["outcome"] == "invalid_request"


async def test_requests_without_an_operation_are_logged_too(served: Served) -> None:
    async with served.client(None) as client:
        assert (await client.get("/v1/health")).status_code == 200
        assert (await client.get("/no/such/route")).status_code == 404
    health, missing = served.lines()
    assert (health["path"], health["status"], health["outcome"], health["action"]) == ("/v1/health", 200, "ok", None)
    assert (missing["status"], missing["outcome"]) == (404, "error")


async def test_the_e2b_api_gets_request_ids_too(served: Served) -> None:
    async with served.client(None, **{"X-API-KEY": served.keys["dev"], "X-Request-Id": "e2b-1"}) as client:
        r = await client.get("/sandboxes")
    assert r.status_code == 200 and r.headers["x-request-id"] == "e2b-1"
    [line] = served.lines()
    assert line["tenant_id"] == served.tenant and line["action"] == "sandbox.list"
    assert (await served.records("sandbox.list"))[-1].request_id == "e2b-1"


async def test_the_audit_api_returns_the_request_id_and_the_chain_verifies(served: Served) -> None:
    async with served.client(**{"X-Request-Id": "listed"}) as client:
        await client.get("/v1/sandboxes")
    async with served.client("admin") as admin:
        records = (await admin.get("/v1/audit", params={"action": "sandbox.list"})).json()["records"]
        assert records[-1]["request_id"] == "listed"
        verified = (await admin.get("/v1/audit/verify")).json()
    assert verified["ok"] is True, verified


# -- a real server ---------------------------------------------------------------------------------------------------


@pytest.mark.runc
def test_corral_serve_log_format_json_writes_only_json_lines(test_home: Path, unique: str) -> None:
    with ServerProcess(test_home / f"log-{unique}", template_home=TEMPLATE_HOME,
                       args=["--log-format", "json"]) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create(f"log-{unique}")
        r = httpx.get(f"{server.url}/v1/tenants", headers={"Authorization": f"Bearer {server.admin_key}",
                                                           "X-Request-Id": f"tenants-{unique}"})
        assert r.status_code == 200 and r.headers["x-request-id"] == f"tenants-{unique}"
    lines = [json.loads(line) for line in server.log.read_text().splitlines() if line.strip()]  # all JSON
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's own lines are JSON too
    requests = [line for line in lines if line["logger"] == "corral.requests"]
    [listed] = [line for line in requests if line["request_id"] == f"tenants-{unique}"]
    assert (listed["action"], listed["status"], listed["outcome"]) == ("tenant.list", 200, "ok")
    assert any(line["action"] == "tenant.create" and line["status"] == 201 for line in requests)
    assert any("admin API key" in line["event"] for line in lines)  # the startup notice, as a log line
