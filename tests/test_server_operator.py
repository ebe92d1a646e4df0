"""Operator controls over real sandboxes: the kill switch and per-sandbox file roots."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import uuid
from typing import Any

import httpx
import pytest

from corral.control import Role
from corral.engine import Capacity

from .conftest import TEMPLATE
from .test_server_api import Api, create, error_code, run
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


async def _live(c: httpx.AsyncClient) -> set[str]:
    return {s["id"] for s in (await c.get("/v1/sandboxes")).json()["sandboxes"]}


# -- kill switch -------------------------------------------------------------------------------------------------


async def test_operator_kills_every_sandbox_of_its_tenant_and_no_other(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("a_op") as op, api.client("b_dev") as other:
        mine = {(await create(dev))["id"] for _ in range(3)}
        theirs = (await create(other))["id"]
        r = await op.post("/v1/kill", json={"tenant": "a"})
        assert r.status_code == 200, r.text
        assert set(r.json()["killed"]) == mine and r.json()["failed"] == {}
        assert await _live(dev) == set()
        for sandbox_id in mine:
            assert (await dev.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "true"})).status_code == 404
            assert sandbox_id not in [s.id for s in api.engine.list()]
        assert (await run(other, theirs, "echo alive"))["exit_code"] == 0  # tenant b untouched


async def test_kill_by_key_spares_the_tenants_other_keys_and_revoke_stops_new_ones(api: Api) -> None:
    second = await api.store.create_key(api.tenants["a"], Role.DEVELOPER, "runaway")
    async with api.client("a_dev") as dev, api.client("a_op") as op, \
            api.client(None, Authorization=f"Bearer {second.key}") as runaway:
        keep = (await create(dev))["id"]
        doomed = {(await create(runaway))["id"] for _ in range(2)}
        r = await op.post("/v1/kill", json={"key": second.info.id, "revoke": True})
        assert r.status_code == 200, r.text
        assert set(r.json()["killed"]) == doomed and r.json()["revoked"] is True
        assert await _live(dev) == {keep}
        r = await runaway.post("/v1/sandboxes", json={"template": TEMPLATE})
        assert r.status_code == 401  # the key is revoked: the agent cannot start again


async def test_kill_switch_is_for_operators_and_admins_in_their_own_tenant(api: Api) -> None:
    async with api.client("b_dev") as b, api.client("a_op") as op, api.client("a_dev") as dev, \
            api.client("a_aud") as aud, api.client("admin") as admin:
        theirs = (await create(b))["id"]
        for who in (dev, aud):
            r = await who.post("/v1/kill", json={"tenant": "a"})
            assert r.status_code == 403 and error_code(r) == "permission_denied"
        # another tenant, or its key, is as unknown to an operator as a name that never existed
        for body in ({"tenant": "b"}, {"tenant": api.tenants["b"]}, {"tenant": "nope"},
                     {"key": api.key_ids["b_dev"]}, {"key": "key-nope"}):
            r = await op.post("/v1/kill", json=body)
            assert r.status_code == 404 and error_code(r) == "not_found", (body, r.text)
        assert await _live(b) == {theirs}
        r = await admin.post("/v1/kill", json={"tenant": "b"})
        assert r.status_code == 200 and r.json()["killed"] == [theirs]


@pytest.mark.parametrize("body", [{}, {"tenant": "a", "key": "k"}, {"tenant": "a", "revoke": True},
                                  {"tenant": 3}, {"tenant": "a", "extra": 1}])
async def test_kill_switch_bad_bodies_are_400(api: Api, body: dict[str, object]) -> None:
    async with api.client("a_op") as op:
        r = await op.post("/v1/kill", json=body)
    assert r.status_code == 400 and error_code(r) == "invalid_request", r.text


async def test_kill_switch_stops_a_sandbox_that_is_still_being_created(api: Api,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reserved, release = asyncio.Event(), asyncio.Event()
    real_create = api.engine.create

    async def slow_create(*args: Any, **kwargs: Any) -> Any:  # the engine is busy when the switch is thrown
        reserved.set()
        await release.wait()
        return await real_create(*args, **kwargs)

    monkeypatch.setattr(api.engine, "create", slow_create)
    async with api.client("a_dev") as dev, api.client("a_op") as op:
        creating = asyncio.create_task(dev.post("/v1/sandboxes", json={"template": TEMPLATE}))
        await asyncio.wait_for(reserved.wait(), 30)
        r = await op.post("/v1/kill", json={"tenant": "a"})
        assert r.status_code == 200 and len(r.json()["killed"]) == 1
        release.set()
        created = await asyncio.wait_for(creating, 60)
    assert created.status_code == 409 and error_code(created) == "conflict", created.text
    assert "kill switch" in created.json()["error"]["message"]
    assert api.engine.list() == []  # what the engine made after the switch was destroyed too


async def test_kill_switch_is_audited(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("a_op") as op:
        sandbox_id = (await create(dev))["id"]
        assert (await op.post("/v1/kill", json={"tenant": "a"})).status_code == 200
    records = [r for r in await api.store.audit.query(action="sandbox.kill_all")]
    assert len(records) == 1
    assert records[0].key_id == api.key_ids["a_op"] and records[0].outcome["killed"] == [sandbox_id]


# -- file roots --------------------------------------------------------------------------------------------------


async def test_default_file_roots(api: Api) -> None:
    async with api.client("a_dev") as dev:
        sandbox = await create(dev)
    assert sandbox["file_roots"] == ["/workspace", "/home/user", "/tmp"]


async def test_custom_file_roots_confine_the_file_api(api: Api) -> None:
    async with api.client("a_dev") as dev:
        sandbox = await create(dev, file_roots=["/workspace/out", "/srv/data/"])
        sid = sandbox["id"]
        assert sandbox["file_roots"] == ["/workspace/out", "/srv/data"]
        await run(dev, sid, "mkdir -p /workspace/out && echo secret > /workspace/in.txt")
        url = f"/v1/sandboxes/{sid}/files"
        ok = await dev.put(url, params={"path": "/workspace/out/a.bin"}, content=b"\x00\xff")
        assert ok.status_code == 200, ok.text
        assert (await dev.get(url, params={"path": "out/a.bin"})).content == b"\x00\xff"
        for path in ("/workspace/in.txt", "in.txt", "/tmp/x", "/workspace/out/../in.txt"):
            r = await dev.get(url, params={"path": path})
            assert r.status_code in (400, 403), (path, r.text)
            assert "outside" in r.json()["error"]["message"] or ".." in r.json()["error"]["message"], r.text
        r = await dev.put(url, params={"path": "/home/user/x"}, content=b"no")
        assert r.status_code in (400, 403)
        assert (await run(dev, sid, ["test", "-e", "/home/user/x"]))["exit_code"] == 1  # refused: nothing written
        # the roots survive a lookup (they are part of the stored record)
        assert (await dev.get(f"/v1/sandboxes/{sid}")).json()["file_roots"] == ["/workspace/out", "/srv/data"]


async def test_root_as_file_root_still_refuses_kernel_and_corral_paths(api: Api) -> None:
    """`["/"]` opens every path the sandbox user reaches (E2B's envd does), but never /proc (bar its read-only
    /proc/sys) or /.corral: /proc/self through the agent would be the agent itself. /sys and /dev are never changed
    (and only regular files are ever read)."""
    async with api.client("a_dev") as dev:
        sid = (await create(dev, file_roots=["/"]))["id"]
        url = f"/v1/sandboxes/{sid}/files"
        assert (await dev.get(url, params={"path": "/etc/hostname"})).status_code == 200
        assert (await dev.get(url, params={"path": "/proc/sys/kernel/hostname"})).status_code == 200
        for path in ("/proc/self/environ", "/proc/1/status", "/.corral/agent/agent/server.py"):
            r = await dev.get(url, params={"path": path})
            assert r.status_code == 403 and "never touches" in r.json()["error"]["message"], (path, r.text)
        assert (await dev.get(url, params={"path": "/dev/null"})).status_code == 400  # not a regular file
        r = await dev.put(url, params={"path": "/sys/kernel/uevent_helper"}, content=b"/tmp/x")
        assert r.status_code == 403 and "never changes" in r.json()["error"]["message"], r.text
        await run(dev, sid, "ln -s /proc/self/environ /home/user/env")
        r = await dev.get(url, params={"path": "/home/user/env"})
        assert r.status_code == 403, r.text


@pytest.mark.parametrize("roots", [[], ["relative"], ["/proc/self"], ["/dev"], ["/.corral/run"],
                                   ["/a/../etc"], ["//etc"], ["/a\x00b"], ["/x"] * 17, "nope"])
async def test_bad_file_roots_are_400_and_create_nothing(api: Api, roots: object) -> None:
    async with api.client("a_dev") as dev:
        r = await dev.post("/v1/sandboxes", json={"template": TEMPLATE, "file_roots": roots})
        assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
        assert await _live(dev) == set()
    assert api.engine.list() == []


# -- machine capacity ----------------------------------------------------------------------------------------------


async def test_full_machine_is_503_with_retry_after_and_changes_nothing(api: Api) -> None:
    api.engine.capacity = Capacity(max_sandboxes=1)
    async with api.client("a_dev") as dev, api.client("b_dev") as other:
        first = (await create(dev))["id"]
        r = await other.post("/v1/sandboxes", json={"template": TEMPLATE})
        assert r.status_code == 503 and error_code(r) == "capacity_exceeded", r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 300
        assert "at most 1 sandboxes" in r.json()["error"]["message"]
        assert await _live(other) == set()
        assert [s.id for s in api.engine.list()] == [first]
        # the refusal is on record, and the tenant's quota was not consumed by it
        records = await api.store.audit.query(action="sandbox.create", tenant=api.tenants["b"])
        assert [e.outcome["status"] for e in records] == [503]
        assert (await dev.delete(f"/v1/sandboxes/{first}")).status_code == 204
        assert (await other.post("/v1/sandboxes", json={"template": TEMPLATE})).status_code == 201


# -- a client that leaves mid-stream -----------------------------------------------------------------------------


async def _marker_processes(c: httpx.AsyncClient, sid: str, marker: str) -> list[str]:
    out = await run(c, sid, ["pgrep", "-af", marker])
    return [line for line in base64.b64decode(out["stdout_b64"]).decode().splitlines() if "pgrep" not in line]


@pytest.mark.parametrize("timeout", [3.0, None])
async def test_client_leaving_a_stream_leaves_no_process_behind(api: Api, live_url: str,
                                                                          timeout: float | None) -> None:
    marker = f"sleep {uuid.uuid4().int % 10_000 + 10_000}"
    async with api.client("a_dev") as c:
        sid = (await create(c))["id"]
        headers = {"Authorization": f"Bearer {api.keys['a_dev']}"}
        body = {"cmd": f"echo started; {marker}; echo never", "stream": True, "timeout": timeout}
        async with httpx.AsyncClient(base_url=live_url, headers=headers, timeout=30) as live:
            async with live.stream("POST", f"/v1/sandboxes/{sid}/exec", json=body) as r:
                lines = r.aiter_lines()  # held: a dropped iterator would close the stream before we mean to
                assert json.loads(await anext(lines))["event"] == "stdout"  # the command is running ...
                assert await _marker_processes(c, sid, marker)  # (the probe can see it) ... now walk away
        for _ in range(100):  # bounded: 10 s, well past the 3 s timeout
            if not await _marker_processes(c, sid, marker):
                break
            await asyncio.sleep(0.1)
        assert await _marker_processes(c, sid, marker) == [], "the command outlived its client and timeout"


# -- one sandbox's crash or OOM affects nothing else ---------------------------------------------------------------


async def test_a_crashed_or_oom_sandbox_affects_no_other_and_not_the_server(api: Api) -> None:
    async with api.client("a_dev") as dev:
        victim = (await create(dev, limits={"memory": "64M"}))["id"]
        bystander = (await create(dev))["id"]
        await run(dev, bystander, "echo before > /workspace/state")
        steady = asyncio.create_task(run(dev, bystander, "for i in $(seq 20); do echo $i; sleep 0.05; done"))
        oom = await run(dev, victim, ["python3", "-c", "b = bytearray(512 * 2**20)"])
        assert oom["oom_killed"] is True
        # now crash it: SIGKILL its PID 1 (the agent) from the host, as a kernel OOM of the agent would
        record = api.engine.runtime.sandboxes[victim].record
        state = await api.engine.backend.runtimes[record.runtime].state(victim)
        assert state is not None
        os.kill(int(state["pid"]), signal.SIGKILL)
        r = await dev.post(f"/v1/sandboxes/{victim}/exec", json={"cmd": "true"})
        assert r.status_code == 502 and error_code(r) == "agent_error", r.text  # a clear error, not a hang
        assert "stopped" in r.json()["error"]["message"] or "killed" in r.json()["error"]["message"]
        done = await asyncio.wait_for(steady, 30)
        assert done["exit_code"] == 0 and base64.b64decode(done["stdout_b64"]).split()[-1] == b"20"
        assert base64.b64decode((await run(dev, bystander, "cat /workspace/state"))["stdout_b64"]) == b"before\n"
        assert (await dev.get("/v1/health")).status_code == 200
        assert (await dev.delete(f"/v1/sandboxes/{victim}")).status_code == 204  # a dead sandbox still cleans up
        assert await _live(dev) == {bystander}
