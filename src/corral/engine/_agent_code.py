"""The agent client's code sessions: cells run (`run_code`, their output and rich results as they come) and the
contexts that run them (docs/code.md)."""

from __future__ import annotations

import base64
import builtins
from collections.abc import Mapping
from typing import Any

from ..agent import protocol
from ..agent.output import DEFAULT_MAX_OUTPUT, OutputBuffer
from ._agent_calls import AgentCalls, OutputCallback, call_output
from ._code import CodeResult, CodeSession, ResultCallback, RichResult, code_result, code_session, rich_result


class AgentCode(AgentCalls):
    """What `AgentClient` does with code sessions in the sandbox."""

    async def run_code(self, code: str, *, language: str | None = "python", session: str | None = None,
                       context: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
                       env: dict[str, str] | None = None, cell_env: Mapping[str, str] | None = None,
                       cwd: str | None = None, show_saved_images: bool = False,
                       on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                       on_result: ResultCallback | None = None, max_output: int | None = None) -> CodeResult:
        """Run one cell (docs/code.md). `env` (the sandbox's), `cwd` and `show_saved_images` apply only if this
        call starts the session; `cell_env` only to this cell; `stdin` only for compiled programs. Of each stream
        the result keeps `max_output` bytes (head and tail; None: 16 MiB, as a command); the callbacks get every
        byte."""
        args: dict[str, Any] = {"code": code, "language": language, "session": session, "timeout": timeout,
                                "env": env, **_context_args(cwd, show_saved_images)}
        if context is not None:
            args["context"] = context
        if cell_env:
            args["cell_env"] = dict(cell_env)
        if stdin is not None:
            args["stdin_b64"] = base64.b64encode(stdin).decode()
        async with self._op("code_run", **args) as conn:
            started = await conn.event()
            # Head and tail only: a cell that prints for an hour must not fill the server's memory.
            kept = max_output or DEFAULT_MAX_OUTPUT
            out, err = OutputBuffer(kept), OutputBuffer(kept)
            results: builtins.list[RichResult] = []
            while True:
                kind, payload = await conn.recv()
                if kind == protocol.STDOUT:
                    out.feed(payload)
                    if on_stdout is not None:
                        await call_output(on_stdout, payload)
                elif kind == protocol.STDERR:
                    err.feed(payload)
                    if on_stderr is not None:
                        await call_output(on_stderr, payload)
                elif kind == protocol.EVENT:
                    ev = protocol.decode_json(payload)
                    if ev.get("event") == "result":
                        results.append(rich_result(ev))
                        if on_result is not None:
                            await _call_result(on_result, results[-1])
                    elif ev.get("event") == "done":
                        return code_result(str(started.get("session", session)),
                                           str(started.get("language", language)), ev, out, err, results)
                else:
                    raise protocol.ProtocolError(f"unexpected frame kind {kind} in a cell's output")

    async def create_code_context(self, language: str = "python", *, cwd: str | None = None,
                                  name: str | None = None, env: dict[str, str] | None = None,
                                  show_saved_images: bool = False) -> CodeSession:
        ev = await self._simple("code_context_create", language=language, context=name, env=env,
                                **_context_args(cwd, show_saved_images))
        return code_session(ev["context"])

    async def code_contexts(self, *, cwd: str | None = None, env: dict[str, str] | None = None,
                            show_saved_images: bool = False) -> builtins.list[CodeSession]:
        ev = await self._simple("code_contexts", env=env, **_context_args(cwd, show_saved_images))
        return [code_session(c) for c in ev["contexts"]]

    async def code_sessions(self) -> builtins.list[CodeSession]:
        ev = await self._simple("code_list")
        return [code_session(s) for s in ev["sessions"]]

    async def interrupt_code(self, session: str = "default") -> None:
        await self._simple("code_interrupt", session=session)

    async def restart_code(self, session: str = "default", *, env: dict[str, str] | None = None) -> None:
        await self._simple("code_restart", session=session, env=env)

    async def close_code(self, session: str = "default") -> None:
        await self._simple("code_close", session=session)


async def _call_result(cb: ResultCallback, result: RichResult) -> None:
    res = cb(result)
    if res is not None:
        await res


def _context_args(cwd: str | None, show_saved_images: bool) -> dict[str, Any]:
    """How a context starts, for the ops that may make one: only what differs from the agent's defaults."""
    return {**({} if cwd is None else {"cwd": cwd}), **({"show_saved_images": True} if show_saved_images else {})}
