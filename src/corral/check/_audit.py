"""Items 34, 35 and 39: the audit log is tamper-evident and out of every sandbox's reach, complete, and keyed.

Tamper evidence is proved the way an auditor would rely on it: export the whole log, verify the export offline
with the same checker as `corral audit verify --file` (with the server's audit keys, read here as the server
reads them: `CORRAL_AUDIT_KEY`, else `<home>/audit.key` when the server runs on this machine), then delete and
edit a middle record of a copy and watch the verification fail at that record. Item 39 goes further, as someone
who can write the database but lacks the key would: rewrite a middle record and re-hash it and every later one
(with plain SHA-256, and with a key of their own), so that every link holds, and the verification must still
fail. Completeness is a scripted session whose every step must show up in the log with the key that did it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .._sdk import AuditRecord
from ._context import CheckContext, clip, run_json
from ._model import ItemFailed

if TYPE_CHECKING:  # the control plane (SQLAlchemy: corral[server]) loads only when an audit item runs
    from ..control import AuditEntry, AuditKeyring, VerifyResult

__all__ = ["expect_broken", "item_34_audit_tamper_evident", "item_35_audit_complete", "item_39_audit_keyed",
           "rewritten_without_key", "server_audit_keys", "tampered_copy", "verify_file"]

DEFAULT_HOME = "/var/lib/corral"
_AUDIT_WAIT = 15.0  # seconds for the newest records (egress events are appended as they happen) to show up


_NO_KEY_FIX = ("run `corral check` on the server's host as root (it reads <home>/audit.key, or pass --home), or "
               "set CORRAL_AUDIT_KEY to the servers' keys")


def verify_file(path: Path, head: str | None = None, keys: AuditKeyring | None = None) -> VerifyResult:
    """Verify an exported JSONL file offline, exactly as `corral audit verify --file` does."""
    from ..control import AuditEntry, ChainHead, verify_chain

    with open(path, encoding="ascii") as f:
        entries = (AuditEntry.from_json(line) for line in f if line.strip())
        return verify_chain(entries, ChainHead.parse(head) if head else None, keys)


def server_audit_keys(ctx: CheckContext) -> AuditKeyring:
    """The server's audit keys as the server finds them: `CORRAL_AUDIT_KEY`, else its state directory's key file
    when it runs on this machine and the file is readable here (else none)."""
    from ..control import AuditKeyring, load_audit_keys

    home = ctx.home if ctx.home is not None else Path(DEFAULT_HOME) if ctx.target.on_this_machine else None
    try:
        return load_audit_keys(home if home is not None else Path("/nonexistent"))
    except PermissionError:
        return AuditKeyring()


def tampered_copy(src: Path, dst: Path, index: int, how: str) -> int:
    """Copy an export, deleting (`how="delete"`) or editing line `index`; return that record's seq."""
    victim = 0
    with open(src, encoding="ascii") as fin, open(dst, "w", encoding="ascii") as fout:
        for i, line in enumerate(fin):
            if i == index:
                record = json.loads(line)
                victim = int(record["seq"])
                if how == "delete":
                    continue
                record["outcome"] = {**(record.get("outcome") or {}), "status": "tampered"}
                line = json.dumps(record, sort_keys=True) + "\n"
            fout.write(line)
    return victim


def expect_broken(path: Path, victim: int, how: str, kind: str, near: tuple[int, ...],
                  keys: AuditKeyring | None = None) -> str:
    """The tampered export at `path` must fail verification at record `victim` (or one of `near`) as `kind`."""
    problem = verify_file(path, keys=keys).problem
    if problem is None:
        raise ItemFailed(f"the export still verified after {how} record {victim}: tampering goes unnoticed",
                         fix="upgrade Corral: the audit chain must hash every record with its predecessor's hash")
    if problem.kind != kind or problem.seq not in near:
        raise ItemFailed(f"after {how} record {victim} the verification failed, but named record {problem.seq} "
                         f"({problem.kind}: {problem.message}) instead of record {victim} ({kind})")
    return f"{how} record {victim}: {problem.message}"


