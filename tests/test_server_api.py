"""The HTTP API in-process (httpx.ASGITransport) over an engine and a ControlStore on a temp SQLite DB.

The engine is the fake (tests/fake_agent.py, the fast tier) unless a test is marked `runc` (`front_engine`):
wire shapes, auth, roles, audit and errors are the front end's own; the runc-marked ones need a real sandbox.

Streaming is checked over a real socket (ASGITransport buffers whole responses): uvicorn serves the same app in
the test's event loop.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import re
import socket
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from corral.control import ControlStore, Quotas, Role
from corral.engine import Engine
from corral.server import create_app
from corral.service import Service

from .conftest import TEMPLATE, on_both_engines

pytestmark = [pytest.mark.anyio]

BASE = "http://corral.test"


@dataclass
class Api:
    app: Any
    store: ControlStore
    engine: Engine
    keys: dict[str, str]  # "admin", "a_dev", "a_op", "a_aud", "b_dev" -> raw key
    key_ids: dict[str, str]
    tenants: dict[str, str]  # name -> id

    def client(self, who: str | None, **headers: str) -> httpx.AsyncClient:
        if who is not None:
            headers["Authorization"] = f"Bearer {self.keys[who]}"
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=BASE, headers=headers,
                                 timeout=60)


@pytest.fixture
async def api(front_engine: Engine, tmp_path: Path) -> AsyncIterator[Api]:
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        await store.bootstrap_admin(None)
        admin_key = (tmp_path / "admin.key").read_text().strip()
        keys, key_ids, tenants = {"admin": admin_key}, {}, {}
        for tenant in ("a", "b"):
            tenants[tenant] = (await store.create_tenant(tenant)).id
        for who, tenant, role in [("a_dev", "a", Role.DEVELOPER), ("a_op", "a", Role.OPERATOR),
                                  ("a_aud", "a", Role.AUDITOR), ("b_dev", "b", Role.DEVELOPER)]:
            new = await store.create_key(tenants[tenant], role, who)
            keys[who], key_ids[who] = new.key, new.info.id
        yield Api(create_app(front_engine, store), store, front_engine, keys, key_ids, tenants)
    finally:
        await store.close()


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/sandboxes", json={"template": TEMPLATE, **body})
    assert r.status_code == 201, r.text
    created: dict[str, Any] = r.json()
    return created


async def run(client: httpx.AsyncClient, sandbox_id: str, cmd: str | list[str], **body: Any) -> dict[str, Any]:
    r = await client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": cmd, **body})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def error_code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


# -- authentication and roles ------------------------------------------------------------------------------------


async def test_health_needs_no_key(api: Api) -> None:
    async with api.client(None) as c:
        r = await c.get("/v1/health")
    assert r.status_code == 200 and r.json() == {"ok": True}


@pytest.mark.parametrize("header", [None, "Bearer", "Basic abc", "Bearer not-a-key",
                                    "Bearer corral_sk_0000000000000000000000000000000000000000"])
async def test_missing_or_wrong_key_is_401(api: Api, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    async with api.client(None, **headers) as c:
        r = await c.get("/v1/sandboxes")
    assert r.status_code == 401, r.text
    assert error_code(r) == "unauthenticated"


async def test_revoked_key_is_401(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("admin") as admin:
        assert (await dev.get("/v1/sandboxes")).status_code == 200
        assert (await admin.delete(f"/v1/keys/{api.key_ids['a_dev']}")).status_code == 204
        r = await dev.get("/v1/sandboxes")
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


async def test_admin_creates_tenants_and_keys_that_work(api: Api) -> None:
    async with api.client("admin") as admin:
        r = await admin.post("/v1/tenants", json={"name": "c"})
        assert r.status_code == 201 and r.json()["name"] == "c"
        assert "c" in [t["name"] for t in (await admin.get("/v1/tenants")).json()["tenants"]]
        r = await admin.post("/v1/keys", json={"tenant": "c", "role": "developer", "name": "ci"})
        assert r.status_code == 201, r.text
        new = r.json()
        assert new["tenant"] == "c" and new["role"] == "developer" and new["key"]
        assert (await admin.post("/v1/tenants", json={"name": "c"})).status_code == 409
        assert (await admin.post("/v1/keys", json={"tenant": "c", "role": "king"})).status_code == 400
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url=BASE,
                                 headers={"Authorization": f"Bearer {new['key']}"}) as c:
        assert (await c.get("/v1/sandboxes")).json() == {"sandboxes": []}


@pytest.mark.parametrize("who", ["a_dev", "a_op", "a_aud"])
async def test_only_admin_manages_accounts(api: Api, who: str) -> None:
    async with api.client(who) as c:
        assert (await c.post("/v1/keys", json={"tenant": "a", "role": "admin"})).status_code == 403
        assert (await c.post("/v1/tenants", json={"name": "x"})).status_code == 403
        assert (await c.get("/v1/tenants")).status_code == 403
        assert (await c.delete(f"/v1/keys/{api.key_ids['b_dev']}")).status_code == 403


async def test_auditor_reads_audit_but_cannot_touch_sandboxes(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        sb = await create(dev)
        assert (await aud.post("/v1/sandboxes", json={"template": TEMPLATE})).status_code == 403
        r = await aud.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "id"})
        assert r.status_code == 403 and error_code(r) == "permission_denied"
        assert (await aud.get(f"/v1/sandboxes/{sb['id']}/files", params={"path": "/etc/hostname"})).status_code == 403
        assert (await aud.get("/v1/sandboxes")).status_code == 403
        assert (await aud.get("/v1/audit")).status_code == 200
        assert (await dev.get("/v1/audit")).status_code == 403
        assert (await dev.get("/v1/audit/verify")).status_code == 403


async def test_auditor_sees_only_its_tenant(api: Api) -> None:
    async with api.client("a_dev") as a, api.client("b_dev") as b, api.client("a_aud") as aud:
        await create(a)
        await create(b)
        records = (await aud.get("/v1/audit")).json()["records"]
        assert records and {r["tenant_id"] for r in records} == {api.tenants["a"]}
        assert (await aud.get("/v1/audit", params={"tenant": "b"})).status_code == 403


# -- other tenants' sandboxes do not exist ------------------------------------------------------------------------

ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("GET", "", {}),
    ("DELETE", "", {}),
    ("POST", "/timeout", {"json": {"timeout": 60}}),
    ("POST", "/pause", {}),
    ("POST", "/resume", {}),
    ("POST", "/exec", {"json": {"cmd": "touch /workspace/pwned"}}),
    ("POST", "/exec", {"json": {"cmd": "touch /workspace/pwned", "stream": True}}),
    ("GET", "/files", {"params": {"path": "/workspace/secret"}}),
    ("PUT", "/files", {"params": {"path": "/workspace/pwned"}, "content": b"x"}),
    ("DELETE", "/files", {"params": {"path": "/workspace/secret"}}),
    ("GET", "/files/list", {"params": {"path": "/workspace"}}),
    ("GET", "/files/stat", {"params": {"path": "/workspace/secret"}}),
    ("GET", "/files/exists", {"params": {"path": "/workspace/secret"}}),
    ("POST", "/files/mkdir", {"json": {"path": "/workspace/pwned"}}),
    ("POST", "/files/rename", {"json": {"src": "/workspace/secret", "dst": "/workspace/pwned"}}),
    ("GET", "/archive", {"params": {"path": "/workspace"}}),
    ("PUT", "/archive", {"params": {"path": "/workspace"}, "content": b""}),
    ("GET", "/metrics", {}),
]


@pytest.mark.parametrize(("method", "suffix", "kwargs"), ROUTES, ids=[f"{m} {s or '/'}" for m, s, _ in ROUTES])
@pytest.mark.parametrize("who", ["a_dev", "a_op"])
async def test_other_tenants_sandbox_is_404_everywhere(api: Api, method: str, suffix: str,
                                                       kwargs: dict[str, Any], who: str) -> None:
    async with api.client("b_dev") as b, api.client(who) as a:
        sb = await create(b)
        await run(b, sb["id"], "echo s > /workspace/secret")
        r = await a.request(method, f"/v1/sandboxes/{sb['id']}{suffix}", **kwargs)
        missing = await a.request(method, f"/v1/sandboxes/sb-doesnotexist{suffix}", **kwargs)
        assert r.status_code == 404, r.text
        assert error_code(r) == "not_found"
        assert r.json()["error"]["message"].replace(sb["id"], "ID") == \
            missing.json()["error"]["message"].replace("sb-doesnotexist", "ID")
        # and nothing happened to it
        still = await b.get(f"/v1/sandboxes/{sb['id']}")
        assert still.status_code == 200 and still.json()["state"] == "running"
        out = await run(b, sb["id"], "ls /workspace")
        assert unb64(out["stdout_b64"]) == b"secret\n"
        assert sb["id"] not in [s["id"] for s in (await a.get("/v1/sandboxes")).json()["sandboxes"]]


# -- lifecycle ------------------------------------------------------------------------------------------------------


@on_both_engines
async def test_lifecycle(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c, metadata={"job": "1"}, limits={"memory": "256M"}, timeout=120)
        other = await create(c, metadata={"job": "2"})
        assert sb["state"] == "running" and sb["template"] == TEMPLATE and sb["runtime"] == "runc"
        assert sb["limits"]["memory"] == 256 * 1024**2 and sb["metadata"] == {"job": "1"}
        listed = (await c.get("/v1/sandboxes", params={"metadata.job": "1"})).json()["sandboxes"]
        assert [s["id"] for s in listed] == [sb["id"]]
        assert {s["id"] for s in (await c.get("/v1/sandboxes")).json()["sandboxes"]} == {sb["id"], other["id"]}
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["id"] == sb["id"]

        r = await c.post(f"/v1/sandboxes/{sb['id']}/timeout", json={"timeout": 3600})
        assert r.status_code == 200 and r.json()["expires_at"] > sb["expires_at"]
        assert (await c.post(f"/v1/sandboxes/{sb['id']}/timeout", json={"timeout": -1})).status_code == 400

        r = await c.post(f"/v1/sandboxes/{sb['id']}/pause")
        assert r.status_code == 200 and r.json()["state"] == "paused"
        r = await c.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "true"})
        assert r.status_code == 409 and error_code(r) == "conflict"
        r = await c.post(f"/v1/sandboxes/{sb['id']}/resume")
        assert r.status_code == 200 and r.json()["state"] == "running"
        assert (await run(c, sb["id"], "echo back"))["exit_code"] == 0

        assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).status_code == 404
        assert sb["id"] not in {s.id for s in api.engine.list()}
        assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 404


@pytest.mark.runc  # the figures are the sandbox's cgroup's
async def test_metrics_are_sampled_and_windowed_by_unix_seconds_or_iso_times(api: Api) -> None:
    sampler = api.app.state.corral.sampler  # lifespan off: the test drives the service's sampler itself
    async with api.client("a_dev") as c:
        before = time.time()
        sb = await create(c, limits={"memory": "256M", "cpus": 0.5})
        url = f"/v1/sandboxes/{sb['id']}/metrics"
        assert (await c.get(url)).json() == {"metrics": []}  # nothing sampled yet
        await sampler.sample()  # the baseline
        await asyncio.sleep(sampler.tick)
        assert await sampler.sample() == 1
        r = await c.get(url)
        assert r.status_code == 200, r.text
        [sample] = r.json()["metrics"]
        assert set(sample) == {"timestamp", "cpus", "cpu_used_pct", "memory_used", "memory_total", "memory_cache",
                               "disk_used", "disk_total"}
        assert sample["cpus"] == 0.5 and sample["memory_total"] == 256 * 1024**2 and sample["disk_total"] > 0
        assert 0 < sample["memory_used"] < 256 * 1024**2 and 0 <= sample["cpu_used_pct"] <= 100
        stamp = datetime.fromisoformat(sample["timestamp"]).timestamp()
        assert int(before) <= stamp <= time.time()

        now = int(time.time())
        assert len((await c.get(url, params={"start": int(before), "end": now})).json()["metrics"]) == 1
        iso = datetime.fromtimestamp(before, UTC).replace(tzinfo=None).isoformat()  # naive: UTC
        assert len((await c.get(url, params={"start": iso})).json()["metrics"]) == 1
        earlier = {"start": f"{datetime.fromtimestamp(before - 3600, UTC).isoformat()}",
                   "end": str(before - 1800)}
        assert (await c.get(url, params=earlier)).json() == {"metrics": []}  # before the sandbox existed

        for bad in ({"start": "yesterday"}, {"end": "nan"}, {"start": "1e400"}, {"start": "2", "end": "1"}):
            r = await c.get(url, params=bad)
            assert r.status_code == 400 and error_code(r) == "invalid_request", (bad, r.text)
    invalid = await api.store.audit.query(action="request.invalid")
    assert invalid[-1].params["route"] == "/v1/sandboxes/{sandbox_id}/metrics" and invalid[-1].target == sb["id"]
    audited = await api.store.audit.query(action="sandbox.metrics")
    assert [r.outcome["status"] for r in audited] == [200] * 5 + [400]  # start after end: the service's refusal
    assert audited[1].outcome["count"] == 1


@pytest.mark.parametrize("body", [
    {"template": "no-such-template"},
    {"limits": {"memory": "lots"}},
    {"limits": {"cpus": -1}},
    {"timeout": 0},
    {"network": "everywhere"},
    {"surprise": 1},
    {"env": {"A": 1}},
])
async def test_invalid_spec_is_400_and_creates_nothing(api: Api, body: dict[str, Any]) -> None:
    async with api.client("a_dev") as c:
        r = await c.post("/v1/sandboxes", json={"template": TEMPLATE, **body})
        assert r.status_code == 400, r.text
        assert error_code(r) == "invalid_request"
        assert (await c.get("/v1/sandboxes")).json() == {"sandboxes": []}
    assert api.engine.list() == []


async def test_reaper_destroys_expired_sandboxes(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c, timeout=1)
        keep = await create(c, timeout=300)
        await asyncio.sleep(1.2)
        assert await Service(api.engine, api.store).reconciler.expire() == [sb["id"]]
        assert (await c.get(f"/v1/sandboxes/{sb['id']}")).status_code == 404
        assert (await c.get(f"/v1/sandboxes/{keep['id']}")).status_code == 200
    assert sb["id"] not in {s.id for s in api.engine.list()}


async def test_lifespan_runs_the_reaper(api: Api, tmp_path: Path) -> None:
    store = ControlStore(home=tmp_path / "other")
    app = create_app(api.engine, store)
    async with app.router.lifespan_context(app):
        admin_tenant = await store.create_tenant("t")
        key = (await store.create_key(admin_tenant.id, Role.DEVELOPER)).key
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE,
                                     headers={"Authorization": f"Bearer {key}"}) as c:
            sb = await create(c, timeout=1)
            for _ in range(40):
                if (await c.get(f"/v1/sandboxes/{sb['id']}")).status_code == 404:
                    break
                await asyncio.sleep(0.1)
            assert (await c.get(f"/v1/sandboxes/{sb['id']}")).status_code == 404
    await api.engine.start()  # the lifespan closed the shared engine; the fixture closes it again


# -- quotas and bad input -----------------------------------------------------------------------------------------


async def test_quota_total_is_429_with_retry_after(api: Api) -> None:
    await api.store.set_quotas(api.tenants["a"], Quotas(max_sandboxes=1, max_sandbox_timeout=600))
    async with api.client("a_dev") as c:
        await create(c, timeout=60)
        r = await c.post("/v1/sandboxes", json={"template": TEMPLATE})
        assert r.status_code == 429 and error_code(r) == "quota_exceeded"
        assert 1 <= int(r.headers["Retry-After"]) <= 61
        assert r.json()["error"]["details"]["limit"] == "max_sandboxes"
        # a per-sandbox maximum does not free up by waiting: no Retry-After
        r = await c.post("/v1/sandboxes", json={"template": TEMPLATE, "timeout": 3600})
        assert r.status_code == 429 and "retry-after" not in r.headers
    assert len(api.engine.list()) == 1


@pytest.mark.parametrize(("method", "path", "kwargs"), [
    ("POST", "/v1/sandboxes", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
    ("POST", "/v1/sandboxes", {"json": [1, 2]}),
    ("POST", "/v1/sandboxes", {"json": {"timeout": "soon"}}),
    ("POST", "/v1/tenants", {"json": {"name": ["x"]}}),
    ("POST", "/v1/keys", {"content": b"\xff\xfe", "headers": {"content-type": "application/json"}}),
    ("GET", "/v1/audit", {"params": {"limit": "many"}}),
    ("GET", "/v1/audit", {"params": {"since": "yesterday"}}),
])
async def test_bad_request_bodies_are_400(api: Api, method: str, path: str, kwargs: dict[str, Any]) -> None:
    async with api.client("admin") as c:
        r = await c.request(method, path, **kwargs)
    assert r.status_code == 400, r.text
    assert error_code(r) == "invalid_request"


async def test_bad_exec_and_file_requests_are_400(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb['id']}"
        for body in ({"cmd": 5}, {"cmd": "true", "timeout": "x"}, {"cmd": "true", "stdin_b64": "!!notbase64"},
                     {}, {"cmd": "true", "max_output": -1}):
            r = await c.post(f"{base}/exec", json=body)
            assert r.status_code == 400, (body, r.text)
        r = await c.post(f"{base}/exec", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = await c.put(f"{base}/files", params={"path": "a", "mode": "rwx"}, content=b"x")
        assert r.status_code == 400
        assert (await c.get(f"{base}/files")).status_code == 400  # no path
        assert (await c.get(f"{base}/files?path=%FF")).status_code == 400  # not UTF-8


# -- commands -------------------------------------------------------------------------------------------------------

NASTY = b"\x00\xff\xfeA\x00\x80\nend"


@on_both_engines
async def test_exec_output_is_byte_exact(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        await c.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "nasty"}, content=NASTY)
        out = await run(c, sb["id"], "cat /workspace/nasty; cat /workspace/nasty >&2; exit 3")
    assert unb64(out["stdout_b64"]) == NASTY and unb64(out["stderr_b64"]) == NASTY
    assert out["exit_code"] == 3 and out["stdout_size"] == len(NASTY)
    assert out["timed_out"] is False and out["oom_killed"] is False


def parse_events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line]


@on_both_engines
async def test_streamed_exec_is_byte_exact(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        await c.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "nasty"}, content=NASTY)
        r = await c.post(f"/v1/sandboxes/{sb['id']}/exec",
                         json={"cmd": "cat /workspace/nasty; cat /workspace/nasty >&2; exit 4", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    events = parse_events(r.content)
    assert events[-1]["event"] == "exit" and events[-1]["exit_code"] == 4
    assert b"".join(unb64(e["data_b64"]) for e in events if e["event"] == "stdout") == NASTY
    assert b"".join(unb64(e["data_b64"]) for e in events if e["event"] == "stderr") == NASTY
    assert unb64(events[-1]["stdout_b64"]) == b""  # already streamed


@on_both_engines
async def test_exec_stdin_bytes(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        out = await run(c, sb["id"], ["cat"], stdin_b64=b64(NASTY * 1000))
        assert unb64(out["stdout_b64"]) == NASTY * 1000
        out = await run(c, sb["id"], "wc -c", stdin_b64="")
        assert unb64(out["stdout_b64"]).strip() == b"0"


@on_both_engines
async def test_exec_argv_cwd_env(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        out = await run(c, sb["id"], ["sh", "-c", 'pwd; echo "$X"'], cwd="/tmp", env={"X": "a b"})
    assert unb64(out["stdout_b64"]) == b"/tmp\na b\n"


@on_both_engines
async def test_exec_timeout_is_a_structured_outcome(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        started = time.monotonic()
        out = await run(c, sb["id"], "echo before; sleep 30", timeout=0.5)
        assert time.monotonic() - started < 10
        assert out["timed_out"] is True and unb64(out["stdout_b64"]) == b"before\n"
        r = await c.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "sleep 30", "timeout": 0.5, "stream": True})
        assert parse_events(r.content)[-1]["timed_out"] is True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def live_url(api: Api) -> AsyncIterator[str]:
    """The same app over a real socket (uvicorn in this event loop; lifespan off: the fixture owns the state)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=port, lifespan="off", log_level="error"))
    task = asyncio.create_task(server.serve())
    for _ in range(100):
        if server.started:
            break
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@on_both_engines
async def test_streamed_exec_delivers_output_before_the_command_ends(api: Api, live_url: str) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
    headers = {"Authorization": f"Bearer {api.keys['a_dev']}"}
    seen: list[tuple[float, dict[str, Any]]] = []
    async with httpx.AsyncClient(base_url=live_url, headers=headers, timeout=30) as live:
        started = time.monotonic()
        async with live.stream("POST", f"/v1/sandboxes/{sb['id']}/exec",
                               json={"cmd": "echo a; sleep 1; echo b", "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line:
                    seen.append((time.monotonic() - started, json.loads(line)))
    first_at, first = seen[0]
    assert first == {"event": "stdout", "data_b64": b64(b"a\n")}
    end_at, end = seen[-1]
    assert end["event"] == "exit" and end["exit_code"] == 0
    assert end_at - first_at >= 0.8, seen  # `a` arrived while `sleep 1` was still running


# -- files ----------------------------------------------------------------------------------------------------------


@on_both_engines
async def test_large_file_round_trip(api: Api) -> None:
    data = os.urandom(20 * 1024 * 1024)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]

    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb['id']}/files"
        r = await c.put(base, params={"path": "/workspace/big.bin"}, content=chunks())
        assert r.status_code == 200, r.text
        assert r.json() == {"path": "/workspace/big.bin", "size": len(data), "checkpoint": None}
        r = await c.get(base, params={"path": "big.bin"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        assert hashlib.sha256(r.content).hexdigest() == hashlib.sha256(data).hexdigest()
        out = await run(c, sb["id"], "sha256sum /workspace/big.bin")
        assert unb64(out["stdout_b64"]).split()[0].decode() == hashlib.sha256(data).hexdigest()


@on_both_engines
async def test_empty_file(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb['id']}/files"
        assert (await c.put(base, params={"path": "empty"}, content=b"")).json()["size"] == 0
        r = await c.get(base, params={"path": "empty"})
        assert r.status_code == 200 and r.content == b""
        assert (await c.get(f"{base}/stat", params={"path": "empty"})).json()["size"] == 0


@on_both_engines
async def test_file_operations(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb['id']}/files"
        assert (await c.post(f"{base}/mkdir", json={"path": "d/e"})).json() == {"created": True, "checkpoint": None}
        assert (await c.post(f"{base}/mkdir", json={"path": "d/e"})).json() == {"created": False, "checkpoint": None}
        await c.put(base, params={"path": "d/e/f.txt", "mode": "384"}, content=b"hello")
        entries = (await c.get(f"{base}/list", params={"path": "d/e"})).json()["entries"]
        assert [(e["name"], e["path"], e["type"], e["size"], e["mode"] & 0o777) for e in entries] == \
            [("f.txt", "/workspace/d/e/f.txt", "file", 5, 0o600)]
        assert set(entries[0]) == {"name", "path", "type", "size", "mode", "mtime", "owner", "group", "permissions",
                                   "target", "metadata"}
        assert (entries[0]["owner"], entries[0]["permissions"], entries[0]["metadata"]) == ("user", "-rw-------", {})
        r = await c.post(f"{base}/rename", json={"src": "d/e/f.txt", "dst": "d/g.txt"})
        assert r.status_code == 204
        assert (await c.get(f"{base}/exists", params={"path": "d/e/f.txt"})).json() == {"exists": False}
        assert (await c.get(base, params={"path": "d/g.txt"})).content == b"hello"
        r = await c.get(base, params={"path": "nope"})
        assert r.status_code == 404 and error_code(r) == "not_found"
        assert (await c.delete(base, params={"path": "d"})).status_code == 204
        assert (await c.get(f"{base}/exists", params={"path": "d"})).json() == {"exists": False}


@on_both_engines
async def test_nul_in_path_is_400_and_writes_nothing(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb['id']}/files"
        r = await c.put(base, params={"path": "/workspace/x\x00y"}, content=b"data")
        assert r.status_code == 400 and "NUL" in r.json()["error"]["message"]
        assert (await c.get(base, params={"path": "/workspace/x\x00y"})).status_code == 400
        assert (await c.post(f"{base}/mkdir", json={"path": "a\x00b"})).status_code == 400
        out = await run(c, sb["id"], "ls -A /workspace")
        assert unb64(out["stdout_b64"]) == b""


@pytest.mark.parametrize("path", ["../etc/passwd", "/workspace/../etc/passwd", "/etc/passwd", "/root/x",
                                  "/proc/self/environ", "/home/user/../../etc/shadow"])
@on_both_engines
async def test_paths_outside_the_roots_are_refused(api: Api, path: str) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb['id']}/files"
        r = await c.get(base, params={"path": path})
        assert 400 <= r.status_code < 500 and r.status_code != 404, r.text
        r = await c.put(base, params={"path": path + ".new"}, content=b"pwned")
        assert 400 <= r.status_code < 500, r.text
        out = await run(c, sb["id"], f"ls {path}.new")
        assert out["exit_code"] != 0


@on_both_engines
async def test_symlink_out_of_the_roots_is_refused(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb['id']}/files"
        await run(c, sb["id"], "ln -s /etc/passwd /workspace/link; ln -s /etc /workspace/etcdir")
        before = unb64((await run(c, sb["id"], "sha256sum /etc/passwd"))["stdout_b64"])
        for path in ("/workspace/link", "/workspace/etcdir/passwd"):
            r = await c.get(base, params={"path": path})
            assert 400 <= r.status_code < 500, r.text
            r = await c.put(base, params={"path": path}, content=b"pwned")
            assert 400 <= r.status_code < 500, r.text
        assert unb64((await run(c, sb["id"], "sha256sum /etc/passwd"))["stdout_b64"]) == before
        r = await c.get(f"/v1/sandboxes/{sb['id']}/archive", params={"path": "/workspace/etcdir"})
        assert 400 <= r.status_code < 500, r.text


@on_both_engines
async def test_archive_round_trip(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        await run(c, sb["id"], "mkdir -p /workspace/src/sub && printf 'a\\0b' > /workspace/src/sub/bin "
                               "&& echo hi > /workspace/src/t.txt")
        r = await c.get(f"/v1/sandboxes/{sb['id']}/archive", params={"path": "src"})
        assert r.status_code == 200
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            names = tar.getnames()
        assert any(n.endswith("sub/bin") for n in names) and any(n.endswith("t.txt") for n in names)
        other = await create(c)
        r = await c.put(f"/v1/sandboxes/{other['id']}/archive", params={"path": "/workspace/restored"},
                        content=r.content)
        assert r.status_code == 200, r.text
        assert r.json()["entries"] >= 2
        files = f"/v1/sandboxes/{other['id']}/files"
        found = unb64((await run(c, other["id"], "cd /workspace/restored && find . -type f | sort"))["stdout_b64"])
        binary = next(line for line in found.decode().split() if line.endswith("sub/bin"))
        r = await c.get(files, params={"path": f"/workspace/restored/{binary[2:]}"})
        assert r.content == b"a\x00b"


# -- the audit trail ------------------------------------------------------------------------------------------------


async def test_audit_records_every_action_with_its_actor(api: Api) -> None:
    data = os.urandom(1000)
    async with api.client("a_dev") as dev, api.client("a_aud") as aud, api.client("b_dev") as b:
        sb = await create(dev, metadata={"k": "v"})
        await run(dev, sb["id"], "echo 'verbatim  $HOME'; exit 7")
        await dev.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "a.bin"}, content=data)
        assert (await b.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "id"})).status_code == 404
        assert (await dev.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204

        records = (await aud.get("/v1/audit", params={"sandbox": sb["id"]})).json()["records"]
        by_action = {r["action"]: r for r in records}
        assert [r["action"] for r in records] == ["sandbox.create", "sandbox.exec", "files.write", "sandbox.kill"]
        for r in records:
            assert r["key_id"] == api.key_ids["a_dev"] and r["role"] == "developer"
            assert r["tenant_id"] == api.tenants["a"] and r["target"] == sb["id"]
        assert by_action["sandbox.create"]["outcome"]["status"] == 201
        exec_rec = by_action["sandbox.exec"]
        assert exec_rec["params"]["cmd"] == "echo 'verbatim  $HOME'; exit 7"
        assert exec_rec["outcome"]["exit_code"] == 7 and exec_rec["outcome"]["timed_out"] is False
        assert "oom_killed" in exec_rec["outcome"]
        write = by_action["files.write"]["params"]
        assert write["path"] == "/workspace/a.bin" and write["size"] == 1000
        assert write["sha256"] == hashlib.sha256(data).hexdigest()
        assert by_action["sandbox.kill"]["outcome"]["status"] == 204

        # the failed attempt by tenant b is on record too, attributed to b
        async with api.client("admin") as admin:
            everything = (await admin.get("/v1/audit", params={"sandbox": sb["id"]})).json()["records"]
        failed = [r for r in everything if r["tenant_id"] == api.tenants["b"]]
        assert len(failed) == 1 and failed[0]["outcome"] == {"status": 404, "error": "not_found"}
        assert failed[0]["key_id"] == api.key_ids["b_dev"]

        verify = (await aud.get("/v1/audit/verify")).json()
        assert verify["ok"] is True and verify["problem"] is None and verify["checked"] >= 5
        head = (await aud.get("/v1/audit/head")).json()
        assert verify["head"] == f"{head['seq']}:{head['hash']}"


async def test_audit_verify_detects_tampering(api: Api, tmp_path: Path) -> None:
    import sqlite3

    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        sb = await create(dev)
        await run(dev, sb["id"], "echo one")
        await run(dev, sb["id"], "echo two")
        db = sqlite3.connect(tmp_path / "corral.db")
        db.execute("UPDATE audit SET params = ? WHERE action = 'sandbox.exec' AND seq = "
                   "(SELECT MIN(seq) FROM audit WHERE action = 'sandbox.exec')",
                   (json.dumps({"cmd": "echo innocent"}),))
        db.commit()
        db.close()
        verify = (await aud.get("/v1/audit/verify")).json()
    assert verify["ok"] is False and verify["problem"]["kind"] == "edited"


async def test_failed_create_is_audited_and_frees_the_quota(api: Api) -> None:
    await api.store.set_quotas(api.tenants["a"], Quotas(max_sandboxes=1))
    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        r = await dev.post("/v1/sandboxes", json={"template": TEMPLATE, "limits": {"memory": "1K"}})
        assert r.status_code == 400
        await create(dev)  # the quota was not consumed by the failure
        records = (await aud.get("/v1/audit", params={"action": "sandbox.create"})).json()["records"]
    assert [r["outcome"]["status"] for r in records] == [400, 201]
    assert records[0]["outcome"]["error"] == "invalid_request"


async def test_every_route_is_in_the_contract(api: Api) -> None:
    """Every route the published OpenAPI lists is in docs/api.md, and every route there is served."""
    doc = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    async with api.client(None) as c:
        paths = (await c.get("/openapi.json")).json()["paths"]
    served = {(method.upper(), path.replace("{sandbox_id}", "{id}").replace("{key_id}", "{id}")
               .replace("{name_or_id}", "{name or id}"))
              for path, methods in paths.items() for method in methods}
    for method, path in served:
        short = path.replace("/v1/sandboxes/{id}", "...")  # the contract abbreviates some
        assert f"{method} {path}" in doc or f"{method} {short}" in doc, (method, path)
    documented = set(re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/v1/[^`?]*?)[`?]", doc))
    assert len(documented) >= 30  # the pattern still finds the contract's routes
    for method, path in documented:
        path = path.replace("...", "/v1/sandboxes/{id}")
        assert (method, path) in served or path.endswith("/pty"), (method, path)  # the WebSocket is not in OpenAPI
    assert len(served) >= 38
