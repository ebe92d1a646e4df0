"""`corral secret put|ls|rm|reseal`: the tenant's stored secrets on a Corral server (docs/secrets.md).

`put`, `ls` and `rm` go through the API. `put` reads the value from standard input (or from the environment
variable `--from-env` names), never from an argument: arguments show in `ps` and shell history. `reseal` is an
operator's local command on the server's host, as `corral audit rotate-key` is: it seals every tenant's stored values
again with the newest key, in the database, and records `secret.resealed`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import typer
from rich.table import Table

from .._exceptions import InvalidRequestError
from .._sdk import Secret
from .._settings import corral_home, database_url
from ._common import (
    ApiKeyOption,
    DbOption,
    HomeOption,
    JsonOption,
    UrlOption,
    client,
    print_json,
    print_table,
    short_time,
)

if TYPE_CHECKING:  # the control plane (SQLAlchemy) loads only for `reseal`: the CLI starts fast
    from ..control import Resealed

RESEALED = "secret.resealed"

secret_app = typer.Typer(help="Store, list and delete secrets that sandboxes use without ever holding them; "
                         "reseal them under a new key.",
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


@secret_app.command("reseal")
def reseal(
    home: HomeOption = None,
    db: DbOption = None,
) -> None:
    """Seal every stored secret again with the newest key (the first of CORRAL_SECRETS_KEY, else of the state
    directory's secrets.key), so that the older keys can go. Run it after the servers restarted with the new key."""
    from ..egress._keyring import ENV, KEY_FILE  # `cryptography` loads only for this command

    state = corral_home(home)
    if os.environ.get(ENV) is None and not (state / KEY_FILE).exists():
        raise InvalidRequestError(f"no secrets key: {ENV} is not set and {state / KEY_FILE} does not exist (is "
                                  "--home the server's state directory?)")
    done = asyncio.run(_reseal(db or database_url(), state))
    typer.echo(f"resealed {done.resealed} stored secret(s) with the newest key; {done.current} already were")


async def _reseal(url: str | None, home: Path) -> Resealed:
    from ..control import AuditEvent, ControlStore
    from ..egress._keyring import SecretKeyring

    async with ControlStore(url, home=home) as store:
        done = await store.reseal_secrets(SecretKeyring.from_environment(home))
        await store.audit.append(AuditEvent(RESEALED, params={"resealed": done.resealed, "current": done.current}))
    return done
