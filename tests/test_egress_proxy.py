"""EgressProxy over real sockets: a client on the sandbox's Unix socket (as the agent's bridge connects), upstream
servers on loopback (reachable only through `private`), curl through a TCP bridge. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import re
import shutil
import tempfile
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from corral import NotFoundError
from corral.egress import EgressEvent, EgressPolicy, EgressProxy, MirrorResponse, _mover
from corral.egress._addresses import host_addresses
from corral.egress._secrets import SecretBinding, new_placeholder

pytestmark = pytest.mark.anyio

MIB = 1024 * 1024
BLOB = random.Random(7).randbytes(50 * MIB)  # every byte value, NULs included
WAIT = 20.0  # the bound on any single wait in these tests
CHUNKS = [1, 5, 4096, 3 * MIB + 7, 100, 65536, 8 * MIB, 2]
SECRET = SecretBinding("TOKEN", new_placeholder(), "s3cr3t/v@lue-" + "x" * 27, ("127.0.0.1",))
SHORT_SECRET = SecretBinding("PIN", new_placeholder(), "4711", ("other.example",))  # scrubbed from every answer


SECRET_VALUES = {SECRET.value.encode(): SECRET.placeholder.encode(),
                 urllib.parse.quote(SECRET.value, safe="").encode(): SECRET.placeholder.encode(),
                 SHORT_SECRET.value.encode(): SHORT_SECRET.placeholder.encode()}
SECRET_OFFSETS = sorted({2 ** k + d for k in range(10, 25) for d in (-20, -1, 0, 3)})


def _secret_body() -> bytes:
    """20 MiB of BLOB with the values (the long one also percent-encoded) at and around power-of-two offsets,
    where reads and chunks of any size split them."""
    values = list(SECRET_VALUES)
    body, at = bytearray(), 0
    for i, offset in enumerate(SECRET_OFFSETS):
        body += BLOB[at:offset] + values[i % 3]
        at = offset
    return bytes(body + BLOB[at: 20 * MIB])


SECRET_BODY = _secret_body()


# -- upstream servers --------------------------------------------------------------------------------------------


@dataclass
class Upstream:
    """A tiny HTTP/1.1 origin on loopback: /bytes/N, /chunked, POST /echo, /slow; records request heads."""

    port: int = 0
    heads: list[bytes] = field(default_factory=list)
    server: asyncio.AbstractServer | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                self.heads.append(head)
                if not await self.answer(head, reader, writer):
                    return
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def answer(self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        method, path = head.split(b" ")[:2]
        path = path.split(b"?")[0]
        close = b"connection: close" in head.lower()
        if path.startswith(b"/bytes/"):
            body = BLOB[: int(path[7:])]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Hop: a\r\nConnection: keep-alive, x-hop\r\n\r\n"
                         % len(body))
            writer.write(body if method != b"HEAD" else b"")
        elif path == b"/chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\na\x00b\xffc\r\n3;ext=1\r\nxyz\r\n"
                         b"0\r\nX-Trailer: t\r\n\r\n")
        elif path == b"/bigchunked":  # small and big chunks (some bigger than any read), a trailer
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            at = 0
            for size in CHUNKS:
                writer.write(b"%x\r\n%b\r\n" % (size, BLOB[at:at + size]))
                at += size
                await writer.drain()
            writer.write(b"0\r\nX-Sum: 1\r\n\r\n")
        elif path == b"/close":  # no length: the body ends when the connection does
            writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + BLOB[: 10 * MIB])
            await writer.drain()
            writer.close()
            return False
        elif path == b"/echo":
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        elif path == b"/paused":  # bulk, a pause longer than a bulk copy's quiet time, bulk again
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (16 * MIB))
            writer.write(BLOB[: 8 * MIB])
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.write(BLOB[8 * MIB: 16 * MIB])
        elif path == b"/secrets":  # values across the proxy's read boundaries (docs/secrets.md)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SECRET_BODY))
            for at in range(0, len(SECRET_BODY), 100_003):  # odd pieces: the reads fall anywhere
                writer.write(SECRET_BODY[at:at + 100_003])
                await writer.drain()
        elif path == b"/slow":
            await asyncio.sleep(30)
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return not close


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    up.server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    up.port = up.server.sockets[0].getsockname()[1]
    yield up
    up.server.close()


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    """A raw TCP echo server (for tunnels): bytes in, the same bytes out, half-close passed on."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(256 * 1024):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


# -- the proxy and a client on its socket ------------------------------------------------------------------------


