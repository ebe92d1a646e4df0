"""`corral volume create|ls|rm`: the tenant's volumes on a Corral server (docs/volumes.md), through its API."""

from __future__ import annotations

import dataclasses
from urllib.parse import quote

import typer
from rich.table import Table

from .._sdk import Volume
from ._common import ApiKeyOption, JsonOption, UrlOption, client, print_json, print_table, short_time

volume_app = typer.Typer(help="Create, list and delete volumes: storage that outlives sandboxes.",
                         no_args_is_help=True)


def _json(volume: Volume) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(volume).items() if not k.startswith("_")}


def _size(n: int) -> str:
    for unit, factor in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B" if n < 2**20 else f"{n / 2**20:.1f}M"


@volume_app.command("create")
def create(
    name: str = typer.Argument(..., help="1 to 63 lowercase letters, digits, '-' or '_'."),
    size: str = typer.Option("1G", "--size", help="The hard limit, from 16M to 1T (e.g. 512M, 10G)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Create an empty volume and print its name; mount it with `Sandbox.create(volumes={"/mnt/data": NAME})`."""
    volume = Volume.create(name, size, api_key=api_key, base_url=url)
    if as_json:
        print_json(_json(volume))
    else:
        typer.echo(volume.name)


@volume_app.command("ls")
def ls(as_json: JsonOption = False, url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """List the tenant's volumes."""
    volumes = Volume.list(api_key=api_key, base_url=url)
    if as_json:
        print_json([_json(v) for v in volumes])
        return
    table = Table("name", "id", "size", "created")
    for v in volumes:
        table.add_row(v.name, v.id, _size(v.size), short_time(v.created_at))
    print_table(table)


@volume_app.command("rm")
def rm(
    name: str = typer.Argument(..., help="The volume's name."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Delete a volume and its files (refused while a sandbox mounts it)."""
    http = client(url, api_key)  # by name at once: `Volume.get` would measure its usage first
    try:
        http.request("DELETE", "/v1/volumes/" + quote(name, safe=""))
    finally:
        http.close()
