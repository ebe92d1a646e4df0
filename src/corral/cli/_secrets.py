"""`corral secret put|ls|rm`: the tenant's stored secrets on a Corral server (docs/secrets.md), through its API.

`put` reads the value from standard input (or from the environment variable `--from-env` names), never from an
argument: arguments show in `ps` and shell history.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from urllib.parse import quote

import typer
from rich.table import Table

from .._sdk import Secret
from ._common import ApiKeyOption, JsonOption, UrlOption, client, print_json, print_table, short_time

secret_app = typer.Typer(help="Store, list and delete secrets that sandboxes use without ever holding them.",
                         no_args_is_help=True)


def _json(secret: Secret) -> dict[str, object]:
    return {k: v for k, v in dataclasses.asdict(secret).items() if not k.startswith("_")}


def _value(from_env: str | None) -> str:
    if from_env is not None:
        value = os.environ.get(from_env)
        if value is None:
            raise typer.BadParameter(f"${from_env} is not set", param_hint="--from-env")
        return value
    if sys.stdin.isatty():
        raise typer.BadParameter("pipe the value on standard input, or name a variable with --from-env",
                                 param_hint="VALUE")
    value = sys.stdin.read()
    return value[:-1] if value.endswith("\n") else value  # `echo` and here-strings add one


@secret_app.command("put")
def put(
    name: str = typer.Argument(..., help="The secret's name (an environment variable name)."),
    host: list[str] = typer.Option(..., "--host", help="A host it may be sent to (repeatable; *.example.com for "
                                   "subdomains)."),
    body: bool = typer.Option(False, "--body", help="Also put it into request bodies, not only headers."),
    from_env: str | None = typer.Option(None, "--from-env", help="Read the value from this environment variable "
                                        "(default: standard input)."),
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Store (or replace) a secret; sandboxes ask for it with `secrets={"VAR": {"stored": NAME}}`."""
    secret = Secret.put(name, _value(from_env), hosts=host, body=body, api_key=api_key, base_url=url)
    if as_json:
        print_json(_json(secret))
    else:
        typer.echo(secret.name)


@secret_app.command("ls")
def ls(as_json: JsonOption = False, url: UrlOption = None, api_key: ApiKeyOption = None) -> None:
    """List the tenant's stored secrets: names and hosts, never values."""
    found = Secret.list(api_key=api_key, base_url=url)
    if as_json:
        print_json([_json(s) for s in found])
        return
    table = Table("name", "hosts", "body", "updated")
    for s in found:
        table.add_row(s.name, ", ".join(s.hosts), "yes" if s.body else "no", short_time(s.updated_at))
    print_table(table)


@secret_app.command("rm")
def rm(
    name: str = typer.Argument(..., help="The secret's name."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Forget a stored secret (sandboxes made with it keep theirs)."""
    http = client(url, api_key)
    try:
        http.request("DELETE", "/v1/secrets/" + quote(name, safe=""))
    finally:
        http.close()
