"""`Blob`: bytes a task uploads or expects, described rather than stored (`_task.py`'s steps and `_checks.py`'s
checks both name them; the loopback server serves them at `Blob.url_path`)."""

from __future__ import annotations

import builtins
import functools
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["Blob", "blob_from_path"]


@dataclass(frozen=True)
class Blob:
    """Bytes described, not stored, so a 1,000-task corpus costs nothing until a task runs.

    * `Blob.literal(b"...")` - these bytes (a `str` is UTF-8).
    * `Blob.random(size, seed)` - `size` pseudo-random bytes, the same for the same seed.
    * `Blob.repeat(pattern, size)` - `pattern` repeated and cut to `size`.
    * `Blob.all_bytes(times)` - 0x00..0xff, `times` times.
    """

    kind: Literal["literal", "random", "repeat", "all_bytes"]
    size: int = 0
    seed: int = 0
    data: bytes = b""

    @classmethod
    def literal(cls, data: bytes | str) -> Blob:
        raw = data.encode() if isinstance(data, str) else data
        return cls("literal", len(raw), 0, raw)

    @classmethod
    def random(cls, size: int, seed: int = 0) -> Blob:
        return cls("random", size, seed)

    @classmethod
    def repeat(cls, pattern: bytes, size: int) -> Blob:
        return cls("repeat", size, 0, pattern)

    @classmethod
    def all_bytes(cls, times: int = 1) -> Blob:
        return cls("all_bytes", 256 * times)

    def bytes(self) -> bytes:
        return _materialize(self.kind, self.size, self.seed, self.data)

    def chunks(self) -> Iterator[builtins.bytes]:
        """The same bytes in pieces of at most 1 MiB, without holding them all (the loopback server streams)."""
        if self.kind != "random":
            data = self.bytes()
            for i in range(0, len(data), _CHUNK):
                yield data[i:i + _CHUNK]
            return
        yield from _random_chunks(self.size, self.seed)

    @property
    def sha256(self) -> str:
        return _sha256(self.kind, self.size, self.seed, self.data)

    @property
    def url_path(self) -> str:
        """Where the runner's loopback server serves these bytes (random and all_bytes blobs only)."""
        if self.kind not in ("random", "all_bytes"):
            raise ValueError("only random and all_bytes blobs are served by the loopback server")
        return f"/blob/{self.kind}/{self.size}/{self.seed}"

    def describe(self) -> str:
        if self.kind == "literal":
            return f"{self.size} literal bytes"
        return f"{self.kind} {self.size} bytes" + (f" (seed {self.seed})" if self.kind == "random" else "")


_CHUNK = 1 << 20


def _random_chunks(size: int, seed: int) -> Iterator[bytes]:
    # Generated in 1 MiB blocks so that a stream and a whole copy agree byte for byte.
    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not secrets
    left = size
    while left > 0:
        block = rng.randbytes(min(_CHUNK, left))
        yield block
        left -= len(block)


@functools.lru_cache(maxsize=32)
def _materialize(kind: str, size: int, seed: int, data: bytes) -> bytes:
    if kind == "literal":
        return data
    if kind == "random":
        return b"".join(_random_chunks(size, seed))
    if kind == "repeat":
        if not data:
            raise ValueError("a repeat blob needs a non-empty pattern")
        return (data * (size // len(data) + 1))[:size]
    if kind == "all_bytes":
        return bytes(range(256)) * (size // 256)
    raise ValueError(f"unknown blob kind {kind!r}")


@functools.lru_cache(maxsize=4096)
def _sha256(kind: str, size: int, seed: int, data: bytes) -> str:
    return hashlib.sha256(_materialize(kind, size, seed, data)).hexdigest()


def blob_from_path(path: str) -> Blob | None:
    """The blob a loopback-server path names (`Blob.url_path`), or None."""
    parts = path.strip("/").split("/")
    if len(parts) != 4 or parts[0] != "blob" or parts[1] not in ("random", "all_bytes"):
        return None
    try:
        size, seed = int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if not 0 <= size <= 1 << 30:
        return None
    return Blob(parts[1], size, seed)  # type: ignore[arg-type]
