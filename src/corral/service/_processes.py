"""Background processes: start, list, get, send stdin, resize, kill, wait for, and attach to one.

A background process belongs to its sandbox, not to the call that started it: it ends by itself, at its own
timeout, when killed, or with the sandbox. Ending an attach (or any other call) never kills it. Every
operation is audited as `process.<operation>` on the sandbox, with the process in its params: its id, or
`{"pid": n}` / `{"tag": t}` when named so (a `ProcessRef`; a plain `str` is Corral's id).
"""

from __future__ import annotations

import asyncio
import builtins
import signal as signals
from collections.abc import AsyncIterable
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .._exceptions import InvalidRequestError
from ..control import Action, Principal
from ..engine import ExecResult, ProcessInfo, ProcessSelector
from ..engine import Processes as EngineProcesses
from ._audited import Audited
from ._commands import Command, StartCallback, exec_outcome
from ._streamed import OutputCallback, Streamed, refusals

if TYPE_CHECKING:
    from ._on_sandbox import OnSandbox

__all__ = ["AttachStream", "Processes", "parse_signal"]

_STDIN_BATCH = 1024 * 1024  # bytes gathered into one write to the sandbox


def parse_signal(value: int | str | None) -> int | None:
    """A signal number from `15`, `"TERM"` or `"SIGTERM"`; None means SIGKILL to the whole process tree."""
    if value is None:
        return None
    try:
        if isinstance(value, int):
            return int(signals.Signals(value))
        name = value.upper()
        return int(signals.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except (KeyError, ValueError):
        raise InvalidRequestError(f"unknown signal {value!r}; use a number or a name like 'SIGTERM'") from None


class AttachStream(Streamed[ExecResult | None]):
    """An attach to a process known to exist: `run` hands over the kept output so far (only what comes after,
    without `replay`), then every new byte, and returns the result, or None when `timeout` passed first.
    `on_start(id, pid)` comes first, before any output. Cancelling `run` only detaches."""

    def __init__(self, audit: Audited, processes: EngineProcesses, ref: ProcessSelector, timeout: float | None,
                 *, replay: bool = True) -> None:
        super().__init__(audit)
        self._processes = processes
        self._ref = ref
        self._timeout = timeout
        self._replay = replay

    async def run(self, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                  on_start: StartCallback | None = None) -> ExecResult | None:
        return await self._run(lambda: self._follow(on_stdout, on_stderr, on_start), _ended_outcome)

    async def _follow(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                      on_start: StartCallback | None) -> ExecResult | None:
        try:
            async with asyncio.timeout(self._timeout):
                return await self._processes.attach(self._ref, on_stdout, on_stderr, replay=self._replay,
                                                    on_start=on_start)
        except TimeoutError:
            return None


def _ended_outcome(result: ExecResult | None) -> dict[str, Any]:
    return {"running": True} if result is None else exec_outcome(result)


class Processes:
    def __init__(self, on: OnSandbox) -> None:
        self._on = on

    async def start(self, principal: Principal, sandbox_id: str, command: Command, *,
                    keep_stdin: bool = False) -> ProcessInfo:
        """Start `command` in the background (named `command.tag`, in a terminal of `command.pty`, if given).
        Its stdin is `command.stdin` then EOF, or stays open for `send_stdin` with `keep_stdin` (or
        `command.keep_stdin`; after `command.stdin`, if any); else it is /dev/null. A terminal's is its input."""
        keep_stdin = keep_stdin or command.keep_stdin
        params = {**command.audit_params(), "stdin": keep_stdin}
        async with self._on.audited(principal, "process.start", sandbox_id, params=params, status=201) as audit:
            processes = await self._processes(principal, sandbox_id, audit, command.command_line())
            info = await processes.launch(replace(command, keep_stdin=keep_stdin))
            audit.outcome.update({"process": info.id, "pid": info.pid})
        return replace(info, running=True, started_at=datetime.now(UTC).timestamp())

    async def list(self, principal: Principal, sandbox_id: str) -> builtins.list[ProcessInfo]:
        async with self._on.audited(principal, "process.list", sandbox_id) as audit:
            found = await (await self._processes(principal, sandbox_id)).list()
            audit.outcome["count"] = len(found)
        return found

    async def get(self, principal: Principal, sandbox_id: str, ref: ProcessSelector) -> ProcessInfo:
        """The process `ref` names; a pid or tag that named several, the running one (else the newest)."""
        async with self._on.audited(principal, "process.get", sandbox_id, params={"process": _param(ref)}):
            return await (await self._processes(principal, sandbox_id)).get(ref)

    async def send_stdin(self, principal: Principal, sandbox_id: str, ref: ProcessSelector,
                         data: bytes | AsyncIterable[bytes], *, eof: bool = False) -> int:
        """Write `data` (bytes, or chunks as they arrive) to the process's stdin (a PTY's: its terminal); the
        bytes written. A process started without `keep_stdin` refuses it (ConflictError); a terminal refuses
        `eof` (InvalidRequestError: send Ctrl-D, 0x04, as input)."""
        params: dict[str, Any] = {"process": _param(ref), "eof": eof}
        async with self._on.audited(principal, "process.stdin", sandbox_id, params=params) as audit:
            processes = await self._processes(principal, sandbox_id)
            sent = 0
            batch = bytearray()
            async for chunk in _chunks(data):
                batch += chunk
                if len(batch) >= _STDIN_BATCH:
                    await processes.send_stdin(ref, bytes(batch))
                    sent += len(batch)
                    batch.clear()
            await processes.send_stdin(ref, bytes(batch), eof=eof)
            sent += len(batch)
            audit.params["size"] = sent
        return sent

    async def close_stdin(self, principal: Principal, sandbox_id: str, ref: ProcessSelector) -> None:
        """EOF on the process's stdin, without data (audited as a `process.stdin` of 0 bytes with `eof`)."""
        await self.send_stdin(principal, sandbox_id, ref, b"", eof=True)

    async def resize(self, principal: Principal, sandbox_id: str, ref: ProcessSelector, rows: int,
                     cols: int) -> None:
        """Resize a PTY process's terminal (ConflictError for a process without one, or one that ended)."""
        params: dict[str, Any] = {"process": _param(ref), "rows": rows, "cols": cols}
        async with self._on.audited(principal, "process.resize", sandbox_id, params=params):
            await (await self._processes(principal, sandbox_id)).resize(ref, rows, cols)

    async def kill(self, principal: Principal, sandbox_id: str, ref: ProcessSelector,
                   signal: int | str | None = None) -> None:
        """Send `signal` (a number or a name) to the process's group; None: SIGKILL to its whole tree, which
        returns once the process is reaped (its pid no longer answers)."""
        params: dict[str, Any] = {"process": _param(ref), "signal": signal}
        async with self._on.audited(principal, "process.kill", sandbox_id, params=params, status=204):
            processes = await self._processes(principal, sandbox_id)
            await processes.kill(ref, parse_signal(signal))

    async def wait(self, principal: Principal, sandbox_id: str, ref: ProcessSelector,
                   timeout: float | None = None) -> ExecResult | None:
        """The process's result once it ends; None if it still runs after `timeout` seconds."""
        params: dict[str, Any] = {"process": _param(ref), "timeout": timeout}
        async with self._on.audited(principal, "process.wait", sandbox_id, params=params) as audit:
            result = await (await self._processes(principal, sandbox_id)).wait(ref, timeout)
            audit.outcome.update(_ended_outcome(result))
        return result

    async def attach(self, principal: Principal, sandbox_id: str, ref: ProcessSelector,
                     timeout: float | None = None, *, replay: bool = True) -> AttachStream:
        """The attach begun: an unknown process is refused here (NotFoundError), before any output. Without
        `replay`, only output produced after the attach is handed over."""
        params: dict[str, Any] = {"process": _param(ref), "timeout": timeout}
        if not replay:
            params["replay"] = False
        async with refusals(self._on.audited(principal, "process.attach", sandbox_id, params=params)) as audit:
            processes = await self._processes(principal, sandbox_id)
            await processes.get(ref)
        return AttachStream(audit, processes, ref, timeout, replay=replay)

    async def _processes(self, principal: Principal, sandbox_id: str, audit: Audited | None = None,
                         starting: str | None = None) -> EngineProcesses:
        """`starting`: the command line of a process about to start (an automatic checkpoint precedes it)."""
        # Ownership first: another tenant's sandbox is a 404 before anything about its processes is looked at.
        record = await self._on.authorize(principal, sandbox_id, Action.SANDBOX_EXEC)
        if starting is not None and audit is not None:
            await self._on.changing(principal, record, starting, audit)
        return self._on.sessions.get(sandbox_id).processes


def _param(ref: ProcessSelector) -> str | dict[str, str | int]:
    """The process as its audit records name it: Corral's id as it always was, else the selector given."""
    if isinstance(ref, str):
        return ref
    return ref.id if ref.id is not None else ref.selector()


async def _chunks(data: bytes | AsyncIterable[bytes]) -> AsyncIterable[bytes]:
    if isinstance(data, bytes):
        yield data
    else:
        async for chunk in data:
            yield chunk
