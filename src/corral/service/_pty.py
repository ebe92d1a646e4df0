"""Interactive terminals: a PTY session for a principal on a sandbox, audited as `sandbox.pty`.

The front end carries the bytes (the REST API over a WebSocket); the service authorizes, opens the terminal in
the engine, maps a lost connection to the sandbox to `AgentError`, and writes the one audit record when the
terminal closes: with the process's exit, the `error` code of a failure, or `disconnected`.

```python
terminal = await service.pty.open(principal, sandbox_id, read_start_frame)   # None: the client left first
try:
    async for chunk in terminal.output(): ...                                  # and terminal.write(keys)
finally:
    await terminal.close(error, disconnected=client_left)                      # hangs up: kills what still runs
```
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._exceptions import AgentError, CorralError, ServerError
from ..agent.protocol import ProtocolError
from ..control import Action, Principal
from ..engine import ExecResult, PtySession
from ._audited import Audited
from ._streamed import refusals

if TYPE_CHECKING:
    from ._on_sandbox import OnSandbox

__all__ = ["Pty", "PtyRequest", "Terminal"]

_AGENT_ERRORS = (OSError, asyncio.IncompleteReadError, ProtocolError)


@dataclass(frozen=True)
class PtyRequest:
    """The terminal a client asks for: its command, size, working directory, environment, timeout and user
    (None: the sandbox user; "root" only in a sandbox created with root)."""

    cmd: str | list[str] = "bash"
    rows: int = 24
    cols: int = 80
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    user: str | None = None

    def audit_params(self) -> dict[str, Any]:
        params = {"cmd": self.cmd, "rows": self.rows, "cols": self.cols, "cwd": self.cwd,
                  "env_names": sorted(self.env), "timeout": self.timeout}
        return {**params, "user": self.user} if self.user is not None else params


StartReader = Callable[[], Awaitable[PtyRequest | None]]


class Pty:
    def __init__(self, on: OnSandbox) -> None:
        self._on = on

    async def open(self, principal: Principal, sandbox_id: str, request: StartReader) -> Terminal | None:
        """Authorize, then ask the client for its `request` (only once the sandbox is known to be its own), then
        open the terminal. None: the client left before asking (`request` returned None); recorded so."""
        audit = self._on.audited(principal, "sandbox.pty", sandbox_id)
        async with refusals(audit):
            await self._on.authorize(principal, sandbox_id, Action.SANDBOX_EXEC)
            wanted = await request()
            if wanted is None:
                audit.outcome["disconnected"] = True
                await audit.record()
                return None
            audit.params.update(wanted.audit_params())
            with _agent_errors():
                session = await self._on.sessions.get(sandbox_id).pty(
                    wanted.cmd, rows=wanted.rows, cols=wanted.cols, cwd=wanted.cwd, env=wanted.env or None,
                    timeout=wanted.timeout, user=wanted.user)
            audit.outcome.update({"process": session.id, "pid": session.pid})
        return Terminal(session, audit)


class Terminal:
    """An open terminal: raw bytes both ways, resize, kill; `result` once its process ended."""

    def __init__(self, session: PtySession, audit: Audited) -> None:
        self._session = session
        self._audit = audit

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def pid(self) -> int:
        return self._session.pid

    @property
    def result(self) -> ExecResult | None:
        return self._session.result

    async def output(self) -> AsyncIterator[bytes]:
        """Terminal output until the process ends (then `result` is set)."""
        chunks = self._session.__aiter__()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except _AGENT_ERRORS as exc:  # only the sandbox's side: a client that went is not an agent failure
                raise _lost(exc) from exc
            yield chunk

    async def write(self, data: bytes) -> None:
        with _agent_errors():
            await self._session.write(data)

    async def resize(self, rows: int, cols: int) -> None:
        with _agent_errors():
            await self._session.resize(rows, cols)

    async def kill(self) -> None:
        with _agent_errors():
            await self._session.kill()

    async def close(self, error: BaseException | None = None, *, disconnected: bool = False) -> None:
        """Hang up (a process still running is killed, as a terminal's is when its window closes) and record
        how the session ended: `error` if it failed, `disconnected` if the client left, else the exit."""
        with contextlib.suppress(*_AGENT_ERRORS):
            await self._session.close()
        if error is not None:
            self._audit.outcome["error"] = error.code if isinstance(error, CorralError) else ServerError.code
        elif disconnected:
            self._audit.outcome["disconnected"] = True
        elif (result := self.result) is not None:
            self._audit.outcome.update({"exit_code": result.exit_code, "signal": result.signal,
                                        "timed_out": result.timed_out, "killed": result.killed,
                                        "duration": result.duration})
        await asyncio.shield(self._audit.record())


@contextlib.contextmanager
def _agent_errors() -> Iterator[None]:
    try:
        yield
    except _AGENT_ERRORS as exc:
        raise _lost(exc) from exc


def _lost(exc: BaseException) -> AgentError:
    return AgentError(f"lost the terminal's connection to the sandbox (stopped or killed?): {exc!r}")
