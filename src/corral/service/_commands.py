"""Commands: run one in a sandbox for its result, or streamed, its output handed over as it is produced.

Audited as `sandbox.exec` with the command verbatim and the names (never the values) of its environment; the
outcome carries how it ended. Neither a non-zero exit, nor a timeout, nor an OOM kill is an error.

A `detached` command is a background process that the call follows (E2B runs every command so): a client that
leaves stops following, and the process goes on, to be found with `service.processes` by id, pid or tag.
"""

from __future__ import annotations

import shlex
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..control import Action, Principal
from ..engine import ExecOptions, ExecResult
from ._audited import Audited
from ._streamed import OutputCallback, Streamed, refusals

if TYPE_CHECKING:
    from ._on_sandbox import OnSandbox, Sessions

__all__ = ["Command", "CommandStream", "Commands", "StartCallback", "exec_outcome"]

StartCallback = Callable[[str, int], Awaitable[None]]  # (Corral's process id, its pid inside the sandbox)


class Command(ExecOptions):
    """A command as the service runs and audits it: the engine's `ExecOptions` (what to run and how; built once by
    the front end that received the request), and its audit record's parameters."""

    def command_line(self) -> str:
        """The command as one line (what an automatic checkpoint before it records)."""
        return self.cmd if isinstance(self.cmd, str) else shlex.join(self.cmd)

    def audit_params(self) -> dict[str, Any]:
        params = {"cmd": self.cmd, "cwd": self.cwd, "env_names": sorted(self.env), "timeout": self.timeout,
                  "max_output": self.max_output, "stdin_size": None if self.stdin is None else len(self.stdin)}
        return {**params, **self._process_params()}

    def _process_params(self) -> dict[str, Any]:
        """How it runs as a process, only where that differs from a plain command (whose record stays as it
        always was)."""
        given = {"detached": self.detached, "tag": self.tag, "keep_stdin": self.keep_stdin,
                 "pty": None if self.pty is None else {"rows": self.pty.rows, "cols": self.pty.cols},
                 "user": self.user}
        return {key: value for key, value in given.items() if value}


def exec_outcome(result: ExecResult) -> dict[str, Any]:
    """How a command ended, for its audit record."""
    return {"exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out,
            "oom_killed": result.oom_killed, "truncated": result.truncated}


class CommandStream(Streamed[ExecResult]):
    """A command authorized on a sandbox the engine has, not started yet: `run` starts it. Cancelling `run`
    kills the command's process tree; a detached command's it only stops following."""

    def __init__(self, sessions: Sessions, audit: Audited, sandbox_id: str, command: Command) -> None:
        super().__init__(audit)
        self._sessions = sessions
        self._sandbox_id = sandbox_id
        self._command = command

    async def run(self, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                  on_start: StartCallback | None = None) -> ExecResult:
        """Run it: `on_start(id, pid)` once the process exists, before any output; then the output as produced."""
        return await self._run(lambda: _exec(self._sessions, self._sandbox_id, self._command, self._audit, on_stdout,
                                             on_stderr, on_start), exec_outcome)


class Commands:
    def __init__(self, on: OnSandbox) -> None:
        self._on = on

    async def run(self, principal: Principal, sandbox_id: str, command: Command) -> ExecResult:
        async with self._audited(principal, sandbox_id, command, stream=False) as audit:
            record = await self._on.authorize(principal, sandbox_id, Action.SANDBOX_EXEC)
            await self._on.changing(principal, record, command.command_line(), audit)
            result = await _exec(self._on.sessions, sandbox_id, command, audit)
            audit.outcome.update(exec_outcome(result))
        return result

    async def stream(self, principal: Principal, sandbox_id: str, command: Command) -> CommandStream:
        """The command begun: authorized, on a sandbox the engine has (a lost one is an error here, before
        any output, not a stream that breaks)."""
        async with refusals(self._audited(principal, sandbox_id, command, stream=True)) as audit:
            record = await self._on.authorize(principal, sandbox_id, Action.SANDBOX_EXEC)
            self._on.sessions.info(sandbox_id)
            await self._on.changing(principal, record, command.command_line(), audit)
        return CommandStream(self._on.sessions, audit, sandbox_id, command)

    def _audited(self, principal: Principal, sandbox_id: str, command: Command, *, stream: bool) -> Audited:
        return self._on.audited(principal, "sandbox.exec", sandbox_id,
                                params={**command.audit_params(), "stream": stream})


async def _exec(sessions: Sessions, sandbox_id: str, command: Command, audit: Audited,
                on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                on_start: StartCallback | None = None) -> ExecResult:
    async def started(process_id: str, pid: int) -> None:
        if command.detached:  # the process outlives the call: its record says which one it was
            audit.outcome.update({"process": process_id, "pid": pid})
        if on_start is not None:
            await on_start(process_id, pid)

    return await sessions.get(sandbox_id).run(command, on_stdout=on_stdout, on_stderr=on_stderr, on_start=started)
