"""The slice of HTTP/1.1 the egress proxy speaks: bounded heads, body framing, and refusal responses.

Heads are checked against HTTP/1.1's grammar (RFC 9112, built from h11's); anything else is `BadMessage`, which the
proxy answers 400 (a request) or 502 (a response). Requests, which go on to servers whose parsers we do not know,
get the strict grammar: no control character but HTAB in a value, exactly one way to frame a body.
Bodies are relayed with their framing untouched (Content-Length or chunked, else until close), so the proxy
never buffers a body and never changes its bytes; they are copied on the raw sockets (`SocketReader`, `Mover` of
`_mover.py`).
Only the lines between chunks are parsed (and checked, as strictly as heads).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from h11._abnf import field_content, status_line, token

from ._mover import CHUNK, Mover

__all__ = [
    "MAX_HEAD",
    "BadMessage",
    "Framing",
    "Head",
    "HeadTooLarge",
    "SocketReader",
    "error_response",
    "framing",
    "parse_request",
    "parse_response",
    "read_head",
    "safe_text",
]

MAX_HEAD = 64 * 1024
MAX_LENGTH_DIGITS = 18  # a Content-Length of up to 10**18 bytes: more than any body, and int() stays trivial

# The grammar's pieces come from h11 (`h11._abnf`, a private module: the expressions h11's own parser is built from),
# compiled as bytes patterns as h11 does (on str, `\s` would also match \x1c-\x1f, \x85 and \xa0).
_TOKEN = re.compile(token.encode())
_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")
_REQUEST_LINE = re.compile(rb"(?P<method>%b) (?P<target>[^\x00-\x20\x7f]+) (?P<version>HTTP/1\.[01])" % token.encode())
_BAD_IN_TARGET = re.compile(rb"[\x00-\x20\x7f]")
_STATUS_LINE = re.compile(status_line.encode())
# Header lines: name ":" OWS [ value OWS ]. (h11's `OWS field-value OWS`, with the value optional, makes two OWS meet
# on a value of whitespace only: a failing match then takes quadratic time, 20 s for a 64 KiB line.) Requests get
# RFC 9110 5.5 as written: field-vchar = VCHAR / obs-text, SP and HTAB only between them. Responses get h11's
# field-content, which also lets other control characters through (real servers send them), never NUL, CR or LF.
_VCHAR = rb"[\x21-\x7e\x80-\xff]"
_REQUEST_FIELD = re.compile(rb"%b:[ \t]*(?:%b+(?:[ \t]+%b+)*[ \t]*)?" % (token.encode(), _VCHAR, _VCHAR))
_RESPONSE_FIELD = re.compile(rb"%b:[ \t]*(?:%b[ \t]*)?" % (token.encode(), field_content.encode()))
_REQUEST_FIELDS = re.compile(rb"(?:%b\r\n)*" % _REQUEST_FIELD.pattern)  # every header line of a head at once
_RESPONSE_FIELDS = re.compile(rb"(?:%b\r\n)*" % _RESPONSE_FIELD.pattern)
# RFC 9112 7.1.1: chunk-size [ chunk-ext ] CRLF, chunk-ext = *( BWS ";" BWS name [ BWS "=" BWS value ] ), the value
# a token or a quoted-string; h11's `;.*` would pass bare CRs and control characters on.
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_CHUNK_LINE = re.compile(rb"(?P<size>[0-9A-Fa-f]{1,16})(?:[ \t]*;[ \t]*%b(?:[ \t]*=[ \t]*(?:%b|%b))?)*[ \t]*\r\n"
                         % (token.encode(), token.encode(), _QUOTED))
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}


class BadMessage(Exception):
    """A malformed HTTP message; `str()` is the explanation sent back (400)."""


class HeadTooLarge(Exception):
    """The head exceeded MAX_HEAD (431)."""


@dataclass
class Head:
    """A parsed request head (`method target version`) or response head (`version status reason`)."""

    start: tuple[str, str, str]
    headers: list[tuple[str, str]] = field(default_factory=list)
    size: int = 0  # bytes on the wire

    def get(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def get_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self.headers if k.lower() == name]

    def tokens(self, name: str) -> set[str]:
        """The comma-separated, lower-cased tokens of every `name` header (Connection, Transfer-Encoding)."""
        return {t.strip().lower() for v in self.get_all(name) for t in v.split(",") if t.strip()}


async def read_head(reader: asyncio.StreamReader) -> Head | None:
    """Read one request head. None at a clean EOF before any byte.

    The reader's buffer limit must be MAX_HEAD: a head without its blank line within it is `HeadTooLarge`.
    """
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise BadMessage("the connection ended inside the request head") from exc
    except asyncio.LimitOverrunError as exc:
        raise HeadTooLarge(f"the head exceeds {MAX_HEAD} bytes") from exc
    if len(raw) > MAX_HEAD:
        raise HeadTooLarge(f"the head exceeds {MAX_HEAD} bytes")
    return parse_request(raw)


def parse_request(raw: bytes) -> Head:
    """A request head, its blank line included: `method target HTTP/1.x`, then header lines, each as RFC 9112 and
    RFC 9110 write them (no control character but HTAB, no bare CR or LF, no obsolete line folding)."""
    lines = raw[:-2]  # every line with its CRLF
    at = 0
    while lines.startswith(b"\r\n", at):  # RFC 9112: ignore empty lines before a request line
        at += 2
    if at == len(lines):
        raise BadMessage("empty request")
    end = lines.index(b"\r\n", at)
    match = _REQUEST_LINE.fullmatch(lines, at, end)
    if match is None:
        raise BadMessage(_request_line_fault(lines[at:end]))
    method, target, version = match.group("method", "target", "version")
    start = (method.decode("ascii"), target.decode("latin-1"), version.decode("ascii"))
    return Head(start, _fields(lines[end + 2:], _REQUEST_FIELDS, _REQUEST_FIELD), len(raw))


def parse_response(raw: bytes) -> Head:
    """A response head, its blank line included: `HTTP/1.x status [reason]`, then header lines, in h11's grammar."""
    lines = raw[:-2]
    end = lines.index(b"\r\n")
    match = _STATUS_LINE.fullmatch(lines, 0, end)
    if match is None or b"HTTP/" + match["http_version"] not in _VERSIONS:
        raise BadMessage(f"malformed status line {safe_text(lines[:end].decode('latin-1'), 80)!r}")
    version, status, reason = match.group("http_version", "status_code", "reason")
    start = ("HTTP/" + version.decode("ascii"), status.decode("ascii"), (reason or b"").decode("latin-1"))
    return Head(start, _fields(lines[end + 2:], _RESPONSE_FIELDS, _RESPONSE_FIELD), len(raw))


