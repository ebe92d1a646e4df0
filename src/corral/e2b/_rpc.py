"""The envd RPC calls as handlers: what a call gets (its sandbox, caller, user, message, deadline) and the table
that routes `/<package>.<Service>/<Method>` to one.

A unary handler returns the response message; a streaming one sends messages with `send` and returns at the end.
Every call is authorized before its handler runs (the sandbox's access token, or an API key), and the handler calls
the service with that principal, so tenancy, roles and audit are exactly /v1's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import Response

from .._users import SandboxUser
from ..control import Principal
from ..service import Service
from ._auth import sandbox_caller
from ._connect import (
    STREAM_TYPE,
    RpcError,
    connect_code,
    envelope,
    read_request,
    read_stream,
    rpc_deadline,
    stream_response,
    unary_error,
    unary_response,
)
from ._front import front_of
from ._user import request_user

__all__ = ["Call", "Rpc", "Send", "rpc_endpoint"]

Send = Callable[[Mapping[str, Any]], Awaitable[None]]
_DEFAULT_KEEPALIVE = 90.0  # envd's default when the client names no interval
_MAX_KEEPALIVE = 86_400  # seconds: a larger interval is no interval at all


@dataclass(frozen=True)
class Call:
    request: Request
    service: Service
    sandbox_id: str
    principal: Principal
    user: SandboxUser
    message: dict[str, Any]
    deadline: float | None  # seconds the client gives the call (`Connect-Timeout-Ms`)


@dataclass(frozen=True)
class Rpc:
    kind: Literal["unary", "stream", "client"]  # a client stream's handler also gets its messages
    handler: Callable[..., Awaitable[Any]]
    keepalive: Mapping[str, Any] | None = None  # the stream's keep-alive message


def rpc_endpoint(table: Mapping[str, Rpc], sandbox_of: Callable[[Request], str | None]
                 ) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        name = request.url.path.lstrip("/")
        rpc = table.get(name)
        if rpc is None:
            return unary_error(RpcError("unimplemented", f"{name} is not implemented by Corral's envd"))
        try:
            call = await _begin(request, sandbox_of, read=rpc.kind != "client")
        except Exception as exc:
            return _refused(rpc, exc)
        if rpc.kind == "unary":
            try:
                return unary_response(await rpc.handler(call))
            except Exception as exc:
                return unary_error(exc)
        if rpc.kind == "client":
            return await _client_stream(rpc, call)

        async def produce(send: Send) -> None:
            await rpc.handler(call, send)

        return stream_response(produce, keepalive=rpc.keepalive, interval=_keepalive_interval(request))

    return endpoint


async def _begin(request: Request, sandbox_of: Callable[[Request], str | None], *, read: bool = True) -> Call:
    sandbox_id = sandbox_of(request)
    if sandbox_id is None:
        raise RpcError("invalid_argument", "no sandbox: send the E2b-Sandbox-Id header")
    service = front_of(request).service
    principal = await sandbox_caller(service, request, sandbox_id)
    user = request_user(request)
    message = await read_request(request) if read else {}
    return Call(request, service, sandbox_id, principal, user, message, rpc_deadline(request))


async def _client_stream(rpc: Rpc, call: Call) -> Response:
    """A client stream's answer: its one message, then the end of the stream (or the error), enveloped."""
    try:
        reply = await rpc.handler(call, read_stream(call.request))
    except Exception as exc:
        code, message = connect_code(exc)
        body = envelope({"error": {"code": code, "message": message}}, end=True)
    else:
        body = envelope(reply) + envelope({}, end=True)
    return Response(body, media_type=STREAM_TYPE)


def _refused(rpc: Rpc, exc: Exception) -> Response:
    """A call refused before it began: a unary error, or a stream that ends at once with the error."""
    if rpc.kind == "unary":
        return unary_error(exc)

    async def fail(send: Send) -> None:
        raise exc

    return stream_response(fail)


def _keepalive_interval(request: Request) -> float:
    raw = request.headers.get("keepalive-ping-interval", "")
    # ASCII digits only ("²".isdigit() holds too), and at most a day: anything else is envd's default.
    return float(raw) if raw.isascii() and raw.isdigit() and 0 < int(raw) <= _MAX_KEEPALIVE else _DEFAULT_KEEPALIVE
