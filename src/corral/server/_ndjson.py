"""The NDJSON output stream shared by exec, code and process attach (docs/api.md, "Commands").

One line per event: `{"event": "stdout"|"stderr", "data_b64"}` as output is produced, then one last line that
the producer returns (`exit`, `end`, `running` or `error`). A producer that raises still ends the stream, with
an `error` line, so a client never waits for a last line that will not come. A bounded queue sits between the
command and the client, so a slow client slows the output it reads instead of growing the server's memory.
The operation's audit record is the service's (`corral.service.Streamed`); this module only frames its output.
The code interpreter sends the same events as binary frames to a client that asks for them (`Framing`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from .._exceptions import CorralError, ServerError

__all__ = ["NDJSON", "Framing", "OutputSink", "Producer", "Sink", "b64", "line", "ndjson_response", "output_stream"]

QUEUE_DEPTH = 64  # events held for a slow client before the producer waits for it

logger = logging.getLogger("corral.server")

OutputSink = Callable[[bytes], Awaitable[None]]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class Framing:
    """How events become bytes on the wire: NDJSON lines (output as base64), unless a subclass says otherwise."""

    media_type = "application/x-ndjson"

    def output(self, kind: str, data: bytes) -> bytes:
        return line({"event": kind, "data_b64": b64(data)})

    def event(self, obj: dict[str, Any]) -> bytes:
        return line(obj)


NDJSON = Framing()


class Sink:
    """Where a producer puts its events: output as `stdout`/`stderr` events, anything else with `event`. It counts
    the output bytes it carried, so a last event can leave out what the stream already delivered."""

    def __init__(self, queue: asyncio.Queue[bytes | None], framing: Framing = NDJSON) -> None:
        self._queue = queue
        self.framing = framing
        self.stdout_sent = 0
        self.stderr_sent = 0

    async def stdout(self, data: bytes) -> None:
        self.stdout_sent += len(data)
        await self._queue.put(self.framing.output("stdout", data))

    async def stderr(self, data: bytes) -> None:
        self.stderr_sent += len(data)
        await self._queue.put(self.framing.output("stderr", data))

    async def event(self, obj: dict[str, Any]) -> None:
        await self._queue.put(self.framing.event(obj))


Producer = Callable[[Sink], Awaitable[bytes]]
Ending = Callable[[], Awaitable[None]]


def ndjson_response(produce: Producer, on_end: Ending, framing: Framing = NDJSON) -> StreamingResponse:
    return StreamingResponse(output_stream(produce, on_end, framing), media_type=framing.media_type)


async def output_stream(produce: Producer, on_end: Ending, framing: Framing = NDJSON) -> AsyncIterator[bytes]:
    """Stream what `produce(sink)` emits, then the last line it returns; then call `on_end`, always.

    A client that leaves cancels `produce` (what that means is the producer's: exec kills its command, attach
    only detaches). `on_end` runs also when `produce` never got to run (the client left at once): it ends the
    operation (the service records it as `disconnected` if nothing else ended it).
    """
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_DEPTH)
    sink = Sink(queue, framing)

    async def run() -> None:
        try:
            last = await produce(sink)
        except Exception as exc:  # not CancelledError: only the reader below cancels, and it is gone then
            last = _failure_line(exc, framing)
        await queue.put(last)
        await queue.put(None)

    task = asyncio.create_task(run())
    try:
        while (item := await queue.get()) is not None:
            yield item
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await on_end()


def _failure_line(exc: Exception, framing: Framing) -> bytes:
    """The last line for a producer that raised: a CorralError as it is, anything else as a logged server_error."""
    if not isinstance(exc, CorralError):
        logger.error("output stream failed", exc_info=exc)
        exc = ServerError("internal error after the stream began; see the server log")
    return framing.event({"event": "error", "error": exc.to_dict()})
