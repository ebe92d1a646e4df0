"""Output reported as MCP progress while a long command or cell runs: each chunk becomes one
`notifications/progress` whose `progress` is the bytes of output so far (it only grows, as the protocol wants)
and whose `message` is the chunk as text. A client that asked for no progress (no token) gets none."""

from __future__ import annotations

import codecs
from collections.abc import Awaitable, Callable

__all__ = ["MAX_MESSAGE", "Progress", "Report"]

Report = Callable[[float, float | None, str | None], Awaitable[None]]  # (progress, total, message)
MAX_MESSAGE = 4000  # characters of one chunk in one notification (the result carries all of it)


class Progress:
    def __init__(self, report: Report) -> None:
        self._report = report
        self._sent = 0

    def stream(self, name: str) -> Callable[[bytes], Awaitable[None]]:
        """The output callback of stream `name` ("stdout", "stderr"): a UTF-8 sequence split across chunks is
        decoded whole; stderr's messages say that they are stderr."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        prefix = "" if name == "stdout" else f"[{name}] "

        async def on_output(chunk: bytes) -> None:
            self._sent += len(chunk)
            text = decoder.decode(chunk)
            if text:
                await self._report(self._sent, None, prefix + text[:MAX_MESSAGE])

        return on_output
