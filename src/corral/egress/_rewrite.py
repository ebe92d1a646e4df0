"""The proxy's way to hosts that a sandbox's secrets are bound to (docs/secrets.md): HTTP/1.1 parsed both ways
over streams, plain or inside TLS the proxy intercepted, each request with its placeholders replaced by values
(`Injection`) and each answer with values replaced by placeholders (`Scrubber`).

Every other request keeps the fast path (`_proxy.py`: heads parsed, bodies copied socket to socket, tunnels
spliced); this one reads every byte of every answer, because it must, and of request bodies when a secret opts
into bodies (plain HTTP with no such secret: the body is copied socket to socket as on the fast path, `copy_body`).
Answers are searched for each value as a substring first; only values found go into the regex (`Scrubber`).
What makes it different from the fast path:
- every byte of an answer's head the sandbox gets is scrubbed: the reason phrase, each header's name and value
  (one by one, so a value can never break the head's structure; a value with a space that spans two of them
  refuses the answer), and the proxy's own words about a malformed head, which are made from its scrubbed bytes
  (they quote the head, cut short, and a value cut short no longer matches);
- besides the values, the encoded forms the proxy itself made of them (the Basic credentials it encoded again)
  are scrubbed, in every answer to the sandbox from then on (`Produced`);
- requests ask for `Accept-Encoding: identity`, and an answer compressed anyway (gzip, deflate) is decompressed
  before scrubbing; another content-coding cannot be checked and is refused (502);
- an answer's transfer-coding must be exactly `chunked` (HTTP/1.1) or none; any other (`gzip, chunked`, chunked
  in an HTTP/1.0 answer) is refused (502), not decoded. Refusing is the safe choice: requests to bound hosts carry
  no `TE` (it is hop-by-hop and dropped), so no server was asked for one and real ones do not send one; decoding
  would be a second decompressor stacked with the content-coding's, more ways to frame a body, and one more place
  where a coding overlooked passes a value on unseen;
- answers go to the client chunked (HTTP/1.1) or delimited by close (HTTP/1.0): scrubbing changes lengths;
- protocol upgrades (WebSocket) are not offered to bound hosts: `Upgrade` is a hop-by-hop header and is dropped.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ._http import (
    HOP_BY_HOP,
    MAX_HEAD,
    BadMessage,
    Framing,
    Head,
    HeadTooLarge,
    framing,
    parse_response,
    safe_text,
)
from ._mover import CHUNK
from ._reasons import Refusal
from ._secrets import BODY_MAX, MAX_FORMS, FormsFull, Injection, Produced, Scrubber, SecretBinding, bound

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
                 secrets: tuple[SecretBinding, ...], timeout: float, sent_up: Count, sent_down: Count,
                 produced: Produced | None = None) -> None:
        self.client_reader, self.client_writer = client
        self.upstream_reader, self.upstream_writer = upstream
        self.secrets = secrets  # all of the sandbox's: any of them is scrubbed from any answer
        self.bound = bound(secrets, host, port)  # those put into requests to this host and port
        self.timeout = timeout
        self.sent_up, self.sent_down = sent_up, sent_down
        self.produced = produced if produced is not None else Produced()  # the sandbox's, across connections
        self.injection = Injection(self.bound, self.produced)
        self.scrub = Scrubber(secrets)
        self.used: set[str] = set()  # names of the secrets put into requests so far
        self.responded = False  # the client has bytes of this answer: a failure can only close the connection
        self._raw_head = b""  # the last answer head as it came, for words about what is wrong with it
        # Set where both ends are plain sockets: copies a request body no secret goes into socket to socket.
        self.copy_body: Callable[[Framing], Awaitable[None]] | None = None

    async def exchange(self, head: Head, body: Framing, path: str, authority: str, *, keep_upstream: bool) -> Exchange:
        """Send `head` (origin-form `path`, `authority` as Host) and its body upstream, then relay the answer."""
        self.injection, self.responded = Injection(self.bound, self.produced), False
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
        try:
            headers = [(k, self.injection.header(k, v)) for k, v in head.headers
                       if k.lower() not in skip and not k.lower().startswith("proxy-")]
        except FormsFull:
            raise Refusal(403, f"Corral egress: this sandbox has had the proxy build {MAX_FORMS} different Basic "
                               "credentials with secrets in them, the most it keeps (it scrubs each from every "
                               "answer); use one of those again", "secret forms limit") from None
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
        # Made now, after the request's head: it scrubs the forms this request's credentials were given too.
        self.scrub = Scrubber(self.secrets, self.produced.pairs())
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
        frame = Framing(0) if no_body else self._framing(response)
        decode = None if no_body else self._decoder(response)
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
            await out(self.scrub.feed_parts(_inflate(decode, piece) if decode is not None else piece))
        await out(self.scrub.feed_parts(_inflate(decode, None)) if decode is not None else [])
        await out([self.scrub.flush()])
        if chunked:
            await self._to_client(b"0\r\n\r\n")

    def _client_head(self, response: Head, *, chunked: bool, close: bool, rewritten: bool = False) -> bytes:
        drop = HOP_BY_HOP | response.tokens("connection") | {"transfer-encoding"}
        if rewritten:  # the body is re-framed (and decompressed): its old length and coding no longer hold
            drop |= {"content-length", "content-encoding"}
        version, status, reason = response.start
        text = self.scrub.text
        lines = [f"{version} {status} {text(reason)}".rstrip(),
                 *(f"{text(k)}: {text(v)}" for k, v in response.headers if k.lower() not in drop)]
        if self.scrub.straddles("\r\n".join(lines).encode("latin-1")):
            raise Refusal(502, "Corral egress: the server's answer head holds a secret's value across two of its "
                               "parts (status, a header's name and value), where it cannot be replaced",
                          "bad upstream response")
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        if close:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _read_head(self) -> Head:
        raw = b""
        try:
            async with asyncio.timeout(self.timeout):
                raw = await self.upstream_reader.readuntil(b"\r\n\r\n")
            if len(raw) > MAX_HEAD:
                raise HeadTooLarge
            head = parse_response(raw)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, HeadTooLarge, BadMessage) as exc:
            raise _bad_upstream(self._fault(raw) if isinstance(exc, BadMessage) else _why(exc)) from None
        self._raw_head = raw
        return head

    def _fault(self, raw: bytes) -> str:
        """What is wrong with a head, in words made from its scrubbed bytes: the words quote the head, cut short to
        fit a status line, and a value cut short would no longer be found in them."""
        try:
            framing(parse_response(self.scrub.replace(raw)), request=False)
        except BadMessage as exc:
            return str(exc)
        return "a malformed head"  # only a value made it malformed: nothing to quote

    def _framing(self, response: Head) -> Framing:
        """How the answer's body ends; a transfer-coding other than chunked is refused (the module's docstring)."""
        codings = [t.strip().lower() for v in response.get_all("transfer-encoding") for t in v.split(",")]
        if codings and (codings != ["chunked"] or response.start[0] != "HTTP/1.1"):
            shown = self._shown(", ".join(response.get_all("transfer-encoding")), 60)
            raise _bad_upstream(f"the server answered {response.start[0]} with Transfer-Encoding {shown}, which the "
                                "proxy cannot check for secrets; answers from a host with secrets may only be "
                                "chunked (HTTP/1.1) or not transfer-coded")
        try:
            return framing(response, request=False)
        except BadMessage:
            raise _bad_upstream(self._fault(self._raw_head)) from None

    def _decoder(self, response: Head) -> zlib._Decompress | None:
        """A decompressor for the answer's Content-Encoding; a value hidden in compressed bytes could not be found."""
        values = response.get_all("content-encoding")
        codings = [c for c in (t.strip().lower() for v in values for t in v.split(",")) if c and c != "identity"]
        if not codings:
            return None
        if codings in (["gzip"], ["x-gzip"]):
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        if codings == ["deflate"]:
            return zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib-wrapped, as RFC 9110 says deflate is
        raise _bad_upstream(f"the server answered with Content-Encoding {self._shown(', '.join(values), 60)}, which "
                            "the proxy cannot check for secrets; only identity, gzip and deflate are passed on")

    def _shown(self, text: str, limit: int) -> str:
        """The server's text in a refusal the sandbox reads: scrubbed first, then cut to fit."""
        return safe_text(self.scrub.text(text), limit)

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


def _bad_upstream(why: str) -> Refusal:
    return Refusal(502, f"Corral egress: bad response from the server: {why}", "bad upstream response")


def _inflate(decode: zlib._Decompress, data: bytes | None) -> bytes:
    """`data` decompressed (None: the end); a corrupt stream is a bad message, not this process's failure."""
    try:
        return decode.flush() if data is None else decode.decompress(data)
    except zlib.error:
        raise BadMessage("the compressed body is corrupt") from None


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
            raise BadMessage("malformed chunk size") from None  # not quoted: the line may hold a value
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
