"""Requests to `<port>-<sandbox id>.<domain>` hosts are forwarded to that port inside the sandbox (docs/ports.md).

`PortsMiddleware` sits in front of the REST API: a request whose `Host` names a sandbox's port (`8000-sb-1234.
localhost:7770`, the domain from `corral serve --domain`) never reaches a route; every other request, and every
host that does not parse as one (a bad port, a bad id, another domain), goes on to the API untouched. The
service authorizes the caller and opens a raw pipe to the port through the sandbox's agent (the sandbox keeps
its loopback-only network); this module only speaks HTTP over that pipe, with well-kept libraries:

* HTTP: httpcore's HTTP/1.1 client connection (h11 underneath) over the pipe, one per request. Request and
  response bodies stream chunk by chunk in both directions, never held whole; `Content-Length` and chunked
  bodies are framed by h11 and by the ASGI server; hop-by-hop headers are dropped, `Host` is kept (apps that
  check it against `Origin` keep working) and `X-Forwarded-For/-Host/-Proto` are set. A client that leaves
  mid-response ends the request in the sandbox too.
* WebSockets: the `websockets` library's client makes the upstream handshake over the pipe (offering the
  client's subprotocols, passing its headers); then messages go both ways as they are (text stays text, bytes
  stay bytes, fragments are reassembled by both ends), and each side's close code and reason reach the other.

Refusals are the API's JSON errors (`{"error": {...}}`): 401 without the owner's key (unless the sandbox has
`public_ports`), 404 for another tenant's sandbox or an unknown one, 409 for a paused one, and 502 `agent_error`
naming the port when nothing listens there or what listens does not speak HTTP. A WebSocket is refused with the
same responses before its handshake (the ASGI "websocket.http.response" extension), or else with close 1008; a
handshake the server in the sandbox refuses gets that server's own answer. uvicorn 0.54 logs a spurious "ASGI
callable returned without completing handshake" ERROR line after each such refusal (Kludex/uvicorn#3138).

Nothing here is hand-written HTTP: the grammar and framing are h11's (through httpcore) and websockets'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

import httpcore
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.frames import Close

from .._exceptions import AgentError, CorralError
from ..service import ClientInfo, PortConnection, PortRequest, Service, TokenPurpose
from ._errors import error_response
from ._port_credentials import strip_credentials

__all__ = ["PortsMiddleware", "port_target"]

logger = logging.getLogger("corral.server")

# `<port>-<sandbox id>`: a port without leading zeros, and the shape of a sandbox id (the service finds it or not).
_LABEL = re.compile(r"([1-9][0-9]{0,4})-(sb-[a-z0-9][a-z0-9-]*)")
_ORIGIN = httpcore.Origin(b"http", b"sandbox", 80)  # never dialled: the connection is the pipe; `Host` is the client's
# Hop-by-hop headers (RFC 9110 7.6.1) and those this relay frames itself; `Expect` is answered by our ASGI server.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                         b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"expect"})
_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto"})
# What the websockets client writes itself in its handshake, or what the ASGI server answers with.
_HANDSHAKE = frozenset({b"host", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
                        b"sec-websocket-protocol", b"sec-websocket-accept", b"content-length", b"date", b"server"})
_WS_MAX_MESSAGE = 16 * 2**20  # what uvicorn accepts from a client by default (`--ws-max-size`)
_WS_OPEN_TIMEOUT = 10.0
_WS_CLOSE_TIMEOUT = 5.0
_WS_DENIED = 1008  # policy violation: the refusal when the ASGI server cannot send an HTTP answer
_WS_BAD_GATEWAY = 1014  # RFC 6455 registry: "Bad Gateway"
_WS_NO_STATUS = 1005  # a close frame without a code; never sent as a code
_WS_ABNORMAL = (1006, 1015)  # no close frame at all; TLS failure: reported locally, never on the wire
_REASON_BYTES = 123  # the most a close frame's reason may hold


def port_target(host: str | None, domain: str) -> tuple[str, int] | None:
    """(sandbox id, port) for a `<port>-<sandbox id>.<domain>[:server port]` host; None for any other host."""
    if not host:
        return None
    name, _, server_port = host.strip().lower().rpartition(":")
    if not name or "]" in name or not server_port.isdigit():  # no port given, or an IPv6 literal
        name = host.strip().lower()
    label, dot, rest = name.removesuffix(".").partition(".")
    match = _LABEL.fullmatch(label)
    if not dot or rest != domain or match is None or int(match.group(1)) > 65535:
        return None
    return match.group(2), int(match.group(1))


class PortsMiddleware:
    """ASGI middleware: sandboxes' port hosts are forwarded to the sandbox, everything else goes to `app`."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            target = port_target(_header(scope, b"host"), self.service.ports.domain)
            if target is not None:
                forward = _forward_http if scope["type"] == "http" else _forward_websocket
                await forward(self.service, scope, receive, send, target)
                return
        await self.app(scope, receive, send)


