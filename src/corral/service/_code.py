"""The code interpreter: run a cell in a stateful session (for its result, or streamed); create and list code
contexts; list, interrupt, restart and close sessions (docs/code.md). Audited as `code.run` with the code verbatim
(a cell's environment variables by name only: their values may be secrets), and `code.<operation>`.

A cell that raises, times out or is OOM-killed is not an error: those are fields of the result (the record
names the exception the cell raised).
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..control import Action, Principal, SandboxRecord
from ..engine import CodeResult, CodeSession, RichResult
from ._audited import Audited
from ._streamed import OutputCallback, Streamed, refusals

if TYPE_CHECKING:
    from ._on_sandbox import OnSandbox, Sessions

__all__ = ["Cell", "Code", "CodeStream", "ResultCallback"]

ResultCallback = Callable[[RichResult], Awaitable[None]]


@dataclass(frozen=True)
class Cell:
    """A cell to run. `session` None: the language's default session (the engine names it); `stdin` is the
    program's stdin, for compiled languages.

    `context`: run in that code context instead (an id from `Code.create_context` or `Code.contexts`, or a
    language's default, `corral.engine.default_context(language)`), in its own language (`language` is
    ignored); an unknown id is a `NotFoundError`. `env`: environment variables for this cell only, on top of the
    sandbox's. `cwd` and `show_saved_images` apply if this call makes the context (docs/code.md)."""

    code: str
    language: str = "python"
    session: str | None = None
    timeout: float | None = None
    stdin: bytes | None = None
    context: str | None = None
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    show_saved_images: bool = False
    max_output: int | None = None  # bytes of each stream the result keeps (None: the engine's 16 MiB)

    def audit_params(self) -> dict[str, Any]:
        given = {"stdin": self.stdin is not None, "context": self.context,
                 "env": sorted(self.env) if self.env else None, "cwd": self.cwd,
                 "show_saved_images": self.show_saved_images, "max_output": self.max_output}
        language = None if self.context is not None else self.language  # a context runs its own language
        return {"code": self.code, "language": language, "session": self.session, "timeout": self.timeout,
                **{k: v for k, v in given.items() if v}}


def _outcome(result: CodeResult) -> dict[str, Any]:
    outcome: dict[str, Any] = {"timed_out": result.timed_out, "oom_killed": result.oom_killed,
                               "session_restarted": result.session_restarted}
    if result.error is not None:
        outcome["exception"] = result.error.name  # the cell raised: not an error of the request
    if result.truncated:
        outcome["truncated"] = True
    return outcome


class CodeStream(Streamed[CodeResult]):
    """A cell authorized on a sandbox the engine has, not started yet: `run` starts it, handing over output
    and each rich result as they are produced. Cancelling `run` cancels the engine's call."""

    def __init__(self, sessions: Sessions, audit: Audited, sandbox_id: str, cell: Cell) -> None:
        super().__init__(audit)
        self._sessions = sessions
        self._sandbox_id = sandbox_id
        self._cell = cell

    async def run(self, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                  on_result: ResultCallback | None = None) -> CodeResult:
        return await self._run(lambda: _run_code(self._sessions, self._sandbox_id, self._cell, on_stdout=on_stdout,
                                                 on_stderr=on_stderr, on_result=on_result), _outcome)


