"""The fake agent's side of one connection (`corral/agent/protocol.py` frames) and its error answers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from corral.agent import protocol

__all__ = ["ERRNO_CODES", "AgentFailure", "Conn", "os_failure"]

ERRNO_CODES = {2: "not_found", 13: "permission_denied", 1: "permission_denied", 17: "conflict", 39: "conflict",
               21: "invalid_request", 20: "invalid_request", 40: "invalid_request", 22: "invalid_request"}


class AgentFailure(Exception):
    """An error answer: the real agent's `code` and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def os_failure(exc: OSError, path: str) -> AgentFailure:
    code = ERRNO_CODES.get(exc.errno or 0, "server_error")
    return AgentFailure(code, f"{path}: {os.strerror(exc.errno) if exc.errno else exc}")


class Conn:
    """One agent connection: frames in and out, and when the agent last sent one (for heartbeats)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.last_sent = time.monotonic()
        self.closed = False

    async def recv(self) -> tuple[int, bytes]:
        kind, length = protocol.parse_header(await self.reader.readexactly(protocol.HEADER.size))
        return kind, await self.reader.readexactly(length) if length else b""

    def send(self, kind: int, payload: bytes = b"") -> None:
        if self.closed:
            return
        for i in range(0, max(len(payload), 1), protocol.CHUNK):
            self.writer.write(protocol.encode(kind, payload[i : i + protocol.CHUNK]))
        self.last_sent = time.monotonic()

    def event(self, **fields: Any) -> None:
        self.send(protocol.EVENT, protocol.encode_json(protocol.EVENT, fields)[protocol.HEADER.size:])

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