# -- what both kinds share ---------------------------------------------------------------------------------------


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _bearer(scope: Scope) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, else None (a public sandbox's app may use the header
    for itself, so another scheme is no error here)."""
    scheme, _, key = (_header(scope, b"authorization") or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def _target(scope: Scope) -> bytes:
    """The request target as the client sent it (still percent-encoded), with its query."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return bytes(path) + (b"?" + bytes(query) if query else b"")


async def _open(svc: Service, scope: Scope, target: tuple[str, int], kind: Literal["http", "websocket"]
                ) -> tuple[PortConnection, tuple[str, ...]]:
    """The connection to the port, and the sandbox's own access tokens (what its app must never be sent)."""
    sandbox_id, port = target
    host = _header(scope, b"host") or ""
    path = _target(scope).decode("latin-1")
    client = ClientInfo(scope["client"][0] if scope.get("client") else None, scope.get("method", "GET"),
                        f"//{host}{path}")
    request = PortRequest(sandbox_id, port, kind, client.method, path)
    conn = await svc.ports.open(_bearer(scope), client, request)
    return conn, tuple(svc.access.token(sandbox_id, purpose) for purpose in TokenPurpose)


def _forwarded_headers(scope: Scope, conn: PortConnection, tokens: tuple[str, ...], drop: frozenset[bytes]
                       ) -> list[tuple[bytes, bytes]]:
    """The client's headers as the sandbox gets them: without hop-by-hop ones (and those named in `Connection`),
    without any credential of Corral's or E2B's (`_port_credentials`), with `X-Forwarded-*` set."""
    raw: list[tuple[bytes, bytes]] = [(bytes(k).lower(), bytes(v)) for k, v in scope["headers"]]
    named = _named_by_connection(raw)
    relayed = [(k, v) for k, v in raw if k not in drop and k not in named and k not in _FORWARDED]
    out = strip_credentials(relayed, tokens, keep_authorization=conn.forwards_authorization)
    chain = [v for k, v in raw if k == b"x-forwarded-for"]
    client = scope.get("client")
    if client:
        chain.append(client[0].encode())
    if chain:
        out.append((b"x-forwarded-for", b", ".join(chain)))
    out.append((b"x-forwarded-host", (_header(scope, b"host") or "").encode("latin-1")))
    secure = scope.get("scheme") in ("https", "wss")
    out.append((b"x-forwarded-proto", b"https" if secure else b"http"))
    return out


