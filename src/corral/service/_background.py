"""The service's background loops (reconciler, metrics sampler, replica heartbeat): how one is ended."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["cancel"]


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel `task` (None: nothing runs) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
