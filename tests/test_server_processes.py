"""Background processes and the PTY WebSocket through the HTTP API, over a real engine and real runc sandboxes.

Plain JSON routes go through httpx.ASGITransport; attach streams and the WebSocket need a real socket (the
transport buffers whole responses), so uvicorn serves the same app in the test's event loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from corral.control import ControlStore, Role
from corral.engine import Engine
from corral.server import create_app

from .conftest import TEMPLATE

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

BASE = "http://corral.test"
NASTY = b"\x00\xff\xfeA\x00\x80\nend\r\n\x1b[0m"


@dataclass
class Api:
    app: Any
    store: ControlStore
    engine: Engine
    keys: dict[str, str]  # "admin", "a_dev", "a_aud", "b_dev" -> raw key
    url: str = ""  # set by `live`: the app on a real loopback socket

    def client(self, who: str | None, *, live: bool = False) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.keys[who]}"} if who is not None else {}
        if live:
            return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=BASE, headers=headers,
                                 timeout=30)


@pytest.fixture
async def api(engine: Engine, tmp_path: Path) -> AsyncIterator[Api]:
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        await store.bootstrap_admin(None)
        keys = {"admin": (tmp_path / "admin.key").read_text().strip()}
        tenants = {t: (await store.create_tenant(t)).id for t in ("a", "b")}
        for who, tenant, role in [("a_dev", "a", Role.DEVELOPER), ("a_aud", "a", Role.AUDITOR),
                                  ("b_dev", "b", Role.DEVELOPER)]:
            keys[who] = (await store.create_key(tenants[tenant], role, who)).key
        yield Api(create_app(engine, store), store, engine, keys)
    finally:
        await store.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def live(api: Api) -> AsyncIterator[Api]:
    """The same app over a real socket (uvicorn in this event loop; lifespan off: the fixture owns the state)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=port, lifespan="off", log_level="error"))
    task = asyncio.create_task(server.serve())
    with anyio.fail_after(10):
        while not server.started:
            await asyncio.sleep(0.02)
    api.url = f"http://127.0.0.1:{port}"
    try:
        yield api
    finally:
        server.should_exit = True
        await task


async def create(client: httpx.AsyncClient) -> str:
    r = await client.post("/v1/sandboxes", json={"template": TEMPLATE})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def start(client: httpx.AsyncClient, sandbox_id: str, cmd: str | list[str], **body: Any) -> dict[str, Any]:
    r = await client.post(f"/v1/sandboxes/{sandbox_id}/processes", json={"cmd": cmd, **body})
    assert r.status_code == 201, r.text
    process: dict[str, Any] = r.json()
    return process


async def wait(client: httpx.AsyncClient, sandbox_id: str, process_id: str, timeout: float = 20) -> dict[str, Any]:
    r = await client.get(f"/v1/sandboxes/{sandbox_id}/processes/{process_id}/wait", params={"timeout": timeout})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


async def count(client: httpx.AsyncClient, sandbox_id: str, name: str) -> int:
    r = await client.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": f"ps -eo comm | grep -c '^{name}$'"})
    return int(unb64(r.json()["stdout_b64"]) or b"0")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line]


def streamed(evs: list[dict[str, Any]], stream: str = "stdout") -> bytes:
    return b"".join(unb64(e["data_b64"]) for e in evs if e["event"] == stream)


# -- background processes -------------------------------------------------------------------------------------------


