"""`corral audit verify|head|export|tail|rotate-key`: the keyed hash chain of the audit trail.

`verify`, `head`, `export` and `tail` ask the server (auditor, operator, admin). `verify --file` checks an export
offline and needs the audit key for the HMACs (`--key-file`, `CORRAL_AUDIT_KEY`, or the `audit.key` of
`CORRAL_HOME` when readable); `--unkeyed` checks only the links, and says so. `rotate-key` is an operator's
local command on the server's host: it puts a new key first in `<CORRAL_HOME>/audit.key`, keeps the old ones
(older records still verify with them), and appends an `audit.key_rotated` record signed with the new key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import typer

from .._exceptions import InvalidRequestError
from .._sdk import AuditProblem, AuditRecord, AuditVerification
from .._settings import audit_key, corral_home, database_url
from ._common import ApiKeyOption, DbOption, HomeOption, JsonOption, UrlOption, admin, note, print_json

if TYPE_CHECKING:  # the control plane (SQLAlchemy) loads only for the local commands below: the CLI starts fast
    from ..control import AuditEntry, AuditKeyring

KEY_ROTATED = "audit.key_rotated"

audit_app = typer.Typer(help="Verify, export and follow the audit trail.", no_args_is_help=True)

TenantFilter = typer.Option(None, "--tenant", help="Only this tenant's records (name or id; admins only).")
SandboxFilter = typer.Option(None, "--sandbox", help="Only records about this sandbox.")
ActionFilter = typer.Option(None, "--action", help="Only this action, e.g. sandbox.exec.")


@audit_app.command("verify")
def verify(
    head: str | None = typer.Option(None, help="A head exported earlier (SEQ:HASH, from `corral audit head`): "
                                               "also catches deleted or replaced newest records."),
    file: Path | None = typer.Option(None, "--file", help="Verify an exported JSONL file here instead of asking "
                                                          "the server (a whole-log export)."),
    key_file: Path | None = typer.Option(None, "--key-file", help="With --file: the audit keys to check the HMACs "
                                                                  "with (default CORRAL_AUDIT_KEY, else "
                                                                  "CORRAL_HOME/audit.key if readable)."),
    unkeyed: bool = typer.Option(False, "--unkeyed", help="With --file and no key: check only the links (the "
                                                          "HMACs are not checked, and the output says so)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Walk the chain; exit 1 and name the first edited, inserted or deleted record (or one signed with an audit
    key the verifier lacks) if it is broken."""
    if file is not None:
        result = _verify_file(file, head, _offline_keys(key_file), links_only=unkeyed)
    else:
        with admin(url, api_key) as a:
            result = a.audit.verify(head)
    if as_json:
        print_json({"ok": result.ok, "checked": result.checked, "head": result.head, "unkeyed": result.unkeyed,
                    "unchecked": result.unchecked,
                    "problem": None if result.problem is None else vars(result.problem)})
    else:
        typer.echo(_summary(result))
    raise typer.Exit(0 if result.ok else 1)


def _summary(result: AuditVerification) -> str:
    p = result.problem
    if p is not None:
        hint = ("; give its key with --key-file or CORRAL_AUDIT_KEY (or --unkeyed to check only the links)"
                if p.kind == "unknown-key" else "")
        return (f"BROKEN at record {p.seq} ({p.kind}): {p.message}; {result.checked} records verified before it, "
                f"last good head {result.head}{hint}")
    notes = []
    if result.unkeyed:
        notes.append(f"{result.unkeyed} from before audit keys (plain SHA-256)")
    if result.unchecked:
        notes.append(f"{result.unchecked} keyed records' HMACs NOT checked (no key): links only")
    extra = f" ({'; '.join(notes)})" if notes else ""
    return f"ok: {result.checked} records verified{extra}; head {result.head}"


def _offline_keys(key_file: Path | None) -> AuditKeyring:
    """The keys for an offline verification: `--key-file`, else CORRAL_AUDIT_KEY, else this host's key file."""
    from ..control import AuditKeyring, load_audit_keys, read_key_file

    if key_file is not None:
        return read_key_file(key_file)
    try:
        return load_audit_keys(corral_home())
    except PermissionError:  # a server's key file, readable by root only: verify without it
        return AuditKeyring()


