"""`ReplicaMiddleware`: a request for a sandbox that another replica runs is served by that replica
(docs/replicas.md).

Outermost in the app, so every front end is covered by the same few lines: the sandbox a request names (the
`/v1/sandboxes/{id}`, `/sandboxes/{id}` and `/v2/sandboxes/{id}` paths, E2B's `E2b-Sandbox-Id` header, and
`<port>-<id>.<domain>` hosts) is looked up (`Replica.route`); if another live replica runs it, the request goes
there as it came (method, target, headers with the `Host`, the body streamed), with this replica's signature and
the client's address, and the answer comes back streamed (NDJSON, downloads). The owner authenticates the
caller's own credentials again and audits under them. Anything else (no sandbox named, this replica's, unknown,
lost, or its replica not answering) is served here, where the service answers with the reason.

An MCP tool call (`POST /mcp`, which keeps no session) names its sandbox in its JSON body: the body is read here
and the call forwarded whole to the owner, so MCP clients may use any replica.

WebSockets (terminals, port relays) are forwarded the same way: the handshake goes to the owner with the
client's headers (its `Host` too) and the signature, and messages are relayed both ways with their close codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from urllib.parse import parse_qsl, unquote

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from .._exceptions import AuthenticationError, CorralError, ServerError
from ..e2b import signed_url_signer
from ..mcp import MAX_BODY as MCP_MAX_BODY
from ..service import Service
from ._errors import error_response
from ._ports import port_target

__all__ = ["REPLICA_CLIENT", "REPLICA_SIGNATURE", "Forwarder", "ReplicaMiddleware"]

logger = logging.getLogger("corral.server")

REPLICA_SIGNATURE = b"x-corral-replica"  # `<replica id>;<time>;<HMAC>` of the replica that forwarded the request
REPLICA_CLIENT = b"x-corral-client"  # the original client's address, vouched for by the signature
_PATH = re.compile(r"^/(?:v[12]/)?sandboxes/([^/]+)")
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                         b"trailer", b"transfer-encoding", b"upgrade", REPLICA_SIGNATURE, REPLICA_CLIENT})
_CONNECT_TIMEOUT = 5.0  # a replica on the same network answers a connect at once; a dead one must not hang us
_HANDSHAKE = frozenset({b"host", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
                        b"sec-websocket-protocol", b"sec-websocket-accept", b"content-length", b"date", b"server"})
_WS_MAX_MESSAGE = 16 * 2**20  # what uvicorn accepts from a client by default
_WS_CLOSE_TIMEOUT = 5.0
_WS_NORMAL, _WS_NO_STATUS, _WS_BAD_GATEWAY = 1000, 1005, 1014
_WS_UNSENDABLE = (1005, 1006, 1015)  # codes that report a close locally, never sent in a close frame


class Forwarder:
    """The HTTP client requests go to other replicas with (one pool, closed with the app)."""

    def __init__(self) -> None:
        timeout = httpx.Timeout(connect=_CONNECT_TIMEOUT, read=None, write=None, pool=_CONNECT_TIMEOUT)
        self.client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False)

    async def aclose(self) -> None:
        await self.client.aclose()


class _ClientLeft(Exception):
    """The client disconnected while its request body was being sent on."""


class ReplicaMiddleware:
    def __init__(self, app: ASGIApp, service: Service, forwarder: Forwarder) -> None:
        self.app = app
        self.service = service
        self.forwarder = forwarder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            scope, forwarded = self._trusted(scope)
        except AuthenticationError as exc:
            await _refuse(scope, receive, send, exc)
            return
        sandbox_id = None if forwarded else _sandbox_of(scope, self.service.ports.domain)
        if sandbox_id is None and not forwarded and scope["type"] == "http" and scope["path"] == "/files":
            sandbox_id = await self._signed_elsewhere(scope)
        if sandbox_id is None and not forwarded and _is_mcp_post(scope):
            read, sandbox_id = await _mcp_tool_sandbox(receive)  # an MCP call names its sandbox in its body
            receive = _replayed(read, receive)
        url = await self.service.replica.route(sandbox_id) if sandbox_id is not None else None
        if url is None:
            await self.app(scope, receive, send)  # never forwarded twice: the owner serves what it is sent
        elif scope["type"] == "websocket":
            await _WebSocketExchange(self, scope, receive, send, url).run()
        else:
            await _Exchange(self, scope, receive, send, url).run()

    async def _signed_elsewhere(self, scope: Scope) -> str | None:
        """E2B's signed `/files` URLs name their sandbox by the signature alone: another replica's, if its token
        made it (checked with the shared secret; the owner checks it again)."""
        params = dict(parse_qsl(bytes(scope.get("query_string") or b"").decode("latin-1")))
        sign = signed_url_signer(scope.get("method", "GET"), params)
        if sign is None:
            return None
        return await self.service.access.signer_elsewhere(sign, params["signature"])

    def _trusted(self, scope: Scope) -> tuple[Scope, bool]:
        """The scope with the replica headers verified and removed; True if another replica forwarded it (its
        client address is then the original client's). A forged signature is refused."""
        headers = scope["headers"]
        signature = _header(scope, REPLICA_SIGNATURE)
        if signature is None:
            if _header(scope, REPLICA_CLIENT) is None:
                return scope, False
            return {**scope, "headers": [(k, v) for k, v in headers if k != REPLICA_CLIENT]}, False
        client = _header(scope, REPLICA_CLIENT) or ""
        sender = self.service.replica.verify(signature, scope.get("method", "GET"), _target(scope), client)
        if sender is None:
            raise AuthenticationError("the request claims to come from a replica, and its signature is not valid")
        stripped = [(k, v) for k, v in headers if k not in (REPLICA_SIGNATURE, REPLICA_CLIENT)]
        return {**scope, "headers": stripped, "client": (client, 0) if client else None,
                "corral.forwarded_by": sender}, True


class _Exchange:
    """One request sent on to the owning replica and its answer streamed back."""

    def __init__(self, middleware: ReplicaMiddleware, scope: Scope, receive: Receive, send: Send,
                 url: str) -> None:
        self.mw, self.scope, self.receive, self.send, self.url = middleware, scope, receive, send, url
        self.body_started = False
        self.answered = False

    async def run(self) -> None:
        try:
            response = await self.mw.forwarder.client.send(self._request(), stream=True)
        except _ClientLeft:
            return
        except httpx.TransportError as exc:
            await self._unsent(exc)
            return
        # httpx sent the whole body before it read the head: from here on `receive` only tells of a disconnect.
        relay = asyncio.create_task(self._answer(response))
        watch = asyncio.create_task(self._watch_disconnect())
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, watch):
                task.cancel()
            relayed, _ = await asyncio.gather(relay, watch, return_exceptions=True)
            await response.aclose()
        if isinstance(relayed, Exception):
            raise relayed  # after the answer began: the ASGI server cuts the connection, the client sees the cut

    def _request(self) -> httpx.Request:
        scope = self.scope
        client = scope["client"][0] if scope.get("client") else ""
        method, target = scope["method"], _target(scope)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP_BY_HOP]
        headers += [(REPLICA_SIGNATURE, self.mw.service.replica.sign(method, target, client).encode()),
                    (REPLICA_CLIENT, client.encode("latin-1"))]
        has_body = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])
        return self.mw.forwarder.client.build_request(method, self.url + target, headers=headers,
                                                      content=self._body() if has_body else None)

    async def _body(self) -> AsyncIterator[bytes]:
        more = True
        while more:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            self.body_started = True
            if chunk := message.get("body", b""):
                yield chunk
            more = bool(message.get("more_body", False))

    async def _unsent(self, exc: httpx.TransportError) -> None:
        """The owner could not be reached. Before any of the body went, the request is served here instead
        (the service refuses it with the reason, after checking the caller); after, whether the owner acted is
        unknown, and the caller is told so."""
        replica = self.url
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout) and not self.body_started:
            logger.warning("replica.unreachable", extra={"replica_url": replica, "error": str(exc)})
            await self.mw.app(self.scope, self.receive, self.send)
            return
        await self._fail(ServerError(
            f"the replica at {replica} that runs this sandbox stopped answering during the request "
            f"({type(exc).__name__}); whether it acted is unknown: check the sandbox before trying again",
            details={"replica_url": replica}), exc)

    async def _answer(self, response: httpx.Response) -> None:
        headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in _HOP_BY_HOP]
        await self.send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        self.answered = True
        try:
            async for chunk in response.aiter_raw():
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            logger.warning("replica.answer_cut", extra={"replica_url": self.url, "error": str(exc)})
            raise ServerError(f"the replica at {self.url} stopped answering mid-response") from exc
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _fail(self, error: CorralError, cause: BaseException) -> None:
        if self.answered:
            raise error from cause
        self.answered = True
        await error_response(error)(self.scope, self.receive, self.send)

    async def _watch_disconnect(self) -> None:
        """Returns when the client leaves, so that a long stream from the owner is closed (and the owner sees
        its caller go)."""
        while (await self.receive())["type"] != "http.disconnect":
            pass


