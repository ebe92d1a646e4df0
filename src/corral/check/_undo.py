"""Item 45: a destructive command can be undone, and the audit trail names who restored what.

In one sandbox of the check's tenant (as its developer): a project (sources, a binary, links, modes, an empty
directory) and a SQLite database with rows; a fingerprint of both (every entry's type, bytes, mode, owner and
link target, `corral.eval._undo`); a checkpoint; then `rm -rf` of the project and `DROP TABLE` in one command.
Restoring the checkpoint must bring every entry back exactly, in the same sandbox (the same id answers with the
files), the database must open with every row, and the tenant's auditor must find the `checkpoint.restore` record
naming the checkpoint, attributed to the developer's key. N/A where the backend declares `checkpoints` (Kubernetes).
"""

from __future__ import annotations

import asyncio
import json

from .._sdk import AsyncSandbox, AuditRecord
from ..eval._undo import FINGERPRINT_SCRIPT, differences
from ..eval.corpus.undo import PROJECT, ROWS, ROWS_BACK, SQLITE, SQLITE_ROWS
from ._context import CheckContext, clip, run_json, run_ok
from ._model import ItemFailed, NotApplicable

__all__ = ["item_45_destructive_command_undone"]

PATHS = ("/workspace/project", "/workspace/db")
BUILD = PROJECT.format(files=200, blob=1 << 20, seed=45) + "\n" + SQLITE.format(rows=ROWS)
DESTROY = ("rm -rf /workspace/project && python3 -c \"import sqlite3; c = sqlite3.connect('/workspace/db/app.db'); "
           "c.execute('drop table users'); c.commit()\"")
_AUDIT_WAIT = 15.0  # seconds for the restore's record to be readable
_SHOWN = 5


async def _tree(sb: AsyncSandbox) -> dict[str, str]:
    found = await run_json(sb, FINGERPRINT_SCRIPT, *PATHS, timeout=120, what="a fingerprint of the project and db")
    return {str(k): str(v) for k, v in dict(found).items()}


async def item_45_destructive_command_undone(ctx: CheckContext) -> str:
    deployment = ctx.deployment
    if (reason := deployment.limitations.get("checkpoints")) is not None:
        raise NotApplicable(f"the {deployment.backend} backend: {reason}")
    async with ctx.sandbox() as sb:
        await run_ok(sb, BUILD, timeout=120, what="a project and a SQLite database")
        before = await _tree(sb)
        checkpoint = await sb.checkpoint(name="corral-check-45")
        await sb.commands.run(DESTROY, timeout=60)
        if not differences(before, await _tree(sb)):
            raise ItemFailed("rm -rf of the project and DROP TABLE changed nothing the probe could see: the probe "
                             "proves nothing (was the command refused?)")
        await sb.restore(checkpoint.id)
        after = await _tree(sb)
        rows = await sb.commands.run(SQLITE_ROWS, timeout=60)  # judged after the files: they say more
        sandbox_id = sb.id
    if diff := differences(before, after):
        more = f"; and {len(diff) - _SHOWN} more" if len(diff) > _SHOWN else ""
        raise ItemFailed(f"after restoring checkpoint {checkpoint.id}, {len(diff)} of {len(before)} entries are not "
                         f"as they were: {'; '.join(diff[:_SHOWN])}{more}",
                         fix="upgrade Corral: a restore must put back every file of the checkpoint (bytes, modes, "
                             "owners, links) and remove what was created since (docs/lifecycle.md)")
    if rows.exit_code != 0 or ROWS_BACK not in rows.stdout:
        raise ItemFailed(f"the database does not have its rows back after the restore: exit {rows.exit_code}, "
                         f"{clip(rows.stdout)!r}, stderr {clip(rows.stderr_bytes)!r}")
    record = await _restore_record(ctx, sandbox_id, checkpoint.id)
    return (f"rm -rf of a project and DROP TABLE undone in sandbox {sandbox_id}: all {len(before)} entries back "
            f"byte for byte, {ROWS} rows in the table; the audit trail names key {record.key_id} ({record.role}) "
            f"restoring {checkpoint.id}")


def _names(record: AuditRecord, checkpoint_id: str) -> bool:
    return checkpoint_id in json.dumps(record.params) or record.target == checkpoint_id


async def _restore_record(ctx: CheckContext, sandbox_id: str, checkpoint_id: str) -> AuditRecord:
    """The `checkpoint.restore` record of the sandbox, as the tenant's auditor reads it: it must name the
    checkpoint and the developer's key."""
    deadline = asyncio.get_running_loop().time() + _AUDIT_WAIT
    async with ctx.admin("auditor") as auditor:
        while True:
            records = [r for r in await auditor.audit.query(sandbox=sandbox_id) if r.action == "checkpoint.restore"]
            if records or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.5)
    if not records:
        raise ItemFailed(f"no checkpoint.restore record for sandbox {sandbox_id}",
                         fix="upgrade Corral: every restore must write its audit record (who, which checkpoint)")
    wanted = ctx.key_ids["developer"]
    for r in records:
        if r.key_id == wanted and r.role == "developer" and _names(r, checkpoint_id):
            return r
    seen = "; ".join(f"key {r.key_id} ({r.role}) params {clip(json.dumps(r.params), 120)}" for r in records)
    raise ItemFailed(f"the checkpoint.restore record does not name who restored {checkpoint_id} (the developer's key "
                     f"{wanted}): {seen}")
