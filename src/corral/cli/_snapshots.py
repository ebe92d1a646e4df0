"""`corral snapshot ls|rm`: the tenant's snapshots (taken with `corral sandbox snapshot ID`)."""

from __future__ import annotations

import dataclasses

import typer
from rich.table import Table

from .._sdk import Snapshot
from ._common import ApiKeyOption, JsonOption, UrlOption, print_json, print_table, short_time

snapshot_app = typer.Typer(help="List and delete snapshots (start sandboxes from one with `sandbox create "
                           "--template <snapshot id>`).", no_args_is_help=True)


def _fields(snap: Snapshot) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(snap).items() if not k.startswith("_")}


@snapshot_app.command("ls")
def ls(as_json: JsonOption = False, url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """List the key's tenant's snapshots."""
    found = Snapshot.list(api_key=api_key, base_url=url)
    if as_json:
        print_json([_fields(s) for s in found])
        return
    table = Table("id", "name", "size", "created", "of sandbox", "template")
    table.columns[0].no_wrap = True
    for s in found:
        table.add_row(s.id, s.name or "", f"{s.size / 2**20:.1f} MiB", short_time(s.created_at), s.sandbox_id or "",
                      s.template or "")
    print_table(table)


@snapshot_app.command("rm")
def rm(
    snapshots: list[str] = typer.Argument(..., help="Snapshot ids or names."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Delete snapshots; sandboxes started from them keep running."""
    for one in snapshots:
        Snapshot.get(one, api_key=api_key, base_url=url).delete()
        typer.echo(one)
