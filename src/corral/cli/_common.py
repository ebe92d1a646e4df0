"""What the API client commands share: the `--url`/`--api-key` options, the connection, and small parsers.

Client commands never read the environment themselves: `ConnectionConfig.resolve` (through `_settings`) falls
back to `CORRAL_URL` and `CORRAL_API_KEY` when an option is not given.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .._exceptions import CorralError
from .._sdk import DEFAULT_REQUEST_TIMEOUT, Admin, ConnectionConfig
from .._sdk._transport import SyncClient

UrlOption = Annotated[str | None, typer.Option(
    "--url", help="The Corral API server (default: $CORRAL_URL, else http://127.0.0.1:7770).", show_default=False)]
ApiKeyOption = Annotated[str | None, typer.Option(
    "--api-key", help="The API key (default: $CORRAL_API_KEY; prefer the variable: options show up in `ps`).",
    show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON (every field) instead of text.")]
# The local operator commands (`audit rotate-key`, `secret reseal`) work on the server's own state and database.
HomeOption = Annotated[Path | None, typer.Option("--home", help="The server's state directory (default "
                                                                "CORRAL_HOME).")]
DbOption = Annotated[str | None, typer.Option("--db", help="The server's database URL (default CORRAL_DB_URL, else "
                                                           "SQLite in the state directory).")]


def config(url: str | None, api_key: str | None, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
           ) -> ConnectionConfig:
    return ConnectionConfig.resolve(api_key=api_key, base_url=url, request_timeout=request_timeout)


def client(url: str | None, api_key: str | None) -> SyncClient:
    """A raw HTTP client for calls the SDK has no method for (the kill switch's ids, archives)."""
    return SyncClient(config(url, api_key))


def admin(url: str | None, api_key: str | None) -> Admin:
    return Admin(api_key=api_key, base_url=url)


def pairs(items: Iterable[str], option: str) -> dict[str, str]:
    """`KEY=VALUE` options into a dict (a usage error, exit 2, names the bad one)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{option} takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, default=str))


def note(message: str) -> None:
    """A human notice on stderr, so stdout stays what scripts parse."""
    print(message, file=sys.stderr, flush=True)


def error_line(exc: CorralError) -> str:
    """The one line the CLI prints for an error: its stable code and its message.

    The code is one of the API's (docs/api.md): the SDK's own transport errors print as their wire ancestor,
    `server_error` (the message says what happened: "cannot connect to Corral at ...")."""
    message = " ".join(exc.message.split()) or type(exc).__name__
    code = next(cls.code for cls in type(exc).__mro__ if issubclass(cls, CorralError) and cls.wire)
    return f"error: {code}: {message}"


def print_table(table: Table) -> None:
    """On a terminal, fit it; in a pipe, never cut a cell (rich would assume 80 columns and elide)."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 1000))
    console.print(table)


def short_time(iso: str | None) -> str:
    """`2030-01-01T12:00:00.123456+00:00` -> `2030-01-01 12:00:00` (times from the server are UTC)."""
    return iso[:19].replace("T", " ") if iso else ""
