"""Checkpoints of a sandbox, restored in place, and what changed since one (docs/api.md, "Checkpoints").

```python
cp = sb.checkpoint(name="before-migrate")        # Checkpoint(id, name, created_at, size, command, automatic)
sb.commands.run("rm -rf /workspace/project")
for change in sb.changes(since=cp):              # Change(path, kind, size, old_size, type, diff)
    print(change.kind, change.path)
result = sb.restore(cp)                          # RestoreResult(checkpoint, paths, stopped)
sb.restore(cp, paths=["/workspace/db"])          # only those paths
sb.checkpoints(); sb.delete_checkpoint(cp)
```

`Sandbox.create(checkpoints="auto")` takes one before each command, code cell and file change; the result of
each names it (`CommandResult.checkpoint`, `Execution.checkpoint`, `Entry.checkpoint` of `files.write`).
The methods are `Sandbox`'s and `AsyncSandbox`'s (these mixins); what they share without I/O is below them.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from .._exceptions import ServerError
from ._transport import AsyncClient, SyncClient, json_dict, sandbox_path

__all__ = ["AsyncCheckpointing", "Change", "Changes", "Checkpoint", "Checkpointing", "RestoreResult",
           "StoppedProcess"]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint of one sandbox: `size` the bytes it added (what changed since the one before), `command`
    what an automatic one preceded."""

    id: str
    name: str | None
    sandbox_id: str
    created_at: str | None
    size: int
    command: str | None = None
    automatic: bool = False

    @classmethod
    def from_wire(cls, data: Any) -> Checkpoint:
        d = json_dict(data, "a checkpoint")
        if not isinstance(d.get("id"), str):
            raise ServerError("malformed response from Corral: expected a checkpoint object with an 'id'")
        return cls(id=d["id"], name=d.get("name"), sandbox_id=str(d.get("sandbox_id") or ""),
                   created_at=d.get("created_at"), size=int(d.get("size") or 0), command=d.get("command"),
                   automatic=bool(d.get("automatic")))


@dataclass(frozen=True)
class StoppedProcess:
    pid: int
    cmd: str


@dataclass(frozen=True)
class RestoreResult:
    """What `restore` did: the checkpoint, the paths (None: everything), and what it stopped: the processes
    that were running (pid and command line), code contexts with a live session, terminals."""

    checkpoint: Checkpoint
    paths: builtins.list[str] | None
    stopped_processes: tuple[StoppedProcess, ...] = ()
    stopped_code_contexts: int = 0
    stopped_terminals: int = 0

    @classmethod
    def from_wire(cls, data: Any) -> RestoreResult:
        d = json_dict(data, "a restore result")
        raw = d.get("stopped")
        stopped: dict[str, Any] = raw if isinstance(raw, dict) else {}
        paths = d.get("paths")
        return cls(checkpoint=Checkpoint.from_wire(d.get("checkpoint")),
                   paths=[str(p) for p in paths] if isinstance(paths, list) else None,
                   stopped_processes=tuple(StoppedProcess(int(p.get("pid") or 0), str(p.get("cmd") or ""))
                                           for p in stopped.get("processes") or () if isinstance(p, dict)),
                   stopped_code_contexts=int(stopped.get("code_contexts") or 0),
                   stopped_terminals=int(stopped.get("terminals") or 0))


@dataclass(frozen=True)
class Change:
    """One changed path: `kind` "added", "modified", "deleted" or "mode" (only mode or owner); `type` "file",
    "dir", "symlink" or "other"; sizes in bytes (None where it did not exist); `diff` a unified diff of a text
    file when asked for (`diff=True`) and within the bounds, else None."""

    path: str
    kind: str
    size: int | None
    old_size: int | None
    type: str
    diff: str | None = None

    @classmethod
    def from_wire(cls, data: Any) -> Change:
        d = json_dict(data, "a change")
        size, old = d.get("size"), d.get("old_size")
        return cls(path=str(d.get("path") or ""), kind=str(d.get("kind") or ""),
                   size=int(size) if isinstance(size, int) else None,
                   old_size=int(old) if isinstance(old, int) else None,
                   type=str(d.get("type") or ""), diff=d.get("diff") if isinstance(d.get("diff"), str) else None)


@dataclass(frozen=True)
class Changes:
    """What changed from `since` to `until` (None: now), sorted by path; iterate it for each `Change`.
    `truncated`: paths or diffs were left out (the bounds in docs/api.md)."""

    since: str
    until: str | None
    changes: tuple[Change, ...]
    truncated: bool = False

    def __iter__(self) -> Iterator[Change]:
        return iter(self.changes)

    def __len__(self) -> int:
        return len(self.changes)

    @classmethod
    def from_wire(cls, data: Any) -> Changes:
        d = json_dict(data, "changes")
        return cls(since=str(d.get("since") or ""), until=d.get("until"),
                   changes=tuple(Change.from_wire(c) for c in d.get("changes") or ()),
                   truncated=bool(d.get("truncated")))


