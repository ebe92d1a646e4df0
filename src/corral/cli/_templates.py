"""`corral templates build|ls|show|import|push|rm`."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..backends.local._agent_files import install_agent
from ..templates import (
    AgentFiles,
    Template,
    TemplateStore,
    build_template,
    builtin_spec,
    import_image,
    load_spec,
    push_template,
    rootless_namespace,
)

templates_app = typer.Typer(help="Build, import, list and push sandbox templates.", no_args_is_help=True)
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


# Run again by `_as_namespace_root`: the same command line, whichever way this process was started.
_RERUN = "import sys; from corral.cli import main; sys.argv[0] = 'corral'; main()"


def _as_namespace_root(store: TemplateStore) -> None:
    """Without root, run this command again as root of the user namespace rootless builds run in.

    A non-root user's templates were built there (docs/templates.md): only there do their files have the
    owners a sandbox sees, which an image must carry, and only there may all of them be read and deleted.
    """
    if os.geteuid() == 0:
        return
    prefix = rootless_namespace(store.root)
    os.execvp(prefix[0], [*prefix, sys.executable, "-c", _RERUN, *sys.argv[1:]])  # noqa: S606 - no shell involved


@templates_app.command("build")
def build(
    name: str = typer.Argument("default", help="A built-in template (default, polyglot...) or a spec file."),
    force: bool = typer.Option(False, help="Rebuild even if an identical template exists."),
    rootless: bool | None = typer.Option(
        None, "--rootless/--no-rootless", show_default="rootless unless run as root",
        help="Build in a user namespace of your subordinate ids (/etc/subuid, /etc/subgid), without root.",
    ),
) -> None:
    """Build a template with mmdebstrap (cached by content: an unchanged spec is instant)."""
    spec = load_spec(name) if Path(name).is_file() else builtin_spec(name)
    store = TemplateStore()
    with console.status(f"building {spec.name}") as status:
        template = build_template(spec, store, progress=_Progress(status), force=force, rootless=rootless)
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
    table = Table("name", "digest", "source", "size", "created", "pushed")
    for t in templates:
        table.add_row(t.name, t.digest[:12], t.source, f"{t.size_bytes / 1e6:.0f} MB", t.created_at.isoformat(),
                      _last_push(t))
    Console().print(table)


def _last_push(template: Template) -> str:
    return template.pushed[-1].reference if template.pushed else ""


@templates_app.command("show")
def show(name: str) -> None:
    """A template's details as JSON, with the images pushed from it (pinned by digest)."""
    typer.echo(json.dumps(TemplateStore().get(name).to_dict(), indent=2, default=str))


@templates_app.command("push")
def push(
    name: str = typer.Argument(..., help="The template to publish."),
    destination: str = typer.Argument(..., help="REGISTRY/REPOSITORY[:TAG]; the tag defaults to the name."),
    creds: str | None = typer.Option(None, "--creds", help="USER:PASSWORD (else $CORRAL_REGISTRY_CREDS, else "
                                     "the standard auth files: $REGISTRY_AUTH_FILE, ~/.docker/config.json)."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP / unverified TLS (a loopback registry)."),
    timeout: float = typer.Option(3600.0, help="Seconds the upload may take."),
) -> None:
    """Publish a template as an OCI image (rootfs + agent) and print its reference pinned by digest."""
    store = TemplateStore()
    template = store.get(name)
    _as_namespace_root(store)
    with console.status(f"pushing {name}") as status:
        agent = AgentFiles(install_agent(store.home))
        result = push_template(template, destination, store, agent=agent, creds=creds, insecure=insecure,
                               timeout=timeout, progress=_Progress(status))
    typer.echo(result.reference)


@templates_app.command("rm")
def rm(name: str) -> None:
    """Remove a template name (and its files when no other name points at them)."""
    store = TemplateStore()
    _as_namespace_root(store)
    store.remove(name)
