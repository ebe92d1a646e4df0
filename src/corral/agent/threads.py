"""Starting a thread inside a sandbox whose pids limit may be full.

Every thread counts against the sandbox's pids.max, and so do the zombies of a tree killed a moment ago until
the reaper collects them. A refusal then is often transient: `start` retries for a short, bounded while before
it lets the caller refuse its request with a structured `quota_exceeded`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

TYPE_CHECKING = False  # `typing` costs the agent's start several milliseconds; annotations only need the names
if TYPE_CHECKING:
    from typing import Any

RETRY_FOR = 0.5  # seconds: long enough for the reaper to drain a killed tree, short enough for a caller to wait


def start(target: Callable[..., Any], *args: Any, name: str | None = None) -> threading.Thread:
    """Start a daemon thread running `target(*args)`; RuntimeError once the limit stays full for RETRY_FOR."""
    deadline = time.monotonic() + RETRY_FOR
    pause = 0.005
    while True:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        try:
            thread.start()
            return thread
        except RuntimeError:
            if time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause)
            pause *= 2


__all__ = ["RETRY_FOR", "start"]
