"""`corral keys create|ls|revoke` (admin): API keys. A new key is printed once, alone on the last line."""

from __future__ import annotations

import dataclasses

import typer
from rich.table import Table

from ._common import ApiKeyOption, JsonOption, UrlOption, admin, print_json, print_table, short_time

keys_app = typer.Typer(help="Create, list and revoke API keys (admin).", no_args_is_help=True)


@keys_app.command("create")
def create(
    tenant: str = typer.Option(..., help="The tenant the key acts for (name)."),
    role: str = typer.Option("developer", help="admin, operator, developer or auditor."),
    name: str = typer.Option("", help="A label for humans (what uses this key)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Create an API key; the key itself is shown only now, alone on the last line (--json: every field)."""
    with admin(url, api_key) as a:
        new = a.keys.create(tenant, role, name=name)
    if as_json:
        print_json(dataclasses.asdict(new))  # the secret included: --json is how scripts take it
        return
    typer.echo(f"{new.id} ({new.role} in {new.tenant}); the key, shown only this once:")
    typer.echo(new.key)


@keys_app.command("ls")
def ls(
    tenant: str | None = typer.Option(None, help="Only this tenant's keys (name or id)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """List API keys (never their secrets: only a hash is stored)."""
    with admin(url, api_key) as a:
        keys = a.keys.list(tenant)
    if as_json:
        print_json([dataclasses.asdict(k) for k in keys])
        return
    table = Table("id", "tenant", "role", "name", "prefix", "created", "last used", "revoked")
    table.columns[0].no_wrap = True
    for k in keys:
        table.add_row(k.id, k.tenant or k.tenant_id, k.role, k.name, k.prefix, short_time(k.created_at),
                      short_time(k.last_used_at), short_time(k.revoked_at))
    print_table(table)


@keys_app.command("revoke")
def revoke(
    key_ids: list[str] = typer.Argument(..., help="Key ids (from `corral keys ls`)."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Revoke API keys for good."""
    with admin(url, api_key) as a:
        for key_id in key_ids:
            a.keys.revoke(key_id)
