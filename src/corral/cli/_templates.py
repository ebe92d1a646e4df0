"""`corral templates build|ls|import|rm`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..templates import TemplateStore, build_template, builtin_spec, import_image, load_spec

templates_app = typer.Typer(help="Build, import and list sandbox templates.", no_args_is_help=True)
console = Console(stderr=True)


class _Progress:
    """Shows the current step in a spinner and keeps Corral's own steps (`==> ...`) on screen."""

    def __init__(self, status: object) -> None:
        self.status = status
        self.started = time.monotonic()

    def __call__(self, line: str) -> None:
        elapsed = time.monotonic() - self.started
        if line.startswith("==> "):
            console.print(f"[bold]{line}[/bold] [dim]({elapsed:.0f}s)[/dim]")
        self.status.update(f"[{elapsed:4.0f}s] {line[:100]}")  # type: ignore[attr-defined]


@templates_app.command("build")
def build(
    name: str = typer.Argument("default", help="A built-in template (default, polyglot...) or a spec file."),
    force: bool = typer.Option(False, help="Rebuild even if an identical template exists."),
) -> None:
    """Build a template with debootstrap (cached by content: an unchanged spec is instant)."""
    spec = load_spec(name) if Path(name).is_file() else builtin_spec(name)
    store = TemplateStore()
    with console.status(f"building {spec.name}") as status:
        template = build_template(spec, store, progress=_Progress(status), force=force)
    typer.echo(template.digest)


@templates_app.command("import")
def import_(path: Path, name: str) -> None:
    """Import an OCI image layout (dir or tar) or a `docker save` archive as template NAME."""
    with console.status(f"importing {name}") as status:
        template = import_image(path, name, TemplateStore(), progress=_Progress(status))
    typer.echo(template.digest)


@templates_app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json")) -> None:
    """List templates."""
    templates = TemplateStore().list()
    if as_json:
        typer.echo(json.dumps([t.to_dict() for t in templates], default=str))
        return
    table = Table("name", "digest", "source", "size", "created")
    for t in templates:
        table.add_row(t.name, t.digest[:12], t.source, f"{t.size_bytes / 1e6:.0f} MB", t.created_at.isoformat())
    Console().print(table)


@templates_app.command("rm")
def rm(name: str) -> None:
    """Remove a template name (and its files when no other name points at them)."""
    TemplateStore().remove(name)
