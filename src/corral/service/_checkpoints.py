"""Checkpoints: a sandbox's writable filesystem kept in place, restored in place, and what changed since.

The engine takes, restores, compares and deletes them (the backend keeps the bytes, `corral.backends.
Checkpointing`); the store records whose each is, its name (unique per sandbox, never shaped like an id), the
command an automatic one preceded, and its size against the tenant's `max_snapshot_bytes`. Roles: whoever may use
the sandbox (developers, operators, admins) creates, deletes and restores; auditors list, get and compare.

Bounds (docs/lifecycle.md, "Checkpoints"): a sandbox keeps its last `checkpoint_keep` automatic checkpoints, and
at most `checkpoint_bytes` of them (a quarter of its disk by default); the oldest automatic ones go first, when a
bound is reached and when one does not fit (the sandbox's disk, the tenant's quota). A named or manual one is never
evicted: a create that needs its room fails, naming which to delete.

Automatic checkpoints (`checkpoints="auto"`) are taken by `before_change`, the one hook the areas that change
files call (commands, background processes, code cells, file writes, removes, renames, directories, archive
uploads), after their authorize step. Its id goes into the operation's audit outcome and the request being
served (`RequestInfo.checkpoint`), which the front ends put on the result.
"""

from __future__ import annotations

import asyncio
import builtins
import re
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from pydantic import BaseModel, Field

from .._exceptions import (
    CapacityError,
    ConflictError,
    CorralError,
    DiskFullError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    ServerError,
)
from .._paths import sandbox_path
from ..backends import CheckpointArtifact, PathChange
from ..backends._spec import DEFAULT_CHECKPOINT_KEEP, MAX_CHECKPOINT_KEEP
from ..control import Action, CheckpointRecord, Principal, SandboxRecord
from ._changes import Changes, diff_changes
from ._requests import current_request

if TYPE_CHECKING:
    from ..control import ControlStore
    from ..engine import SandboxSession
    from ._audited import Audited, Auditor
    from ._on_sandbox import Authorize

__all__ = ["CHECKPOINT_ID", "CheckpointEngine", "Checkpoints", "RestoreResult", "Stopped"]

CHECKPOINT_ID = re.compile(r"ckpt-[0-9a-f]{16}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_RESTORE_PATHS = 64
_COMMAND_MAX = 1024  # characters of an automatic checkpoint's command kept in its record


class CheckpointEngine(Protocol):
    """What the area uses of the engine: its checkpoint methods, and a running sandbox's session (what a restore
    stops is listed through its agent first)."""

    @property
    def checkpoints_supported(self) -> bool: ...

    async def checkpoint(self, sandbox_id: str, checkpoint_id: str) -> CheckpointArtifact: ...

    async def restore_checkpoint(self, sandbox_id: str, artifact: CheckpointArtifact, *,
                                 paths: Sequence[str] | None = None) -> None: ...

    async def checkpoint_changes(self, sandbox_id: str, since: CheckpointArtifact,
                                 until: CheckpointArtifact | None = None) -> builtins.list[PathChange]: ...

    async def checkpoint_read(self, sandbox_id: str, artifact: CheckpointArtifact, path: str,
                              limit: int) -> bytes | None: ...

    async def delete_checkpoint(self, sandbox_id: str, artifact: CheckpointArtifact) -> None: ...

    def get(self, sandbox_id: str) -> SandboxSession: ...


@dataclass(frozen=True)
class Stopped:
    """What a restore of a running sandbox ended: its processes (pid and command line), its code contexts with
    a live session, its terminals."""

    processes: builtins.list[dict[str, Any]] = field(default_factory=builtins.list)
    code_contexts: int = 0
    terminals: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"processes": self.processes, "code_contexts": self.code_contexts, "terminals": self.terminals}


@dataclass(frozen=True)
class RestoreResult:
    checkpoint: CheckpointRecord
    paths: builtins.list[str] | None  # None: everything
    stopped: Stopped


class CheckpointOptions(BaseModel):
    """A create's checkpoint options (`CreateSandbox` has them): "auto" takes one before each change to files;
    None: the tenant's default, else "manual"; the bounds of the automatic ones."""

    checkpoints: Literal["auto", "manual"] | None = None
    checkpoint_keep: Annotated[int, Field(ge=1, le=MAX_CHECKPOINT_KEEP)] = DEFAULT_CHECKPOINT_KEEP
    checkpoint_bytes: Annotated[int, Field(ge=0)] | None = None  # None: a quarter of the disk

    def checkpoint_spec(self) -> dict[str, Any]:
        """The `SandboxSpec` fields they are."""
        return {"checkpoints": self.checkpoints or "manual", "checkpoint_keep": self.checkpoint_keep,
                "checkpoint_bytes": self.checkpoint_bytes}