def _verify_file(path: Path, head: str | None, keys: AuditKeyring, *, links_only: bool) -> AuditVerification:
    """Verify an export offline, with the server's own checker (no server needed)."""
    from ..control import AuditEntry, ChainHead, verify_chain

    with open(path, encoding="ascii") as f:
        entries = (AuditEntry.from_json(line) for line in f if line.strip())
        result = verify_chain(entries, ChainHead.parse(head) if head else None, keys, links_only=links_only)
    problem = result.problem
    return AuditVerification(ok=result.ok, checked=result.checked, head=str(result.head),
                             problem=None if problem is None else AuditProblem(problem.seq, problem.kind,
                                                                               problem.message),
                             unkeyed=result.unkeyed, unchecked=result.unchecked)


@audit_app.command("rotate-key")
def rotate_key(
    home: HomeOption = None,
    db: DbOption = None,
) -> None:
    """Put a new audit key first in the server's audit.key (keeping the old ones, which older records verify
    with) and record `audit.key_rotated`. Restart the servers to sign with it; replicas share the file's keys."""
    if audit_key() is not None:
        raise InvalidRequestError("the audit keys come from CORRAL_AUDIT_KEY, which this command cannot change: "
                                  "put a new key (`openssl rand -hex 32`) first in it, keep the old ones after a "
                                  "comma, and restart every server")
    from ..control import AUDIT_KEY_FILE, rotate_audit_key_file

    state = corral_home(home)
    new_id, kept = rotate_audit_key_file(state / AUDIT_KEY_FILE)
    note(f"new audit key {new_id} first in {state / AUDIT_KEY_FILE}; kept: {', '.join(kept) or 'none'}")
    entry = asyncio.run(_record_rotation(db or database_url(), state, new_id, kept))
    typer.echo(f"recorded {KEY_ROTATED} as record {entry.seq}; restart the servers to sign with {new_id}")


async def _record_rotation(url: str | None, home: Path, new_id: str, kept: list[str]) -> AuditEntry:
    # The store loads the keys from the file just written, so the record is signed with the new key.
    from ..control import AuditEvent, ControlStore

    async with ControlStore(url, home=home) as store:
        return await store.audit.append(AuditEvent(KEY_ROTATED, params={"key_id": new_id, "kept": kept}))


@audit_app.command("head")
def head(url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """Print the newest record as SEQ:HASH; keep it where the database's owner cannot write, for `verify --head`."""
    with admin(url, api_key) as a:
        typer.echo(a.audit.head())


@contextlib.contextmanager
def _output(out: Path | None) -> Iterator[TextIO]:
    if out is None or str(out) == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    with open(out, "w", encoding="ascii") as f:
        yield f


@audit_app.command("export")
def export(
    out: Path | None = typer.Option(None, "--out", "-o", help="Write here instead of stdout."),
    tenant: str | None = TenantFilter,
    sandbox: str | None = SandboxFilter,
    action: str | None = ActionFilter,
    since: str | None = typer.Option(None, help="From this ISO 8601 time (inclusive)."),
    until: str | None = typer.Option(None, help="Until this ISO 8601 time (exclusive)."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Export matching records as JSONL, oldest first (a whole-log export verifies with `verify --file`)."""
    with admin(url, api_key) as a, _output(out) as f:
        count = a.audit.export(f, tenant=tenant, sandbox=sandbox, action=action, since=since, until=until)
    if out is not None and str(out) != "-":
        note(f"{count} records written to {out}")


def _line(record: AuditRecord) -> str:
    status = record.outcome.get("status", "")
    error = record.outcome.get("error")
    who = f"{record.role or '-'}@{record.tenant_id or '-'}"
    return (f"{record.seq:>7} {record.time} {who} {record.action} {record.target or '-'} {status}"
            + (f" {error}" if error else ""))


@audit_app.command("tail")
def tail(
    tenant: str | None = TenantFilter,
    sandbox: str | None = SandboxFilter,
    action: str | None = ActionFilter,
    after: int | None = typer.Option(None, help="Start after this seq (default: from now)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Print new records as they are appended, until Ctrl-C."""
    try:
        with admin(url, api_key) as a:
            for record in a.audit.follow(after=after, tenant=tenant, sandbox=sandbox, action=action):
                typer.echo(json.dumps(record.to_dict()) if as_json else _line(record))
                sys.stdout.flush()  # a pipe reader (or a test) sees each record as it comes
    except KeyboardInterrupt:
        raise typer.Exit(0) from None  # Ctrl-C is how a tail ends, not an error
