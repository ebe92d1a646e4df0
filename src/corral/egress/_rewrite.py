"""The proxy's way to hosts that a sandbox's secrets are bound to (docs/secrets.md): HTTP/1.1 parsed both ways
over streams, plain or inside TLS the proxy intercepted, each request with its placeholders replaced by values
(`Injection`) and each answer with values replaced by placeholders (`Scrubber`).

Every other request keeps the fast path (`_proxy.py`: heads parsed, bodies copied socket to socket, tunnels
spliced); this one reads every byte of every answer, because it must, and of request bodies when a secret opts
into bodies (plain HTTP with no such secret: the body is copied socket to socket as on the fast path, `copy_body`).
Answers are searched for each value as a substring first; only values found go into the regex (`Scrubber`).
What makes it different from the fast path:
- requests ask for `Accept-Encoding: identity`, and an answer compressed anyway (gzip, deflate) is decompressed
  before scrubbing; another encoding cannot be checked and is refused (502);
- answers go to the client chunked (HTTP/1.1) or delimited by close (HTTP/1.0): scrubbing changes lengths;
- protocol upgrades (WebSocket) are not offered to bound hosts: `Upgrade` is a hop-by-hop header and is dropped.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ._http import CHUNK, HOP_BY_HOP, MAX_HEAD, BadMessage, Framing, Head, HeadTooLarge, framing, parse_response
from ._reasons import Refusal
from ._secrets import BODY_MAX, Injection, Scrubber, SecretBinding, bound

__all__ = ["Exchange", "Rewriter"]

Count = Callable[[int], None]


@dataclass
class Exchange:
    """How one request and its answer ended: whether the client and the upstream connections can carry more."""

    client_keeps: bool
    upstream_keeps: bool


class Rewriter:
    """Requests from `client` to one upstream connection, one at a time, with secrets put in and taken out."""

    def __init__(self, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter], *, host: str, port: int,
                 secrets: tuple[SecretBinding, ...], timeout: float, sent_up: Count, sent_down: Count) -> None:
        self.client_reader, self.client_writer = client
        self.upstream_reader, self.upstream_writer = upstream
        self.secrets = secrets  # all of the sandbox's: any of them is scrubbed from any answer
        self.bound = bound(secrets, host, port)  # those put into requests to this host and port
        self.timeout = timeout
        self.sent_up, self.sent_down = sent_up, sent_down
        self.injection = Injection(self.bound)
        self.scrub = Scrubber(secrets)
        self.used: set[str] = set()  # names of the secrets put into requests so far
        self.responded = False  # the client has bytes of this answer: a failure can only close the connection
        # Set where both ends are plain sockets: copies a request body no secret goes into socket to socket.
        self.copy_body: Callable[[Framing], Awaitable[None]] | None = None

    async def exchange(self, head: Head, body: Framing, path: str, authority: str, *, keep_upstream: bool) -> Exchange:
        """Send `head` (origin-form `path`, `authority` as Host) and its body upstream, then relay the answer."""
        self.injection, self.scrub, self.responded = Injection(self.bound), Scrubber(self.secrets), False
        try:
            return await self._exchange(head, body, path, authority, keep_upstream=keep_upstream)
        finally:
            self.used |= self.injection.used

    async def _exchange(self, head: Head, body: Framing, path: str, authority: str, *,
                        keep_upstream: bool) -> Exchange:
        if "100-continue" in head.tokens("expect") and (body.chunked or body.length):
            # We take the body now, not the server: tell the client to send it. Interim: a final status may follow.
            self.client_writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            async with asyncio.timeout(self.timeout):
                await self.client_writer.drain()
        data = await self._request_body(body) if self.injection.rewrites_body else None
        await self._to_upstream(self._request_head(head, path, authority, keep_upstream, data))
        if data is not None:
            await self._to_upstream(data)
        elif (body.chunked or body.length) and self.copy_body is not None:
            await self._upstream_flushed()  # the head first: bytes on the socket must not overtake it
            await self.copy_body(body)
        elif body.chunked or body.length:
            async for piece in _body(self.client_reader, body, self.timeout):
                await self._to_upstream(b"%x\r\n%b\r\n" % (len(piece), piece) if body.chunked else piece)
            if body.chunked:
                await self._to_upstream(b"0\r\n\r\n")
        return await self._response(head, keep_upstream)

    def _request_head(self, head: Head, path: str, authority: str, keep: bool, data: bytes | None) -> bytes:
        method, _, version = head.start
        named = head.tokens("connection")
        skip = HOP_BY_HOP | named | {"host", "accept-encoding", "expect"}
        if data is not None:
            skip |= {"content-length", "transfer-encoding"}
        headers = [(k, self.injection.header(k, v)) for k, v in head.headers
                   if k.lower() not in skip and not k.lower().startswith("proxy-")]
        lines = [f"{method} {self.injection.text(path)} {version}", f"Host: {authority}",
                 *(f"{k}: {v}" for k, v in headers), "Accept-Encoding: identity",
                 "Connection: " + ("keep-alive" if keep else "close")]
        if data is not None:
            lines.append(f"Content-Length: {len(data)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _request_body(self, body: Framing) -> bytes:
        if not (body.chunked or body.length):
            return b""
        if body.length is not None and body.length > BODY_MAX:
            raise _too_large()
        parts, size = [], 0
        async for piece in _body(self.client_reader, body, self.timeout):
            size += len(piece)
            if size > BODY_MAX:
                raise _too_large()
            parts.append(piece)
        return self.injection.body(b"".join(parts))

    async def _response(self, request: Head, keep_upstream: bool) -> Exchange:
        while True:
            response = await self._read_head()
            status = int(response.start[1])
            if status == 101:
                raise Refusal(502, "Corral egress: the server switched protocols, which connections to a host with "
                                   "secrets do not support", "bad upstream response")
            if status >= 200:
                break
            await self._to_client(self._client_head(response, chunked=False, close=False))  # 1xx: passes on
        no_body = request.start[0] == "HEAD" or status in (204, 304)
        frame = Framing(0) if no_body else _response_framing(response)
        decode = None if no_body else _decoder(response)
        client_keeps = request.start[2] == "HTTP/1.1" and "close" not in request.tokens("connection")
        chunked = not no_body and client_keeps
        upstream_keeps = keep_upstream and not frame.until_close and "close" not in response.tokens("connection")
        await self._to_client(self._client_head(response, chunked=chunked, close=not client_keeps,
                                                rewritten=not no_body))
        if not no_body:
            await self._relay_body(frame, decode, chunked)
        return Exchange(client_keeps=client_keeps and (chunked or no_body), upstream_keeps=upstream_keeps)

    async def _relay_body(self, frame: Framing, decode: zlib._Decompress | None, chunked: bool) -> None:
        async def out(parts: list[bytes | memoryview]) -> None:
            size = sum(len(p) for p in parts)
            if size:  # one copy: the scrubbed pieces and the chunk's framing joined
                await self._to_client(b"".join([b"%x\r\n" % size, *parts, b"\r\n"] if chunked else parts))

        async for piece in _body(self.upstream_reader, frame, self.timeout):
            await out(self.scrub.feed_parts(decode.decompress(piece) if decode is not None else piece))
        await out(self.scrub.feed_parts(decode.flush()) if decode is not None else [])
        await out([self.scrub.flush()])
        if chunked:
            await self._to_client(b"0\r\n\r\n")

    def _client_head(self, response: Head, *, chunked: bool, close: bool, rewritten: bool = False) -> bytes:
        drop = HOP_BY_HOP | response.tokens("connection") | {"transfer-encoding"}
        if rewritten:  # the body is re-framed (and decompressed): its old length and coding no longer hold
            drop |= {"content-length", "content-encoding"}
        lines = [" ".join(response.start).rstrip(),
                 *(f"{k}: {self.scrub.text(v)}" for k, v in response.headers if k.lower() not in drop)]
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        if close:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _read_head(self) -> Head:
        try:
            async with asyncio.timeout(self.timeout):
                raw = await self.upstream_reader.readuntil(b"\r\n\r\n")
            if len(raw) > MAX_HEAD:
                raise HeadTooLarge
            return parse_response(raw)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, HeadTooLarge, BadMessage) as exc:
            raise Refusal(502, f"Corral egress: bad response from the server: {_why(exc)}",
                          "bad upstream response") from None

    async def _to_client(self, data: bytes) -> None:
        self.responded = True
        self.client_writer.write(data)
        self.sent_down(len(data))
        async with asyncio.timeout(self.timeout):
            await self.client_writer.drain()

    async def _upstream_flushed(self) -> None:
        transport = self.upstream_writer.transport
        if transport.get_write_buffer_size():
            transport.set_write_buffer_limits(high=0)  # drain() now returns only once the buffer is empty
            try:
                async with asyncio.timeout(self.timeout):
                    await self.upstream_writer.drain()
            finally:
                transport.set_write_buffer_limits()

    async def _to_upstream(self, data: bytes) -> None:
        self.upstream_writer.write(data)
        self.sent_up(len(data))
        async with asyncio.timeout(self.timeout):
            await self.upstream_writer.drain()


def _why(exc: Exception) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the connection ended inside the head"
    if isinstance(exc, asyncio.LimitOverrunError | HeadTooLarge):
        return f"the head exceeds {MAX_HEAD} bytes"
    return str(exc)


def _too_large() -> Refusal:
    return Refusal(413, f"Corral egress: a request body to a host with secrets in bodies is read whole, and this one "
                        f"is larger than {BODY_MAX} bytes", "bad request")


def _response_framing(response: Head) -> Framing:
    try:
        return framing(response, request=False)
    except BadMessage as exc:
        raise Refusal(502, f"Corral egress: bad response from the server: {exc}", "bad upstream response") from None


def _decoder(response: Head) -> zlib._Decompress | None:
    """A decompressor for the answer's Content-Encoding; a value hidden in compressed bytes could not be found."""
    codings = [c for c in (t.strip().lower() for v in response.get_all("content-encoding") for t in v.split(","))
               if c and c != "identity"]
    if not codings:
        return None
    if codings in (["gzip"], ["x-gzip"]):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if codings == ["deflate"]:
        return zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib-wrapped, as RFC 9110 says deflate is
    raise Refusal(502, f"Corral egress: the server answered with Content-Encoding {', '.join(codings)}, which the "
                       "proxy cannot check for secrets; only identity, gzip and deflate are passed on",
                  "bad upstream response")