def _request_line_fault(line: bytes) -> str:
    method, _, rest = line.partition(b" ")
    target, _, version = rest.rpartition(b" ")
    bad = _BAD_IN_TARGET.search(target)
    if _TOKEN.fullmatch(method) and version in _VERSIONS and bad is not None:
        return (f"invalid character {bad[0].decode('latin-1')!r} in the request target "
                "(percent-encode spaces and control characters)")
    return f"malformed request line {safe_text(line.decode('latin-1'), 80)!r}"


def _fields(lines: bytes, grammar: re.Pattern[bytes], line_grammar: re.Pattern[bytes]) -> list[tuple[str, str]]:
    """Header lines, each with its CRLF, as (name, value) without the value's surrounding whitespace. One match
    checks them all; the fault, if any, names the header, never its value (which may be a credential)."""
    if grammar.fullmatch(lines) is None:
        bad = next(line for line in lines.split(b"\r\n") if line_grammar.fullmatch(line) is None)
        raise BadMessage(_field_fault(bad))
    fields = lines.decode("latin-1").split("\r\n")
    fields.pop()  # what follows the last CRLF: nothing
    return [(name, value.strip(" \t")) for name, _, value in (field.partition(":") for field in fields)]


def _field_fault(line: bytes) -> str:
    name, colon, _ = line.partition(b":")
    if line[:1] in (b" ", b"\t"):
        return "obsolete line folding (a header line that starts with whitespace)"
    if not colon or not _TOKEN.fullmatch(name):
        return f"malformed header line {safe_text(name.decode('latin-1'), 40)!r}"
    return f"invalid character in header {name.decode('ascii')}"


