"""The slice of HTTP/1.1 the egress proxy speaks: bounded heads, body framing, and refusal responses.

Bodies are relayed with their framing untouched (Content-Length or chunked, else until close), so the proxy
never buffers a body and never changes its bytes; they are copied on the raw sockets (`SocketReader`, `Mover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

__all__ = [
    "MAX_HEAD",
    "BadMessage",
    "Framing",
    "Head",
    "HeadTooLarge",
    "Mover",
    "SocketReader",
    "Stall",
    "error_response",
    "framing",
    "parse_head",
    "read_head",
    "safe_text",
]

MAX_HEAD = 64 * 1024
CHUNK = 1024 * 1024  # relay reads: big enough that per-read overhead vanishes next to the copy
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_HEX = re.compile(rb"^[0-9A-Fa-f]{1,16}$")
_STATUS_LINE = re.compile(r"^HTTP/1\.[01] ([0-9]{3})(?: (.*))?$")
SPLICE = hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")  # Linux (Python 3.10+)
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
    """Read one head (request or response). None at a clean EOF before any byte.

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
    return parse_head(raw)


def parse_head(raw: bytes) -> Head:
    """A head, its blank line included, from its bytes."""
    lines = raw[:-4].decode("latin-1").split("\r\n")
    while lines and not lines[0]:  # RFC 9112: ignore empty lines before a request line
        lines.pop(0)
    if not lines:
        raise BadMessage("empty request")
    parts = lines[0].split(" ")
    if len(parts) < 3 and not lines[0].startswith("HTTP/"):
        raise BadMessage(f"malformed start line {safe_text(lines[0], 80)!r}")
    start = (parts[0], parts[1] if len(parts) > 1 else "", " ".join(parts[2:]))
    return Head(start, [_header(line) for line in lines[1:]], len(raw))


def _header(line: str) -> tuple[str, str]:
    name, sep, value = line.partition(":")
    if not sep or not _TOKEN.match(name):
        raise BadMessage(f"malformed header line {safe_text(line, 80)!r}")
    value = value.strip(" \t")
    if any(c in value for c in "\x00\r\n"):
        raise BadMessage(f"invalid character in header {name}")
    return name, value


def check_request_line(head: Head) -> None:
    method, target, version = head.start
    if not _TOKEN.match(method) or not target or version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadMessage(f"malformed request line {safe_text(' '.join(head.start), 80)!r}")


def parse_status(head: Head) -> tuple[int, str]:
    match = _STATUS_LINE.match(" ".join(head.start))
    if match is None:
        raise BadMessage("malformed status line from upstream")
    return int(match.group(1)), match.group(2) or ""


@dataclass(frozen=True)
class Framing:
    """How a body ends: `length` bytes, `chunked`, or (responses only) at close. `length == 0`: no body."""

    length: int | None = 0
    chunked: bool = False

    @property
    def until_close(self) -> bool:
        return self.length is None and not self.chunked


def framing(head: Head, *, request: bool) -> Framing:
    """RFC 9112 section 6: chunked wins; conflicting or bad lengths are refused (request smuggling)."""
    codings = head.tokens("transfer-encoding")
    lengths = {v.strip() for v in head.get_all("content-length")}
    if codings:
        if request and lengths:
            raise BadMessage("both Transfer-Encoding and Content-Length")
        if "chunked" not in codings:
            if request:
                raise BadMessage("unsupported Transfer-Encoding")
            return Framing(length=None)
        return Framing(length=None, chunked=True)
    if lengths:
        if len(lengths) > 1 or not all(v.isascii() and v.isdigit() for v in lengths):
            raise BadMessage("invalid Content-Length")
        return Framing(length=int(lengths.pop()))
    return Framing(length=0 if request else None)


Count = Callable[[int], None]


# -- moving bodies on the raw sockets --------------------------------------------------------------------------------
#
# Bodies and tunnels are copied on the sockets themselves, not through asyncio streams (which copy every byte twice
# more and halve the throughput): with splice(2) through a pipe where Linux has it, so the bytes never enter this
# process, else with recv_into/sendall on one reused buffer. Either way exactly the bytes the framing says, never
# one more (a Content-Length copy asks the kernel for no more than what is left).


class Stall:
    """`async with Stall(seconds) as stall:` raises TimeoutError in its body once nothing has moved (`touch()`) for
    `seconds`. One timer per period, not one per read or write: on a fast link per-operation timeouts would cost
    more than the copy. Other tasks may `touch()` it too (a request body going up while a response is awaited)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = time.monotonic()
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None

    def touch(self) -> None:
        self.last = time.monotonic()

    async def __aenter__(self) -> Stall:
        await self._timeout.__aenter__()
        self.last = time.monotonic()
        self._handle = asyncio.get_running_loop().call_later(self.seconds, self._check)
        return self

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        quiet = time.monotonic() - self.last
        if quiet >= self.seconds:
            self._timeout.reschedule(loop.time())  # expire now: the body gets TimeoutError
        else:
            self._handle = loop.call_later(self.seconds - quiet, self._check)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._timeout.__aexit__(exc_type, exc, tb)  # turns its own cancellation into TimeoutError


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _ready(fd: int, *, write: bool) -> None:
    """Wait until `fd` is readable (or writable); errors and EOF count as ready (the next call reports them)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    if write:
        loop.add_writer(fd, _wake, future)
    else:
        loop.add_reader(fd, _wake, future)
    try:
        await future
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