async def _body(reader: asyncio.StreamReader, frame: Framing, timeout: float) -> AsyncIterator[bytes]:
    """A message body's bytes (chunked framing removed, trailers dropped), as they arrive."""
    try:
        if frame.chunked:
            async for piece in _chunks(reader, timeout):
                yield piece
            return
        left = frame.length
        while left is None or left > 0:
            async with asyncio.timeout(timeout):
                piece = await reader.read(CHUNK if left is None else min(CHUNK, left))
            if not piece:
                if left is None:
                    return
                raise BadMessage(f"the connection ended {left} bytes before the end of the body")
            if left is not None:
                left -= len(piece)
            yield piece
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise BadMessage("the connection ended inside the body") from exc


async def _chunks(reader: asyncio.StreamReader, timeout: float) -> AsyncIterator[bytes]:
    while True:
        async with asyncio.timeout(timeout):
            line = await reader.readuntil(b"\r\n")
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadMessage(f"malformed chunk size {size_text[:20]!r}") from None
        if size == 0:
            async with asyncio.timeout(timeout):
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers: not passed on
            return
        while size:
            async with asyncio.timeout(timeout):
                piece = await reader.readexactly(min(size, CHUNK))
            size -= len(piece)
            yield piece
        async with asyncio.timeout(timeout):
            if await reader.readexactly(2) != b"\r\n":
                raise BadMessage("a chunk does not end with CRLF")