class Code:
    def __init__(self, on: OnSandbox) -> None:
        self._on = on

    async def run(self, principal: Principal, sandbox_id: str, cell: Cell) -> CodeResult:
        async with self._audited(principal, sandbox_id, cell, stream=False) as audit:
            await self._changing(principal, await self._authorized(principal, sandbox_id), cell, audit)
            result = await _run_code(self._on.sessions, sandbox_id, cell)
            audit.outcome.update(_outcome(result))
        return result

    async def stream(self, principal: Principal, sandbox_id: str, cell: Cell) -> CodeStream:
        """The cell begun: authorized, on a sandbox the engine has (a lost one is an error here, before any
        output, not a stream that breaks)."""
        async with refusals(self._audited(principal, sandbox_id, cell, stream=True)) as audit:
            record = await self._authorized(principal, sandbox_id)
            self._on.sessions.info(sandbox_id)
            await self._changing(principal, record, cell, audit)
        return CodeStream(self._on.sessions, audit, sandbox_id, cell)

    async def create_context(self, principal: Principal, sandbox_id: str, language: str = "python",
                             cwd: str | None = None, *, show_saved_images: bool = False) -> CodeSession:
        """A new code context, its id a new UUID; its session starts with its first cell (in `cwd`, None:
        /workspace). A cwd that is no directory is an `InvalidRequestError`; one the sandbox user may not enter
        is accepted, and its cells get a `PermissionDeniedError`."""
        params = {"language": language, "cwd": cwd, **({"show_saved_images": True} if show_saved_images else {})}
        async with self._on.audited(principal, "code.create_context", sandbox_id, params=params) as audit:
            await self._authorized(principal, sandbox_id)
            context = await self._on.sessions.get(sandbox_id).create_code_context(language, cwd=cwd,
                                                                                  show_saved_images=show_saved_images)
            audit.outcome["context"] = context.name
        return context

    async def contexts(self, principal: Principal, sandbox_id: str, *, cwd: str | None = None,
                       show_saved_images: bool = False) -> builtins.list[CodeSession]:
        """Every code context: the default python and javascript ones first (made with `cwd` and
        `show_saved_images` if they do not exist yet), then the others in the order they were made."""
        async with self._on.audited(principal, "code.contexts", sandbox_id) as audit:
            await self._authorized(principal, sandbox_id)
            found = await self._on.sessions.get(sandbox_id).code_contexts(cwd=cwd,
                                                                          show_saved_images=show_saved_images)
            audit.outcome["count"] = len(found)
        return found

    async def sessions(self, principal: Principal, sandbox_id: str) -> builtins.list[CodeSession]:
        async with self._on.audited(principal, "code.sessions", sandbox_id) as audit:
            await self._authorized(principal, sandbox_id)
            found = await self._on.sessions.get(sandbox_id).code_sessions()
            audit.outcome["count"] = len(found)
        return found

    async def interrupt(self, principal: Principal, sandbox_id: str, session: str) -> None:
        async with self._session_op(principal, "code.interrupt", sandbox_id, session):
            await self._authorized(principal, sandbox_id)
            await self._on.sessions.get(sandbox_id).interrupt_code(session)

    async def restart(self, principal: Principal, sandbox_id: str, session: str) -> None:
        async with self._session_op(principal, "code.restart", sandbox_id, session):
            await self._authorized(principal, sandbox_id)
            await self._on.sessions.get(sandbox_id).restart_code(session)

    async def close(self, principal: Principal, sandbox_id: str, session: str) -> None:
        async with self._session_op(principal, "code.close", sandbox_id, session):
            await self._authorized(principal, sandbox_id)
            await self._on.sessions.get(sandbox_id).close_code(session)

    async def _authorized(self, principal: Principal, sandbox_id: str) -> SandboxRecord:
        # Ownership first: another tenant's sandbox is a 404 before anything about its sessions is looked at.
        return await self._on.authorize(principal, sandbox_id, Action.SANDBOX_EXEC)

    async def _changing(self, principal: Principal, record: SandboxRecord, cell: Cell, audit: Audited) -> None:
        """Before a cell runs: an automatic checkpoint, if the sandbox takes them."""
        language = f"context {cell.context}" if cell.context is not None else cell.language
        await self._on.changing(principal, record, f"code cell ({language})", audit)

    def _audited(self, principal: Principal, sandbox_id: str, cell: Cell, *, stream: bool) -> Audited:
        return self._on.audited(principal, "code.run", sandbox_id, params={**cell.audit_params(), "stream": stream})

    def _session_op(self, principal: Principal, action: str, sandbox_id: str, session: str) -> Audited:
        return self._on.audited(principal, action, sandbox_id, params={"session": session}, status=204)


async def _run_code(sessions: Sessions, sandbox_id: str, cell: Cell, **callbacks: Any) -> CodeResult:
    # Only what was given: the engine picks each language's default session.
    given: dict[str, Any] = {k: v for k, v in (("session", cell.session), ("stdin", cell.stdin),
                                               ("context", cell.context), ("env", cell.env), ("cwd", cell.cwd),
                                               ("show_saved_images", cell.show_saved_images or None),
                                               ("max_output", cell.max_output))
                             if v is not None}
    return await sessions.get(sandbox_id).run_code(cell.code, language=cell.language, timeout=cell.timeout,
                                                   **given, **callbacks)