class Mover:
    """Moves bytes from one socket to another (one direction; one mover per direction), counting them in `count`
    and touching `stall`. Both sockets must be non-blocking and not registered with the loop by anyone else for
    the same direction (a transport's socket: use a duplicate of its descriptor, with the transport's reading
    paused while this reads)."""

    _splice = SPLICE

    def __init__(self, count: Count, stall: Stall | None = None) -> None:
        self.count = count
        self.stall = stall
        self._pipe: tuple[int, int] | None = None
        self._pipe_size = 0
        self._buffer: bytearray | None = None

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _touch(self, n: int) -> None:
        self.count(n)
        if self.stall is not None:
            self.stall.touch()

    async def send(self, dst: socket.socket, data: bytes | bytearray | memoryview) -> None:
        if data:
            await asyncio.get_running_loop().sock_sendall(dst, data)
            self._touch(len(data))

    async def move(self, src: socket.socket, dst: socket.socket, limit: int | None = None) -> int:
        """Move what `src` has (at least one byte, at most `limit`) to `dst`; 0 once `src` is at EOF."""
        size = CHUNK if limit is None else min(limit, CHUNK)
        if self._splice:
            try:
                return await self._move_spliced(src, dst, size)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                self._splice = False  # no byte has moved: splice fails on its first call or never
                self.close()
        loop = asyncio.get_running_loop()
        if self._buffer is None:
            self._buffer = bytearray(64 * 1024)  # grows for bulk transfers; most bodies never need more
        elif size > len(self._buffer) and len(self._buffer) < CHUNK:
            self._buffer = bytearray(CHUNK)
        view = memoryview(self._buffer)[:size]
        n = await loop.sock_recv_into(src, view)
        if n:
            await loop.sock_sendall(dst, view[:n])
            self._touch(n)
        return n

    async def _move_spliced(self, src: socket.socket, dst: socket.socket, size: int) -> int:
        if self._pipe is None:
            self._pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._pipe_size = fcntl.fcntl(self._pipe[1], fcntl.F_GETPIPE_SZ)
        pipe_out, pipe_in = self._pipe
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        while True:
            try:
                n = os.splice(src.fileno(), pipe_in, size, flags=flags)
                break
            except BlockingIOError:
                await _ready(src.fileno(), write=False)
        left = n
        while left:  # the pipe is empty again before this returns: what was read is what was sent
            try:
                left -= os.splice(pipe_out, dst.fileno(), left, flags=flags)
            except BlockingIOError:
                await _ready(dst.fileno(), write=True)
        if n >= self._pipe_size and self._pipe_size < CHUNK:
            # A bulk transfer: a bigger pipe (fewer calls). Only then: a pipe's size counts against its owner's
            # pipe quota (fs.pipe-user-pages-soft) for as long as it exists, which for a tunnel can be hours.
            with contextlib.suppress(OSError):
                self._pipe_size = fcntl.fcntl(pipe_in, fcntl.F_SETPIPE_SZ, CHUNK)
        if n:
            self._touch(n)
        return n


class SocketReader:
    """Buffered reads of heads and chunk lines from a non-blocking socket; bodies go past the buffer (`body()`)."""

    def __init__(self, sock: socket.socket, data: bytes = b"") -> None:
        self.sock = sock
        self.buffer = bytearray(data)
        self.eof = False

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
        return parse_head(self.take(end + 4))

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
            while await mover.move(self.sock, dst):
                pass
        else:
            await self._length(dst, frame.length, mover, prefix)

    async def _length(self, dst: socket.socket, left: int, mover: Mover, prefix: bytes = b"") -> None:
        first = self.take(left)
        await mover.send(dst, prefix + first)
        left -= len(first)
        while left > 0:
            n = await mover.move(self.sock, dst, left)
            if not n:
                raise BadMessage("the body ended early")
            left -= n

    async def _chunked(self, dst: socket.socket, mover: Mover, prefix: bytes) -> None:
        """Chunk lines are checked; lines and small chunks are sent in batches, big chunks socket to socket."""
        out = bytearray(prefix)

        async def flush() -> None:
            await mover.send(dst, out)
            out.clear()

        while True:
            line = await self.line(flush)
            size_text = line.split(b";", 1)[0].strip()
            if not _HEX.match(size_text):  # int(x, 16) would take "0x1", "+1" and "1_0" too
                raise BadMessage("malformed chunk size")
            size = int(size_text, 16)
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
        while True:  # trailers, up to the empty line
            line = await self.line(flush)
            out += line
            if line == b"\r\n":
                break
        await flush()


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
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body
