"""Connect RPC (connectrpc.com/docs/protocol), JSON codec, on Starlette: how E2B's SDKs call envd.

Written here rather than taken from the `connectrpc` package: its server runs on message classes generated from
E2B's .proto files (protoc plus E2B's generated code in the project), while what envd's clients use is a small,
stable subset: unary calls (`application/json` in and out; an error is an HTTP status and `{"code", "message"}`)
and server streams (`application/connect+json`: one enveloped request, then enveloped messages and a final
end-of-stream envelope carrying `{}` or `{"error": {...}}`). An envelope is a flags byte (0x02: end of stream), a
big-endian u32 length and the JSON payload. Compression is never negotiated by those clients and is refused.

A stream whose sandbox vanished (killed, expired, paused) ends with `unavailable` and a message that says so; E2B's
SDKs then ask `/health`, which answers 502, and tell their caller the sandbox is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .._exceptions import AgentError, CorralError, SandboxTimeoutError
from ._errors import logger

__all__ = ["RpcError", "connect_code", "envelope", "read_request", "rpc_deadline", "stream_response",
           "unary_error", "unary_response"]

UNARY_TYPE = "application/json"
STREAM_TYPE = "application/connect+json"
END_STREAM = 0x02
_ENVELOPE = struct.Struct(">BI")
_MAX_MESSAGE = 16 * 1024 * 1024  # an input message: the largest stdin chunk a client sends is far below
_MAX_TIMEOUT_DIGITS = 10  # `Connect-Timeout-Ms` (Connect's protocol): a longer value is no deadline

# The protocol's codes and their HTTP statuses (for unary errors).
HTTP_STATUS: Mapping[str, int] = MappingProxyType({
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
})
# Corral's error codes (`corral._exceptions`) as Connect codes.
_CODE_OF: Mapping[str, str] = MappingProxyType({
    "invalid_request": "invalid_argument", "unauthenticated": "unauthenticated",
    "permission_denied": "permission_denied", "not_found": "not_found", "conflict": "failed_precondition",
    "sandbox_timeout": "unavailable", "quota_exceeded": "resource_exhausted", "capacity_exceeded": "unavailable",
    "disk_full": "resource_exhausted", "server_error": "internal", "template_build_failed": "internal",
    "agent_error": "unavailable", "runtime_unavailable": "unavailable",
})


class RpcError(Exception):
    """An error in the protocol's own terms, for the cases Corral's codes do not say precisely enough."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def connect_code(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, RpcError):
        return exc.code, exc.message
    if isinstance(exc, CorralError):
        return _CODE_OF.get(exc.code, "internal"), exc.message
    logger.error("envd call failed", exc_info=exc)
    return "internal", "internal error; see the server log"


def _sandbox_gone(exc: BaseException) -> bool:
    return isinstance(exc, AgentError | SandboxTimeoutError)


# -- requests ------------------------------------------------------------------------------------------------


def rpc_deadline(request: Request) -> float | None:
    """The client's deadline in seconds (`Connect-Timeout-Ms`), if it sent one."""
    raw = request.headers.get("connect-timeout-ms")
    # Connect's grammar: at most 10 ASCII digits ("²".isdigit() holds too; 400 digits overflow a float).
    if raw is None or not (raw.isascii() and raw.isdigit()) or len(raw) > _MAX_TIMEOUT_DIGITS:
        return None
    return int(raw) / 1000 or None


async def read_request(request: Request) -> dict[str, Any]:
    """The request message: the body of a unary call, or the one envelope of a server stream's request."""
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise RpcError("unimplemented", "compressed requests are not supported")
    buffer = bytearray()
    async for chunk in request.stream():  # refused at the first chunk past the limit, never held whole
        buffer += chunk
        if len(buffer) > _MAX_MESSAGE:
            raise RpcError("resource_exhausted", f"request message larger than {_MAX_MESSAGE} bytes")
    body = bytes(buffer)
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type == STREAM_TYPE:
        body = _one_envelope(body)
    elif content_type != UNARY_TYPE:
        raise RpcError("unimplemented", f"content type {content_type!r} is not supported: only Connect's JSON "
                                        "codec is (application/json, application/connect+json)")
    return _message(body)


