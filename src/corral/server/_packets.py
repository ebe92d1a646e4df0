"""`one_packet(send)`: a whole response of known length leaves in one TCP segment, not two.

uvicorn writes a response's head and its body apart (two sends on the socket: two packets, and a reader that
wakes twice), which was a good part of what a short command's exec round trip spent outside the command. Where
the server's `send` is uvicorn's (its cycle has the connection's transport) and the connection is TCP on Linux,
the socket is corked (`TCP_CORK`) from the head of a response with a `content-length` to its first body message
(a `Response` sends it right after its head, before the loop runs anything else), and the kernel sends it all at
the uncork. A body that is not there by the loop's next turn (a proxied port's slow upstream) does not hold the
head back: the socket is uncorked then. Streamed responses (no `content-length`: NDJSON) are never corked. Anywhere
else (another server, a test's ASGI transport, a Unix socket) `send` is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from starlette.types import Message, Send

__all__ = ["Corked", "one_packet"]

_CORK = getattr(socket, "TCP_CORK", None)  # Linux only


class Corked:
    """The `send` of one request; `release()` uncorks if a response never got its body (an error, a cancel)."""

    def __init__(self, send: Send, sock: Any) -> None:
        self._send = send
        self._sock = sock
        self._corked = False

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start" and _has_length(message):
            self._set(True)
            asyncio.get_running_loop().call_soon(self.release)  # no later than the loop's next turn
        try:
            await self._send(message)
        finally:
            if kind == "http.response.body":
                self.release()

    def release(self) -> None:
        if self._corked:
            self._set(False)

    def _set(self, on: bool) -> None:
        with contextlib.suppress(OSError):  # a connection already gone: nothing to hold back or push out
            self._sock.setsockopt(socket.IPPROTO_TCP, _CORK, 1 if on else 0)
            self._corked = on


def one_packet(send: Send) -> Corked | None:
    """The corking `send` for a request served by uvicorn over TCP; None where that cannot be done."""
    if _CORK is None:
        return None
    transport = getattr(getattr(send, "__self__", None), "transport", None)  # uvicorn's RequestResponseCycle
    get_extra_info = getattr(transport, "get_extra_info", None)
    sock = get_extra_info("socket") if callable(get_extra_info) else None
    if sock is None or getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
        return None
    return Corked(send, sock)


def _has_length(message: Message) -> bool:
    return any(name.lower() == b"content-length" for name, _ in message.get("headers", ()))