def parse_status(head: Head) -> tuple[int, str]:
    """The status code and reason of a head from `parse_response`."""
    return int(head.start[1]), head.start[2]


@dataclass(frozen=True)
class Framing:
    """How a body ends: `length` bytes, `chunked`, or (responses only) at close. `length == 0`: no body."""

    length: int | None = 0
    chunked: bool = False

    @property
    def until_close(self) -> bool:
        return self.length is None and not self.chunked


def framing(head: Head, *, request: bool) -> Framing:
    """RFC 9112 section 6, strictly for requests (request smuggling) and as a client must for responses."""
    return _request_framing(head) if request else _response_framing(head)


def _request_framing(head: Head) -> Framing:
    """Exactly `Transfer-Encoding: chunked` (HTTP/1.1 only), or one Content-Length, or no body; never both."""
    codings, lengths = head.get_all("transfer-encoding"), head.get_all("content-length")
    if codings and lengths:
        raise BadMessage("both Transfer-Encoding and Content-Length")
    if codings:
        if len(codings) > 1 or codings[0].lower() != "chunked":
            raise BadMessage(f"unsupported Transfer-Encoding {safe_text(', '.join(codings), 60)!r} (a request "
                             "body may only be sent with exactly 'Transfer-Encoding: chunked')")
        if head.start[2] != "HTTP/1.1":
            raise BadMessage("Transfer-Encoding in an HTTP/1.0 request")
        return Framing(length=None, chunked=True)
    if len(lengths) > 1:
        raise BadMessage("more than one Content-Length")
    return Framing(length=_content_length(lengths[0])) if lengths else Framing(length=0)


def _response_framing(head: Head) -> Framing:
    """Transfer-Encoding overrides Content-Length; chunked when it is the final coding, else until close (6.3)."""
    codings = head.get_all("transfer-encoding")
    if codings:
        final = codings[-1].rpartition(",")[2].strip().lower()
        return Framing(length=None, chunked=final == "chunked" and head.start[0] == "HTTP/1.1")
    lengths = {v.strip() for value in head.get_all("content-length") for v in value.split(",")}
    if len(lengths) > 1:
        raise BadMessage("conflicting Content-Length values")
    return Framing(length=_content_length(lengths.pop())) if lengths else Framing(length=None)