def _named_by_connection(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    """Headers that `Connection` names: hop-by-hop too (RFC 9110 7.6.1)."""
    return {token.strip().lower() for key, value in headers if key == b"connection" for token in value.split(b",")}


# -- HTTP --------------------------------------------------------------------------------------------------------


class _ClientLeft(Exception):
    """The client disconnected while its request body was being sent on."""


class _PipeStream(httpcore.AsyncNetworkStream):
    """httpcore's view of the pipe: reads and writes on the non-blocking socket, errors as httpcore's own."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return await self._loop.sock_recv(self._sock, max_bytes)
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            await self._loop.sock_sendall(self._sock, buffer)
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._sock.close()

    def get_extra_info(self, info: str) -> Any:
        return self._sock if info == "socket" else None


@contextlib.contextmanager
def _upstream_errors(port: int) -> Iterator[None]:
    """httpcore's errors (what listens on the port broke HTTP, or the pipe broke) as `AgentError`."""
    try:
        yield
    except (httpcore.ProtocolError, httpcore.NetworkError, httpcore.TimeoutException,
            httpcore.UnsupportedProtocol) as exc:
        raise AgentError(f"port {port} in the sandbox did not answer with HTTP/1.1 ({type(exc).__name__}: {exc}); "
                         "is the server there an HTTP server, and still running?",
                         details={"port": port}) from exc


async def _forward_http(svc: Service, scope: Scope, receive: Receive, send: Send, target: tuple[str, int]) -> None:
    try:
        conn, tokens = await _open(svc, scope, target, "http")
    except CorralError as exc:
        await error_response(exc)(scope, receive, send)
        return
    exchange = _HttpExchange(scope, receive, send, conn, tokens, target[1])
    relay = asyncio.create_task(exchange.relay())
    watch = asyncio.create_task(exchange.watch_disconnect())
    try:
        await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relay, watch):
            task.cancel()
        relayed, watched = await asyncio.gather(relay, watch, return_exceptions=True)
        failure = relayed if isinstance(relayed, Exception) and not isinstance(relayed, _ClientLeft) else None
        left = (watched is None and not exchange.complete) or isinstance(relayed, _ClientLeft)
        await exchange.close(failure, left=left)
    if failure is not None:
        raise failure  # after the response began: the ASGI server drops the connection, so the client sees the cut


