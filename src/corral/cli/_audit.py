"""`corral audit verify|head|export|tail`: the hash-chained audit trail (auditor, operator, admin)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import typer

from .._sdk import AuditRecord, AuditVerification
from ._common import ApiKeyOption, JsonOption, UrlOption, admin, note, print_json

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
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Walk the chain; exit 1 and name the first edited, inserted or deleted record if it is broken."""
    if file is not None:
        result = _verify_file(file, head)
    else:
        with admin(url, api_key) as a:
            result = a.audit.verify(head)
    if as_json:
        print_json({"ok": result.ok, "checked": result.checked, "head": result.head,
                    "problem": None if result.problem is None else vars(result.problem)})
    elif result.problem is None:
        typer.echo(f"ok: {result.checked} records verified; head {result.head}")
    else:
        p = result.problem
        typer.echo(f"BROKEN at record {p.seq} ({p.kind}): {p.message}; {result.checked} records verified before "
                   f"it, last good head {result.head}")
    raise typer.Exit(0 if result.ok else 1)


def _verify_file(path: Path, head: str | None) -> AuditVerification:
    """Verify an export offline, with the server's own checker (no server needed)."""
    from .._sdk import AuditProblem
    from ..control import AuditEntry, ChainHead, verify_chain

    with open(path, encoding="ascii") as f:
        entries = (AuditEntry.from_json(line) for line in f if line.strip())
        result = verify_chain(entries, ChainHead.parse(head) if head else None)
    problem = result.problem
    return AuditVerification(ok=result.ok, checked=result.checked, head=str(result.head),
                             problem=None if problem is None else AuditProblem(problem.seq, problem.kind,
                                                                               problem.message))


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
