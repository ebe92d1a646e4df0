"""`OriginRequests`: requests sent to the proxy as a server (origin form, `GET /path`): the package mirror's
`/pypi/...` and `/npm/...` for sandboxes granted `@packages`, and the agent's reports of refused DNS lookups
(`/_corral/dns?name=`)."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse

from .._exceptions import CorralError
from . import _reasons as reasons
from ._connection_base import ConnectionBase
from ._events import MirrorResponse, PackageMirrorProtocol
from ._forwarding import client_keeps
from ._http import (
    HOP_BY_HOP,
    Framing,
    Head,
    safe_text,
)
from ._mover import CHUNK
from ._proxied import Attempt
from ._reasons import Refusal

log = logging.getLogger("corral.egress")


class OriginRequests(ConnectionBase):
    """The origin-form requests, one part of a `Connection`."""

    async def _origin(self, head: Head, body: Framing, path: str, attempt: Attempt) -> bool:
        # Neither reads a request body: one the client sent is left unread, so the connection cannot go on.
        keep = client_keeps(head) and not (body.chunked or body.length)
        if urllib.parse.urlsplit(path).path == "/_corral/dns":
            return await self._dns(keep, path, attempt)
        mirror = self.proxy.mirror
        if mirror is not None and mirror.handles(path):
            return await self._mirror(mirror, head, keep, path, attempt)
        raise reasons.not_a_proxy_request(safe_text(path, 80))

    async def _dns(self, keep: bool, path: str, attempt: Attempt) -> bool:
        names = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("name")
        if not names or not names[0]:
            raise reasons.bad_request("/_corral/dns needs ?name=")
        attempt.kind, attempt.method, attempt.port = "dns", "DNS", 53
        attempt.host = safe_text(names[0], 253)
        attempt.rule, attempt.reason = "dns refused", reasons.dns_refused(attempt.host)
        self._respond(b"HTTP/1.1 204 No Content\r\n" + (b"" if keep else b"Connection: close\r\n") + b"\r\n")
        async with asyncio.timeout(self.proxy.io_timeout):
            await self.writer.drain()
        return keep

    async def _mirror(self, mirror: PackageMirrorProtocol, head: Head, keep: bool, path: str,
                      attempt: Attempt) -> bool:
        attempt.kind, attempt.host, attempt.path = "mirror", "mirror", safe_text(path, 2000)
        policy = self._known().policy
        if not policy.grants_preset("packages"):
            raise reasons.mirror_denied(policy)
        attempt.allowed, attempt.rule = True, "preset @packages"
        try:
            response = await mirror.handle(head.start[0], path, head.headers)
        except CorralError as exc:
            raise Refusal(502, f"Corral package mirror: {exc.message}", "mirror failed") from exc
        except Exception as exc:  # the mirror's bug must not look like the sandbox's fault
            log.exception("package mirror failed on %s", path)
            raise Refusal(502, f"Corral package mirror failed: {type(exc).__name__}: {exc}", "mirror failed") from exc
        return await self._send_mirror(response, head, keep, attempt)

    async def _send_mirror(self, response: MirrorResponse, request: Head, keep: bool, attempt: Attempt) -> bool:
        headers = [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP | {"transfer-encoding"}]
        has_length = any(k.lower() == "content-length" for k, _ in headers)
        no_body = request.start[0] == "HEAD" or response.status in (204, 304)
        chunked = not no_body and not has_length and request.start[2] == "HTTP/1.1"
        keep = keep and (no_body or has_length or chunked)
        headers += [("Transfer-Encoding", "chunked")] if chunked else []
        headers += [] if keep else [("Connection", "close")]
        lines = [f"HTTP/1.1 {response.status} {safe_text(response.reason, 200)}"] + [f"{k}: {v}" for k, v in headers]
        out = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._respond(out)
        attempt.count_down(len(out))
        try:
            if not no_body:
                await self._stream_mirror_body(response, chunked, attempt)
            async with asyncio.timeout(self.proxy.io_timeout):
                await self.writer.drain()
        finally:
            aclose = getattr(response.body, "aclose", None)
            if aclose is not None:
                await aclose()
        return keep

    async def _stream_mirror_body(self, response: MirrorResponse, chunked: bool, attempt: Attempt) -> None:
        async for data in response.body:
            if not data:
                continue
            out = b"%x\r\n%b\r\n" % (len(data), data) if chunked else data
            self.writer.write(out)
            attempt.count_down(len(out))
            if self.writer.transport.get_write_buffer_size() > CHUNK:
                async with asyncio.timeout(self.proxy.io_timeout):
                    await self.writer.drain()
        if chunked:
            self.writer.write(b"0\r\n\r\n")
            attempt.count_down(5)