def _content_length(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise BadMessage(f"invalid Content-Length {safe_text(text, 20)!r}")
    if len(text) > MAX_LENGTH_DIGITS:
        raise BadMessage(f"Content-Length of {len(text)} digits (at most {MAX_LENGTH_DIGITS})")
    return int(text)




class SocketReader:
    """Buffered reads of heads and chunk lines from a non-blocking socket; bodies go past the buffer (`body()`).
    `request`: what it reads is a request (heads and trailers in the strict grammar), else a response."""

    def __init__(self, sock: socket.socket, data: bytes = b"", *, request: bool = False) -> None:
        self.sock = sock
        self.buffer = bytearray(data)
        self.eof = False
        self._parse = parse_request if request else parse_response
        self._trailer = _REQUEST_FIELD if request else _RESPONSE_FIELD

    async def fill(self) -> bool:
        """Read what the socket has into the buffer; False at EOF."""
        if self.eof:
            return False
        data = await asyncio.get_running_loop().sock_recv(self.sock, 64 * 1024)
        self.eof = not data
        self.buffer += data
        return bool(data)

    def take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    async def read_head(self) -> Head | None:
        """One head, as `read_head` reads it from a stream: None at EOF before any byte."""
        seen = 0
        while (end := self.buffer.find(b"\r\n\r\n", max(0, seen - 3))) < 0:
            if len(self.buffer) > MAX_HEAD:
                raise HeadTooLarge(f"the head exceeds {MAX_HEAD} bytes")
            seen = len(self.buffer)
            if not await self.fill():
                if not self.buffer.strip():
                    return None
                raise BadMessage("the connection ended inside the head")
        if end + 4 > MAX_HEAD:
            raise HeadTooLarge(f"the head exceeds {MAX_HEAD} bytes")
        return self._parse(self.take(end + 4))

    async def line(self, flush: Callable[[], Awaitable[None]]) -> bytes:
        """One CRLF-terminated line (chunk sizes, trailers); `flush` runs before every wait for more bytes."""
        seen = 0
        while (end := self.buffer.find(b"\r\n", max(0, seen - 1))) < 0:
            if len(self.buffer) > MAX_HEAD:
                raise BadMessage("malformed chunked body")
            seen = len(self.buffer)
            await flush()
            if not await self.fill():
                raise BadMessage("malformed chunked body")
        return self.take(end + 2)

    async def body(self, dst: socket.socket, frame: Framing, mover: Mover, prefix: bytes = b"") -> None:
        """Copy one body to `dst` as is: `prefix` (a head) and the buffered bytes in one send, then the rest
        straight from socket to socket."""
        if frame.chunked:
            await self._chunked(dst, mover, prefix)
        elif frame.length is None:
            await mover.send(dst, prefix + self.take(len(self.buffer)))
            await mover.pump(self.sock, dst)
        else:
            await self._length(dst, frame.length, mover, prefix)

    async def _length(self, dst: socket.socket, left: int, mover: Mover, prefix: bytes = b"") -> None:
        first = self.take(left)
        await mover.send(dst, prefix + first)
        left -= len(first)
        if left > 0 and await mover.pump(self.sock, dst, left) < left:
            raise BadMessage("the body ended early")

    async def _chunked(self, dst: socket.socket, mover: Mover, prefix: bytes) -> None:
        """Chunk lines are checked before they go on (a bad one never does); lines and small chunks are sent in
        batches, big chunks socket to socket."""
        out = bytearray(prefix)

        async def flush() -> None:
            await mover.send(dst, out)
            out.clear()

        while True:
            line = await self.line(flush)
            match = _CHUNK_LINE.fullmatch(line)
            if match is None:
                raise BadMessage(_chunk_fault(line))
            size = int(match["size"], 16)  # on the matched hex digits only: int() would take "0x1", "+1", "1_0"
            out += line
            if size == 0:
                break
            data = self.take(size)
            out += data
            if len(data) < size:
                await flush()
                await self._length(dst, size - len(data), mover)
            if await self.line(flush) != b"\r\n":
                raise BadMessage("malformed chunk end")
            out += b"\r\n"
            if len(out) >= CHUNK:
                await flush()
        while (line := await self.line(flush)) != b"\r\n":  # trailers, up to the empty line
            if self._trailer.fullmatch(line, 0, len(line) - 2) is None:
                raise BadMessage(f"malformed trailer line ({_field_fault(line[:-2])})")
            out += line
        out += line
        await flush()


def _chunk_fault(line: bytes) -> str:
    size = line.split(b";", 1)[0].strip()
    if not _HEX.fullmatch(size):
        return "malformed chunk size"
    return "malformed chunk extension (a control character, a bare CR or LF, or not name[=value])"


def safe_text(text: str, limit: int = 400) -> str:
    """Printable ASCII only (other characters become '?'), at most `limit` characters: fit for a status line."""
    clean = "".join(c if " " <= c <= "~" else "?" for c in text)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def error_response(status: int, reason: str, *, marker: str | None = None, extra: dict[str, object] | None = None,
                   keep_alive: bool = False) -> bytes:
    """`HTTP/1.1 <status> <reason>`, the reason again in a text body plus a JSON line, and the
    `X-Corral-Egress` header (`marker`) when the proxy itself refused or failed."""
    reason = safe_text(reason)
    body = (reason + "\n" + json.dumps({"status": status, "reason": reason, **(extra or {})}) + "\n").encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: " + ("keep-alive" if keep_alive else "close")]
    if marker:
        head.append(f"X-Corral-Egress: {safe_text(marker, 600)}")
    if status == 407:  # the challenge a 407 must carry (RFC 9110 15.5.8): clients then send their credentials
        head.append('Proxy-Authenticate: Basic realm="corral-egress"')
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body
