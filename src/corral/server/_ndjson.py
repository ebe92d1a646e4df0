"""The NDJSON output stream shared by exec and process attach (docs/api.md, "Commands").

One line per event: `{"event": "stdout"|"stderr", "data_b64"}` as output is produced, then one last line that
the producer returns (`exit`, `running` or `error`). A bounded queue sits between the command and the client,
so a slow client slows the output it reads instead of growing the server's memory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ._context import Audited

__all__ = ["OutputSink", "Sink", "b64", "line", "output_stream"]

QUEUE_DEPTH = 64  # events held for a slow client before the producer waits for it

OutputSink = Callable[[bytes], Awaitable[None]]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class Sink:
    """Where a producer puts its events: output as `stdout`/`stderr` lines, anything else with `event`. It counts
    the output bytes it carried, so a last event can leave out what the stream already delivered."""

    def __init__(self, queue: asyncio.Queue[bytes | None]) -> None:
        self._queue = queue
        self.stdout_sent = 0
        self.stderr_sent = 0

    async def stdout(self, data: bytes) -> None:
        self.stdout_sent += len(data)
        await self._queue.put(line({"event": "stdout", "data_b64": b64(data)}))

    async def stderr(self, data: bytes) -> None:
        self.stderr_sent += len(data)
        await self._queue.put(line({"event": "stderr", "data_b64": b64(data)}))

    async def event(self, obj: dict[str, Any]) -> None:
        await self._queue.put(line(obj))


Producer = Callable[[Sink], Awaitable[bytes]]


async def output_stream(produce: Producer, audit: Audited) -> AsyncIterator[bytes]:
    """Stream what `produce(sink)` emits, then the last line it returns; audit at the end.

    A client that leaves cancels `produce` (what that means is the producer's: exec kills its command, attach
    only detaches) and is recorded as `disconnected`.
    """
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_DEPTH)
    sink = Sink(queue)

    async def run() -> None:
        await queue.put(await produce(sink))
        await queue.put(None)  # not on cancellation: only the reader below cancels, and it is gone then

    task = asyncio.create_task(run())
    try:
        while (item := await queue.get()) is not None:
            yield item
    finally:
        if not task.done():
            audit.outcome["disconnected"] = True
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await audit.record()