@dataclass
class Rig:
    proxy: EgressProxy
    sock: Path
    events: list[EgressEvent]

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(WAIT):
            return await asyncio.open_unix_connection(str(self.sock), limit=1024 * 1024)

    async def request(self, raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
        """Send one request on a new connection; read until the proxy closes it."""
        return await exchange(await self.open(), raw)

    def policy(self, network, private=()) -> None:  # type: ignore[no-untyped-def]
        self.proxy.set_policy("sb1", EgressPolicy.parse(network, private=private))

    async def settle(self, count: int) -> None:
        """Wait until `count` events arrived (events come when an attempt ends)."""
        async with asyncio.timeout(WAIT):
            while len(self.events) < count:
                await asyncio.sleep(0.01)


async def exchange(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                   raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send `raw` on the connection, read until the proxy closes it: (status line, headers, body)."""
    reader, writer = connection
    writer.write(raw)
    async with asyncio.timeout(WAIT):
        data = await reader.read()
    writer.close()
    return split_response(data)


def split_response(data: bytes) -> tuple[bytes, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return lines[0].encode("latin-1"), headers, body


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    events: list[EgressEvent] = []

    async def collect(event: EgressEvent) -> None:  # async on purpose: the proxy must schedule it
        events.append(event)

    tmp = Path(tempfile.mkdtemp(prefix="eg-", dir="/tmp"))  # short: Unix socket paths are limited to 108 bytes
    proxy = EgressProxy(on_event=collect, mirror=FakeMirror(), idle_timeout=1.0, connect_timeout=3.0, io_timeout=5.0)
    await proxy.start()
    await proxy.attach("sb1", tmp / "proxy.sock", EgressPolicy.parse("none"))
    try:
        yield Rig(proxy, tmp / "proxy.sock", events)
    finally:
        await proxy.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def connect_tunnel(rig: Rig, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await rig.open()
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        status = await reader.readuntil(b"\r\n\r\n")
    assert status == b"HTTP/1.1 200 Connection established\r\n\r\n", status
    return reader, writer


async def echo_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> None:
    """Send `payload` through a tunnel to the echo server and check the exact bytes come back."""

    async def send() -> None:
        for i in range(0, len(payload), MIB):
            writer.write(payload[i:i + MIB])
            await writer.drain()
        writer.write_eof()

    async with asyncio.timeout(WAIT * 3):
        sender = asyncio.create_task(send())
        back = await reader.read()  # until the echo server's half-close comes through
        await sender
    assert len(back) == len(payload) and back == payload


# -- allowed traffic ---------------------------------------------------------------------------------------------


async def test_connect_to_private_loopback_server(rig: Rig, upstream: Upstream):
    target = f"127.0.0.1:{upstream.port}"
    rig.policy(["127.0.0.1"], private=[target])
    reader, writer = await connect_tunnel(rig, target)
    writer.write(f"GET /bytes/{MIB} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        data = await reader.read()
    writer.close()
    _, headers, body = split_response(data)
    assert body == BLOB[:MIB] and headers["content-length"] == str(MIB)
    await rig.settle(1)
    event = rig.events[0]
    assert (event.kind, event.method, event.host, event.port, event.allowed) == (
        "connect", "CONNECT", "127.0.0.1", upstream.port, True)
    assert event.rule == f"allow 127.0.0.1 + private {target}"
    assert event.bytes_down == len(data) and event.bytes_up > 40 and event.duration > 0
    assert rig.proxy.denials("sb1", 0) == []


async def test_host_corral_internal_is_the_tenants_host_service_on_that_port(rig: Rig, upstream: Upstream,
                                                                               echo: int):
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}", f"127.0.0.1:{echo}"])
    line, _, body = await rig.request(f"GET http://host.corral.internal:{upstream.port}/bytes/5 HTTP/1.1\r\n"
                                      "Host: x\r\nConnection: close\r\n\r\n".encode())
    assert line == b"HTTP/1.1 200 OK" and body == BLOB[:5]
    assert f"host: host.corral.internal:{upstream.port}".encode() in upstream.heads[-1].lower()
    reader, writer = await connect_tunnel(rig, f"host.corral.internal:{echo}")  # HTTPS and any TCP: CONNECT
    await echo_exact(reader, writer, BLOB[:MIB])
    writer.close()
    await rig.settle(2)
    assert [(e.host, e.allowed, e.rule) for e in rig.events] == [
        ("host.corral.internal", True, f"policy internet + host service 127.0.0.1:{upstream.port}"),
        ("host.corral.internal", True, f"policy internet + host service 127.0.0.1:{echo}")]


@pytest.mark.parametrize(("network", "private", "words"), [
    ("internet", [], "names no host service of this tenant"),  # no pair on that port
    ("internet", ["127.0.0.1:{port}", "127.0.0.2:{port}"], "is ambiguous, the tenant allows 2 host services"),
    ("none", ["127.0.0.1:{port}"], "this sandbox has no network access (policy: none)"),  # the policy still rules
    (["pypi.org"], ["127.0.0.1:{port}"], "is not in this sandbox's allowlist"),
])
async def test_host_corral_internal_is_refused_with_the_reason(rig: Rig, upstream: Upstream, network: object,
                                                              private: list[str], words: str):
    rig.policy(network, private=[p.format(port=upstream.port) for p in private])
    line, _, _ = await rig.request(f"GET http://host.corral.internal:{upstream.port}/ HTTP/1.1\r\n"
                                   "Host: x\r\nConnection: close\r\n\r\n".encode())
    assert line.startswith(b"HTTP/1.1 403 Corral egress denied: host.corral.internal") and words in line.decode()
    assert upstream.heads == []


async def test_host_corral_internal_can_be_allowed_by_name(rig: Rig, upstream: Upstream):
    rig.policy(["host.corral.internal"], private=[f"127.0.0.1:{upstream.port}"])
    line, _, _ = await rig.request(f"GET http://host.corral.internal:{upstream.port}/bytes/1 HTTP/1.1\r\n"
                                   "Host: x\r\nConnection: close\r\n\r\n".encode())
    assert line == b"HTTP/1.1 200 OK"


async def test_connect_50mib_both_ways_exact(rig: Rig, echo: int):
    rig.policy("internet", private=[f"127.0.0.1:{echo}"])
    reader, writer = await connect_tunnel(rig, f"127.0.0.1:{echo}")
    await echo_exact(reader, writer, BLOB)
    writer.close()
    await rig.settle(1)
    assert rig.events[0].bytes_up == len(BLOB) and rig.events[0].bytes_down == len(BLOB)


async def test_bytes_sent_before_the_200_reach_the_server(rig: Rig, echo: int):
    rig.policy("internet", private=[f"127.0.0.1:{echo}"])
    reader, writer = await rig.open()
    writer.write(f"CONNECT 127.0.0.1:{echo} HTTP/1.1\r\n\r\n".encode() + b"early\x00bytes")  # e.g. a TLS hello
    writer.write_eof()
    async with asyncio.timeout(WAIT):
        assert await reader.read() == b"HTTP/1.1 200 Connection established\r\n\r\nearly\x00bytes"
    writer.close()


async def test_absolute_form_50mib_exact_and_rewritten(rig: Rig, upstream: Upstream):
    rig.policy([f"127.0.0.1:{upstream.port}"], private=[f"127.0.0.1:{upstream.port}"])
    status, headers, body = await rig.request(
        f"GET http://127.0.0.1:{upstream.port}/bytes/{len(BLOB)}?q=1#frag HTTP/1.1\r\nHost: wrong\r\n"
        "Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\n"
        "Connection: close, X-Drop\r\nX-Drop: 1\r\nX-Keep: 2\r\n\r\n".encode())
    assert status == b"HTTP/1.1 200 OK"
    assert len(body) == len(BLOB) and body == BLOB
    assert "x-hop" not in headers and headers["connection"] == "close"
    sent = upstream.heads[0].decode()
    assert sent.startswith(f"GET /bytes/{len(BLOB)}?q=1 HTTP/1.1\r\nHost: 127.0.0.1:{upstream.port}\r\n")
    for dropped in ("Proxy-", "TE:", "X-Drop", "Host: wrong"):
        assert dropped not in sent
    assert "X-Keep: 2" in sent
    await rig.settle(1)
    assert rig.events[0].kind == "http" and rig.events[0].allowed and rig.events[0].bytes_down > len(BLOB)


async def test_absolute_form_keep_alive_chunked_and_body(rig: Rig, upstream: Upstream):
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}"])
    base = f"http://127.0.0.1:{upstream.port}"
    reader, writer = await rig.open()
    payload = b"\x00\xff" * 5000
    writer.write(f"GET {base}/chunked HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"Transfer-Encoding: chunked" in head and b"Connection: close" not in head
        body = await reader.readuntil(b"0\r\nX-Trailer: t\r\n\r\n")
    assert body == b"5\r\na\x00b\xffc\r\n3;ext=1\r\nxyz\r\n0\r\nX-Trailer: t\r\n\r\n"
    writer.write(f"POST {base}/echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        assert await reader.readexactly(len(payload)) == payload
    writer.write(f"HEAD {base}/bytes/100 HTTP/1.0\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        rest = await reader.read()
    assert rest.startswith(b"HTTP/1.1 200 OK") and rest.endswith(b"Connection: close\r\n\r\n")
    writer.close()
    await rig.settle(3)
    assert [e.method for e in rig.events] == ["GET", "POST", "HEAD"]


async def test_absolute_form_big_chunked_and_close_delimited_bodies_exact(rig: Rig, upstream: Upstream):
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}"])
    status, headers, body = await rig.request(
        f"GET http://127.0.0.1:{upstream.port}/bigchunked HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    expected = b"".join(b"%x\r\n%b\r\n" % (size, BLOB[at:at + size])
                        for size, at in zip(CHUNKS, [sum(CHUNKS[:i]) for i in range(len(CHUNKS))], strict=True))
    assert status == b"HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked"
    assert body == expected + b"0\r\nX-Sum: 1\r\n\r\n"  # the framing as sent, not re-chunked
    status, headers, body = await rig.request(f"GET http://127.0.0.1:{upstream.port}/close HTTP/1.1\r\n\r\n".encode())
    assert status == b"HTTP/1.1 200 OK" and headers["connection"] == "close"
    assert len(body) == 10 * MIB and body == BLOB[: 10 * MIB]
    await rig.settle(2)
    assert all(e.allowed for e in rig.events)
    assert rig.events[0].bytes_down > len(expected) and rig.events[1].bytes_down > 10 * MIB


async def test_request_body_then_a_pipelined_request(rig: Rig, upstream: Upstream):
    """A big request body goes up exactly; what the client sent after it is the next request, not body."""
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}"])
    base = f"http://127.0.0.1:{upstream.port}"
    payload = BLOB[: 5 * MIB + 3]
    reader, writer = await rig.open()
    writer.write(f"POST {base}/echo HTTP/1.1\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload
                 + f"GET {base}/bytes/10 HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and f"Content-Length: {len(payload)}".encode() in head
        assert await reader.readexactly(len(payload)) == payload
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and await reader.read() == BLOB[:10]
    writer.close()
    await rig.settle(2)
    assert [e.method for e in rig.events] == ["POST", "GET"] and rig.events[0].bytes_up > len(payload)


@pytest.mark.parametrize("size_line", [b"0x5", b"+5", b"5_0", b"zz"])
async def test_malformed_chunk_sizes_end_the_response(rig: Rig, size_line: bytes):
    """A chunk size int(x, 16) would take is not one HTTP allows: the relay stops there (no smuggling)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size_line + b"\r\nhello\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        rig.policy("internet", private=[f"127.0.0.1:{port}"])
        status, _, body = await rig.request(f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n".encode())
        assert status.startswith(b"HTTP/1.1 502 ") and b"malformed chunk size" in status, status
        assert b"hello" not in body
        await rig.settle(1)
        assert "chunk" in rig.events[0].reason and not rig.events[0].allowed
    finally:
        server.close()


async def test_set_policy_applies_to_new_connections_only(rig: Rig, echo: int):
    rig.policy(["127.0.0.1"], private=[f"127.0.0.1:{echo}"])
    reader, writer = await connect_tunnel(rig, f"127.0.0.1:{echo}")
    rig.policy("none")
    status, headers, _ = await rig.request(f"CONNECT 127.0.0.1:{echo} HTTP/1.1\r\n\r\n".encode())
    assert status.startswith(b"HTTP/1.1 403 ") and "rule=policy none" in headers["x-corral-egress"]
    await echo_exact(reader, writer, b"still open\x00" * 1000)  # the tunnel opened before the change lives on
    writer.close()


def bulk_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "corral-egress-bulk"]


async def no_bulk_threads() -> None:
    """Every bulk copy's thread has ended (they end within one poll of being stopped)."""
    async with asyncio.timeout(WAIT):
        while bulk_threads():
            await asyncio.sleep(0.01)


async def test_bulk_copies_resume_after_a_pause_exact(rig: Rig, upstream: Upstream, echo: int):
    """A bulk copy goes back to the event loop when its source goes quiet, and on when bytes come again."""
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}", f"127.0.0.1:{echo}"])
    status, _, body = await rig.request(f"GET http://127.0.0.1:{upstream.port}/paused HTTP/1.1\r\n"
                                        "Connection: close\r\n\r\n".encode())
    assert status == b"HTTP/1.1 200 OK" and len(body) == 16 * MIB and body == BLOB[:16 * MIB]
    reader, writer = await connect_tunnel(rig, f"127.0.0.1:{echo}")
    for part in (BLOB[:8 * MIB], BLOB[8 * MIB:8 * MIB + 5], BLOB[9 * MIB:17 * MIB]):
        writer.write(part)
        async with asyncio.timeout(WAIT):
            assert await reader.readexactly(len(part)) == part
        await asyncio.sleep(0.2)  # quiet: the copy is back on the loop
    writer.close()
    await rig.settle(2)
    assert [e.bytes_down for e in rig.events][1] == 16 * MIB + 5
    await no_bulk_threads()


async def test_bulk_threads_are_capped_and_the_rest_copy_on_the_loop(rig: Rig, upstream: Upstream,
                                                                      monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(_mover, "_BULK_THREADS", threading.BoundedSemaphore(1))
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}"])
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(bulk_threads()))
            await asyncio.sleep(0.001)

    async def one() -> None:
        _, _, body = await rig.request(f"GET http://127.0.0.1:{upstream.port}/bytes/{len(BLOB)} HTTP/1.1\r\n"
                                       "Connection: close\r\n\r\n".encode())
        assert len(body) == len(BLOB) and body == BLOB

    watcher = asyncio.create_task(watch())
    async with asyncio.timeout(60):
        await asyncio.gather(*(one() for _ in range(3)))
    watcher.cancel()
    assert most == 1  # one copy had the thread at a time; the others went on on the loop, as exact
    await no_bulk_threads()


