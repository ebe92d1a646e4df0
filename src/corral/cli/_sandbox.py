"""`corral sandbox create|ls|exec|kill`: drive the local engine directly (no server needed)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from ..engine import Engine, Limits, SandboxSpec

sandbox_app = typer.Typer(help="Create, list, use and kill sandboxes on this machine.", no_args_is_help=True)
console = Console()
T = TypeVar("T")


def _run(fn: Callable[[Engine], Awaitable[T]]) -> T:
    async def go() -> T:
        async with Engine() as engine:
            return await fn(engine)

    return asyncio.run(go())


@sandbox_app.command("create")
def create(
    template: str = typer.Option("default", help="Template name."),
    runtime: str = typer.Option("runc", help="runc, or runsc (gVisor)."),
    timeout: float = typer.Option(300, help="Seconds until the sandbox is destroyed."),
    memory: str = typer.Option("512M"), cpus: float = typer.Option(1.0), pids: int = typer.Option(256),
    disk: str = typer.Option("1G"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Create a sandbox and print its id."""
    spec = SandboxSpec(template=template, runtime=runtime, timeout=timeout,  # type: ignore[arg-type]
                       limits=Limits(memory=memory, cpus=cpus, pids=pids, disk=disk),  # type: ignore[arg-type]
                       env=_parse_env(env))

    async def go(engine: Engine) -> dict[str, Any]:
        sb = await engine.create(spec)
        return {"id": sb.id, "expires_at": sb.info.expires_at.isoformat()}

    out = _run(go)
    typer.echo(json.dumps(out) if as_json else out["id"])


@sandbox_app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json")) -> None:
    """List sandboxes."""

    async def go(engine: Engine) -> list[dict[str, Any]]:
        return [{"id": s.id, "state": s.state.value, "template": s.template, "runtime": s.runtime,
                 "created_at": s.created_at.isoformat(), "expires_at": s.expires_at.isoformat()}
                for s in engine.list()]

    rows = _run(go)
    if as_json:
        typer.echo(json.dumps(rows))
        return
    table = Table("id", "state", "template", "runtime", "expires")
    for r in rows:
        table.add_row(r["id"], r["state"], r["template"], r["runtime"], r["expires_at"])
    console.print(table)


@sandbox_app.command("exec", context_settings={"allow_extra_args": True})
def exec_(
    sandbox_id: str,
    command: list[str] = typer.Argument(..., help="A shell command (one argument) or an argv (after --)."),
    timeout: float = typer.Option(None, help="Seconds before the command's whole process tree is killed."),
    cwd: str = typer.Option(None),
) -> None:
    """Run a command, stream its output, exit with its exit code."""
    cmd: str | list[str] = command[0] if len(command) == 1 else command
    stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()

    def out(data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    def err(data: bytes) -> None:
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()

    async def go(engine: Engine) -> int:
        r = await engine.exec(sandbox_id, cmd, timeout=timeout, cwd=cwd, stdin=stdin, on_stdout=out,
                              on_stderr=err)
        if r.stdout_cut is not None:
            out(f"\n[corral: {r.stdout_size - len(r.stdout_bytes)} bytes of stdout left out]\n".encode())
            out(r.stdout_bytes[r.stdout_cut :])
        if r.stderr_cut is not None:
            err(f"\n[corral: {r.stderr_size - len(r.stderr_bytes)} bytes of stderr left out]\n".encode())
            err(r.stderr_bytes[r.stderr_cut :])
        if r.truncated:
            typer.echo(f"[corral] output truncated: stdout {r.stdout_size} bytes, stderr {r.stderr_size} bytes "
                       "in total; the middle was left out", err=True)
        if r.timed_out:
            typer.echo(f"[corral] timed out after {timeout}s; the whole process tree was killed", err=True)
        if r.oom_killed:
            typer.echo("[corral] killed: the sandbox ran out of memory", err=True)
        return r.exit_code if r.exit_code is not None else 1

    raise typer.Exit(_run(go))


@sandbox_app.command("kill")
def kill(sandbox_ids: list[str]) -> None:
    """Destroy sandboxes."""

    async def go(engine: Engine) -> None:
        for sid in sandbox_ids:
            await engine.destroy(sid)

    _run(go)


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--env takes KEY=VALUE, got {item!r}")
        env[key] = value
    return env