class _HttpExchange:
    """One request relayed to the sandbox and its response relayed back."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, conn: PortConnection, tokens: tuple[str, ...],
                 port: int) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self.conn, self.tokens = conn, tokens
        self.port = port
        self.body_sent = asyncio.Event()  # from then on `receive` only tells of a disconnect
        self.status: int | None = None  # once the response began
        self.error: CorralError | None = None  # what was answered instead of a response
        self.complete = False  # the whole response went out
        self.sent = 0
        self.received = 0

    async def relay(self) -> None:
        headers = _forwarded_headers(self.scope, self.conn, self.tokens, _HOP_BY_HOP)
        raw = {k for k, _ in headers}
        chunked = _header(self.scope, b"transfer-encoding") is not None
        if chunked:
            headers = [(k, v) for k, v in headers if k != b"content-length"]  # RFC 9112 6.3: chunked wins
            headers.append((b"transfer-encoding", b"chunked"))
        elif b"content-length" not in raw:
            self.body_sent.set()  # a request without a body: nothing will be read for it
        url = httpcore.URL(scheme=b"http", host=b"sandbox", port=80, target=_target(self.scope))
        request = httpcore.Request(self.scope["method"].encode("ascii"), url, headers=headers, content=self._body())
        http = httpcore.AsyncHTTP11Connection(_ORIGIN, _PipeStream(self.conn.socket))
        try:
            with _upstream_errors(self.port):
                response = await http.handle_async_request(request)
            try:
                await self._respond(response)
            finally:
                await response.aclose()
        except AgentError as exc:
            if self.status is not None:
                logger.warning("port.response_cut", extra={"port": self.port, "error": exc.message})
                raise
            self.status, self.error = 502, exc
            await error_response(exc)(self.scope, self.receive, self.send)
        finally:
            await http.aclose()

    async def _respond(self, response: httpcore.Response) -> None:
        headers = _response_headers(response.headers)
        await self.send({"type": "http.response.start", "status": response.status, "headers": headers})
        self.status = response.status
        with _upstream_errors(self.port):
            async for chunk in response.aiter_stream():
                self.received += len(chunk)
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        self.complete = True

    async def _body(self) -> AsyncIterator[bytes]:
        while not self.body_sent.is_set():
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            if body := message.get("body", b""):
                self.sent += len(body)
                yield body
            if not message.get("more_body", False):
                self.body_sent.set()

    async def watch_disconnect(self) -> None:
        """Returns when the client disconnects (after its body: until then the body's reader sees that)."""
        await self.body_sent.wait()
        while (await self.receive())["type"] != "http.disconnect":
            pass

    async def close(self, failure: Exception | None, *, left: bool) -> None:
        """Record the exchange: the status answered, a failure after that, or that the client left first."""
        self.conn.outcome.update(bytes_sent=self.sent, bytes_received=self.received)
        status = self.status or (500 if failure is not None else 0)  # 0: the client left before any answer
        await self.conn.close(status, error=failure or self.error, disconnected=left)


def _response_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    raw = [(k.lower(), v) for k, v in headers]
    named = _named_by_connection(raw)
    return [(k, v) for k, v in raw if k not in _HOP_BY_HOP and k not in named]


# -- WebSockets --------------------------------------------------------------------------------------------------


async def _forward_websocket(svc: Service, scope: Scope, receive: Receive, send: Send,
                             target: tuple[str, int]) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    try:
        conn, tokens = await _open(svc, scope, target, "websocket")
    except CorralError as exc:
        await _deny(scope, send, exc)
        return
    port = target[1]
    try:
        upstream = await _handshake(scope, conn, tokens, port)
    except InvalidStatus as exc:  # the server in the sandbox refused the handshake: its answer is the answer
        await _deny_as(scope, send, exc.response.status_code, list(exc.response.headers.raw_items()),
                       bytes(exc.response.body or b""))
        await conn.close(exc.response.status_code)
        return
    except CorralError as exc:
        await _deny(scope, send, exc)
        await conn.close(502, error=exc)
        return
    except BaseException:
        await conn.close(0, disconnected=True)
        raise
    await _relay_websocket(scope, receive, send, conn, upstream, port)


async def _handshake(scope: Scope, conn: PortConnection, tokens: tuple[str, ...], port: int) -> ClientConnection:
    uri = f"ws://{_header(scope, b'host')}{_target(scope).decode('latin-1')}"
    headers = [(k.decode("latin-1"), v.decode("latin-1"))
               for k, v in _forwarded_headers(scope, conn, tokens, _HOP_BY_HOP | _HANDSHAKE)]
    try:
        return await connect(uri, sock=conn.socket, subprotocols=scope.get("subprotocols") or None,
                             additional_headers=headers, user_agent_header=None, compression=None,
                             open_timeout=_WS_OPEN_TIMEOUT, ping_interval=None, close_timeout=_WS_CLOSE_TIMEOUT,
                             max_size=_WS_MAX_MESSAGE)
    except InvalidStatus:
        raise
    except (InvalidHandshake, InvalidURI, OSError, TimeoutError, EOFError) as exc:
        raise AgentError(f"port {port} in the sandbox did not complete a WebSocket handshake "
                         f"({type(exc).__name__}: {exc}); is the server there a WebSocket server?",
                         details={"port": port}) from exc


async def _relay_websocket(scope: Scope, receive: Receive, send: Send, conn: PortConnection,
                           upstream: ClientConnection, port: int) -> None:
    answered = upstream.response.headers.raw_items() if upstream.response is not None else []
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answered
               if k.lower().encode("latin-1") not in _HOP_BY_HOP | _HANDSHAKE]
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol, "headers": headers})
    counts = {"messages_sent": 0, "messages_received": 0}
    inbound = asyncio.create_task(_client_to_upstream(receive, upstream, counts, conn))
    outbound = asyncio.create_task(_upstream_to_client(upstream, send, counts, conn, port))
    try:
        # Whichever side closes first has told the other (with its code) before its task ends.
        await asyncio.wait({inbound, outbound}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (inbound, outbound):
            task.cancel()
        results = await asyncio.gather(inbound, outbound, return_exceptions=True)
        with contextlib.suppress(Exception):
            await upstream.close()
        conn.outcome.update(counts)
        error = next((r for r in results if isinstance(r, Exception) and not isinstance(r, ConnectionClosed)), None)
        await conn.close(101, error=error)


async def _client_to_upstream(receive: Receive, upstream: ClientConnection, counts: dict[str, int],
                              conn: PortConnection) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "websocket.disconnect":
            if "close_code" in conn.outcome:
                return  # the client's answer to the sandbox's close, relayed the other way
            code = int(message.get("code") or 1000)
            conn.outcome["client_close_code"] = code
            with contextlib.suppress(ConnectionClosed, OSError):
                await upstream.close(*_close_to_upstream(code, str(message.get("reason") or "")))
            return
        if message["type"] != "websocket.receive":
            continue
        data = message.get("bytes")
        text = message.get("text")
        with contextlib.suppress(ConnectionClosed):  # the sandbox's close reaches the client the other way
            await upstream.send(data if data is not None else text or "")
        counts["messages_sent"] += 1


async def _upstream_to_client(upstream: ClientConnection, send: Send, counts: dict[str, int],
                              conn: PortConnection, port: int) -> None:
    try:
        async for message in upstream:
            key = "text" if isinstance(message, str) else "bytes"
            await send({"type": "websocket.send", key: message})
            counts["messages_received"] += 1
    except ConnectionClosed:
        pass
    if "client_close_code" in conn.outcome:
        return  # the client closed first: it knows
    code, reason = _close_to_client(upstream.protocol.close_rcvd, port)
    conn.outcome["close_code"] = code
    await send({"type": "websocket.close", "code": code, "reason": reason})


def _sendable(code: int) -> bool:
    """Can a close frame carry `code`? (RFC 6455 7.4: the registered ones, and 3000-4999.)"""
    return code in (1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014) or 3000 <= code <= 4999


def _close_to_client(received: Close | None, port: int) -> tuple[int, str]:
    """The close the client gets when the sandbox's side ended: the sandbox's own code and reason, when it sent
    one that can be sent on."""
    if received is None or received.code in _WS_ABNORMAL:
        return _WS_BAD_GATEWAY, _reason(f"port {port} in the sandbox closed without a close frame")
    if received.code == _WS_NO_STATUS:
        return 1000, ""
    if not _sendable(received.code):
        return _WS_BAD_GATEWAY, _reason(f"port {port} in the sandbox closed with code {received.code}")
    return received.code, received.reason


def _close_to_upstream(code: int, reason: str) -> tuple[int, str]:
    if code == _WS_NO_STATUS:
        return 1000, ""
    if code in _WS_ABNORMAL:
        return 1001, "the client went away"
    return (code, _reason(reason)) if _sendable(code) else (1000, "")


def _reason(text: str) -> str:
    return text.encode()[:_REASON_BYTES].decode("utf-8", errors="ignore")


async def _deny(scope: Scope, send: Send, exc: CorralError) -> None:
    response = error_response(exc)
    await _deny_as(scope, send, response.status_code, response.raw_headers, bytes(response.body))


async def _deny_as(scope: Scope, send: Send, status: int, headers: Sequence[tuple[bytes | str, bytes | str]],
                   body: bytes) -> None:
    """Refuse a WebSocket before its handshake with an HTTP answer, if the ASGI server can send one."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": _WS_DENIED})
        return
    raw = [(_bytes(k).lower(), _bytes(v)) for k, v in headers
           if _bytes(k).lower() not in _HOP_BY_HOP | {b"content-length", b"date", b"server"}]
    await send({"type": "websocket.http.response.start", "status": status,
                "headers": [*raw, (b"content-length", str(len(body)).encode())]})
    await send({"type": "websocket.http.response.body", "body": body})


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")
