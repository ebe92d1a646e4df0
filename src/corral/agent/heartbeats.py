"""Heartbeats: an empty frame on every connection that asked for them, whenever it has been silent that long.

The host bounds every wait on the agent by an idle timeout (docs/architecture.md, "Agent liveness"); a long,
healthy silence (`sleep 60`, a terminal nobody types in, a watch with no changes) must not look like a dead
agent. One thread beats for every connection, rather than one per connection: each thread counts against the
sandbox's pids limit. A beat proves that the agent process runs (not stopped, not frozen, not dead, its
interpreter not stuck holding the GIL); an operation's own thread blocked forever in a bug would not stop it.
"""

from __future__ import annotations

import threading
import time

from . import threads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .channel import Channel

MIN_INTERVAL = 0.05  # a host asking for less gets this: a beat is a send on every silent connection
MAX_INTERVAL = 60.0
_IDLE_WAKE = 1.0  # with nothing due sooner, the thread still wakes this often (a new connection wakes it at once)

_lock = threading.Lock()
_channels: dict[Channel, float] = {}  # connection -> its interval
_wake = threading.Event()
_thread: threading.Thread | None = None


def interval_of(value: object) -> float | None:
    """The interval a request asks for (its "heartbeat" field), bounded; None if it asks for none."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return None
    return min(max(float(value), MIN_INTERVAL), MAX_INTERVAL)


def register(ch: Channel, interval: float) -> None:
    """Beat on `ch` every `interval` seconds of silence until `unregister`. RuntimeError if the beating thread
    cannot start (the pids limit is full): the caller refuses the request rather than let the host time out."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threads.start(_run, name="heartbeats")
        _channels[ch] = interval
    _wake.set()


def unregister(ch: Channel) -> None:
    with _lock:
        _channels.pop(ch, None)


def _run() -> None:
    while True:
        _wake.wait(_beat_due())
        _wake.clear()


def _beat_due() -> float:
    """Beat on every connection silent for its interval; seconds until the next one is due."""
    with _lock:
        channels = list(_channels.items())
    now = time.monotonic()
    wait = _IDLE_WAKE
    for ch, interval in channels:
        due = ch.last_sent + interval
        if due <= now:
            ch.heartbeat()
            due = now + interval
        wait = min(wait, due - now)
    return max(wait, 0.005)


__all__ = ["MAX_INTERVAL", "MIN_INTERVAL", "interval_of", "register", "unregister"]
