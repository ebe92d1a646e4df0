"""`corral check`: run the sandbox checklist against a running deployment (an admin's key)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .._sdk import ConnectionConfig
from ..check import ITEMS, CheckOptions, Target, print_report, report_json, run_check
from ._common import ApiKeyOption, JsonOption, UrlOption

HomeOption = Annotated[Path | None, typer.Option(
    "--home", help="The server's state directory (its CORRAL_HOME), when it runs on this machine: enables the "
                   "host-side probes (agent socket, server memory, fail closed).", show_default=False)]
ItemOption = Annotated[list[int], typer.Option("--item", "-i", help="Only this item (1-36, 43), repeatable.")]


class _Bar:
    """A progress bar on stderr (only on a terminal), one step per task or item function."""

    def __init__(self) -> None:
        console = Console(stderr=True)
        self.bar = Progress(TextColumn("check"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)
        self.task = self.bar.add_task("", total=None)

    def start(self, total: int) -> None:
        self.bar.update(self.task, total=total)

    def advance(self, label: str, status: str) -> None:
        self.bar.update(self.task, advance=1, description=f"{label}: {status}")

    def __enter__(self) -> _Bar:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def check_command(
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
    home: HomeOption = None,
    template: Annotated[str, typer.Option(help="The template the probes' sandboxes use.")] = "default",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="In-sandbox tasks at once.")] = 8,
    item: ItemOption = [],  # noqa: B006 - typer reads the default, never mutates it
    as_json: JsonOption = False,
) -> None:
    """Prove the sandbox checklist (items 1-36 and 43) against a running deployment; exit 1 if any item fails.

    Needs an admin's key: the check runs in throwaway tenants (`corral-check-<hex>`) that are disabled, emptied
    and stripped of their keys at the end.
    """
    unknown = [n for n in item if n not in ITEMS]
    if unknown:
        raise typer.BadParameter(f"no checklist item {unknown[0]}: items are 1 to {max(ITEMS)}", param_hint="--item")
    if home is not None and not (home / "engine").is_dir():
        raise typer.BadParameter(f"{home} is not a Corral state directory (no engine/ in it)",
                                 param_hint="--home")
    config = ConnectionConfig.resolve(api_key=api_key, base_url=url)
    if not config.api_key:
        raise typer.BadParameter("an admin's API key is needed: set CORRAL_API_KEY or pass --api-key",
                                 param_hint="--api-key")
    target = Target(url=config.base_url, admin_key=config.api_key, home=home, template=template)
    options = CheckOptions(concurrency=concurrency, items=frozenset(item) if item else None)
    with _Bar() as bar:
        report = asyncio.run(run_check(target, options, progress=bar))
    if as_json:
        typer.echo(report_json(report))
    else:
        print_report(report)
    raise typer.Exit(report.exit_code)
