"""The API server's HTTP protocol (`corral.server._reads`): a streamed body reaches the app in reads of up to
1 MiB (asyncio's default is 256 KiB). uvicorn on a real loopback socket."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from corral.server._reads import LARGE_READ, HttpProtocol

pytestmark = pytest.mark.anyio

BODY = 8 * 1024 * 1024


class _Recorder:
    """An ASGI app that takes its time over each body message (so the client's bytes wait in the socket) and
    keeps their sizes."""

    def __init__(self) -> None:
        self.sizes: list[list[int]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        sizes: list[int] = []
        while True:
            await asyncio.sleep(0.02)
            message = await receive()
            sizes.append(len(message.get("body", b"")))
            if not message.get("more_body"):
                break
        self.sizes.append(sizes)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
async def served() -> AsyncIterator[tuple[_Recorder, int]]:
    app = _Recorder()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="error", http=HttpProtocol))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        yield app, sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


async def _put(port: int, size: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"PUT /f HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
        writer.write(b"x" * size)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 60)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_streamed_body_arrives_in_reads_larger_than_asyncios_default(served: tuple[_Recorder, int]) -> None:
    app, port = served
    assert (await _put(port, BODY)).startswith(b"HTTP/1.1 204")
    [sizes] = app.sizes
    assert sum(sizes) == BODY
    # Default reads give at most 256 KiB and what uvicorn buffers before pausing (64 KiB) per message.
    assert max(sizes) > 256 * 1024 + 64 * 1024 and max(sizes) <= LARGE_READ + 64 * 1024 + 1
