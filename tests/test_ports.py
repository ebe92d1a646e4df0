"""A sandbox's ports from outside (`sb.get_host(port)`, docs/ports.md).

Live: web servers inside real runc sandboxes (python3 -m http.server, and stdlib servers of our own for streamed
responses, uploads and WebSockets: the template has no `websockets` package), reached through a real server
over a loopback socket, with the Host header naming the port. Unit: the Host parsing, the fall-through of other
hosts to the API, the error and close-code mappings, and the service's refusals (over tests/fakes.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest
from typer.testing import CliRunner
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import Close

from corral import AgentError, AsyncSandbox, InvalidRequestError, Sandbox
from corral.cli import app as cli
from corral.control import ControlStore, Role
from corral.engine import Engine
from corral.server import ServerProcess, create_app
from corral.server._port_credentials import strip_credentials
from corral.server._ports import _close_to_client, _close_to_upstream, _upstream_errors, port_target
from corral.service import PORT_ACTION, TokenPurpose, check_domain

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME, TEST_HOME
from .fakes import FakeBackend, FakeTemplates, World
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

MIB = 2**20
HTTP_PORT, STREAM_PORT, WS_PORT = 8000, 8001, 8002

# A stdlib HTTP/1.1 server: a streamed (chunked) response, one that never ends, uploads hashed as they arrive
# (Content-Length or chunked), and the request headers it got.
STREAM_SERVER = r'''
import hashlib, json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body, kind="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        if self.path == "/headers":
            seen = {}
            for key, value in self.headers.items():
                seen.setdefault(key.lower(), []).append(value)
            return self.reply(200, json.dumps(seen).encode())
        if self.path not in ("/ticks", "/forever"):
            return self.reply(404, b'{"missing": true}')
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.path == "/ticks":
            for i in range(5):
                self.chunk(b"tick %d\n" % i)
                time.sleep(0.4)
            self.wfile.write(b"0\r\n\r\n")
            return
        try:
            while True:
                self.chunk(b"x" * 1024)
                time.sleep(0.05)
        except OSError:
            open("/tmp/forever-ended", "w").write("ended")
            self.close_connection = True

    def do_POST(self):
        digest, size = hashlib.sha256(), 0
        chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
        def take(n):
            nonlocal size
            while n:
                data = self.rfile.read(min(n, 1 << 20))
                digest.update(data)
                size += len(data)
                n -= len(data)
        if chunked:
            while (n := int(self.rfile.readline().split(b";")[0], 16)):
                take(n)
                self.rfile.readline()
            self.rfile.readline()
        else:
            take(int(self.headers.get("Content-Length", "0")))
        self.reply(200, json.dumps({"size": size, "sha256": digest.hexdigest(), "chunked": chunked}).encode())

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''

# A stdlib WebSocket echo server (RFC 6455): text stays text, bytes stay bytes; "close:CODE:REASON" makes it
# close with that code; the close code a client sends is written to /tmp/ws-close.
WS_SERVER = r'''
import base64, hashlib, json, socket, struct, sys, threading

def exact(conn, n):
    data = bytearray()
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise EOFError
        data += got
    return bytes(data)

def frame(conn):
    first, second = exact(conn, 2)
    n = second & 0x7F
    if n == 126:
        n = struct.unpack(">H", exact(conn, 2))[0]
    elif n == 127:
        n = struct.unpack(">Q", exact(conn, 8))[0]
    mask = exact(conn, 4) if second & 0x80 else b""
    data = exact(conn, n)
    if mask and n:
        data = (int.from_bytes(data, "big") ^ int.from_bytes((mask * (n // 4 + 1))[:n], "big")).to_bytes(n, "big")
    return bool(first & 0x80), first & 0x0F, data

def send(conn, op, data):
    n = len(data)
    if n < 126:
        size = bytes([n])
    elif n < 65536:
        size = bytes([126]) + struct.pack(">H", n)
    else:
        size = bytes([127]) + struct.pack(">Q", n)
    conn.sendall(bytes([0x80 | op]) + size + data)

def serve(conn):
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    open("/tmp/ws-headers", "w").write(json.dumps(headers))
    accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode()
                                           + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()
    reply = ("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             f"Sec-WebSocket-Accept: {accept}\r\n")
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
    if "corral-test" in offered:
        reply += "Sec-WebSocket-Protocol: corral-test\r\n"
    conn.sendall((reply + "\r\n").encode())
    message, kind = b"", 1
    while True:
        fin, op, data = frame(conn)
        if op == 8:
            code = struct.unpack(">H", data[:2])[0] if len(data) >= 2 else 1005
            open("/tmp/ws-close", "w").write(f"{code} {data[2:].decode()}")
            send(conn, 8, data[:2])
            break
        if op == 9:
            send(conn, 10, data)
            continue
        if op == 10:
            continue
        if op:
            message, kind = b"", op
        message += data
        if not fin:
            continue
        if kind == 1 and message.startswith(b"close:"):
            _, code, reason = message.decode().split(":", 2)
            send(conn, 8, struct.pack(">H", int(code)) + reason.encode())
            while frame(conn)[1] != 8:
                pass
            break
        send(conn, kind, message)
    conn.close()

listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(16)
while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''


# -- unit: the Host parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "expected"), [
    ("8000-sb-0123456789abcdef.localhost:7770", ("sb-0123456789abcdef", 8000)),
    ("8000-sb-0123456789abcdef.localhost", ("sb-0123456789abcdef", 8000)),
    ("1-sb-abcd.localhost:80", ("sb-abcd", 1)),
    ("65535-sb-abcd.localhost", ("sb-abcd", 65535)),
    ("8000-SB-ABCD.LocalHost:7770", ("sb-abcd", 8000)),  # host names are case-insensitive
    ("8000-sb-abcd.localhost.:7770", ("sb-abcd", 8000)),  # the absolute form
])
def test_port_hosts_parse(host: str, expected: tuple[str, int]) -> None:
    assert port_target(host, "localhost") == expected


@pytest.mark.parametrize("host", [
    None, "", "localhost", "localhost:7770", "127.0.0.1:7770", "[::1]:7770", "corral.test",
    "0-sb-abcd.localhost", "65536-sb-abcd.localhost", "08000-sb-abcd.localhost", "123456-sb-abcd.localhost",
    "-1-sb-abcd.localhost", "abc-sb-abcd.localhost", "8000.localhost", "8000-.localhost",  # bad ports
    "8000-abcd.localhost", "8000-sb-.localhost", "8000-sb-ab_cd.localhost", "8000-sb-abcd", "sb-abcd.localhost",
    "8000-sb-abcd.example.com", "8000-sb-abcd.localhost.example.com", "x.8000-sb-abcd.localhost",  # other domains
    "8000-sb-abcd.localhostx", "8000-sb-abcd.xlocalhost",
])
def test_other_hosts_are_not_port_hosts(host: str | None) -> None:
    assert port_target(host, "localhost") is None


def test_a_domain_of_several_labels() -> None:
    assert port_target("3000-sb-abcd.sandboxes.example.com:443", "sandboxes.example.com") == ("sb-abcd", 3000)
    assert port_target("3000-sb-abcd.example.com", "sandboxes.example.com") is None


@pytest.mark.parametrize(("given", "normal"), [("localhost", "localhost"), ("Sandboxes.Example.COM.",
                                                                            "sandboxes.example.com")])
def test_check_domain_normalises(given: str, normal: str) -> None:
    assert check_domain(given) == normal


@pytest.mark.parametrize("bad", ["", ".", "a..b", "-a.com", "a-.com", "a_b.com", "a b", "x" * 64 + ".com",
                                 "exa\x00mple.com", "127.0.0.1:80", "*.example.com"])
def test_check_domain_refuses_what_is_not_a_dns_name(bad: str) -> None:
    with pytest.raises(InvalidRequestError, match="not a DNS name"):
        check_domain(bad)


# -- unit: error and close-code mappings -------------------------------------------------------------------------

# httpcore's errors that one HTTP/1.1 connection over a stream we give it cannot raise: they belong to pools and
# proxies, which this relay does not use.
_NOT_RAISED_HERE = {httpcore.ConnectionNotAvailable, httpcore.ProxyError}


_HTTPCORE_ERRORS = sorted((e for e in vars(httpcore).values() if isinstance(e, type) and issubclass(e, Exception)
                           and e.__module__.startswith("httpcore") and e not in _NOT_RAISED_HERE),
                          key=lambda e: e.__name__)


@pytest.mark.parametrize("error", _HTTPCORE_ERRORS)
def test_every_httpcore_error_is_mapped_to_an_agent_error_naming_the_port(error: type[Exception]) -> None:
    with pytest.raises(AgentError, match="port 8123") as caught, _upstream_errors(8123):
        raise error("boom")
    assert isinstance(caught.value.__cause__, error) and caught.value.details == {"port": 8123}


@pytest.mark.parametrize(("received", "expected"), [
    (Close(4321, "bye"), (4321, "bye")), (Close(1000, ""), (1000, "")), (Close(1001, "away"), (1001, "away")),
    (Close(1005, ""), (1000, "")),  # an empty close frame: a normal close
    (None, (1014, "port 80 in the sandbox closed without a close frame")),
    (Close(1006, ""), (1014, "port 80 in the sandbox closed without a close frame")),
])
def test_the_sandboxs_close_reaches_the_client(received: Close | None, expected: tuple[int, str]) -> None:
    assert _close_to_client(received, 80) == expected


@pytest.mark.parametrize(("code", "reason", "expected"), [
    (4000, "done", (4000, "done")), (1000, "", (1000, "")), (1005, "", (1000, "")),
    (1006, "", (1001, "the client went away")), (1015, "", (1001, "the client went away")),
    (2999, "odd", (1000, "")), (1001, "é" * 100, (1001, "é" * 61)),  # a reason is cut at 123 bytes, whole chars
])
def test_the_clients_close_reaches_the_sandbox(code: int, reason: str, expected: tuple[int, str]) -> None:
    assert _close_to_upstream(code, reason) == expected


# -- unit: the routing and the refusals, over the fake backend --------------------------------------------------


@pytest.fixture
async def fake_app() -> AsyncIterator[tuple[Any, dict[str, str], str]]:
    """The app on a custom domain over `FakeBackend`: (app, keys, the id of a sandbox of tenant a)."""
    home = Path(tempfile.mkdtemp(prefix="cp-", dir="/tmp"))  # short: the fake agents' Unix sockets live here
    world = World(home / "world")
    world.dir.mkdir()
    engine = Engine(home, FakeBackend(home, world), templates=FakeTemplates())  # type: ignore[arg-type]
    store = ControlStore(home=home)
    app = create_app(engine, store, domain="Sandboxes.Test")
    service = app.state.corral
    await service.start()
    try:
        keys = {}
        for tenant in ("a", "b"):
            tenant_id = (await store.create_tenant(tenant)).id
            keys[tenant] = (await store.create_key(tenant_id, Role.DEVELOPER)).key
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as c:
            r = await c.post("/v1/sandboxes", json={"template": "default"}, headers=_auth(keys["a"]))
            assert r.status_code == 201, r.text
        yield app, keys, r.json()["id"]
    finally:
        await service.close()
        await engine.close(destroy_all=True)
        for server in world.agents.values():
            server.close()
        shutil.rmtree(home, ignore_errors=True)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _in_process(app: Any, host: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", headers={"Host": host})


@pytest.mark.anyio
async def test_other_hosts_reach_the_api_and_info_names_the_domain(fake_app: tuple[Any, dict[str, str], str]) -> None:
    app, keys, sandbox_id = fake_app
    for host in ("127.0.0.1:7770", "sandboxes.test", "api.sandboxes.test", f"8000-{sandbox_id}.localhost",
                 f"0-{sandbox_id}.sandboxes.test", f"8000-{sandbox_id}.other.test"):
        async with _in_process(app, host) as c:
            r = await c.get("/v1/info", headers=_auth(keys["a"]))
            assert r.status_code == 200 and r.json()["domain"] == "sandboxes.test", (host, r.text)
    async with _in_process(app, f"8000-{sandbox_id}.sandboxes.test:7770") as c:
        r = await c.get("/v1/info", headers=_auth(keys["a"]))  # a port host: never the API, whatever the path
    assert "nothing is listening on port 8000" in r.json()["error"]["message"]  # it went to the sandbox's agent


@pytest.mark.anyio
async def test_refusals_401_and_404_say_nothing_about_other_sandboxes(
        fake_app: tuple[Any, dict[str, str], str]) -> None:
    app, keys, sandbox_id = fake_app
    service = app.state.corral
    async with _in_process(app, f"8000-{sandbox_id}.sandboxes.test") as c:
        anonymous = await c.get("/")
        wrong = await c.get("/", headers={"Authorization": "Basic Zm9vOmJhcg=="})
        other = await c.get("/", headers=_auth(keys["b"]))
    async with _in_process(app, "8000-sb-0000000000000000.sandboxes.test") as c:
        unknown_anonymous = await c.get("/")
        unknown = await c.get("/", headers=_auth(keys["a"]))
    assert anonymous.status_code == wrong.status_code == unknown_anonymous.status_code == 401
    assert anonymous.json() == unknown_anonymous.json()  # existence does not leak to callers without a key
    assert anonymous.json()["error"]["code"] == "unauthenticated"
    assert other.status_code == unknown.status_code == 404
    assert other.json()["error"]["code"] == "not_found" and "sandbox" in other.json()["error"]["message"]
    records = await service.store.audit.query(action=PORT_ACTION)
    assert [r.outcome["status"] for r in records] == [404, 404]  # the 401s are auth.denied records instead
    assert [(r.target, r.params["port"], r.params["public"]) for r in records] == [
        (sandbox_id, 8000, False), ("sb-0000000000000000", 8000, False)]


# -- live: real sandboxes behind a real server ---------------------------------------------------------------------

def live(test: Any) -> Any:
    """Marks of a test over real sandboxes: it needs runc and the template, and runs in an event loop."""
    return pytest.mark.runc(pytest.mark.anyio(test))


def _port_client(url: str, host: str, key: str | None = None, **headers: str) -> httpx.AsyncClient:
    """Requests to `url` (the server's real socket) that name the sandbox's port in their Host header."""
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.AsyncClient(base_url=url, headers={"Host": host, **headers}, timeout=120, trust_env=False)


async def _start(sb: AsyncSandbox, command: str, port: int) -> None:
    """Run a server in the background and wait until it listens."""
    await sb.commands.run(f"nohup {command} >/tmp/server-{port}.log 2>&1 &", timeout=30)
    wait = f"for i in $(seq 200); do (echo > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0; sleep 0.05; done"
    result = await sb.commands.run(wait + "; exit 1", timeout=30)
    assert result.exit_code == 0, (await sb.commands.run(f"cat /tmp/server-{port}.log")).stdout


@pytest.fixture
async def web(api: Api, live_url: str) -> AsyncIterator[AsyncSandbox]:
    """A sandbox of tenant a running http.server (on /workspace), the streaming server and the WebSocket one."""
    async with await AsyncSandbox.create(TEMPLATE, api_key=api.keys["a_dev"], base_url=live_url) as sb:
        await sb.files.write("/workspace/stream.py", STREAM_SERVER)
        await sb.files.write("/workspace/ws.py", WS_SERVER)
        await sb.files.write("/workspace/hello.txt", b"hello from the sandbox\n")
        await _start(sb, f"python3 -m http.server {HTTP_PORT} --bind 127.0.0.1 --directory /workspace", HTTP_PORT)
        await _start(sb, f"python3 /workspace/stream.py {STREAM_PORT}", STREAM_PORT)
        await _start(sb, f"python3 /workspace/ws.py {WS_PORT}", WS_PORT)
        yield sb


@live
async def test_an_http_server_is_reached_with_the_key_and_refused_without(api: Api, live_url: str,
                                                                        web: AsyncSandbox) -> None:
    host = await web.get_host(HTTP_PORT)
    assert host == f"{HTTP_PORT}-{web.id}.localhost:{httpx.URL(live_url).port}"
    async with _port_client(live_url, host, api.keys["a_dev"]) as c:
        r = await c.get("/hello.txt")
        assert r.status_code == 200 and r.content == b"hello from the sandbox\n"
        assert (await c.get("/missing")).status_code == 404  # the app's own 404 comes through as it is
    async with _port_client(live_url, host) as c:
        refused = await c.get("/hello.txt")
    async with _port_client(live_url, host, api.keys["b_dev"]) as c:
        foreign = await c.get("/hello.txt")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthenticated"
    assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "not_found"
    assert "hello" not in refused.text + foreign.text
    async with _port_client(live_url, "127.0.0.1") as c:
        assert (await c.get("/v1/health")).json() == {"ok": True}  # other hosts are the API
    records = await api.store.audit.query(action=PORT_ACTION, sandbox=web.id)
    assert [(r.params["path"], r.outcome["status"]) for r in records] == [
        ("/hello.txt", 200), ("/missing", 404), ("/hello.txt", 404)]  # the 401 is an auth.denied record
    assert records[0].key_id == api.key_ids["a_dev"] and records[0].outcome["bytes_received"] == 23
    with pytest.raises(InvalidRequestError):
        await web.get_host(0)


@live
async def test_headers_hop_by_hop_dropped_forwarded_added_key_never_passed_on(api: Api, live_url: str,
                                                                            web: AsyncSandbox) -> None:
    host = await web.get_host(STREAM_PORT)
    async with _port_client(live_url, host, api.keys["a_dev"], **{"X-Custom": "kept", "Connection": "X-Drop",
                                                                  "X-Drop": "dropped"}) as c:
        seen = (await c.get("/headers")).json()
    assert seen["host"] == [host] and seen["x-custom"] == ["kept"] and seen["x-forwarded-host"] == [host]
    assert seen["x-forwarded-for"] == ["127.0.0.1"] and seen["x-forwarded-proto"] == ["http"]
    assert "authorization" not in seen and "x-drop" not in seen  # Corral's key never reaches the sandbox


@live
async def test_public_ports_need_no_key_and_keep_the_apps_own_authorization(api: Api,
                                                                            live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, public_ports=True, api_key=api.keys["a_dev"],
                                         base_url=live_url) as sb:
        await sb.files.write("/workspace/stream.py", STREAM_SERVER)
        await _start(sb, f"python3 /workspace/stream.py {STREAM_PORT}", STREAM_PORT)
        host = await sb.get_host(STREAM_PORT)
        async with _port_client(live_url, host) as c:
            anonymous = await c.get("/headers")
            app_token = await c.get("/headers", headers={"Authorization": "Bearer the-apps-own-token"})
            corral_key = await c.get("/headers", headers=_auth(api.keys["b_dev"]))
        assert anonymous.status_code == app_token.status_code == corral_key.status_code == 200
        assert app_token.json()["authorization"] == ["Bearer the-apps-own-token"]
        assert "authorization" not in corral_key.json()  # a Corral key never reaches a sandbox, public or not
        records = await api.store.audit.query(action=PORT_ACTION, sandbox=sb.id)
        assert len(records) == 3 and all(r.params["public"] and r.key_id is None for r in records)
        assert {r.tenant_id for r in records} == {api.tenants["a"]}  # the owner's trail shows who came


def _credential_headers(key: str, token: str) -> dict[str, str]:
    """Every way a client may carry a Corral key or a sandbox token to a port (issue 29 item 4)."""
    basic = base64.b64encode(f"git:{key}".encode()).decode()
    return {"X-API-KEY": key, "X-Access-Token": token, "E2B-Traffic-Access-Token": token,
            "X-Supabase-Token": key, "X-Custom-Auth": f"token={key}", "X-Encoded": urllib.parse.quote(f"k {key}"),
            "X-Basic": f"Basic {basic}", "Cookie": f"theme=dark; session={key}; other=1"}


def _assert_no_credential(seen: dict[str, list[str]], key: str, token: str) -> None:
    dump = json.dumps(seen)
    assert key not in dump and token not in dump and key.split("_")[2][:20] not in dump
    assert not {"x-api-key", "x-access-token", "e2b-traffic-access-token", "x-supabase-token", "x-custom-auth",
                "x-encoded", "x-basic"} & set(seen)
    assert seen["cookie"] == ["theme=dark; other=1"]  # the app's own cookies stay


@live
async def test_no_corral_key_or_sandbox_token_reaches_the_app_in_any_header_or_cookie(
        api: Api, live_url: str, web: AsyncSandbox) -> None:
    host = await web.get_host(STREAM_PORT)
    key = api.keys["a_dev"]
    token = _service(api).access.token(web.id, TokenPurpose.SANDBOX)
    async with _port_client(live_url, host, key, **_credential_headers(key, token)) as c:
        seen = (await c.get("/headers")).json()
    _assert_no_credential(seen, key, token)
    assert "authorization" not in seen and seen["x-forwarded-host"] == [host]


@live
async def test_a_public_sandbox_gets_no_corral_credential_either(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, public_ports=True, api_key=api.keys["a_dev"],
                                         base_url=live_url) as sb:
        await sb.files.write("/workspace/stream.py", STREAM_SERVER)
        await _start(sb, f"python3 /workspace/stream.py {STREAM_PORT}", STREAM_PORT)
        host = await sb.get_host(STREAM_PORT)
        key = api.keys["b_dev"]
        token = _service(api).access.token(sb.id, TokenPurpose.PORTS)
        async with _port_client(live_url, host, **_credential_headers(key, token)) as c:
            alone = [(await c.get("/headers", headers={name: value})).json()
                     for name, value in (("X-API-KEY", key), ("X-Access-Token", token))]
            everything = (await c.get("/headers")).json()
            basic = base64.b64encode(f"x:{key}".encode()).decode()
            in_basic = (await c.get("/headers", headers={"Authorization": f"Basic {basic}"})).json()
        # E2B's SDKs name the port by header and send the traffic token: on a public sandbox it still stays out.
        async with httpx.AsyncClient(base_url=live_url, trust_env=False, timeout=60) as c:
            e2b = (await c.get("/headers", headers={"E2b-Sandbox-Id": sb.id, "E2b-Sandbox-Port": str(STREAM_PORT),
                                                     "E2B-Traffic-Access-Token": token})).json()
    for seen in (*alone, everything, in_basic, e2b):
        assert key not in json.dumps(seen) and token not in json.dumps(seen)
        assert "x-api-key" not in seen and "x-access-token" not in seen and "authorization" not in seen
    _assert_no_credential(everything, key, token)


def test_strip_credentials_keeps_the_apps_own_headers() -> None:
    key = "corral_abcdefgh_" + "A" * 43
    headers = [(b"x-app", b"mine"), (b"authorization", b"Bearer app-token"), (b"x-api-key", b"app-key"),
               (b"cookie", b"a=1"), (b"x-leak", key.encode()), (b"x-tok", b"pre-tok123-post")]
    assert strip_credentials(headers, ["tok123"], keep_authorization=True) == [
        (b"x-app", b"mine"), (b"authorization", b"Bearer app-token"), (b"cookie", b"a=1")]
    assert (b"authorization", b"Bearer app-token") not in strip_credentials(headers, [], keep_authorization=False)


def _service(api: Api) -> Any:
    return api.app.state.corral


@live
async def test_a_port_nothing_listens_on_is_a_502_naming_the_port(api: Api, live_url: str,
                                                                 web: AsyncSandbox) -> None:
    host = await web.get_host(9)
    async with _port_client(live_url, host, api.keys["a_dev"]) as c:
        r = await c.post("/upload", content=b"x" * 100_000)
    error = r.json()["error"]
    assert r.status_code == 502 and error["code"] == "agent_error"
    assert "nothing is listening on port 9 in the sandbox" in error["message"]
    assert error["details"]["port"] == 9 and error["details"]["sandbox_id"] == web.id
    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://{host}/", host="127.0.0.1", port=httpx.URL(live_url).port, proxy=None,
                           additional_headers=_auth(api.keys["a_dev"])):
            pass
    assert refused.value.response.status_code == 502 and b"port 9" in (refused.value.response.body or b"")
    [record, ws_record] = await api.store.audit.query(action=PORT_ACTION, sandbox=web.id)
    assert record.outcome == {"status": 502, "error": "agent_error"} and ws_record.params["kind"] == "websocket"


@live
async def test_a_streamed_response_arrives_in_pieces_before_it_ends(api: Api, live_url: str,
                                                                   web: AsyncSandbox) -> None:
    host = await web.get_host(STREAM_PORT)
    arrivals: list[tuple[float, bytes]] = []
    async with _port_client(live_url, host, api.keys["a_dev"]) as c, c.stream("GET", "/ticks") as r:
        assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
        async for chunk in r.aiter_raw():
            arrivals.append((time.monotonic(), chunk))
    body = b"".join(chunk for _, chunk in arrivals)
    assert body == b"".join(b"tick %d\n" % i for i in range(5))
    # The server sleeps 0.4 s after each tick: relayed as they come, the first arrives ~1.6 s before the last.
    first = next(t for t, chunk in arrivals if b"tick 0" in chunk)
    last = next(t for t, chunk in arrivals if b"tick 4" in chunk)
    assert last - first > 1.2, arrivals


@live
async def test_a_client_that_leaves_ends_the_response_inside_the_sandbox(api: Api, live_url: str,
                                                                        web: AsyncSandbox) -> None:
    host = await web.get_host(STREAM_PORT)
    async with _port_client(live_url, host, api.keys["a_dev"]) as c, c.stream("GET", "/forever") as r:
        got = 0
        async for chunk in r.aiter_raw():
            got += len(chunk)
            if got > 10_000:
                break
    for _ in range(100):  # the server in the sandbox sees its connection end (and records it)
        if await web.files.exists("/tmp/forever-ended"):
            break
        await asyncio.sleep(0.1)
    assert await web.files.exists("/tmp/forever-ended")
    for _ in range(50):
        [record] = await api.store.audit.query(action=PORT_ACTION, sandbox=web.id)
        if record.outcome.get("disconnected"):
            break
        await asyncio.sleep(0.1)
    assert record.outcome["disconnected"] is True and record.outcome["status"] == 200


@live
async def test_fifty_megabytes_up_and_down_byte_exact(api: Api, live_url: str, web: AsyncSandbox) -> None:
    data = os.urandom(50 * MIB)
    digest = hashlib.sha256(data).hexdigest()
    host = await web.get_host(STREAM_PORT)

    async def pieces() -> AsyncIterator[bytes]:  # no length given: the request goes chunked
        for i in range(0, len(data), 3 * MIB + 17):
            yield data[i : i + 3 * MIB + 17]

    async with _port_client(live_url, host, api.keys["a_dev"]) as c:
        sized = (await c.post("/upload", content=data)).json()
        chunked = (await c.post("/upload", content=pieces())).json()
    assert sized == {"size": len(data), "sha256": digest, "chunked": False}
    assert chunked == {"size": len(data), "sha256": digest, "chunked": True}
    await web.files.write("/workspace/big.bin", data)
    async with _port_client(live_url, await web.get_host(HTTP_PORT), api.keys["a_dev"]) as c:
        down = await c.get("/big.bin")
    assert down.status_code == 200 and int(down.headers["content-length"]) == len(data)
    assert hashlib.sha256(down.content).hexdigest() == digest


@live
async def test_a_websocket_echo_with_subprotocol_and_close_codes_both_ways(api: Api, live_url: str,
                                                                          web: AsyncSandbox) -> None:
    host = await web.get_host(WS_PORT)
    server_port = httpx.URL(live_url).port
    options: dict[str, Any] = {"host": "127.0.0.1", "port": server_port, "proxy": None, "max_size": 4 * MIB}
    big = os.urandom(MIB) + b"\x00\xff"
    async with connect(f"ws://{host}/echo?x=1", subprotocols=["corral-test", "other"],  # type: ignore[list-item]
                       additional_headers=_auth(api.keys["a_dev"]), **options) as ws:
        assert ws.subprotocol == "corral-test"
        await ws.send("héllo")
        assert await ws.recv() == "héllo"
        await ws.send(big)
        assert await ws.recv() == big
        await ws.send(b"")
        assert await ws.recv() == b""
        await ws.send("close:4321:bye")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4321 and ws.close_reason == "bye"  # the sandbox's close, as it sent it
    async with connect(f"ws://{host}/", additional_headers=_auth(api.keys["a_dev"]), **options) as ws:
        await ws.send(b"ping")
        assert await ws.recv() == b"ping"
        await ws.close(4000, "client done")
    for _ in range(50):
        if await web.files.exists("/tmp/ws-close"):
            break
        await asyncio.sleep(0.1)
    assert await web.files.read("/tmp/ws-close") == b"4000 client done"  # the client's close, as it sent it
    handshake = json.loads(await web.files.read("/tmp/ws-headers"))
    assert handshake["host"] == host and "authorization" not in handshake
    with pytest.raises(InvalidStatus) as not_websocket:  # what listens refuses the upgrade: its answer comes back
        async with connect(f"ws://{await web.get_host(STREAM_PORT)}/nothing-here",
                           additional_headers=_auth(api.keys["a_dev"]), **options):
            pass
    assert not_websocket.value.response.status_code == 404
    assert not_websocket.value.response.body == b'{"missing": true}'
    assert not_websocket.value.response.headers["content-type"] == "application/json"
    with pytest.raises(InvalidStatus) as refused:
        async with connect(f"ws://{host}/", **options):
            pass
    assert refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as foreign:
        async with connect(f"ws://{host}/", additional_headers=_auth(api.keys["b_dev"]), **options):
            pass
    assert foreign.value.response.status_code == 404
    for _ in range(50):
        records = await api.store.audit.query(action=PORT_ACTION, sandbox=web.id)
        if len(records) == 4 and all("messages_sent" in r.outcome for r in records[:2]):
            break
        await asyncio.sleep(0.1)
    first, second, upgrade_refused, foreign_record = records  # one record per WebSocket, not per message
    assert first.outcome == {"status": 101, "messages_sent": 4, "messages_received": 3, "close_code": 4321}
    assert second.outcome == {"status": 101, "messages_sent": 1, "messages_received": 1, "client_close_code": 4000}
    assert upgrade_refused.outcome == {"status": 404} and upgrade_refused.params["port"] == STREAM_PORT
    assert foreign_record.outcome["status"] == 404 and foreign_record.key_id == api.key_ids["b_dev"]


@live
async def test_a_paused_sandbox_is_a_409_and_answers_again_once_resumed(api: Api, live_url: str,
                                                                       web: AsyncSandbox) -> None:
    host = await web.get_host(HTTP_PORT)
    await web.pause()
    async with _port_client(live_url, host, api.keys["a_dev"]) as c:
        paused = await c.get("/hello.txt")
        await web.resume()
        resumed = await c.get("/hello.txt")
    assert paused.status_code == 409 and paused.json()["error"]["code"] == "conflict"
    assert resumed.status_code == 200 and resumed.content == b"hello from the sandbox\n"


# -- live: `corral serve --domain` and the CLI ----------------------------------------------------------------------


@pytest.mark.runc
@pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs")
def test_corral_serve_domain_and_the_cli_host_command() -> None:
    TEST_HOME.mkdir(parents=True, exist_ok=True)
    home = TEST_HOME / f"ports-{uuid.uuid4().hex[:8]}"  # not pytest's tmp_path: 0700, sandboxes cannot reach it
    try:
        with ServerProcess(home, template_home=TEMPLATE_HOME, args=["--domain", "Preview.Test"]) as server:
            key = server.admin_key
            with Sandbox.create(TEMPLATE, api_key=key, base_url=server.url) as sb:
                sb.commands.run(f"nohup python3 -m http.server {HTTP_PORT} --bind 127.0.0.1 >/dev/null 2>&1 &")
                host = sb.get_host(HTTP_PORT)
                assert host == f"{HTTP_PORT}-{sb.id}.preview.test:{server.port}"
                env = {"CORRAL_URL": server.url, "CORRAL_API_KEY": key}
                printed = CliRunner().invoke(cli, ["sandbox", "host", sb.id, str(HTTP_PORT)], env=env)
                assert printed.exit_code == 0 and printed.stdout.strip() == host, printed.output
                r = _get_once_listening(server.url, host, _auth(key))
                assert r.status_code == 200 and b"Directory listing" in r.content
                bad = CliRunner().invoke(cli, ["sandbox", "host", sb.id, "0"], env=env)
                assert bad.exit_code == 2
            created = CliRunner().invoke(cli, ["sandbox", "create", "--template", TEMPLATE, "--public-ports"], env=env)
            assert created.exit_code == 0, created.output
            with Sandbox.connect(created.stdout.strip(), api_key=key, base_url=server.url) as public:
                public.commands.run(f"nohup python3 -m http.server {HTTP_PORT} --bind 127.0.0.1 >/dev/null 2>&1 &")
                r = _get_once_listening(server.url, public.get_host(HTTP_PORT), {})
                assert r.status_code == 200 and b"Directory listing" in r.content  # no key: public ports
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _get_once_listening(url: str, host: str, headers: dict[str, str]) -> httpx.Response:
    """GET / through the port host, again while nothing listens yet (a server started in the background)."""
    for _ in range(100):
        r = httpx.get(f"{url}/", headers={"Host": host, **headers}, trust_env=False, timeout=30)
        if r.status_code != 502:
            return r
        time.sleep(0.05)
    return r


# -- live: the engine's tunnel itself ------------------------------------------------------------------------------

# Reads until the client's half-close, then answers with what it got and closes: on ::1 only (the fallback).
HALF_CLOSE_SERVER = r'''
import hashlib, socket, sys
listener = socket.socket(socket.AF_INET6)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("::1", int(sys.argv[1])))
listener.listen(4)
while True:
    conn, _ = listener.accept()
    digest, size = hashlib.sha256(), 0
    while data := conn.recv(1 << 16):
        digest.update(data)
        size += len(data)
    conn.sendall(f"{size} {digest.hexdigest()}".encode())
    conn.close()
'''


@live
async def test_the_engine_tunnel_passes_half_closes_and_falls_back_to_ipv6(engine: Engine, sandbox: Any) -> None:
    await sandbox.files.write("/workspace/half.py", HALF_CLOSE_SERVER)
    await sandbox.exec("nohup python3 /workspace/half.py 9100 >/tmp/half.log 2>&1 &")
    await sandbox.exec("for i in $(seq 200); do (echo > /dev/tcp/::1/9100) 2>/dev/null && exit; sleep 0.05; done")
    data = os.urandom(5 * MIB + 3)
    for _ in range(2):  # one connection after another: each is its own pipe
        reader, writer = await asyncio.open_connection(sock=await engine.get(sandbox.id).open_port(9100))
        writer.write(data)
        writer.write_eof()  # the server answers only once it sees the end of the request
        answer = await asyncio.wait_for(reader.read(), 30)  # ... and its close ends the answer
        writer.close()
        assert answer == f"{len(data)} {hashlib.sha256(data).hexdigest()}".encode()


@live
async def test_the_engine_refuses_closed_and_impossible_ports(engine: Engine, sandbox: Any) -> None:
    with pytest.raises(AgentError, match="nothing is listening on port 9101 in the sandbox") as closed:
        await engine.get(sandbox.id).open_port(9101)
    assert closed.value.details["port"] == 9101
    for bad in (0, 65536, -1, "80", True, 80.0):
        with pytest.raises(InvalidRequestError, match="port must be an integer from 1 to 65535"):
            await engine.get(sandbox.id).open_port(bad)  # type: ignore[arg-type]
    assert (await sandbox.exec("echo still fine")).stdout == "still fine\n"  # the agent serves on