class _WebSocketExchange:
    """One WebSocket opened on the owning replica and relayed, messages and close codes, both ways."""

    def __init__(self, middleware: ReplicaMiddleware, scope: Scope, receive: Receive, send: Send,
                 url: str) -> None:
        self.mw, self.scope, self.receive, self.send, self.url = middleware, scope, receive, send, url

    async def run(self) -> None:
        opening = await self.receive()
        if opening["type"] != "websocket.connect":
            return
        try:
            upstream = await self._handshake()
        except InvalidStatus as exc:  # the owner refused (unknown sandbox, credentials): its answer is the answer
            await _deny_as(self.scope, self.send, exc.response.status_code, bytes(exc.response.body or b""))
            return
        except (OSError, TimeoutError, InvalidHandshake, EOFError) as exc:
            logger.warning("replica.unreachable", extra={"replica_url": self.url, "error": str(exc)})
            await self.mw.app(self.scope, _replayed([opening], self.receive), self.send)  # refused here, with why
            return
        await self.send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        inbound = asyncio.create_task(self._client_to_owner(upstream))
        outbound = asyncio.create_task(self._owner_to_client(upstream))
        try:
            await asyncio.wait({inbound, outbound}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (inbound, outbound):
                task.cancel()
            await asyncio.gather(inbound, outbound, return_exceptions=True)
            with contextlib.suppress(Exception):
                await upstream.close()

    async def _handshake(self) -> ClientConnection:
        scope, owner = self.scope, httpx.URL(self.url)
        client = scope["client"][0] if scope.get("client") else ""
        target = _target(scope)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() not in _HOP_BY_HOP | _HANDSHAKE]
        headers += [(REPLICA_SIGNATURE.decode(), self.mw.service.replica.sign("GET", target, client)),
                    (REPLICA_CLIENT.decode(), client)]
        sock = await _connected(owner.host, owner.port or 80)
        try:
            # The URI only names the Host header: the socket already goes to the owner, and the client's Host
            # (a port host, say) is what the owner routes on.
            return await connect(f"ws://{_header(scope, b'host') or owner.host}{target}", sock=sock,
                                 subprotocols=scope.get("subprotocols") or None, additional_headers=headers,
                                 user_agent_header=None, compression=None, open_timeout=_CONNECT_TIMEOUT,
                                 ping_interval=None, close_timeout=_WS_CLOSE_TIMEOUT, max_size=_WS_MAX_MESSAGE)
        except BaseException:
            sock.close()
            raise

    async def _client_to_owner(self, upstream: ClientConnection) -> None:
        while True:
            message: Message = await self.receive()
            if message["type"] == "websocket.disconnect":
                code = int(message.get("code") or _WS_NORMAL)
                with contextlib.suppress(ConnectionClosed, OSError):
                    await upstream.close(_WS_NORMAL if code in _WS_UNSENDABLE else code,
                                         str(message.get("reason") or ""))
                return
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                with contextlib.suppress(ConnectionClosed):  # the owner's close reaches the client the other way
                    await upstream.send(data if data is not None else message.get("text") or "")

    async def _owner_to_client(self, upstream: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in upstream:
                await self.send({"type": "websocket.send", "text" if isinstance(message, str) else "bytes": message})
        received = upstream.protocol.close_rcvd
        if received is None or received.code in _WS_UNSENDABLE:
            code, reason = ((_WS_NORMAL, "") if received is not None and received.code == _WS_NO_STATUS else
                            (_WS_BAD_GATEWAY, f"the replica at {self.url} closed without a close frame"))
        else:
            code, reason = received.code, received.reason
        with contextlib.suppress(Exception):  # the client may have gone meanwhile
            await self.send({"type": "websocket.close", "code": code, "reason": reason})


async def _connected(host: str, port: int) -> socket.socket:
    """A TCP connection to the owner, within the connect timeout."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(_CONNECT_TIMEOUT):
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(_CONNECT_TIMEOUT):
            await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


def _is_mcp_post(scope: Scope) -> bool:
    """A call to `/mcp` with a key: one without is refused where it arrives, before anything reads its body."""
    return (scope["type"] == "http" and scope.get("method") == "POST" and scope["path"] == "/mcp"
            and _header(scope, b"authorization") is not None)


async def _mcp_tool_sandbox(receive: Receive) -> tuple[list[Message], str | None]:
    """The messages of an MCP request's body, read whole (as far as `/mcp` accepts), and the sandbox its tool call
    names (`tools/call` with a `sandbox_id` argument), if any. `/mcp` keeps no session (docs/mcp.md), so one
    request is one whole exchange: the owner can serve it as this replica would."""
    read: list[Message] = []
    size = 0
    while size <= MCP_MAX_BODY:
        message = await receive()
        read.append(message)
        if message["type"] != "http.request":
            return read, None
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    else:
        return read, None  # more than `/mcp` accepts: refused where it arrived
    try:
        call = json.loads(b"".join(m.get("body", b"") for m in read))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: the MCP server says so
        return read, None
    if not isinstance(call, dict) or call.get("method") != "tools/call":
        return read, None
    params = call.get("params")
    arguments = params.get("arguments") if isinstance(params, dict) else None
    sandbox_id = arguments.get("sandbox_id") if isinstance(arguments, dict) else None
    return read, sandbox_id[:128] if isinstance(sandbox_id, str) and sandbox_id else None


def _replayed(read: list[Message], receive: Receive) -> Receive:
    """`receive` with the messages already `read` given again first, in order."""
    pending = list(reversed(read))

    async def again() -> Message:
        return pending.pop() if pending else await receive()

    return again


async def _deny_as(scope: Scope, send: Send, status: int, body: bytes) -> None:
    """Refuse a WebSocket before its handshake with the owner's HTTP answer, if the ASGI server can send one."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": "websocket.http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "websocket.http.response.body", "body": body})


async def _refuse(scope: Scope, receive: Receive, send: Send, exc: CorralError) -> None:
    if scope["type"] == "http":
        await error_response(exc)(scope, receive, send)
        return
    with contextlib.suppress(Exception):
        await receive()  # websocket.connect
    response = error_response(exc)
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": response.status_code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(response.body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": bytes(response.body)})
    else:
        await send({"type": "websocket.close", "code": 1013, "reason": exc.message.encode()[:123].decode(
            "utf-8", errors="ignore")})


def _sandbox_of(scope: Scope, domain: str) -> str | None:
    """The sandbox a request names, by E2B's header, a port host, or the path; None if it names none."""
    e2b = _header(scope, b"e2b-sandbox-id")
    if e2b is not None:
        return e2b.strip()[:128] or None
    target = port_target(_header(scope, b"host"), domain)
    if target is not None:
        return target[0]
    match = _PATH.match(scope.get("path", ""))
    return unquote(match.group(1)) if match is not None else None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _target(scope: Scope) -> str:
    """The request target as the client sent it (still percent-encoded), with its query."""
    path = bytes(scope.get("raw_path") or scope["path"].encode())
    query = bytes(scope.get("query_string") or b"")
    return (path + (b"?" + query if query else b"")).decode("latin-1")
