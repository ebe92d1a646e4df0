"""A blocking, thread-safe framed channel over one accepted Unix socket (the agent's side)."""

from __future__ import annotations

import threading
import time

from . import protocol

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from _socket import socket
    from typing import Any


class Closed(Exception):
    """The host went away."""


MSG_DONTWAIT = 64  # Linux; `_socket` has it, typeshed's stub of it does not
_HEARTBEAT = protocol.encode(protocol.HEARTBEAT)


class Channel:
    def __init__(self, sock: socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.last_sent = time.monotonic()  # what `heartbeats` measures silence from

    def heartbeat(self) -> None:
        """One heartbeat frame, unless a frame is being sent (not silent) or the host has not read what it was
        sent (the socket buffer is full: it has frames to read, it is not waiting on silence). Never blocks: one
        thread beats for every connection, and a host that stopped reading must not stop the others' beats."""
        # Whatever happens, the next beat is due an interval from now: a skipped beat must not be retried at once.
        self.last_sent = time.monotonic()
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            sent = self.sock.send(_HEARTBEAT, MSG_DONTWAIT)
            if sent < len(_HEARTBEAT):  # a 5-byte frame cut by a nearly full buffer: finish it, or break framing
                self.sock.sendall(_HEARTBEAT[sent:])
        except OSError:
            pass  # full (BlockingIOError), or the host went away: the operation's own thread finds out
        finally:
            self._send_lock.release()

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1024 * 1024))
            if not chunk:
                raise Closed
            buf += chunk
        return bytes(buf)

    def recv(self) -> tuple[int, bytes]:
        kind, length = self.recv_header()
        try:
            return kind, self._recv_exact(length) if length else b""
        except OSError as exc:
            raise Closed from exc

    def recv_header(self) -> tuple[int, int]:
        """The next frame's kind and payload length; the payload follows with `recv_into` (or `skip`)."""
        try:
            return protocol.parse_header(self._recv_exact(protocol.HEADER.size))
        except OSError as exc:
            raise Closed from exc

    def recv_into(self, view: memoryview) -> int:
        """Read what has arrived of the current payload into `view` (at most its length, at least one byte).

        Bulk data goes straight from the socket to its buffer: no frame is assembled, no bytes are copied twice.
        """
        try:
            n = self.sock.recv_into(view)
        except OSError as exc:
            raise Closed from exc
        if not n:
            raise Closed
        return n

    def skip(self, length: int) -> None:
        """Read and drop `length` payload bytes."""
        try:
            while length:
                length -= len(self._recv_exact(min(length, protocol.CHUNK)))
        except OSError as exc:
            raise Closed from exc

    def recv_json(self, expected: int) -> dict[str, Any]:
        kind, payload = self.recv()
        if kind != expected:
            raise protocol.ProtocolError(f"expected frame kind {expected}, got {kind}")
        return protocol.decode_json(payload)

    def send(self, kind: int, payload: bytes = b"") -> None:
        # Bytes go in frames of a chunk; a JSON message is read whole, so it is one frame (up to MAX_FRAME).
        frames = [protocol.encode(kind, payload)] if kind in protocol.JSON_KINDS else \
            [protocol.encode(kind, payload[i : i + protocol.CHUNK]) for i in range(0, max(len(payload), 1),
                                                                                   protocol.CHUNK)]
        try:
            with self._send_lock:
                for frame in frames:
                    self.sock.sendall(frame)
                self.last_sent = time.monotonic()
        except OSError as exc:
            raise Closed from exc

    def send_json(self, kind: int, obj: dict[str, Any]) -> None:
        frame = protocol.encode_json(kind, obj)
        try:
            with self._send_lock:
                self.sock.sendall(frame)
                self.last_sent = time.monotonic()
        except OSError as exc:
            raise Closed from exc

    def event(self, **fields: Any) -> None:
        self.send_json(protocol.EVENT, fields)

    def error(self, code: str, message: str, **details: Any) -> None:
        self.send_json(protocol.ERROR, {"code": code, "message": message, "details": details})


def relay(ch: Channel, kind: int, payload: bytes) -> None:
    """A frame to the host, unless it left (`Closed`): the operation's own loop notices that and stops."""
    try:
        ch.send(kind, payload)
    except Closed:
        pass
