"""Following one process from one connection: an event naming it, its output as it is produced, its exit.

A follower never owns the process it follows: when its host hangs up it stops following and returns, and the
process goes on, to be found again by id, pid or tag. This serves `attach` (with the kept output first, or
only what comes after) and the `exec` of a background process that streams to the request that started it
(`background` with `stream`: the way E2B runs every command).
"""

from __future__ import annotations

import os
import select

from . import protocol
from .channel import Channel, Closed
from .process import Process

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any


def follow(ch: Channel, proc: Process, *, first: dict[str, Any], replay: bool) -> None:
    """Send `first`, then (with `replay`) the output kept so far, then every new byte, then the exit event;
    return as soon as the host hangs up, leaving the process running."""
    wake_r, wake_w = os.pipe()

    def sink(stream: str, data: bytes) -> None:
        try:
            ch.send(protocol.STDOUT if stream == "stdout" else protocol.STDERR, data)
        except Closed:
            pass  # the host left; this follower is about to unregister

    def wake() -> None:
        try:
            os.write(wake_w, b"x")
        except OSError:
            pass

    try:
        # Under the process's lock nothing is read from it: no byte is both replayed and followed, none lost.
        with proc.lock:
            ch.send_json(protocol.EVENT, first)
            if replay:
                send_all_kept(ch, proc)
            proc.follow.append(sink)
            proc.on_done.append(wake)
            ended = proc.done.is_set()
        if ended or _until_done_or_hangup(ch, wake_r):
            ch.send_json(protocol.EVENT, proc.result())
    finally:
        with proc.lock:
            _discard(proc.follow, sink)
            _discard(proc.on_done, wake)
        os.close(wake_r)
        os.close(wake_w)


def _until_done_or_hangup(ch: Channel, wake_r: int) -> bool:
    """True once the process is done; False when the host hung up first (or broke the framing)."""
    poller = select.poll()
    poller.register(ch.sock.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if wake_r in ready:
            return True
        try:
            ch.recv()  # the host sends nothing here: a frame is dropped, the end of the stream is its leaving
        except (Closed, protocol.ProtocolError):
            return False


def send_all_kept(ch: Channel, proc: Process) -> None:
    """The output kept so far: each stream's head, then (past the cap) a `tail` event and the newest bytes."""
    for name, buf, kind in (("stdout", proc.stdout, protocol.STDOUT), ("stderr", proc.stderr, protocol.STDERR)):
        if buf.head:
            ch.send(kind, bytes(buf.head))
        if buf.tail_len:
            ch.event(event="tail", stream=name, omitted=buf.omitted)
            ch.send(kind, buf.tail_bytes())


def _discard(items: list[Any], item: Any) -> None:
    if item in items:
        items.remove(item)