async def test_start_list_get_and_wait(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        p = await start(c, sb, "printf 'one\\n'; sleep 0.3; printf 'two\\n' >&2; exit 3", env={"X": "y"})
        assert p["running"] is True and p["cmd"] == "printf 'one\\n'; sleep 0.3; printf 'two\\n' >&2; exit 3"
        assert p["argv"][:2] == ["/bin/bash", "-lc"] and p["pid"] > 0 and p["started_at"]
        listed = (await c.get(f"/v1/sandboxes/{sb}/processes")).json()["processes"]
        assert [x["id"] for x in listed if x["running"]] == [p["id"]]
        result = await wait(c, sb, p["id"])
        assert result["running"] is False and result["exit_code"] == 3 and result["signal"] is None
        assert unb64(result["stdout_b64"]) == b"one\n" and unb64(result["stderr_b64"]) == b"two\n"
        got = (await c.get(f"/v1/sandboxes/{sb}/processes/{p['id']}")).json()
        assert got["running"] is False and got["exit_code"] == 3 and got["id"] == p["id"]
        assert (await wait(c, sb, p["id"]))["exit_code"] == 3  # the result stays to be fetched again


async def test_kill_gives_the_signal(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        p = await start(c, sb, "sleep 1000 & sleep 1000")
        r = await c.get(f"/v1/sandboxes/{sb}/processes/{p['id']}/wait", params={"timeout": 0.2})
        assert r.json() == {"id": p["id"], "running": True}
        assert (await c.post(f"/v1/sandboxes/{sb}/processes/{p['id']}/kill")).status_code == 204
        result = await wait(c, sb, p["id"])
        assert result["killed"] is True and result["signal"] == 9 and result["exit_code"] == 137
        assert await count(c, sb, "sleep") == 0  # the whole tree went

        p = await start(c, sb, ["sleep", "1000"])
        r = await c.post(f"/v1/sandboxes/{sb}/processes/{p['id']}/kill", json={"signal": "TERM"})
        assert r.status_code == 204
        result = await wait(c, sb, p["id"])
        assert result["signal"] == 15 and result["exit_code"] == 143


async def test_stdin_round_trip_is_byte_exact(api: Api) -> None:
    big = os.urandom(3 * 1024 * 1024 + 7)  # more than one batch to the agent
    async with api.client("a_dev") as c:
        sb = await create(c)
        p = await start(c, sb, ["cat"], stdin=True)
        base = f"/v1/sandboxes/{sb}/processes/{p['id']}"
        r = await c.post(f"{base}/stdin", content=NASTY)
        assert r.status_code == 200 and r.json() == {"size": len(NASTY)}
        assert (await c.post(f"{base}/stdin", content=big, params={"eof": "true"})).json() == {"size": len(big)}
        result = await wait(c, sb, p["id"])
        assert result["exit_code"] == 0 and unb64(result["stdout_b64"]) == NASTY + big

        # stdin_b64 without `stdin: true`: those bytes, then EOF
        p = await start(c, sb, "od -An -tx1", stdin_b64=b64(b"\x00\xff"))
        assert unb64((await wait(c, sb, p["id"]))["stdout_b64"]).split() == [b"00", b"ff"]
        # no stdin at all: /dev/null, and writing to it is a conflict
        p = await start(c, sb, ["cat"])
        assert (await wait(c, sb, p["id"]))["exit_code"] == 0
        p = await start(c, sb, ["sleep", "5"])
        r = await c.post(f"/v1/sandboxes/{sb}/processes/{p['id']}/stdin", content=b"x")
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"


async def test_process_timeout_is_a_structured_outcome(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        p = await start(c, sb, "echo before; sleep 100", timeout=0.5)
        result = await wait(c, sb, p["id"])
        assert result["timed_out"] is True and unb64(result["stdout_b64"]) == b"before\n"


async def test_bad_requests_are_400_and_unknown_processes_404(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        base = f"/v1/sandboxes/{sb}/processes"
        p = await start(c, sb, ["sleep", "5"])
        for r in [await c.post(base, json={"cmd": "true", "stdin_b64": "%%%"}),
                  await c.post(base, json={"cmd": "true", "stream": True}),
                  await c.post(base, json={"cmd": "true", "timeout": -1}),
                  await c.post(f"{base}/{p['id']}/kill", json={"signal": "SIGNOPE"}),
                  await c.post(f"{base}/{p['id']}/kill", json={"signal": True}),
                  await c.get(f"{base}/{p['id']}/wait", params={"timeout": -1}),
                  await c.get(f"{base}/{p['id']}/attach", params={"timeout": "soon"})]:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_request"
        for method, suffix in [("GET", ""), ("GET", "/wait"), ("GET", "/attach"), ("POST", "/kill"),
                               ("POST", "/stdin")]:
            r = await c.request(method, f"{base}/99{suffix}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, suffix, r.text)
        r = await c.post(base, json={"cmd": ["no-such-program"]})
        assert r.status_code == 400 and "command not found" in r.json()["error"]["message"]


PROCESS_ROUTES: list[tuple[str, str, dict[str, Any]]] = [
    ("POST", "", {"json": {"cmd": "touch /workspace/pwned"}}),
    ("GET", "", {}),
    ("GET", "/{pid}", {}),
    ("POST", "/{pid}/stdin", {"content": b"x"}),
    ("POST", "/{pid}/kill", {}),
    ("GET", "/{pid}/wait", {"params": {"timeout": 0}}),
    ("GET", "/{pid}/attach", {"params": {"timeout": 0}}),
]


async def test_other_tenants_sandbox_and_processes_are_404(api: Api) -> None:
    async with api.client("b_dev") as b, api.client("a_dev") as a:
        sb = await create(b)
        p = await start(b, sb, "echo secret; sleep 30", stdin=True)
        for method, suffix, kwargs in PROCESS_ROUTES:
            path = f"/processes{suffix}".format(pid=p["id"])
            r = await a.request(method, f"/v1/sandboxes/{sb}{path}", **kwargs)
            missing = await a.request(method, f"/v1/sandboxes/sb-doesnotexist{path}", **kwargs)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (method, path, r.text)
            assert r.json()["error"]["message"].replace(sb, "ID") == \
                missing.json()["error"]["message"].replace("sb-doesnotexist", "ID")
        # nothing happened to it, and a's own sandbox does not know b's process ids
        listed = (await b.get(f"/v1/sandboxes/{sb}/processes")).json()["processes"]
        assert [x["id"] for x in listed] == [p["id"]] and listed[0]["running"] is True
        assert (await count(b, sb, "touch")) == 0
        mine = await create(a)
        assert (await a.get(f"/v1/sandboxes/{mine}/processes/{p['id']}")).status_code == 404


async def test_auditor_may_not_start_processes(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        sb = await create(dev)
        r = await aud.post(f"/v1/sandboxes/{sb}/processes", json={"cmd": "id"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"


async def test_audit_records_process_commands_verbatim(api: Api) -> None:
    cmd = "echo 'verbatim  $HOME'; exit 7"
    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        sb = await create(dev)
        p = await start(dev, sb, cmd, env={"SECRET": "hunter2"})
        await wait(dev, sb, p["id"])
        await dev.post(f"/v1/sandboxes/{sb}/processes/{p['id']}/kill", json={"signal": 15})
        records = (await aud.get("/v1/audit", params={"sandbox": sb})).json()["records"]
    by_action = {r["action"]: r for r in records}
    started = by_action["process.start"]
    assert started["params"]["cmd"] == cmd and started["params"]["env_names"] == ["SECRET"]
    assert "hunter2" not in json.dumps(records)
    assert started["outcome"]["status"] == 201 and started["outcome"]["process"] == p["id"]
    assert by_action["process.wait"]["outcome"]["exit_code"] == 7
    assert by_action["process.kill"]["params"] == {"process": p["id"], "signal": 15}


# -- attach ---------------------------------------------------------------------------------------------------------


async def test_attach_replays_earlier_output_then_follows(live: Api) -> None:
    async with live.client("a_dev", live=True) as c:
        sb = await create(c)
        p = await start(c, sb, "printf 'a\\000b\\377'; printf 'E\\376' >&2; sleep 1; printf 'c\\n'; exit 5")
        await asyncio.sleep(0.5)  # the first output is out before anyone attaches
        seen: list[tuple[float, dict[str, Any]]] = []
        began = time.monotonic()
        with anyio.fail_after(20):
            async with c.stream("GET", f"/v1/sandboxes/{sb}/processes/{p['id']}/attach") as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
                async for line in r.aiter_lines():
                    if line:
                        seen.append((time.monotonic() - began, json.loads(line)))
    evs = [e for _, e in seen]
    assert streamed(evs) == b"a\x00b\xffc\n" and streamed(evs, "stderr") == b"E\xfe"
    assert seen[0][0] < 0.4  # the replay came at once, before `c` was printed
    exit_ev = evs[-1]
    assert exit_ev["event"] == "exit" and exit_ev["exit_code"] == 5 and exit_ev["id"] == p["id"]
    assert unb64(exit_ev["stdout_b64"]) == b""  # everything was streamed already


async def test_attach_with_timeout_ends_with_running(live: Api) -> None:
    async with live.client("a_dev", live=True) as c:
        sb = await create(c)
        p = await start(c, sb, "echo hi; sleep 30")
        with anyio.fail_after(10):
            r = await c.get(f"/v1/sandboxes/{sb}/processes/{p['id']}/attach", params={"timeout": 0.5})
        evs = events(r.content)
        assert streamed(evs) == b"hi\n" and evs[-1] == {"event": "running", "id": p["id"]}
        assert (await c.get(f"/v1/sandboxes/{sb}/processes/{p['id']}")).json()["running"] is True


async def test_disconnecting_an_attach_leaves_the_process_to_its_timeout(live: Api) -> None:
    async with live.client("a_dev", live=True) as c:
        sb = await create(c)
        p = await start(c, sb, "echo started; sleep 30", timeout=3)
        began = time.monotonic()
        with anyio.fail_after(10):
            async with c.stream("GET", f"/v1/sandboxes/{sb}/processes/{p['id']}/attach") as r:
                async for line in r.aiter_lines():
                    assert json.loads(line) == {"event": "stdout", "data_b64": b64(b"started\n")}
                    break  # and hang up mid-stream
        await asyncio.sleep(0.5)
        got = (await c.get(f"/v1/sandboxes/{sb}/processes/{p['id']}")).json()
        assert got["running"] is True, got
        result = await wait(c, sb, p["id"], timeout=20)
        assert result["timed_out"] is True and 2.5 < time.monotonic() - began < 15
        assert unb64(result["stdout_b64"]) == b"started\n"
    async with live.client("a_aud") as aud:
        records = (await aud.get("/v1/audit", params={"sandbox": sb, "action": "process.attach"})).json()["records"]
    assert records and records[0]["outcome"].get("disconnected") is True


async def test_processes_die_with_their_sandbox(api: Api) -> None:
    async with api.client("a_dev") as c:
        sb = await create(c)
        await start(c, sb, "sleep 1000")
        assert (await c.delete(f"/v1/sandboxes/{sb}")).status_code == 204
        r = await c.get(f"/v1/sandboxes/{sb}/processes")
        assert r.status_code == 404


# -- PTY over a WebSocket ---------------------------------------------------------------------------------------------


def ws_url(api: Api, sandbox_id: str) -> str:
    return api.url.replace("http://", "ws://") + f"/v1/sandboxes/{sandbox_id}/pty"


async def open_pty(api: Api, sandbox_id: str, who: str | None = "a_dev", **start: Any) -> ClientConnection:
    headers = {"Authorization": f"Bearer {api.keys[who]}"} if who else {}
    ws = await connect(ws_url(api, sandbox_id), additional_headers=headers, open_timeout=10)
    with contextlib.suppress(ConnectionClosed):  # a refused connection may be closed before it is sent
        await ws.send(json.dumps({"type": "start", **start}))
    return ws


async def read_until(ws: ClientConnection, marker: bytes, out: bytearray, controls: list[dict[str, Any]]) -> None:
    """Collect output into `out` (and text frames into `controls`) until `marker` shows up."""
    with anyio.fail_after(15):
        while marker not in out:
            message = await ws.recv()
            if isinstance(message, bytes):
                out += message
            else:
                controls.append(json.loads(message))
                if controls[-1]["type"] in ("exit", "error"):
                    return


async def read_to_close(ws: ClientConnection, out: bytearray, controls: list[dict[str, Any]]) -> None:
    with anyio.fail_after(15):
        try:
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    out += message
                else:
                    controls.append(json.loads(message))
        except ConnectionClosed:
            pass


async def test_pty_tty_resize_exit_code_and_exact_bytes(live: Api) -> None:
    async with live.client("a_dev") as c:
        sb = await create(c)
    ws = await open_pty(live, sb, cmd=["bash", "--norc", "--noprofile"], rows=30, cols=100)
    out, controls = bytearray(), []
    try:
        await ws.send(b"stty size; tty; echo $TERM; echo MARK$((1+1))\n")  # the echoed line has no `MARK2`
        await read_until(ws, b"MARK2\r\n", out, controls)
        assert controls[0]["type"] == "started" and controls[0]["pid"] > 0
        await ws.send(json.dumps({"type": "resize", "rows": 40, "cols": 120}))
        # raw mode, so keystrokes reach od exactly; the output side is exact too (no newline in it to map)
        await ws.send(b"stty size; printf 'A\\000B\\377C'; echo; stty raw -echo; echo R$((1+1)); od -An -tx1 -N5; "
                      b"stty sane; exit 7\n")
        await read_until(ws, b"R2", out, controls)  # raw mode is on: from here keystrokes are not interpreted
        await ws.send(b"\x00\xff\x01\x7f\x03")
        await read_to_close(ws, out, controls)
    finally:
        await ws.close()
    text = out.decode(errors="replace")
    assert "30 100" in text and "40 120" in text and "xterm-256color" in text, text
    assert "/dev/pts/" in text, text
    assert b"A\x00B\xffC" in out
    assert "00 ff 01 7f 03" in text, text
    assert controls[-1] == {"type": "exit", "exit_code": 7, "signal": None, "timed_out": False, "killed": False,
                            "duration": controls[-1]["duration"]}
    assert ws.close_code == 1000


async def test_pty_kill_frame_and_hang_up(live: Api) -> None:
    async with live.client("a_dev") as c:
        sb = await create(c)
        ws = await open_pty(live, sb, cmd="sleep 1000")
        out, controls = bytearray(), []
        with anyio.fail_after(10):
            assert json.loads(await ws.recv())["type"] == "started"
        await ws.send(json.dumps({"type": "kill"}))
        await read_to_close(ws, out, controls)
        assert controls[-1]["type"] == "exit" and controls[-1]["killed"] is True and controls[-1]["signal"] == 9

        # closing the socket hangs up: the terminal's process tree is killed
        ws = await open_pty(live, sb, cmd="sleep 2000 & sleep 2000")
        with anyio.fail_after(10):
            assert json.loads(await ws.recv())["type"] == "started"
        await asyncio.sleep(0.3)
        assert await count(c, sb, "sleep") == 2
        await ws.close()
        with anyio.fail_after(10):
            while await count(c, sb, "sleep"):
                await asyncio.sleep(0.1)


async def expect_refusal(ws: ClientConnection, code: int, error: str) -> str:
    out, controls = bytearray(), []
    await read_to_close(ws, out, controls)
    assert ws.close_code == code, (ws.close_code, ws.close_reason, controls)
    assert controls and controls[-1]["type"] == "error" and controls[-1]["error"]["code"] == error, controls
    return str(controls[-1]["error"]["message"])


async def test_pty_refusals_have_close_codes(live: Api) -> None:
    async with live.client("a_dev") as a, live.client("b_dev") as b:
        mine, theirs = await create(a), await create(b)
    await expect_refusal(await open_pty(live, mine, who=None), 4401, "unauthenticated")
    bad = await connect(ws_url(live, mine), additional_headers={"Authorization": "Bearer nope"}, open_timeout=10)
    await expect_refusal(bad, 4401, "unauthenticated")
    other = await expect_refusal(await open_pty(live, theirs), 4404, "not_found")
    missing = await expect_refusal(await open_pty(live, "sb-doesnotexist"), 4404, "not_found")
    assert other.replace(theirs, "ID") == missing.replace("sb-doesnotexist", "ID")
    await expect_refusal(await open_pty(live, mine, who="a_aud"), 4403, "permission_denied")
    await expect_refusal(await open_pty(live, mine, rows=0), 4400, "invalid_request")
    await expect_refusal(await open_pty(live, mine, cmd=["no-such-program"]), 4400, "invalid_request")
    ws = await open_pty(live, mine, cmd="sleep 100")
    with anyio.fail_after(10):
        assert json.loads(await ws.recv())["type"] == "started"
    with contextlib.suppress(ConnectionClosed):
        await ws.send("not json")
    await expect_refusal(ws, 4400, "invalid_request")
    # a first frame that is not `start`
    ws = await connect(ws_url(live, mine), additional_headers={"Authorization": f"Bearer {live.keys['a_dev']}"},
                       open_timeout=10)
    with contextlib.suppress(ConnectionClosed):
        await ws.send(b"ls\n")
    await expect_refusal(ws, 4400, "invalid_request")


async def test_pty_is_audited(live: Api) -> None:
    async with live.client("a_dev") as c, live.client("a_aud") as aud:
        sb = await create(c)
        ws = await open_pty(live, sb, cmd="exit 4", env={"TOKEN": "s3cret"})
        out, controls = bytearray(), []
        await read_to_close(ws, out, controls)
        assert controls[-1]["type"] == "exit" and controls[-1]["exit_code"] == 4
        with anyio.fail_after(10):
            while not (records := (await aud.get("/v1/audit", params={"sandbox": sb, "action": "sandbox.pty"})
                                   ).json()["records"]):
                await asyncio.sleep(0.05)
    assert records[0]["params"]["cmd"] == "exit 4" and records[0]["params"]["env_names"] == ["TOKEN"]
    assert records[0]["outcome"]["exit_code"] == 4 and "s3cret" not in json.dumps(records)
