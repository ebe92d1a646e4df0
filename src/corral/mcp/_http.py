"""`MCPFront`: `/mcp` on `corral serve`, MCP's streamable HTTP transport with the API key as a bearer token.

Every request must carry `Authorization: Bearer <key>`: the service authenticates it (a refusal is recorded as
`auth.denied`, like on /v1) and a missing or wrong key is a 401 with a JSON-RPC error body, which MCP clients
show as the connection's error. The principal goes to the tools in the request's ASGI scope.

Stateless: each POST is a whole exchange (its answer an SSE stream, so a long call's progress comes before its
result), and no MCP session lives in this process. So a server restart or another replica breaks no client,
and no session can be carried over from one key to another.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.types import Receive, Scope, Send

from .._exceptions import AuthenticationError
from ..control import Principal
from ..service import ClientInfo, Service
from ._server import PRINCIPAL_SCOPE_KEY, mcp_server

__all__ = ["MAX_BODY", "MCPFront"]

MAX_BODY = 16 * 2**20  # one request's JSON: write_file's content is in it (12 MiB of bytes as base64)
_UNAUTHENTICATED = -32001  # JSON-RPC's implementation-defined server error range: the key was refused
_FIX = "send a valid Corral API key as 'Authorization: Bearer <key>'; an admin makes one with `corral keys create`"


class MCPFront:
    """The ASGI app of `/mcp`; `run()` must be entered for the app's lifetime (the server's lifespan does)."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self._manager = StreamableHTTPSessionManager(app=mcp_server(service), stateless=True,
                                                     max_request_body_size=MAX_BODY)

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        async with self._manager.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            principal = await self._authenticate(scope)
        except AuthenticationError as exc:
            await _unauthenticated(send, exc)
            return
        await self._manager.handle_request({**scope, PRINCIPAL_SCOPE_KEY: principal}, receive, send)

    async def _authenticate(self, scope: Scope) -> Principal:
        client = ClientInfo(scope["client"][0] if scope.get("client") else None, scope.get("method", ""),
                            scope.get("path", ""))
        header = _header(scope, b"authorization")
        scheme, _, key = (header or "").partition(" ")
        if header is not None and (scheme.lower() != "bearer" or not key.strip()):
            exc = AuthenticationError("the Authorization header must be 'Bearer <key>'")
            await self._service.record_denial(client, exc, None)
            raise exc
        return await self._service.authenticate(key.strip() if header is not None else None, client)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _unauthenticated(send: Send, exc: AuthenticationError) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": None,
                       "error": {"code": _UNAUTHENTICATED, "message": f"{exc.code}: {exc.message} ({_FIX})"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b'Bearer realm="corral"')]})
    await send({"type": "http.response.body", "body": body})