async def read_stream(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a client stream, as they arrive (each one enveloped)."""
    buffer = bytearray()
    async for chunk in request.stream():
        buffer += chunk
        while len(buffer) >= _ENVELOPE.size:
            flags, length = _ENVELOPE.unpack_from(buffer)
            if length > _MAX_MESSAGE:
                raise RpcError("resource_exhausted", f"message larger than {_MAX_MESSAGE} bytes")
            if len(buffer) < _ENVELOPE.size + length:
                break
            payload = bytes(buffer[_ENVELOPE.size:_ENVELOPE.size + length])
            del buffer[:_ENVELOPE.size + length]
            if flags & END_STREAM:
                return
            yield _message(payload)
    if buffer:
        raise RpcError("invalid_argument", "the request stream ended inside a message")


def _one_envelope(body: bytes) -> bytes:
    if len(body) < _ENVELOPE.size:
        raise RpcError("invalid_argument", "the stream request has no message")
    flags, length = _ENVELOPE.unpack_from(body)
    if flags & 0x01:
        raise RpcError("unimplemented", "compressed messages are not supported")
    if len(body) != _ENVELOPE.size + length:
        raise RpcError("invalid_argument", "the stream request must hold exactly one message")
    return body[_ENVELOPE.size:]


def _message(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload) if payload.strip() else {}
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the decoder goes
        raise RpcError("invalid_argument", f"the message is not valid JSON: {exc}") from None
    if not isinstance(message, dict):
        raise RpcError("invalid_argument", "the message is not a JSON object")
    return message


# -- responses -----------------------------------------------------------------------------------------------


def unary_response(message: Mapping[str, Any]) -> Response:
    return JSONResponse(dict(message))


def unary_error(exc: BaseException) -> Response:
    code, message = connect_code(exc)
    return JSONResponse({"code": code, "message": message}, status_code=HTTP_STATUS.get(code, 500))


def envelope(message: Mapping[str, Any], *, end: bool = False) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _ENVELOPE.pack(END_STREAM if end else 0, len(payload)) + payload


Producer = Callable[[Callable[[Mapping[str, Any]], Awaitable[None]]], Awaitable[None]]


def stream_response(produce: Producer, *, keepalive: Mapping[str, Any] | None = None,
                    interval: float | None = None) -> StreamingResponse:
    """A server stream: `produce(send)` sends the messages; it ends the stream by returning, or with an error.
    `keepalive` is sent after `interval` seconds without a message (E2B's SDKs ask for one to keep proxies from
    closing a quiet stream). A producer whose sandbox went away cuts the connection instead of ending it."""
    return StreamingResponse(_stream(produce, keepalive, interval), media_type=STREAM_TYPE)


async def _stream(produce: Producer, keepalive: Mapping[str, Any] | None,
                  interval: float | None) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=64)  # backpressure on the sandbox's output

    async def send(message: Mapping[str, Any]) -> None:
        await queue.put(envelope(message))

    async def run() -> None:
        try:
            await produce(send)
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            try:
                async with asyncio.timeout(interval if keepalive else None):
                    item = await queue.get()
            except TimeoutError:
                assert keepalive is not None
                yield envelope(keepalive)
                continue
            if item is None:
                break
            yield item
        error = task.exception()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if error is None:
        yield envelope({}, end=True)
        return
    code, message = connect_code(error)
    if _sandbox_gone(error):
        code, message = "unavailable", ("the connection to the sandbox ended before the stream completed: the sandbox "
                                        f"was killed or reached its end of life ({message})")
    yield envelope({"error": {"code": code, "message": message}}, end=True)
