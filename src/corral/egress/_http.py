"""The slice of HTTP/1.1 the egress proxy speaks: bounded heads, body framing, and refusal responses.

Heads are checked against HTTP/1.1's grammar (RFC 9112, built from h11's); anything else is `BadMessage`, which the
proxy answers 400 (a request) or 502 (a response). Requests, which go on to servers whose parsers we do not know,
get the strict grammar: no control character but HTAB in a value, exactly one way to frame a body.
Bodies are relayed with their framing untouched (Content-Length or chunked, else until close), so the proxy
never buffers a body and never changes its bytes; they are copied on the raw sockets (`SocketReader`, `Mover`).
Only the lines between chunks are parsed (and checked, as strictly as heads).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import select
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

from h11._abnf import field_content, status_line, token

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
    "parse_request",
    "parse_response",
    "read_head",
    "safe_text",
]

MAX_HEAD = 64 * 1024
MAX_LENGTH_DIGITS = 18  # a Content-Length of up to 10**18 bytes: more than any body, and int() stays trivial
CHUNK = 1024 * 1024  # relay reads: big enough that per-read overhead vanishes next to the copy

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


MAX_BULK_THREADS = 64  # bulk copies in threads at once, per process; more go on on the event loop
_BULK_THREADS = threading.BoundedSemaphore(MAX_BULK_THREADS)


class Mover:
    """Moves bytes from one socket to another (one direction; one mover per direction), counting them in `count`
    and touching `stall`. Both sockets must be non-blocking and not registered with the loop by anyone else for
    the same direction (a transport's socket: use a duplicate of its descriptor, with the transport's reading
    paused while this reads).

    `pump` moves a whole body or tunnel direction. A burst that fills the 1 MiB pipe (a bulk transfer) goes on in a
    thread of its own, splicing and waiting with poll(2) there, until the source goes quiet for `QUIET` seconds:
    each wait of the event loop costs two epoll_ctl calls, a trip through the loop and a task step, and on a
    busy loop the copy waits its turn; the thread is woken by the kernel alone. Idle tunnels hold no thread, and
    at most MAX_BULK_THREADS copies have one at a time."""

    _splice = SPLICE
    QUIET = 0.05  # seconds without a byte to read before a bulk transfer goes back to the event loop
    BATCH = 512 * 1024  # bytes a bulk read from a TCP socket waits for ...
    BATCH_WAIT = 0.002  # ... at most this long

    def __init__(self, count: Count, stall: Stall | None = None) -> None:
        self.count = count
        self.stall = stall
        self._pipe: tuple[int, int] | None = None
        self._pipe_size = 0
        self._buffer: bytearray | None = None
        self._wake: int | None = None  # an eventfd that stops the bulk thread (a cancellation)
        self._stop = False

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None
        if self._wake is not None:
            os.close(self._wake)
            self._wake = None

    def _touch(self, n: int) -> None:
        self.count(n)
        if self.stall is not None:
            self.stall.touch()

    async def send(self, dst: socket.socket, data: bytes | bytearray | memoryview) -> None:
        if data:
            await asyncio.get_running_loop().sock_sendall(dst, data)
            self._touch(len(data))

    async def pump(self, src: socket.socket, dst: socket.socket, limit: int | None = None) -> int:
        """Move bytes until `src` is at EOF or, with a `limit`, `limit` bytes have moved; the bytes moved."""
        moved = 0
        while limit is None or moved < limit:
            left = None if limit is None else limit - moved
            n = await self.move(src, dst, left)
            if not n:
                break
            moved += n
            # A read that filled the pipe (grown to 1 MiB by the first full one): the source had a burst ready.
            if self._splice and n >= self._pipe_size and (left is None or left - n >= CHUNK) \
                    and _BULK_THREADS.acquire(blocking=False):  # else: on the loop, as any other copy
                try:
                    bulk, eof = await self._bulk(src, dst, None if left is None else left - n)
                finally:
                    _BULK_THREADS.release()
                moved += bulk
                if eof:
                    break
        return moved

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
        if n >= self._pipe_size:
            self._grow_pipe()
        if n:
            self._touch(n)
        return n

    def _grow_pipe(self) -> None:
        """A bulk transfer: a bigger pipe (fewer calls). Only then: a pipe's size counts against its owner's pipe
        quota (fs.pipe-user-pages-soft) for as long as it exists, which for a tunnel can be hours."""
        if self._pipe is not None and self._pipe_size < CHUNK:
            with contextlib.suppress(OSError):
                self._pipe_size = fcntl.fcntl(self._pipe[1], fcntl.F_SETPIPE_SZ, CHUNK)

    async def _bulk(self, src: socket.socket, dst: socket.socket, limit: int | None) -> tuple[int, bool]:
        """`_spliced_thread` in a thread of its own; cancelled (a stall, a detach), it stops the thread and waits
        for it: the descriptors it uses must not be closed (and reused) under it."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[int, bool]] = loop.create_future()
        if self._wake is None:
            self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._stop = False

        def run() -> None:
            result: tuple[int, bool] | None = None
            error: BaseException | None = None
            try:
                result = self._spliced_thread(src, dst, limit)
            except BaseException as exc:  # handed to the awaiting task, which raises it
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
                loop.call_soon_threadsafe(_settle, done, result, error)

        threading.Thread(target=run, name="corral-egress-bulk", daemon=True).start()
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            self._stop = True
            os.eventfd_write(self._wake, 1)
            while not done.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(done)
            with contextlib.suppress(BaseException):
                done.result()  # retrieved: a failure of a cancelled transfer is not news
            raise

    def _spliced_thread(self, src: socket.socket, dst: socket.socket, limit: int | None) -> tuple[int, bool]:
        """In the bulk thread: splice until `limit` bytes have moved, `src` is at EOF, nothing arrives for QUIET
        seconds or `_stop`. The pipe is empty whenever this returns normally. Returns (bytes moved, at EOF).

        From a TCP source, reads are batched: SO_RCVLOWAT makes poll wait for BATCH bytes (or the rest of a body
        of known length), at most BATCH_WAIT seconds, so a wakeup moves a pipe's worth, not each segment."""
        assert self._pipe is not None and self._wake is not None
        pipe_out, pipe_in = self._pipe
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        self._grow_pipe()
        readable, writable = select.poll(), select.poll()
        readable.register(src.fileno(), select.POLLIN)
        readable.register(self._wake, select.POLLIN)
        writable.register(dst.fileno(), select.POLLOUT)
        writable.register(self._wake, select.POLLIN)
        lowat = _Lowat(src)
        moved = 0
        quiet_since = time.monotonic()
        try:
            while limit is None or moved < limit:
                size = self._pipe_size if limit is None else min(limit - moved, self._pipe_size)
                lowat.set(min(size, self.BATCH))
                try:
                    n = os.splice(src.fileno(), pipe_in, size, flags=flags)
                except BlockingIOError:
                    if self._stop:
                        return moved, False
                    if not readable.poll(lowat.wait_ms) and time.monotonic() - quiet_since >= self.QUIET:
                        return moved, False  # quiet: back to the event loop, which waits without a thread
                    continue  # BATCH bytes, or BATCH_WAIT passed: what has arrived goes on
                if not n:
                    return moved, True
                left = n
                while left:
                    try:
                        left -= os.splice(pipe_out, dst.fileno(), left, flags=flags)
                    except BlockingIOError:
                        writable.poll()
                    if self._stop:
                        return moved, False
                moved += n
                quiet_since = time.monotonic()
                self._touch(n)
            return moved, False
        finally:
            lowat.set(1)


class _Lowat:
    """SO_RCVLOWAT of a TCP socket, set only when it changes (a Unix socket's poll ignores it: never set).

    Never above a quarter of the receive buffer the kernel has already given the socket: a low-water mark the
    buffer cannot hold twice over makes Linux grow the buffer and clamp the receive window to the mark, which on a
    long path would cap the throughput until autotuning grows the buffer again."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.value = 1
        self.room = 0  # a quarter of SO_RCVBUF, as last read
        self.tcp = sock.family in (socket.AF_INET, socket.AF_INET6)

    @property
    def wait_ms(self) -> int:
        return int(Mover.BATCH_WAIT * 1000) if self.value > 1 else int(Mover.QUIET * 1000)

    def set(self, value: int) -> None:
        if not self.tcp:
            return
        if value > self.room and value > self.value:
            with contextlib.suppress(OSError):
                self.room = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4
        value = max(1, min(value, self.room))
        if value != self.value:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, value)
                self.value = value


def _settle(future: asyncio.Future[tuple[int, bool]], result: tuple[int, bool] | None,
            exc: BaseException | None) -> None:
    """On the loop: the bulk thread's outcome to its task."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        assert result is not None
        future.set_result(result)


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
