"""The undo tools: `checkpoint`, `list_checkpoints`, `restore`, `list_changes` and `delete_checkpoint`, each one
call of the service's `checkpoints` area (roles, tenancy, bounds and audit are its own), and how their results
read for a model. Their descriptions say when to reach for them: before something risky, and after a mistake,
so that an agent undoes its own instead of declaring the damage permanent."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import mcp_types as types

from .._paths import sandbox_path
from ..control import CheckpointRecord
from ..service import Change, Changes, RestoreResult
from ._args import CheckpointArgs, CheckpointRefArgs, KillArgs, ListChangesArgs, RestoreArgs
from ._call import CHANGES, DESTROYS, READ_ONLY, Call, Tool
from ._results import result

__all__ = ["CHECKPOINT_TOOLS"]


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


def checkpoint_json(record: CheckpointRecord) -> dict[str, Any]:
    return {"checkpoint_id": record.id, "name": record.name, "sandbox_id": record.sandbox_id,
            "created_at": _iso(record.created_at), "size": record.size_bytes, "command": record.command,
            "automatic": record.automatic}


def _line(c: dict[str, Any]) -> str:
    label = f" \"{c['name']}\"" if c["name"] else ""
    before = f"  before: {c['command']}" if c["command"] else ""
    return f"{c['checkpoint_id']}{label}  {c['created_at']}  {c['size']} bytes{before}"


# -- the tools -----------------------------------------------------------------------------------------------


async def checkpoint(call: Call, args: CheckpointArgs) -> types.CallToolResult:
    record = await call.service.checkpoints.create(call.principal, args.sandbox_id, args.name)
    made = checkpoint_json(record)
    return result(f"Checkpoint {record.id} taken of sandbox {args.sandbox_id} ({record.size_bytes} bytes new). "
                  f"restore it with checkpoint \"{record.id}\" to put every file back as it is now.", made)


async def list_checkpoints(call: Call, args: KillArgs) -> types.CallToolResult:
    found = [checkpoint_json(r) for r in await call.service.checkpoints.list(call.principal, args.sandbox_id)]
    text = ("\n".join(_line(c) for c in found) if found else
            f"Sandbox {args.sandbox_id} has no checkpoints. Take one with checkpoint (or create sandboxes with "
            "checkpoints \"auto\").")
    return result(text, {"sandbox_id": args.sandbox_id, "checkpoints": found})


async def restore(call: Call, args: RestoreArgs) -> types.CallToolResult:
    paths = None if args.paths is None else [sandbox_path(p) for p in args.paths]
    done = await call.service.checkpoints.restore(call.principal, args.sandbox_id, args.checkpoint, paths)
    return result(_restored_text(args.sandbox_id, done), _restored_json(args.sandbox_id, done))


def _restored_json(sandbox_id: str, done: RestoreResult) -> dict[str, Any]:
    return {"sandbox_id": sandbox_id, "checkpoint_id": done.checkpoint.id, "name": done.checkpoint.name,
            "paths": done.paths, "stopped": done.stopped.to_json()}


def _restored_text(sandbox_id: str, done: RestoreResult) -> str:
    where = ", ".join(done.paths) if done.paths else "every file"
    lines = [f"Restored sandbox {sandbox_id} to checkpoint {done.checkpoint.id} ({where}): those files are as "
             "they were when it was taken."]
    stopped = done.stopped
    lines += [f"stopped process {p['pid']}: {p['cmd']}" for p in stopped.processes]
    if stopped.code_contexts:
        lines.append(f"restarted {stopped.code_contexts} code session(s): their variables are gone")
    if stopped.terminals:
        lines.append(f"closed {stopped.terminals} terminal(s)")
    if stopped.processes or stopped.code_contexts or stopped.terminals:
        lines.append("Start again what you still need (servers, background jobs): nothing was left running.")
    return "\n".join(lines)


async def list_changes(call: Call, args: ListChangesArgs) -> types.CallToolResult:
    found = await call.service.checkpoints.changes(call.principal, args.sandbox_id, args.since, args.until,
                                                   diff=args.diff)
    return result(_changes_text(found), _changes_json(args.sandbox_id, found))


def _changes_json(sandbox_id: str, found: Changes) -> dict[str, Any]:
    return {"sandbox_id": sandbox_id, "since": found.since.id, "until": None if found.until is None else found.until.id,
            "truncated": found.truncated, "changes": [c.to_json() for c in found.changes]}


def _changes_text(found: Changes) -> str:
    since, until = found.since.id, "now" if found.until is None else found.until.id
    if not found.changes:
        return f"Nothing changed between {since} and {until}."
    lines = [f"{len(found.changes)} path(s) changed between {since} and {until}:"]
    lines += [_change_line(c) for c in found.changes]
    lines += [c.diff.rstrip("\n") for c in found.changes if c.diff]
    if found.truncated:
        lines.append("[cut at the server's bound: list changes between checkpoints closer together, or read the "
                     "files themselves]")
    return "\n".join(lines)


def _change_line(change: Change) -> str:
    c = change.change
    if c.type != "file":
        sizes = ""
    elif c.kind in ("modified", "mode"):
        sizes = f" ({c.old_size} -> {c.size} bytes)"
    else:
        sizes = f" ({c.old_size if c.kind == 'deleted' else c.size} bytes)"
    return f"{c.kind:<8} {c.type:<7} {c.path}{sizes}"


async def delete_checkpoint(call: Call, args: CheckpointRefArgs) -> types.CallToolResult:
    await call.service.checkpoints.delete(call.principal, args.sandbox_id, args.checkpoint)
    return result(f"Deleted checkpoint {args.checkpoint} of sandbox {args.sandbox_id}.",
                  {"sandbox_id": args.sandbox_id, "checkpoint": args.checkpoint, "deleted": True})


CHECKPOINT_TOOLS: tuple[Tool[Any], ...] = (
    Tool("checkpoint", "Save the sandbox's files as they are now, to undo later with restore: everything the "
         "sandbox can write (workspace, home, installed packages) except /tmp and volumes. Take one before "
         "anything risky or hard to reverse: deleting or rewriting many files, a database migration or DROP, "
         "an install over a working environment, rewriting git history. Cheap: it costs what changed since the "
         "last checkpoint. Returns checkpoint_id.", CheckpointArgs, checkpoint, CHANGES),
    Tool("list_checkpoints", "List a sandbox's checkpoints, newest first: id, name, time, size, and for automatic "
         "ones the command they were taken before. Use it to find the checkpoint to restore: the one just before "
         "the step that broke things.", KillArgs, list_checkpoints, READ_ONLY),
    Tool("restore", "Undo your own mistake: put the sandbox's files back as they were at a checkpoint, in place "
         "(same sandbox_id, network and limits). Use it when something you ran destroyed or corrupted files (rm "
         "-rf, a dropped table, a broken venv or git repository, a truncated data file): the damage is NOT "
         "permanent while a checkpoint from before it exists, so restore it and say so instead of telling the "
         "user it cannot be recovered. Running processes, code sessions (their variables) and terminals are "
         "stopped first; the result lists them. `paths` restores only those paths and keeps every other change. "
         "Check with list_changes what it will undo.", RestoreArgs, restore, DESTROYS),
    Tool("list_changes", "Show exactly what changed in the sandbox's files since a checkpoint (until a later one, "
         "or now): added, modified, deleted and mode-changed paths with sizes, and with diff=true a unified diff "
         "of each text file. Use it to see what one command did (the checkpoint taken before it) before you "
         "restore, or to report it truthfully.", ListChangesArgs, list_changes, READ_ONLY),
    Tool("delete_checkpoint", "Delete a checkpoint you no longer need; the bytes only it holds are freed. Named "
         "checkpoints are never removed to make room: delete one when checkpoint reports that the sandbox's "
         "checkpoint space is full.", CheckpointRefArgs, delete_checkpoint, DESTROYS),
)
