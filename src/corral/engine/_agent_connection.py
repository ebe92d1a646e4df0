"""One connection to a sandbox's agent, as the host holds it: frames sent and received, heartbeats skipped, and
every wait bounded by the idle timeout (docs/architecture.md, "Agent liveness"); what the agents of one sandbox
share (`AgentState`); and the data a request sends (`Source`), cut into frames.

`AgentCalls` (`_agent_calls.py`) opens these connections, one per operation."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from .._exceptions import AgentError, error_from_code
from ..agent import protocol

Source = bytes | bytearray | memoryview | str | IO[bytes] | AsyncIterable[bytes] | Iterable[bytes]
_UPLOAD_SEND_BUFFER = 1024 * 1024  # a frame in flight while the agent writes the last one
_SO_SNDBUFFORCE = 32  # Linux; the socket module does not name it
_T = TypeVar("_T")


@dataclass(frozen=True)
class Liveness:
    """How long the host waits on a silent agent: the agent beats every `heartbeat_interval` seconds of silence,
    and `idle_timeout` seconds without any frame end the call with `AgentError` (None: wait forever)."""

    heartbeat_interval: float = 5.0
    idle_timeout: float | None = 30.0


class AgentState:
    """What every client of one agent shares (`as_user` makes more): whether it beats, and whether Corral froze
    it (its own pause: a frozen agent is silent, not wedged)."""

    def __init__(self) -> None:
        self.heartbeats: bool | None = None  # None: not known until a ping tells the agent's protocol version
        self.frozen = False
        self.thawed_at = -float("inf")

    def excused(self, idle: float) -> bool:
        """Whether a silence of `idle` seconds is Corral's doing: frozen now, or thawed since it began."""
        return self.frozen or time.monotonic() - self.thawed_at < idle


class AgentConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, label: str, *, op: str = "",
                 idle: float | None = None, state: AgentState | None = None,
                 details: dict[str, Any] | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.label = label
        self.op = op
        self.idle = idle  # None: an agent of before heartbeats, whose silences prove nothing
        self.state = state or AgentState()
        self.details = details or {}

    async def send(self, kind: int, payload: bytes = b"", *, bounded: bool = False) -> None:
        """`bounded`: the agent must take the bytes within the idle timeout (file data, which it reads as fast
        as it writes; not stdin, which waits for a process that may rightly not read it for hours)."""
        for i in range(0, max(len(payload), 1), protocol.CHUNK):
            self.writer.write(protocol.encode(kind, payload[i : i + protocol.CHUNK]))
        if bounded:
            await self.within_idle(self.writer.drain)
        else:
            await self.writer.drain()

    async def send_json(self, kind: int, obj: dict[str, Any]) -> None:
        self.writer.write(protocol.encode_json(kind, obj))
        await self.writer.drain()

    async def recv(self) -> tuple[int, bytes]:
        """The next frame that is not a heartbeat; `AgentError` after the idle timeout without any frame."""
        while True:
            kind, payload = await self._frame()
            if kind != protocol.HEARTBEAT:
                break
        if kind == protocol.ERROR:
            err = protocol.decode_json(payload)
            raise error_from_code(str(err.get("code")), str(err.get("message")), err.get("details"))
        return kind, payload

    async def _frame(self) -> tuple[int, bytes]:
        # Header and payload waited for apart: a pause may freeze the agent mid-frame, and a wait that starts
        # again must not have dropped the header it had read.
        header = await self.within_idle(lambda: self.reader.readexactly(protocol.HEADER.size))
        kind, length = protocol.parse_header(header)
        if not length:
            return kind, b""
        return kind, await self.within_idle(lambda: self.reader.readexactly(length))

    async def within_idle(self, step: Callable[[], Awaitable[_T]]) -> _T:
        """`step()`, failing with `AgentError` if it makes no progress for the idle timeout. Cancelling a read or
        a drain loses nothing (the bytes stay buffered), so a silence Corral caused (a pause) just waits again."""
        if self.idle is None:
            return await step()
        while True:
            deadline = asyncio.timeout(self.idle)
            try:
                async with deadline:
                    return await step()
            except TimeoutError:
                if not deadline.expired():
                    raise  # the step's own (a TCP ETIMEDOUT), mapped by `_op`
                if not self.state.excused(self.idle):
                    raise silent_agent(self.label, self.op, self.idle, self.details) from None

    async def event(self) -> dict[str, Any]:
        kind, payload = await self.recv()
        if kind != protocol.EVENT:
            raise protocol.ProtocolError(f"expected an event frame, got kind {kind}")
        return protocol.decode_json(payload)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self.writer.wait_closed()


def silent_agent(label: str, op: str, idle: float, details: Mapping[str, Any]) -> AgentError:
    """The error of a call whose agent said nothing, not even a heartbeat, for the idle timeout."""
    during = f" during {op!r}" if op else ""
    return AgentError(f"the agent of {label} stopped answering: no frame, not even a heartbeat, for {idle:g}s"
                      f"{during}; its process may be stopped, frozen (not by Corral's pause) or wedged",
                      details={**details, "op": op, "idle_timeout": idle})


def widen_send_buffer(conn: AgentConnection) -> None:
    """Let an upload keep a whole frame in flight to the agent over a Unix socket.

    With the default buffer (~200 KiB, less than one 256 KiB chunk of a request body) host and agent take turns:
    the host waits while the agent writes to disk, then the agent waits for the host (measured on this hop alone:
    ~560 MB/s, ~950 with this). Forced past `net.core.wmem_max` when we may (root); TCP tunes its own buffers.
    """
    sock = conn.writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return
    for option in (_SO_SNDBUFFORCE, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, _UPLOAD_SEND_BUFFER)
            return


async def send_data(conn: AgentConnection, data: Source) -> int:
    sent = 0
    async for chunk in chunks(data):
        await conn.send(protocol.DATA, chunk, bounded=True)
        sent += len(chunk)
    await conn.send(protocol.DATA_END, bounded=True)
    return sent


async def chunks(data: Source) -> AsyncIterator[bytes]:
    """Any supported source as chunks of at most one frame."""
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        for i in range(0, len(view), protocol.CHUNK):
            yield bytes(view[i : i + protocol.CHUNK])
        return
    if hasattr(data, "read"):
        while chunk := data.read(protocol.CHUNK):
            yield bytes(chunk)
        return
    if isinstance(data, AsyncIterable):
        async for piece in data:
            for i in range(0, len(piece), protocol.CHUNK):
                yield bytes(piece[i : i + protocol.CHUNK])
        return
    for piece in data:
        for i in range(0, len(piece), protocol.CHUNK):
            yield bytes(piece[i : i + protocol.CHUNK])


async def sock_read_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = protocol.parse_header(await _sock_read_exactly(sock, protocol.HEADER.size))
    return kind, await _sock_read_exactly(sock, length) if length else b""


async def _sock_read_exactly(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from a non-blocking socket, never more; `IncompleteReadError` at an early EOF."""
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(buf), n)
        buf += chunk
    return bytes(buf)
