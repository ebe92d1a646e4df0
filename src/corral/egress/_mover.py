"""Moving bodies and tunnels on the raw sockets (`Mover`), and the one timer that ends a copy nothing moved in for
too long (`Stall`).

Bodies and tunnels are copied on the sockets themselves, not through asyncio streams (which copy every byte twice
more and halve the throughput): with splice(2) through a pipe where Linux has it, so the bytes never enter this
process, else with recv_into/sendall on one reused buffer. Either way exactly the bytes the framing says, never
one more (a Content-Length copy asks the kernel for no more than what is left).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["CHUNK", "Count", "Mover", "Stall"]

CHUNK = 1024 * 1024  # relay reads: big enough that per-read overhead vanishes next to the copy
SPLICE = hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")  # Linux (Python 3.10+)
Count = Callable[[int], None]


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