def checkpoint_mode(asked: str | None, tenant_default: str | None, supported: bool) -> str:
    """What a new sandbox takes: what its create asked, else its tenant's default, else "manual". "auto" asked of
    a backend that keeps no checkpoints is refused; a tenant's default there is "manual"."""
    mode = asked or tenant_default or "manual"
    if mode == "auto" and not supported:
        if asked == "auto":
            raise InvalidRequestError("checkpoints='auto' needs a backend that keeps checkpoints, and this one "
                                      "does not (GET /v1/info lists its limitations)", details={"checkpoints": asked})
        return "manual"
    return mode


def check_name(name: str | None) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not _NAME.fullmatch(name) or CHECKPOINT_ID.fullmatch(name):
        raise InvalidRequestError(f"checkpoint name {name!r} is not valid: 1-128 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit, and not shaped like a checkpoint id",
                                  details={"name": name})
    return name


def check_paths(paths: Sequence[str] | None) -> builtins.list[str] | None:
    """Absolute sandbox paths (`InvalidRequestError` naming `paths`); None: the whole filesystem."""
    if paths is None:
        return None
    if isinstance(paths, str) or not paths or len(paths) > MAX_RESTORE_PATHS:
        raise InvalidRequestError(f"paths must be a list of 1 to {MAX_RESTORE_PATHS} absolute paths (or null: "
                                  "everything)", details={"paths": paths if isinstance(paths, str) else None})
    checked: builtins.list[str] = []
    for index, path in enumerate(paths):
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidRequestError(f"paths[{index}] must be an absolute path, not {path!r}",
                                      details={"paths": index})
        checked.append(str(sandbox_path(path, f"paths[{index}]")))
    return checked


def artifact_of(record: CheckpointRecord) -> CheckpointArtifact:
    try:
        return CheckpointArtifact.from_json(record.artifact)
    except ValueError as exc:
        raise ServerError(f"checkpoint {record.id} is unreadable: {exc}") from None


def checkpoint_budget(record: SandboxRecord) -> int:
    """Bytes the sandbox's automatic checkpoints may hold."""
    spec = record.spec
    return spec.checkpoint_bytes if spec.checkpoint_bytes is not None else spec.limits.disk // 4