CheckpointRef = Checkpoint | str  # a Checkpoint, its id or its name


def _ref(checkpoint: CheckpointRef) -> str:
    value = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
    if not isinstance(value, str) or not value:
        raise TypeError("a checkpoint is a Checkpoint, its id or its name")
    return value


def _one(sandbox_id: str, checkpoint: CheckpointRef) -> str:
    return sandbox_path(sandbox_id, "/checkpoints/" + quote(_ref(checkpoint), safe=""))


def _restore_body(checkpoint: CheckpointRef, paths: Sequence[str] | None) -> dict[str, Any]:
    if isinstance(paths, str):
        raise TypeError("paths is a list of paths, not one string")
    return {"checkpoint": _ref(checkpoint), "paths": None if paths is None else builtins.list(paths)}


def _changes_params(since: CheckpointRef, until: CheckpointRef | None, diff: bool) -> dict[str, str]:
    params = {"since": _ref(since), "diff": "true" if diff else "false"}
    return params if until is None else {**params, "until": _ref(until)}


class Checkpointing:
    """`Sandbox`'s checkpoint methods."""

    _client: SyncClient

    @property
    def id(self) -> str:  # the sandbox's (`_SandboxBase.id`, first in the classes' order)
        raise NotImplementedError

    def checkpoint(self, name: str | None = None) -> Checkpoint:
        """Keep the sandbox's files as they are now (not /tmp, /dev/shm or volumes); `name` unique in it."""
        body = {} if name is None else {"name": name}
        return Checkpoint.from_wire(self._client.request("POST", sandbox_path(self.id, "/checkpoints"), json=body))

    def checkpoints(self) -> builtins.list[Checkpoint]:
        """Its checkpoints, newest first."""
        data = json_dict(self._client.request("GET", sandbox_path(self.id, "/checkpoints")), "checkpoints")
        return [Checkpoint.from_wire(c) for c in data.get("checkpoints") or ()]

    def get_checkpoint(self, checkpoint: CheckpointRef) -> Checkpoint:
        return Checkpoint.from_wire(self._client.request("GET", _one(self.id, checkpoint)))

    def delete_checkpoint(self, checkpoint: CheckpointRef) -> None:
        self._client.request("DELETE", _one(self.id, checkpoint))

    def restore(self, checkpoint: CheckpointRef, paths: Sequence[str] | None = None) -> RestoreResult:
        """Every file back as at `checkpoint` (`paths`: only those, each with all below it), in place; running
        processes end first (the result lists them), and the sandbox runs again, same id and settings."""
        data = self._client.request("POST", sandbox_path(self.id, "/restore"), json=_restore_body(checkpoint, paths))
        return RestoreResult.from_wire(data)

    def changes(self, since: CheckpointRef, until: CheckpointRef | None = None, *, diff: bool = False) -> Changes:
        """What changed from `since` to `until` (None: now); `diff`: unified diffs of text files, bounded."""
        params = _changes_params(since, until, diff)
        return Changes.from_wire(self._client.request("GET", sandbox_path(self.id, "/changes"), params=params))


class AsyncCheckpointing:
    """`AsyncSandbox`'s checkpoint methods: `Checkpointing`'s, awaited."""

    _client: AsyncClient

    @property
    def id(self) -> str:  # the sandbox's (`_SandboxBase.id`, first in the classes' order)
        raise NotImplementedError

    async def checkpoint(self, name: str | None = None) -> Checkpoint:
        body = {} if name is None else {"name": name}
        data = await self._client.request("POST", sandbox_path(self.id, "/checkpoints"), json=body)
        return Checkpoint.from_wire(data)

    async def checkpoints(self) -> builtins.list[Checkpoint]:
        data = json_dict(await self._client.request("GET", sandbox_path(self.id, "/checkpoints")), "checkpoints")
        return [Checkpoint.from_wire(c) for c in data.get("checkpoints") or ()]

    async def get_checkpoint(self, checkpoint: CheckpointRef) -> Checkpoint:
        return Checkpoint.from_wire(await self._client.request("GET", _one(self.id, checkpoint)))

    async def delete_checkpoint(self, checkpoint: CheckpointRef) -> None:
        await self._client.request("DELETE", _one(self.id, checkpoint))

    async def restore(self, checkpoint: CheckpointRef, paths: Sequence[str] | None = None) -> RestoreResult:
        body = _restore_body(checkpoint, paths)
        return RestoreResult.from_wire(await self._client.request("POST", sandbox_path(self.id, "/restore"), json=body))

    async def changes(self, since: CheckpointRef, until: CheckpointRef | None = None, *,
                      diff: bool = False) -> Changes:
        params = _changes_params(since, until, diff)
        data = await self._client.request("GET", sandbox_path(self.id, "/changes"), params=params)
        return Changes.from_wire(data)
