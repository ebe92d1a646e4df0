"""`corral exec ID -- argv...` or `corral exec ID "shell string"`: run a command in a sandbox, its output
streamed to this terminal byte for byte, and exit with its exit code."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import BinaryIO

import typer

from .._sdk import CommandResult, Commands
from ._common import ApiKeyOption, UrlOption, client, note, pairs

TIMED_OUT_EXIT = 124  # what coreutils' `timeout` returns, so scripts can tell a timeout from a failure
SIGNAL_EXIT_BASE = 128  # a process killed by signal n exits 128+n, as in a shell


def _writer(stream: BinaryIO) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        stream.write(data)
        stream.flush()  # live output: a progress line must show up before the command ends

    return write


def _stdin(disabled: bool) -> bytes | None:
    """Piped-in stdin is sent to the command (the API takes it whole); a terminal is never read."""
    if disabled or sys.stdin is None or sys.stdin.isatty():
        return None
    return sys.stdin.buffer.read()


def exit_code(result: CommandResult, timeout: float | None) -> int:
    """The command's exit status as a shell would report it, with a notice on stderr for what it cannot say."""
    if result.notice:  # pip, curl and git do not print a proxy's reason: say it here, once per host and reason
        note(result.notice.rstrip("\n"))
    if result.truncated:
        note(f"corral: output truncated: stdout {result.stdout_size} bytes, stderr {result.stderr_size} bytes in "
             "total; the middle was left out")
    if result.timed_out:
        note(f"corral: timed out after {timeout:g}s; the command and its processes were killed" if timeout
             else "corral: timed out; the command and its processes were killed")
        return TIMED_OUT_EXIT
    if result.oom_killed:
        note("corral: killed: the sandbox ran out of memory")
    if result.exit_code is not None:
        return result.exit_code
    if result.signal:
        return SIGNAL_EXIT_BASE + result.signal
    return 1


def exec_command(
    sandbox_id: str = typer.Argument(..., help="The sandbox id."),
    command: list[str] = typer.Argument(..., help="One shell string (run by bash -lc), or an argv after --.",
                                        show_default=False),
    timeout: float | None = typer.Option(None, help="Seconds before the command's whole process tree is killed "
                                                    "(exit 124)."),
    cwd: str | None = typer.Option(None, help="Working directory in the sandbox (default /workspace)."),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable.", show_default=False),
    no_stdin: bool = typer.Option(False, "--no-stdin", help="Do not send stdin even when it is not a terminal."),
    user: str | None = typer.Option(None, "--user", "-u", help="Who runs it: root (a sandbox created with --root), "
                                    "or the sandbox user (the default)."),
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Run a command in a sandbox, streaming its output here, and exit with its exit code.

    `corral exec ID "shell string"` runs it with bash -lc; `corral exec ID -- argv...` runs an argv. A timeout
    exits 124, a command killed by signal n exits 128+n. Piped-in stdin is sent to the command.
    """
    cmd: str | list[str] = command[0] if len(command) == 1 else command
    http = client(url, api_key)
    try:
        result = Commands(http, sandbox_id).run(
            cmd, timeout=timeout, cwd=cwd, env=pairs(env, "--env"), stdin=_stdin(no_stdin),
            on_stdout=_writer(sys.stdout.buffer), on_stderr=_writer(sys.stderr.buffer), user=user)
    finally:
        http.close()
    if result.checkpoint is not None:  # a sandbox with automatic checkpoints: how to undo what this did
        note(f"corral: checkpoint {result.checkpoint} was taken before this command (undo it: corral sandbox "
             f"restore {sandbox_id} {result.checkpoint})")
    raise typer.Exit(exit_code(result, timeout))
