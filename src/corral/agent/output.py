"""One stream's kept output (`OutputBuffer`): a head streamed live and a bounded tail, and the true total size,
so that a command that prints for an hour keeps at most `max_output` bytes (16 MiB by default)."""

from __future__ import annotations

import collections

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024


class OutputBuffer:
    """One stream's kept bytes: a head (streamed live) and a tail ring, plus the true total size."""

    def __init__(self, max_output: int) -> None:
        self.tail_cap = max_output // 4
        self.head_cap = max_output - self.tail_cap
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_len = 0
        self.total = 0

    def feed(self, data: bytes) -> bytes:
        """Keep `data`; return the part of it that belongs to the head (what may be streamed live)."""
        self.total += len(data)
        room = self.head_cap - len(self.head)
        live = data[:room] if room > 0 else b""
        self.head += live
        rest = data[len(live) :]
        if rest and self.tail_cap:
            self.tail.append(rest)
            self.tail_len += len(rest)
            self._trim()
        return live

    def _trim(self) -> None:
        while self.tail_len - len(self.tail[0]) >= self.tail_cap:
            self.tail_len -= len(self.tail.popleft())
        excess = self.tail_len - self.tail_cap
        if excess > 0:
            self.tail[0] = self.tail[0][excess:]
            self.tail_len -= excess

    @property
    def omitted(self) -> int:
        return self.total - len(self.head) - self.tail_len

    def tail_bytes(self) -> bytes:
        return b"".join(self.tail)