class Checkpoints:
    def __init__(self, store: ControlStore, engine: CheckpointEngine, audited: Auditor, authorize: Authorize) -> None:
        self._store = store
        self._engine = engine
        self._audited = audited
        self._authorize = authorize

    # -- taking them ---------------------------------------------------------------------------------------

    async def create(self, principal: Principal, sandbox_id: str, name: str | None = None, *,
                     command: str | None = None, automatic: bool = False) -> CheckpointRecord:
        """A checkpoint of the sandbox now (`name`: unique among its checkpoints); a manual one unless
        `automatic` (then evicted first, and `command` says what it preceded)."""
        params = {"name": name, "automatic": automatic} if automatic else {"name": name}
        async with self._audited(principal, "checkpoint.create", sandbox_id, params=params, status=201) as audit:
            name = check_name(name)
            record = await self._authorize(principal, sandbox_id, Action.CHECKPOINT_WRITE)
            taken = await self._take(principal, record, name, command, automatic, audit.outcome)
            audit.outcome.update(checkpoint=taken.id, size_bytes=taken.size_bytes)
            return taken

    async def before_change(self, principal: Principal, record: SandboxRecord, command: str,
                            audit: Audited) -> str | None:
        """The hook: with `checkpoints="auto"`, a checkpoint before the operation `audit` records (already
        authorized on `record`); its id, also in the audit outcome and the request's info. One that cannot be
        taken (no room even after evictions, a backend without them) does not stop the operation: the outcome
        says why there is none."""
        if record.spec.checkpoints != "auto":
            return None
        try:
            taken = await self._take(principal, record, None, command[:_COMMAND_MAX], True, audit.outcome)
        except CorralError as exc:
            audit.outcome["checkpoint_error"] = {"code": exc.code, "message": exc.message}
            return None
        audit.outcome["checkpoint"] = taken.id
        request = current_request()
        if request is not None:
            request.checkpoint = taken.id
        return taken.id

    async def _take(self, principal: Principal, record: SandboxRecord, name: str | None, command: str | None,
                    automatic: bool, outcome: dict[str, Any]) -> CheckpointRecord:
        store = self._store.checkpoints
        if name is not None and await store.name_taken(record.id, name):
            raise _name_taken(record.id, name)
        existing = await store.list(record.tenant_id, record.id)  # newest first
        evicted: builtins.list[str] = []
        if automatic:  # room for this one among the last `checkpoint_keep`
            autos = [c for c in existing if c.automatic]
            for old in autos[record.spec.checkpoint_keep - 1:]:
                await self._evict(record, old, evicted)
        checkpoint_id = f"ckpt-{secrets.token_hex(8)}"
        artifact = await self._fitting(record, checkpoint_id, existing, evicted)
        taken = CheckpointRecord(id=checkpoint_id, tenant_id=record.tenant_id, sandbox_id=record.id, name=name,
                                 created_at=datetime.now(UTC), size_bytes=artifact.size_bytes, command=command,
                                 automatic=automatic, artifact=artifact.to_json())
        await self._record(principal, record, taken, artifact, existing, evicted)
        await self._within_budget(record, taken, existing, evicted)
        if evicted:
            outcome["evicted"] = evicted
        return taken

    async def _fitting(self, record: SandboxRecord, checkpoint_id: str, existing: builtins.list[CheckpointRecord],
                       evicted: builtins.list[str]) -> CheckpointArtifact:
        """The engine's checkpoint; one that does not fit evicts the oldest automatic one and tries again."""
        while True:
            try:
                return await self._engine.checkpoint(record.id, checkpoint_id)
            except (CapacityError, DiskFullError) as exc:
                if not await self._evict_oldest(record, existing, evicted):
                    raise _no_room(record, existing, evicted, exc) from None

    async def _record(self, principal: Principal, record: SandboxRecord, taken: CheckpointRecord,
                      artifact: CheckpointArtifact, existing: builtins.list[CheckpointRecord],
                      evicted: builtins.list[str]) -> None:
        """Into the store; over the tenant's quota, the oldest automatic ones make room. What the store refuses
        is deleted from the backend at once, so nothing unrecorded stays behind."""
        try:
            while True:
                try:
                    await self._store.checkpoints.add(principal, taken)
                    return
                except QuotaExceededError:
                    if not await self._evict_oldest(record, existing, evicted):
                        raise
        except BaseException:
            await asyncio.shield(self._engine.delete_checkpoint(record.id, artifact))
            raise

    async def _within_budget(self, record: SandboxRecord, taken: CheckpointRecord,
                             existing: builtins.list[CheckpointRecord], evicted: builtins.list[str]) -> None:
        """At most `checkpoint_budget` bytes of automatic checkpoints: the oldest go (never the one just taken)."""
        autos = [c for c in [taken, *existing] if c.automatic and c.id not in evicted]  # newest first
        total, budget = sum(c.size_bytes for c in autos), checkpoint_budget(record)
        for old in reversed(autos):
            if total <= budget or old.id == taken.id:
                break
            await self._evict(record, old, evicted)
            total -= old.size_bytes

    async def _evict_oldest(self, record: SandboxRecord, existing: builtins.list[CheckpointRecord],
                            evicted: builtins.list[str]) -> bool:
        for old in reversed(existing):
            if old.automatic and old.id not in evicted:
                await self._evict(record, old, evicted)
                return True
        return False

    async def _evict(self, record: SandboxRecord, old: CheckpointRecord, evicted: builtins.list[str]) -> None:
        await self._engine.delete_checkpoint(record.id, artifact_of(old))
        await self._store.checkpoints.mark_deleted(old.id)
        evicted.append(old.id)

    # -- reading them --------------------------------------------------------------------------------------

    async def list(self, principal: Principal, sandbox_id: str) -> builtins.list[CheckpointRecord]:
        """The sandbox's checkpoints, newest first."""
        async with self._audited(principal, "checkpoint.list", sandbox_id) as audit:
            record = await self._authorize(principal, sandbox_id, Action.CHECKPOINT_READ)
            found = await self._store.checkpoints.list(record.tenant_id, sandbox_id)
            audit.outcome["count"] = len(found)
            return found

    async def get(self, principal: Principal, sandbox_id: str, checkpoint: str) -> CheckpointRecord:
        """By id or name; another sandbox's (or tenant's) checkpoint does not exist here."""
        async with self._audited(principal, "checkpoint.get", sandbox_id, params={"checkpoint": checkpoint[:256]}):
            return await self._found(principal, sandbox_id, checkpoint, Action.CHECKPOINT_READ)

    async def changes(self, principal: Principal, sandbox_id: str, since: str, until: str | None = None,
                      diff: bool = False) -> Changes:
        """What changed from `since` to `until` (None: now), sorted by path; `diff`: a unified diff of each text
        file, bounded per file and in total (`Changes.truncated`)."""
        params = {"since": since[:256], "until": None if until is None else until[:256], "diff": diff}
        async with self._audited(principal, "checkpoint.changes", sandbox_id, params=params) as audit:
            first = await self._found(principal, sandbox_id, since, Action.CHECKPOINT_READ, field_name="since")
            last = None if until is None else await self._found(principal, sandbox_id, until,
                                                                Action.CHECKPOINT_READ, field_name="until")
            before, after = artifact_of(first), None if last is None else artifact_of(last)
            found = await self._engine.checkpoint_changes(sandbox_id, before, after)
            result = await diff_changes(self._engine, sandbox_id, first, last, found, diff=diff)
            audit.outcome.update(count=len(result.changes), truncated=result.truncated)
            return result

    async def _found(self, principal: Principal, sandbox_id: str, checkpoint: str, action: Action, *,
                     field_name: str = "checkpoint") -> CheckpointRecord:
        if not isinstance(checkpoint, str) or not checkpoint or len(checkpoint) > 128:
            raise InvalidRequestError(f"{field_name} must be a checkpoint id or name",
                                      details={field_name: str(checkpoint)[:256]})
        record = await self._authorize(principal, sandbox_id, action)
        try:
            return await self._store.checkpoints.get(record.tenant_id, sandbox_id, checkpoint)
        except NotFoundError as exc:
            exc.details = {field_name: checkpoint}
            raise

    # -- deleting and restoring ----------------------------------------------------------------------------

    async def delete(self, principal: Principal, sandbox_id: str, checkpoint: str) -> None:
        """The checkpoint and the bytes no other one uses."""
        async with self._audited(principal, "checkpoint.delete", sandbox_id,
                                 params={"checkpoint": checkpoint[:256]}, status=204) as audit:
            found = await self._found(principal, sandbox_id, checkpoint, Action.CHECKPOINT_WRITE)
            await self._engine.delete_checkpoint(sandbox_id, artifact_of(found))
            await self._store.checkpoints.mark_deleted(found.id)
            audit.outcome.update(checkpoint=found.id, name=found.name)

    async def restore(self, principal: Principal, sandbox_id: str, checkpoint: str,
                      paths: Sequence[str] | None = None) -> RestoreResult:
        """Every file back as at `checkpoint` (`paths`: only those, each with everything below it), in place.
        A running sandbox's processes end (listed first: the result and the audit record say what stopped);
        it runs again with the same id, limits, policy, secrets and volumes. The checkpoints stay."""
        params = {"checkpoint": checkpoint[:256] if isinstance(checkpoint, str) else None,
                  "paths": list(paths) if paths is not None and not isinstance(paths, str) else paths}
        async with self._audited(principal, "checkpoint.restore", sandbox_id, params=params) as audit:
            checked = check_paths(paths)
            found = await self._found(principal, sandbox_id, checkpoint, Action.CHECKPOINT_WRITE)
            stopped = await self._running_now(sandbox_id)
            await self._engine.restore_checkpoint(sandbox_id, artifact_of(found), paths=checked)
            audit.outcome.update(checkpoint=found.id, name=found.name, paths=checked, stopped=stopped.to_json())
            return RestoreResult(found, checked, stopped)

    async def _running_now(self, sandbox_id: str) -> Stopped:
        """What a restore will stop, from the sandbox's agent; nothing for one that is not running."""
        try:
            session = self._engine.get(sandbox_id)
            listed = await session.processes.list()
            contexts = await session.code_sessions()
        except CorralError:  # paused (nothing runs), or its agent does not answer: it is stopped all the same
            return Stopped()
        running = [p for p in listed if p.running]
        return Stopped(processes=[{"pid": p.pid, "cmd": _command_line(p.argv)} for p in running if not p.pty],
                       code_contexts=sum(1 for c in contexts if c.pid), terminals=sum(1 for p in running if p.pty))


def _command_line(argv: builtins.list[str]) -> str:
    """A process's command as it was given: a shell command line unwrapped from the agent's `bash -lc`."""
    if len(argv) == 3 and argv[0].endswith("sh") and argv[1] in ("-c", "-lc"):
        return argv[2]
    return shlex.join(argv)


def _name_taken(sandbox_id: str, name: str) -> CorralError:
    return ConflictError(f"sandbox {sandbox_id} has a checkpoint named {name!r} already; delete it or choose "
                         "another name", details={"name": name})


def _no_room(record: SandboxRecord, existing: builtins.list[CheckpointRecord], evicted: builtins.list[str],
             exc: CorralError) -> DiskFullError:
    kept = [c.name or c.id for c in existing if c.id not in evicted and not c.automatic]
    which = f"; delete one of its checkpoints to make room: {', '.join(kept[:10])}" if kept else ""
    return DiskFullError(f"a checkpoint of sandbox {record.id} does not fit: {exc.message}{which}",
                         details={"sandbox_id": record.id, "checkpoints": kept[:10]})
