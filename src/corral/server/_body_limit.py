"""`BodyLimitMiddleware`: every request body that is parsed whole (JSON of /v1, MCP, E2B's control plane) has a
limit, enforced before the body is buffered past it (docs/api.md, "Sizes").

A `Content-Length` over the limit is refused before a byte is read; a chunked body (or one without a length) is
read up to the limit and refused at the first chunk past it. Either way the answer is 413 `invalid_request`
naming the limit (`details.limit`, bytes), and the route never runs, so nothing is changed or audited at its
size. What is streamed and never held whole is not limited here: file and archive uploads, process stdin, E2B's
`/files` uploads, and every request to a sandbox's data plane (its port's app decides; envd's RPCs keep their
own message limit, enforced the same way in e2b/_connect.py).
"""

from __future__ import annotations

import re

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._errors import error_body
from ._ports import port_target

__all__ = ["JSON_BODY_LIMIT", "BodyLimitMiddleware"]

JSON_BODY_LIMIT = 16 * 2**20  # bytes: MCP's write_file takes file contents in JSON; larger files are uploads
# Bodies that are streamed to the sandbox as they come, never held whole: no limit here.
_STREAMED = re.compile(r"^(?:/v1/sandboxes/[^/]+/(?:files|archive|processes/[^/]+/stdin)|/files)$")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, domain: str, limit: int = JSON_BODY_LIMIT) -> None:
        self.app = app
        self.domain = domain
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._limited(scope):
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.limit:
            await self._refuse(scope, receive, send)
            return
        if length == 0 or (length is None and not _chunked(scope)):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app sees that as it would have
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    def _limited(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        if b"e2b-sandbox-id" in headers or port_target(_text(headers.get(b"host")), self.domain) is not None:
            return False  # a sandbox's data plane
        return _STREAMED.fullmatch(scope["path"]) is None

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body("invalid_request", f"the request body is larger than the limit of {self.limit} bytes "
                          f"({self.limit // 2**20} MiB); send files as uploads (PUT /v1/sandboxes/{{id}}/files)",
                          {"limit": self.limit, "field": "body"})
        await JSONResponse(body, status_code=413, headers={"connection": "close"})(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(reversed(messages))

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            text = bytes(value).strip()
            return int(text) if text.isdigit() else None  # a bad length is the ASGI server's to refuse
    return None


def _chunked(scope: Scope) -> bool:
    return any(key == b"transfer-encoding" for key, _ in scope["headers"])


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None
