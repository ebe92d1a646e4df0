"""What changed between two checkpoints (or since one): the backend's list of paths, and on request a unified
diff of each text file, bounded per file and in total so that a large change never makes a large answer.

A file's bytes at a checkpoint come from the backend (`checkpoint_read`); "now" from the sandbox's agent, as the
sandbox user within the sandbox's file roots (a file it may not read gets no diff, only its entry). Text is UTF-8
without NUL bytes; anything else, or a file over `DIFF_FILE_MAX` on either side, gets no diff.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .._exceptions import CorralError
from ..backends import CheckpointArtifact, PathChange
from ..control import CheckpointRecord

if TYPE_CHECKING:
    from ..engine import SandboxSession

__all__ = ["DIFF_FILE_MAX", "DIFF_TOTAL_MAX", "MAX_CHANGES", "Change", "Changes", "diff_changes"]

MAX_CHANGES = 10_000  # paths in one answer
DIFF_FILE_MAX = 256 * 1024  # bytes of a file (either side) that is diffed at all
DIFF_TEXT_MAX = 64 * 1024  # characters of one file's diff
DIFF_TOTAL_MAX = 1024 * 1024  # characters of every diff in one answer


class Readable(Protocol):
    async def checkpoint_read(self, sandbox_id: str, artifact: CheckpointArtifact, path: str,
                              limit: int) -> bytes | None: ...

    def get(self, sandbox_id: str) -> SandboxSession: ...


@dataclass(frozen=True)
class Change:
    """One changed path; `diff` its unified diff (a text file, asked for, within the bounds), else None."""

    change: PathChange
    diff: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = self.change.to_json()
        if self.diff is not None:
            data["diff"] = self.diff
        return data


@dataclass(frozen=True)
class Changes:
    since: CheckpointRecord
    until: CheckpointRecord | None  # None: now
    changes: list[Change]
    truncated: bool  # paths left out (over MAX_CHANGES), or diffs cut or left out (over the bounds)


async def diff_changes(engine: Readable, sandbox_id: str, since: CheckpointRecord, until: CheckpointRecord | None,
                       found: Sequence[PathChange], *, diff: bool) -> Changes:
    truncated = len(found) > MAX_CHANGES
    kept = list(found[:MAX_CHANGES])
    if not diff:
        return Changes(since, until, [Change(c) for c in kept], truncated)
    reader = _Reader(engine, sandbox_id, since, until)
    out: list[Change] = []
    budget = DIFF_TOTAL_MAX
    for change in kept:
        text: str | None = None
        if budget > 0 and _diffable(change):
            text = await reader.diff(change)
            if text is not None and len(text) > min(DIFF_TEXT_MAX, budget):
                text, truncated = text[:min(DIFF_TEXT_MAX, budget)] + "\n\\ diff cut here\n", True
            budget -= len(text or "")
        elif budget <= 0 and _diffable(change):
            truncated = True
        out.append(Change(change, text))
    return Changes(since, until, out, truncated)


def _diffable(change: PathChange) -> bool:
    return (change.type == "file" and change.kind != "mode"
            and all(size is None or size <= DIFF_FILE_MAX for size in (change.size, change.old_size)))


class _Reader:
    def __init__(self, engine: Readable, sandbox_id: str, since: CheckpointRecord,
                 until: CheckpointRecord | None) -> None:
        self._engine = engine
        self._sandbox_id = sandbox_id
        self._since = CheckpointArtifact.from_json(since.artifact)
        self._until = None if until is None else CheckpointArtifact.from_json(until.artifact)

    async def diff(self, change: PathChange) -> str | None:
        try:
            old = b"" if change.kind == "added" else await self._read(self._since, change.path)
            new = b"" if change.kind == "deleted" else await self._read(self._until, change.path)
        except CorralError:  # unreadable now (outside the roots, gone since): the entry without its diff
            return None
        old_text, new_text = _text(old), _text(new)
        if old_text is None or new_text is None:
            return None
        lines = difflib.unified_diff(old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                     fromfile="a" + change.path, tofile="b" + change.path)
        return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)

    async def _read(self, artifact: CheckpointArtifact | None, path: str) -> bytes | None:
        if artifact is not None:
            data = await self._engine.checkpoint_read(self._sandbox_id, artifact, path, DIFF_FILE_MAX + 1)
            return data if data is None or len(data) <= DIFF_FILE_MAX else None
        data = await self._engine.get(self._sandbox_id).files_for().read(path)
        return data if len(data) <= DIFF_FILE_MAX else None


def _text(data: bytes | None) -> str | None:
    if data is None or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