@pytest.mark.parametrize("end", ["detach", "stall"])
async def test_a_bulk_copy_to_a_client_that_stops_reading_ends(rig: Rig, upstream: Upstream, end: str):
    """The client reads nothing while 50 MiB come: the bulk copy's thread waits for it to be writable until a
    detach or the stall timeout ends the connection; the thread ends with it."""
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}"])
    rig.proxy.io_timeout = 1.0
    reader, writer = await rig.open()
    writer.write(f"GET http://127.0.0.1:{upstream.port}/bytes/{len(BLOB)} HTTP/1.1\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        while not bulk_threads():  # the copy went to its thread (a full pipe), then filled the client's buffers
            await asyncio.sleep(0.01)
    if end == "detach":
        await rig.proxy.detach("sb1")
    async with asyncio.timeout(WAIT):
        await no_bulk_threads()
        got = len(await reader.read())  # what the buffers held, then the close
    assert 0 < got < len(BLOB)
    writer.close()
    await rig.settle(1)
    assert rig.events[0].allowed and 0 < rig.events[0].bytes_down < len(BLOB)
    if end == "stall":
        assert "timed out" in rig.events[0].reason


async def test_a_scrubbed_20mib_answer_is_exact_with_values_across_reads(rig: Rig, upstream: Upstream):
    """A host a secret is bound to: every value in the answer, wherever the reads split it, becomes its
    placeholder; every other byte arrives as sent (the body re-framed chunked)."""
    policy = EgressPolicy.parse("internet", private=[f"127.0.0.1:{upstream.port}"])
    rig.proxy.set_policy("sb1", dataclasses.replace(policy, secrets=(SECRET, SHORT_SECRET)))
    status, headers, body = await rig.request(f"GET http://127.0.0.1:{upstream.port}/secrets HTTP/1.1\r\n"
                                              "Host: x\r\n\r\n".encode())
    assert status == b"HTTP/1.1 200 OK" and headers["transfer-encoding"] == "chunked"
    reference = re.compile(b"|".join(re.escape(v) for v in sorted(SECRET_VALUES, key=len, reverse=True)))
    expected = reference.sub(lambda m: SECRET_VALUES[m.group()], SECRET_BODY)  # one pass over the whole body
    got = dechunk(body)
    assert len(got) == len(expected) and got == expected
    assert got.count(SECRET.placeholder.encode()) >= sum(i % 3 != 2 for i in range(len(SECRET_OFFSETS)))
    assert SECRET.value.encode() not in got and SECRET_VALUES and b"4711" not in got


async def test_a_request_body_to_a_bound_host_goes_exact_then_the_next_request(rig: Rig, upstream: Upstream):
    """No secret opts into bodies: the body is copied as sent (socket to socket), a placeholder in it stays one,
    and the request pipelined after it is served on the same connection."""
    policy = EgressPolicy.parse("internet", private=[f"127.0.0.1:{upstream.port}"])
    rig.proxy.set_policy("sb1", dataclasses.replace(policy, secrets=(SECRET,)))
    body = BLOB[:5 * MIB] + SECRET.placeholder.encode()
    url = f"http://127.0.0.1:{upstream.port}"
    reader, writer = await rig.open()
    writer.write(f"POST {url}/echo HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body +
                 f"GET {url}/bytes/10 HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        data = await reader.read()
    writer.close()
    first, _, rest = data.partition(b"\r\n0\r\n\r\n")  # the first answer is re-framed chunked (scrubbed)
    status, _, echoed = split_response(first + b"\r\n0\r\n\r\n")
    assert status == b"HTTP/1.1 200 OK" and dechunk(echoed) == body
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and rest.partition(b"\r\n\r\n")[2] == BLOB[:10]  # until close
    await rig.settle(2)
    assert rig.events[0].bytes_up > len(body) and rig.events[0].secrets == ()


def dechunk(body: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2:end + 2 + size]
        assert body[end + 2 + size:end + 4 + size] == b"\r\n"
        at = end + 4 + size


async def test_detach_closes_tunnels_and_socket(rig: Rig, echo: int):
    rig.policy("internet", private=[f"127.0.0.1:{echo}"])
    reader, writer = await connect_tunnel(rig, f"127.0.0.1:{echo}")
    idle_reader, idle_writer = await rig.open()
    await rig.proxy.detach("sb1")
    async with asyncio.timeout(5):
        assert await reader.read() == b""
        assert await idle_reader.read() == b""
    assert not rig.sock.exists()
    with pytest.raises(OSError):
        await asyncio.open_unix_connection(str(rig.sock))
    await rig.settle(1)
    assert rig.events[0].kind == "connect" and rig.events[0].allowed
    with pytest.raises(NotFoundError):
        rig.proxy.set_policy("sb1", EgressPolicy.parse("none"))
    assert rig.proxy.denials("sb1", 0) == []
    await rig.proxy.detach("sb1")  # twice is harmless
    writer.close()
    idle_writer.close()


async def test_50_concurrent_tunnels_exact_bytes(rig: Rig, echo: int):
    rig.policy("internet", private=[f"127.0.0.1:{echo}"])

    async def one(i: int) -> None:
        reader, writer = await connect_tunnel(rig, f"127.0.0.1:{echo}")
        await echo_exact(reader, writer, BLOB[i * 300_000:(i + 1) * 300_000])
        writer.close()

    async with asyncio.timeout(60):
        await asyncio.gather(*(one(i) for i in range(50)))
    await rig.settle(50)
    assert all(e.allowed and e.bytes_up == 300_000 for e in rig.events)


# -- refusals ----------------------------------------------------------------------------------------------------


def own_address() -> str:
    found = sorted(str(ip) for ip in host_addresses() if not ip.is_loopback and ip.version == 4)
    if not found:
        pytest.skip("this host has no non-loopback IPv4 address")
    return found[0]


DENIALS = [
    ("internet", "169.254.169.254:80", "forbidden address 169.254.169.254 (link-local, cloud metadata)",
     "169.254.169.254 (link-local, cloud metadata), an address no sandbox may reach"),
    ("internet", "10.0.0.1:443", "forbidden address 10.0.0.1 (private, RFC 1918)", 'private=["10.0.0.1:443"]'),
    ("internet", "127.0.0.1:{port}", "forbidden address 127.0.0.1 (loopback)", "(policy: internet)"),
    ("internet", "localhost:{port}", "forbidden address ", "localhost resolves to "),
    ("internet", "{own}:443", "(this host's own address)", "this host's own address"),
    ("internet", "[::1]:443", "forbidden address ::1 (loopback)", 'private=["[::1]:443"]'),
    ("internet", "[::ffff:127.0.0.1]:443", "embeds 127.0.0.1", "loopback"),
    (["example.org"], "pypi.org:443", "not in allowlist",
     "pypi.org is not in this sandbox's allowlist (policy: example.org); allow it with network=[..., \"pypi.org\"]"),
    (["pypi.org:443"], "pypi.org:80", "not in allowlist", 'network=[..., "pypi.org:80"]'),
    ("none", "pypi.org:443", "policy none", 'no network access (policy: none); allow it with network=["pypi.org"]'),
]


@pytest.mark.parametrize(("network", "target", "rule", "words"), DENIALS)
@pytest.mark.parametrize("form", ["connect", "absolute"])
async def test_denials(rig: Rig, upstream: Upstream, network, target, rule, words, form):
    target = target.format(port=upstream.port, own="{own}" in target and own_address())
    rig.policy(network)
    since = time.time()
    if form == "connect":
        request = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n"
    else:
        request = f"GET http://{target}/bytes/10 HTTP/1.1\r\nHost: {target}\r\n\r\n"
    status, headers, body = await rig.request(request.encode())
    reason = status.decode().removeprefix("HTTP/1.1 403 ")
    assert status.startswith(b"HTTP/1.1 403 Corral egress denied: ") and words in reason, status
    assert status.isascii() and len(status) < 500
    host = target.rpartition(":")[0].strip("[]").replace("::ffff:127.0.0.1", "::ffff:7f00:1")
    assert headers["x-corral-egress"].startswith(f"denied; host={host}; port={target.rpartition(':')[2]}; rule=")
    assert rule in headers["x-corral-egress"]
    assert headers["content-type"].startswith("text/plain") and headers["connection"] == "close"
    assert body.split(b"\n")[0].decode() == reason
    await rig.settle(1)
    (event,) = rig.events
    assert not event.allowed and rule in event.rule and event.reason == reason
    assert event.kind == ("connect" if form == "connect" else "http")
    assert rig.proxy.denials("sb1", since) == [event]
    assert rig.proxy.denials("sb1", time.time() + 1) == []
    assert upstream.heads == []


async def test_curl_prints_the_refusal(rig: Rig, upstream: Upstream):
    """What an agent runs: curl through the proxy (over TCP, as the agent's bridge offers it)."""
    bridge = await asyncio.start_server(lambda r, w: _bridge(rig, r, w), "127.0.0.1", 0)
    port = bridge.sockets[0].getsockname()[1]
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp"}
    curl = ["curl", "-sS", "--noproxy", "", "--max-time", "10", "-x", f"http://127.0.0.1:{port}"]
    try:
        rc, out, err = await _run([*curl, "https://blocked.example/"], env)
        assert rc != 0 and b"403" in err, err  # curl prints only the status for a refused CONNECT
        rc, out, err = await _run([*curl, "http://blocked.example/"], env)
        assert rc == 0 and out.startswith(b"Corral egress denied: blocked.example is not reachable"), out
        rig.policy("internet", private=[f"127.0.0.1:{upstream.port}"])
        rc, out, err = await _run([*curl, f"http://127.0.0.1:{upstream.port}/bytes/100000"], env)
        assert rc == 0 and out == BLOB[:100000], err
    finally:
        bridge.close()
    assert [e.allowed for e in rig.proxy.denials("sb1", 0)] == [False, False]


async def _bridge(rig: Rig, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    up_reader, up_writer = await rig.open()

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.write_eof()

    await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
    writer.close()
    up_writer.close()


async def _run(argv: list[str], env: dict[str, str]) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(WAIT):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out, err


@pytest.mark.parametrize(("target", "status", "words"), [
    ("nonexistent.invalid:443", 502, "cannot resolve nonexistent.invalid"),
    ("127.0.0.1:{closed}", 502, "cannot connect to 127.0.0.1:{closed}"),
])
async def test_upstream_failures_are_502(rig: Rig, target, status, words):
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # bound, never listening: connection refused
        target, words = target.format(closed=closed), words.format(closed=closed)
        rig.policy("internet", private=[f"127.0.0.1:{closed}"])
        begun = time.monotonic()
        line, headers, _ = await rig.request(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
    assert line.startswith(f"HTTP/1.1 {status} ".encode()) and words in line.decode(), line
    assert headers["x-corral-egress"].startswith("error; ") and time.monotonic() - begun < 5
    await rig.settle(1)
    assert not rig.events[0].allowed and rig.proxy.denials("sb1", 0) == rig.events


async def test_upstream_silence_is_504_not_a_hang(rig: Rig, upstream: Upstream):
    rig.policy("internet", private=[f"127.0.0.1:{upstream.port}"])
    rig.proxy.io_timeout = 0.5
    line, _, _ = await rig.request(f"GET http://127.0.0.1:{upstream.port}/slow HTTP/1.1\r\n\r\n".encode())
    assert line.startswith(b"HTTP/1.1 504 ") and b"timed out" in line


async def test_oversized_head_is_431(rig: Rig):
    reader, writer = await rig.open()
    writer.write(b"GET http://a.example/ HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    async with asyncio.timeout(WAIT):
        data = await reader.read()
    assert data.startswith(b"HTTP/1.1 431 Corral egress proxy: request head larger than 65536 bytes\r\n")
    writer.close()


@pytest.mark.parametrize("sent", [b"", b"GET http://a.example/ HTTP/1.1\r\nHost: a"])
async def test_idle_and_slow_clients_are_dropped(rig: Rig, sent: bytes):
    reader, writer = await rig.open()
    writer.write(sent)
    begun = time.monotonic()
    async with asyncio.timeout(5):
        assert await reader.read() == b""
    assert 0.8 < time.monotonic() - begun < 4  # idle_timeout is 1 s
    writer.close()


@pytest.mark.parametrize(("request_bytes", "words"), [
    (b"GET https://pypi.org/ HTTP/1.1\r\n\r\n", b"go through CONNECT"),
    (b"CONNECT pypi.org HTTP/1.1\r\n\r\n", b"CONNECT needs host:port"),
    (b"CONNECT bad_host!:443 HTTP/1.1\r\n\r\n", b"bad request"),
    (b"GET / HTTP/1.1\r\n\r\n", b"is not a proxy request; use this address as an HTTP proxy"),
    (b"GET http://user:pw@a.org/ HTTP/1.1\r\n\r\n", b"credentials in the URL"),
    (b"BROKEN\r\n\r\n", b"malformed"),
    (b"GET http://a.org/ HTTP/1.1\r\nBad Header\r\n\r\n", b"malformed header"),
    (b"POST http://a.org/ HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", b"both"),
])
async def test_bad_requests_are_400(rig: Rig, request_bytes, words):
    rig.policy("internet")
    line, _, body = await rig.request(request_bytes)
    assert line.startswith(b"HTTP/1.1 400 ") and words in line, line
    assert body.startswith(line[13:])


# -- origin-form: DNS reports and the package mirror -----------------------------------------------------------


async def test_dns_report_becomes_a_denial(rig: Rig):
    line, _, body = await rig.request(b"GET /_corral/dns?name=evil.example.com HTTP/1.1\r\nHost: c\r\n"
                                      b"Connection: close\r\n\r\n")
    assert line == b"HTTP/1.1 204 No Content" and body == b""
    (event,) = rig.proxy.denials("sb1", 0)
    assert (event.kind, event.host, event.port, event.allowed) == ("dns", "evil.example.com", 53, False)
    assert event.reason == ("DNS lookup of evil.example.com refused: names resolve through the proxy only "
                            "(HTTP_PROXY=http://127.0.0.1:3128)")


class FakeMirror:
    def handles(self, path: str) -> bool:
        return path.startswith(("/pypi/", "/npm/"))

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]]) -> MirrorResponse:
        if path == "/pypi/boom":
            raise RuntimeError("disk on fire")

        async def body() -> AsyncIterator[bytes]:
            yield b"wheel\x00"
            yield b"bytes"

        length = [("Content-Length", "11")] if path.endswith("/sized") else []
        return MirrorResponse(200, "OK", [("Content-Type", "application/octet-stream"), *length], body())


async def test_mirror_needs_the_packages_preset(rig: Rig):
    rig.policy(["pypi.org"])
    line, headers, _ = await rig.request(b"GET /pypi/simple/numpy/ HTTP/1.1\r\nHost: 127.0.0.1:3128\r\n\r\n")
    assert line.startswith(b"HTTP/1.1 403 Corral egress denied: package mirror needs the @packages preset")
    assert "rule=mirror needs @packages" in headers["x-corral-egress"]
    assert rig.proxy.denials("sb1", 0)[0].kind == "mirror"


@pytest.mark.parametrize("target", ["/pypi/simple/numpy/", "http://127.0.0.1:3128/pypi/simple/numpy/"])
async def test_mirror_streams_with_framing(rig: Rig, target: str):
    rig.policy(["@packages"])
    reader, writer = await rig.open()
    writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:3128\r\n\r\n".encode())
    writer.write(b"GET /npm/x/sized HTTP/1.1\r\nHost: 127.0.0.1:3128\r\nConnection: close\r\n\r\n")
    async with asyncio.timeout(WAIT):
        data = await reader.read()
    writer.close()
    first, _, second = data.partition(b"0\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in first and first.endswith(b"6\r\nwheel\x00\r\n5\r\nbytes\r\n")
    assert second.endswith(b"Content-Length: 11\r\nConnection: close\r\n\r\nwheel\x00bytes")
    await rig.settle(2)
    assert [(e.kind, e.allowed, e.path) for e in rig.events] == [
        ("mirror", True, "/pypi/simple/numpy/"), ("mirror", True, "/npm/x/sized")]


async def test_mirror_failure_is_502(rig: Rig):
    rig.policy(["@packages"])
    line, _, _ = await rig.request(b"GET /pypi/boom HTTP/1.1\r\n\r\n")
    assert line == b"HTTP/1.1 502 Corral package mirror failed: RuntimeError: disk on fire"


# -- events ------------------------------------------------------------------------------------------------------


async def test_broken_event_callbacks_never_break_traffic(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    def broken(event: EgressEvent) -> None:
        raise RuntimeError("audit down")

    sock = Path(tempfile.mkdtemp(prefix="eg-", dir="/tmp")) / "p.sock"
    proxy = EgressProxy(on_event=broken)
    await proxy.attach("sb", sock, EgressPolicy.parse("none"))
    try:
        for _ in range(2):
            reader, writer = await asyncio.open_unix_connection(str(sock))
            writer.write(b"CONNECT a.org:443 HTTP/1.1\r\n\r\n")
            async with asyncio.timeout(WAIT):
                assert (await reader.read()).startswith(b"HTTP/1.1 403 ")
            writer.close()
    finally:
        await proxy.close()
        shutil.rmtree(sock.parent)
    assert len(proxy.denials("sb", 0)) == 0  # detached: nothing kept
    assert "egress event callback failed" in caplog.text


async def test_event_to_dict(rig: Rig):
    await rig.request(b"CONNECT a.org:443 HTTP/1.1\r\n\r\n")
    await rig.settle(1)
    record = rig.events[0].to_dict()
    assert record["kind"] == "connect" and record["host"] == "a.org" and record["rule"] == "policy none"
    assert set(record) >= {"time", "sandbox_id", "method", "port", "allowed", "reason", "bytes_up", "bytes_down",
                           "duration"}


async def test_denials_keep_the_last_200(rig: Rig):
    for i in range(210):
        reader, writer = await rig.open()
        writer.write(f"GET /_corral/dns?name=n{i}.test HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
        async with asyncio.timeout(WAIT):
            await reader.read()
        writer.close()
    kept = rig.proxy.denials("sb1", 0)
    assert len(kept) == 200 and kept[0].host == "n10.test" and kept[-1].host == "n209.test"


async def test_attach_replaces_a_stale_socket(tmp_path: Path):
    sock = Path(tempfile.mkdtemp(prefix="eg-", dir="/tmp")) / "p.sock"
    sock.write_bytes(b"stale")
    proxy = EgressProxy()
    try:
        await proxy.attach("sb", sock, EgressPolicy.parse("none"))
        assert sock.is_socket() and (sock.stat().st_mode & 0o777) == 0o666
        await proxy.attach("sb", sock, EgressPolicy.parse("internet"))  # again: replaces the listener
        assert proxy.policy("sb").mode == "internet"
    finally:
        await proxy.close()
        shutil.rmtree(sock.parent)