def _verified_whole(export: Path, count: int, keys: AuditKeyring) -> None:
    whole = verify_file(export, keys=keys)
    p = whole.problem
    if p is not None and p.kind == "unknown-key":
        raise ItemFailed(f"the exported audit log cannot be checked here: record {p.seq}: {p.message}",
                         fix=_NO_KEY_FIX)
    if p is not None:
        raise ItemFailed(f"the exported audit log does not verify: record {p.seq} ({p.kind}): {p.message}",
                         fix="investigate the database: someone changed the audit table (see `corral audit "
                             "verify`); restore it from a backup")
    if whole.checked != count or count < 3:
        raise ItemFailed(f"the export held {count} records, of which {whole.checked} verified: too few to test "
                         "tampering (the check's own setup writes several)")


def _tamper_and_verify(export: Path, count: int, keys: AuditKeyring) -> list[str]:
    """Verify the export, then a copy with its middle record deleted and one with it edited (blocking I/O)."""
    _verified_whole(export, count, keys)
    found = []
    for how, doing, kind in (("delete", "deleting", "deleted"), ("edit", "editing", "edited")):
        copy = export.with_name(f"{how}.jsonl")
        victim = tampered_copy(export, copy, count // 2, how)
        near = (victim, victim + 1) if how == "delete" else (victim,)
        found.append(expect_broken(copy, victim, doing, kind, near, keys))
    return found


REACH_PROBE = r"""
import json, os, socket, subprocess, sys
paths, host, port = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
seen = {}
for p in paths:
    try:
        os.lstat(p)
        seen[p] = "exists"
    except OSError as e:
        seen[p] = e.strerror
found = subprocess.run(["find", "/", "-xdev", "-name", "corral.db*", "-not", "-path", "/proc/*"],
                       capture_output=True, text=True, timeout=30).stdout.split()
def ask(addr, target):
    s = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
    s.settimeout(5)
    try:
        s.connect(addr)
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        return s.recv(200).decode(errors="replace").split("\r\n")[0] or "connected, no answer"
    except OSError as e:
        return "error: " + (e.strerror or type(e).__name__)
    finally:
        s.close()
direct = ask((host, port), "/v1/health")
proxied = ask(("127.0.0.1", 3128), f"http://{host}:{port}/v1/health")
print(json.dumps({"paths": seen, "found": found, "direct": direct, "proxied": proxied}))
"""


async def item_34_audit_tamper_evident(ctx: CheckContext) -> str:
    """Edits and deletions of an exported log are caught and named; the live chain verifies against its current
    head; no sandbox can see the state directory or reach the API server."""
    with tempfile.TemporaryDirectory(prefix="corral-check-audit-") as tmp:
        export = Path(tmp) / "audit.jsonl"
        async with ctx.admin() as admin:
            with open(export, "w", encoding="ascii") as f:
                count = await admin.audit.export(f)
            head = await admin.audit.head()
            live = await admin.audit.verify(head)
        keys = server_audit_keys(ctx)
        found = await asyncio.to_thread(_tamper_and_verify, export, count, keys)  # a big log: not on the loop
    if not live.ok:
        p = live.problem
        where = f"record {p.seq} ({p.kind}): {p.message}" if p else "unknown"
        raise ItemFailed(f"the server's chain does not verify against its own head {head}: {where}")
    reach = await _out_of_reach(ctx)
    return f"{count} records verify offline and against head {head}; {'; '.join(found)}; {reach}"


async def _out_of_reach(ctx: CheckContext) -> str:
    home = str(ctx.home) if ctx.home is not None else DEFAULT_HOME
    paths = [home, f"{home}/corral.db", f"{home}/admin.key", f"{home}/sandboxes"]
    url = urlsplit(ctx.url)
    host, port = url.hostname or "127.0.0.1", url.port or (443 if url.scheme == "https" else 80)
    async with ctx.sandbox() as sb:
        out = await run_json(sb, REACH_PROBE, json.dumps(paths), host, str(port), timeout=60,
                             what="state directory and API reach")
    visible = {p: r for p, r in out["paths"].items() if r == "exists"}
    if visible or out["found"]:
        raise ItemFailed(f"a sandbox sees the server's state: {sorted(visible)} {out['found']}",
                         fix="never mount the state directory (or any parent of it) into sandboxes")
    for how in ("direct", "proxied"):
        if out[how].startswith("HTTP/") and " 200" in out[how]:
            raise ItemFailed(f"a sandbox reached the API server at {host}:{port} ({how}): {out[how]}",
                             fix="the API server's address must be unreachable from sandboxes: keep the egress "
                                 "proxy's ban on the host's own addresses and private ranges")
    return f"a sandbox sees none of {home}, corral.db* and cannot reach {host}:{port} ({clip(out['proxied'], 60)})"


SESSION_FILE = "/workspace/corral-check-audit.txt"
ALLOC = "b = b'\\x01' * (256 << 20)\nprint(len(b))\n"
EGRESS = "curl -sS -m 10 -o /dev/null -x http://127.0.0.1:3128 http://example.com/corral-check"


async def item_35_audit_complete(ctx: CheckContext) -> str:
    """Create, exec, a timeout, an OOM kill, a file write, an egress refusal and the kill are each on record,
    attributed to the developer key that did them."""
    async with ctx.sandbox(limits={"memory": "64M"}) as sb:
        sid = sb.id
        await sb.commands.run("echo corral-check", timeout=20)
        timed = await sb.commands.run("sleep 30", timeout=0.5)
        oom = await sb.commands.run(["python3", "-c", ALLOC], timeout=30)
        await sb.files.write(SESSION_FILE, b"data")
        egress = await sb.commands.run(EGRESS, timeout=30)
        await sb.kill()
    if not timed.timed_out or not oom.oom_killed:
        raise ItemFailed(f"the session's limit hits did not happen (timed out: {timed.timed_out}, OOM-killed: "
                         f"{oom.oom_killed}): items 10 and 12 say more")
    wanted = _expectations(ctx.key_ids["developer"])
    records = await _records_of(ctx, sid, wanted)
    missing = [what for what, match in wanted.items() if not any(match(r) for r in records)]
    actors = [f"{r.action} by key {r.key_id} ({r.role})" for r in records if not _by_developer(r, ctx)]
    if missing:
        denials = ", ".join(d.host for d in egress.egress_denials) or "none"
        raise ItemFailed(f"no audit record of: {', '.join(missing)} (records for the sandbox: "
                         f"{', '.join(r.action for r in records) or 'none'}; egress refusals seen by the command: "
                         f"{denials})")
    if actors:
        raise ItemFailed(f"records attributed to the wrong actor: {'; '.join(actors)}")
    return f"{len(records)} records for the session, each with its key: {', '.join(wanted)}"


Match = Callable[[AuditRecord], bool]


def _by_developer(r: AuditRecord, ctx: CheckContext) -> bool:
    """The session's developer key did it (egress records carry the key whose sandbox connected, and no role)."""
    roles = ("developer", None) if r.action.startswith("egress.") else ("developer",)
    return r.key_id == ctx.key_ids["developer"] and r.role in roles


def _expectations(key_id: str) -> dict[str, Match]:
    """What the session must leave, as record predicates."""

    def by(action: str, check: Callable[[AuditRecord], bool] = lambda r: True) -> Match:
        return lambda r: r.action == action and r.key_id == key_id and check(r)

    return {
        "create": by("sandbox.create"),
        "exec": by("sandbox.exec", lambda r: r.params.get("cmd") == "echo corral-check"),
        "timeout": by("sandbox.exec", lambda r: r.outcome.get("timed_out") is True),
        "OOM kill (limit hit)": by("sandbox.exec", lambda r: r.outcome.get("oom_killed") is True),
        "file write": by("files.write", lambda r: r.params.get("path") == SESSION_FILE),
        "egress refusal": lambda r: (r.action.startswith("egress.") and r.key_id == key_id
                                     and r.outcome.get("allowed") is False),
        "kill": by("sandbox.kill"),
    }


async def _records_of(ctx: CheckContext, sid: str, wanted: dict[str, Match]) -> list[AuditRecord]:
    """The sandbox's records as its tenant's auditor reads them, waiting briefly for late (egress) records."""
    deadline = asyncio.get_running_loop().time() + _AUDIT_WAIT
    async with ctx.admin("auditor") as auditor:
        while True:
            records = await auditor.audit.query(sandbox=sid)
            if all(any(m(r) for r in records) for m in wanted.values()):
                return records
            if asyncio.get_running_loop().time() > deadline:
                return records
            await asyncio.sleep(0.5)


# -- item 39: the chain is keyed ---------------------------------------------------------------------------------


def rewritten_without_key(entries: list[AuditEntry], victim: int, how: str) -> list[AuditEntry]:
    """`entries` with record `victim` edited and it and every later record re-hashed and re-linked, so that every
    link holds, by someone without the server's key: `how="sha256"` re-hashes them unkeyed (plain SHA-256, as
    records before keys were), `how="own-key"` with a random key of their own under the server's key id."""
    key = secrets.token_bytes(32)
    out: list[AuditEntry] = []
    for entry in entries:
        if entry.seq >= victim:
            outcome = {**entry.outcome, "status": "tampered"} if entry.seq == victim else entry.outcome
            entry = dataclasses.replace(entry, prev_hash=out[-1].hash if out else entry.prev_hash, outcome=outcome)
            if how == "sha256":
                entry = dataclasses.replace(entry, hmac_key_id=None)
                entry = dataclasses.replace(entry, hash=entry.computed_hash())
            else:
                entry = dataclasses.replace(entry, hash=hmac.new(key, entry.message(), hashlib.sha256).hexdigest())
        out.append(entry)
    return out


def _forge_and_verify(export: Path, count: int, keys: AuditKeyring) -> str:
    """Verify the export with the server's keys, then two rewrites without them (blocking I/O)."""
    from ..control import AuditEntry, verify_chain

    _verified_whole(export, count, keys)
    with open(export, encoding="ascii") as f:
        entries = [AuditEntry.from_json(line) for line in f if line.strip()]
    keyed = [e.seq for e in entries if e.hmac_key_id is not None]
    if len(keyed) < 3:
        raise ItemFailed(f"only {len(keyed)} of the {count} exported records are keyed: the server signs its audit "
                         "records with plain SHA-256, which anyone who can write the database can recompute",
                         fix="upgrade Corral: audit records must be HMACs with a key kept outside the database")
    victim = keyed[len(keyed) // 2]
    found = []
    for how, label in (("sha256", "plain SHA-256"), ("own-key", "a key not the server's")):
        result = verify_chain(rewritten_without_key(entries, victim, how), keys=keys)
        if result.problem is None:
            raise ItemFailed(f"record {victim} rewritten and every later record re-hashed with {label} still "
                             "verified: the chain's hashes can be recomputed without the server's key",
                             fix="upgrade Corral: audit records must be HMACs with a key kept outside the database")
        found.append(f"{label}: record {result.problem.seq} ({result.problem.kind})")
    return f"{len(keyed)} keyed records verify with the server's keys {', '.join(keys.ids)}; record {victim} " \
           f"rewritten and re-hashed to the end without them fails: {'; '.join(found)}"


async def item_39_audit_keyed(ctx: CheckContext) -> str:
    """Rewriting a middle record and re-hashing every later one without the server's key makes verification
    fail (checked offline, with the server's keys, on a whole-log export)."""
    keys = server_audit_keys(ctx)
    if not keys:
        raise ItemFailed("the server's audit keys are not readable here, so the chain's HMACs cannot be checked",
                         fix=_NO_KEY_FIX)
    with tempfile.TemporaryDirectory(prefix="corral-check-audit-key-") as tmp:
        export = Path(tmp) / "audit.jsonl"
        async with ctx.admin() as admin:
            with open(export, "w", encoding="ascii") as f:
                count = await admin.audit.export(f)
        return await asyncio.to_thread(_forge_and_verify, export, count, keys)
