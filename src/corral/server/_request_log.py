"""`RequestLogMiddleware`: every request gets an id, answers with it, and ends in one log line.

The id is the client's (or its proxy's) `X-Request-Id` when that is a sensible one (`REQUEST_ID`), else a new one.
It is written back into the request's headers, so whatever serves the request further (another replica, through
`ReplicaMiddleware`) keeps it; it is sent back in the response's `X-Request-Id`; and the service writes it into
the audit records of the request (`corral.service.request_scope`).

The log line (logger `corral.requests`, at INFO) carries what the service learned: tenant, key, action, sandbox,
outcome, with the status and duration. `corral serve --log-format json` prints it as one JSON object; in the
default text format it is not printed (uvicorn's access log is). Nothing is formatted when nobody listens.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..service import REQUEST_ID, RequestInfo, new_request_id, request_scope

__all__ = ["REQUEST_ID_HEADER", "RequestLogMiddleware"]

REQUEST_ID_HEADER = "X-Request-Id"
_HEADER = REQUEST_ID_HEADER.lower().encode("latin-1")

logger = logging.getLogger("corral.requests")


class RequestLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        request_id = _incoming_id(scope) or new_request_id()
        headers = [(k, v) for k, v in scope["headers"] if k != _HEADER]
        scope = {**scope, "headers": [*headers, (_HEADER, request_id.encode("latin-1"))]}
        answer = _Answer(send, request_id)
        started = time.perf_counter()
        with request_scope(request_id) as info:
            try:
                await self.app(scope, receive, answer.send)
            except BaseException:
                answer.status = answer.status or 500
                raise
            finally:
                if logger.isEnabledFor(logging.INFO):
                    logger.info("request", extra=_fields(scope, info, answer.status, time.perf_counter() - started))


class _Answer:
    """The response's `send`, with the request id added to its head, and the status kept for the log line."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self._header = (_HEADER, request_id.encode("latin-1"))
        self.status = 0

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind in ("http.response.start", "websocket.accept"):
            self.status = message.get("status", 101)
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER]  # a replica's, say
            message = {**message, "headers": [*kept, self._header]}
        elif kind == "websocket.close" and not self.status:
            self.status = 403  # refused before it was accepted (Starlette answers a close so with 403)
        await self._send(message)


def _incoming_id(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == _HEADER:
            text = value.decode("latin-1")
            return text if REQUEST_ID.fullmatch(text) else None
    return None


def _fields(scope: Scope, info: RequestInfo, status: int, seconds: float) -> dict[str, Any]:
    """The log line's fields (the path without its query: E2B's signed URLs carry their signature there)."""
    client = scope.get("client")
    error = info.error
    return {"request_id": info.request_id, "method": scope.get("method", "GET"), "path": scope.get("path", ""),
            "status": status, "duration_ms": round(seconds * 1000, 3), "tenant_id": info.tenant_id,
            "key_id": info.key_id, "action": info.action, "sandbox_id": info.sandbox_id,
            "outcome": error or ("ok" if 0 < status < 400 else "error"),
            "client": client[0] if client else None}
