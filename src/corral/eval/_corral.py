"""`CorralAdapter`: the runner's steps as calls of Corral's async SDK against a Corral server.

Each task gets its own sandbox (`AsyncSandbox.create` with the task's setup, tagged with metadata
`eval=<task id>`), and every `CorralError` or transport failure becomes the step's `ErrorInfo`. The sandbox is
killed when the session closes, whatever happened.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx

from .._exceptions import CorralError
from .._sdk import AsyncSandbox
from .._sdk._code import Execution
from .._sdk._models import CommandResult
from ._adapter import SetupError
from ._outcome import Denial, ErrorInfo, Outcome
from ._task import (
    CAPABILITIES,
    Checkpoint,
    Code,
    Exec,
    Fingerprint,
    Pause,
    Read,
    Restore,
    SetNetwork,
    Step,
    Task,
    Write,
    WriteArchive,
)
from ._undo import UndoState, fingerprint_argv, fingerprinted

__all__ = ["CorralAdapter"]


def error_info(exc: BaseException) -> ErrorInfo:
    """A Corral error (or a transport failure) as the runner records it."""
    if isinstance(exc, CorralError):
        status = exc.details.get("status")
        return ErrorInfo(exc.code, exc.message, int(status) if isinstance(status, int) else None)
    if isinstance(exc, httpx.HTTPError):
        return ErrorInfo("transport_error", f"{type(exc).__name__}: {exc}")
    raise exc


class CorralAdapter:
    """Runs tasks on a Corral server.

    **Parameters:**

    * **base_url**, **api_key** - the server and a developer key of the tenant the tasks run as.
    * **capabilities** - what to claim (default: everything Corral does; drop `polyglot` when that template is
      not built, `loopback_server` when the tenant has no allowance for the runner's server).
    * **request_timeout** - seconds for calls that are not commands (commands wait for their own timeout).
    """

    name = "corral"

    def __init__(self, *, base_url: str, api_key: str, capabilities: frozenset[str] = CAPABILITIES,
                 request_timeout: float = 120.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.capabilities = capabilities
        self.request_timeout = request_timeout

    async def open(self, task: Task) -> CorralSession:
        setup = task.setup
        started = time.monotonic()
        try:
            sb = await AsyncSandbox.create(
                setup.template, timeout=setup.timeout, network=_network(setup.network),
                limits=dict(setup.limits) or None, env=dict(setup.env) or None,
                metadata={"eval": task.id[:200]}, api_key=self.api_key, base_url=self.base_url,
                request_timeout=self.request_timeout, max_retries=5, **_checkpoints(setup.checkpoints),
            )
        except (CorralError, httpx.HTTPError) as exc:
            raise SetupError(error_info(exc), seconds=time.monotonic() - started) from exc
        session = CorralSession(sb, time.monotonic() - started)
        try:
            for path, blob in setup.files:
                await sb.files.write(path, blob.bytes())
        except (CorralError, httpx.HTTPError) as exc:
            await session.close()
            info = error_info(exc)
            raise SetupError(ErrorInfo(info.code, f"uploading the task's files: {info.message}", info.status),
                             seconds=session.create_seconds) from exc
        return session

    async def aclose(self) -> None:
        """Nothing is shared between sessions."""


def _network(network: str | tuple[str, ...]) -> str | list[str]:
    return network if isinstance(network, str) else list(network)


def _checkpoints(mode: str) -> dict[str, Any]:
    # "manual" is the server's default (and a tenant's own default may differ): only "auto" is asked for.
    return {"checkpoints": "auto"} if mode == "auto" else {}


class CorralSession:
    def __init__(self, sandbox: AsyncSandbox, create_seconds: float) -> None:
        self.sandbox = sandbox
        self.create_seconds = create_seconds
        self.undo = UndoState()

    async def run(self, step: Step) -> Outcome:
        started = time.monotonic()
        try:
            outcome = await self._dispatch(step)
        except (CorralError, httpx.HTTPError) as exc:
            return Outcome(step.kind, time.monotonic() - started, error=error_info(exc))
        return _with_duration(self.undo.note(outcome), time.monotonic() - started)

    async def _dispatch(self, step: Step) -> Outcome:
        sb = self.sandbox
        if isinstance(step, Exec):
            cmd = step.cmd if isinstance(step.cmd, str) else list(step.cmd)
            r = await sb.commands.run(cmd, timeout=step.timeout, cwd=step.cwd, env=dict(step.env) or None,
                                      stdin=step.stdin.bytes() if step.stdin is not None else None)
            return _exec_outcome(r)
        if isinstance(step, Code):
            ex = await sb.run_code(step.code, language=step.language, session=step.session, timeout=step.timeout)
            return _code_outcome(ex)
        if isinstance(step, Write):
            await sb.files.write(step.path, step.data.bytes())
            return Outcome("write")
        if isinstance(step, Read):
            return Outcome("read", data=await sb.files.read(step.path))
        if isinstance(step, WriteArchive):
            await sb.files.write_archive(step.path, step.data.bytes())
            return Outcome("write_archive")
        if isinstance(step, SetNetwork):
            await sb.set_network(_network(step.network))
            return Outcome("set_network")
        if isinstance(step, Pause):
            await sb.pause()
            await sb.resume()
            return Outcome("pause")
        return await self._undo_step(step)

    async def _undo_step(self, step: Step) -> Outcome:
        sb = self.sandbox
        if isinstance(step, Checkpoint):
            self.undo.checkpoints[step.label] = (await sb.checkpoint()).id
            return Outcome("checkpoint")
        if isinstance(step, Restore):
            target = self.undo.checkpoint_id(step.to)
            if target is None:
                raise TypeError(f"no checkpoint {step.to!r} was taken before this restore: the task is malformed")
            result = await sb.restore(target, paths=list(step.paths) if step.paths is not None else None)
            return Outcome("restore", stopped=tuple(p.cmd for p in result.stopped_processes))
        if isinstance(step, Fingerprint):
            r = await sb.commands.run(fingerprint_argv(step), timeout=120)
            return fingerprinted(step, _exec_outcome(r), self.undo)
        raise TypeError(f"unknown step {step!r}")

    async def close(self) -> None:
        await _quietly(self.sandbox.kill)
        await _quietly(self.sandbox.close)


async def _quietly(call: Callable[[], Awaitable[Any]]) -> None:
    # Closing is best effort: the sandbox may already be gone (its TTL, a kill step), and the task's outcome is
    # already decided. Its TTL destroys anything a failed kill leaves.
    try:
        await call()
    except (CorralError, httpx.HTTPError):
        pass


def _exec_outcome(r: CommandResult) -> Outcome:
    return Outcome(
        "exec", exit_code=r.exit_code, signal=r.signal, stdout=r.stdout_bytes, stderr=r.stderr_bytes,
        stdout_size=r.stdout_size, stderr_size=r.stderr_size, timed_out=r.timed_out, oom_killed=r.oom_killed,
        truncated=r.truncated, denials=tuple(Denial(d.host, d.port, d.reason) for d in r.egress_denials),
        checkpoint=r.checkpoint,
    )


def _code_outcome(ex: Execution) -> Outcome:
    return Outcome(
        "code", stdout=ex.stdout_bytes, stderr=ex.stderr_bytes, stdout_size=ex.stdout_size,
        stderr_size=ex.stderr_size, truncated=ex.truncated, timed_out=ex.timed_out, oom_killed=ex.oom_killed,
        text=ex.text,
        results=tuple(dict(r.data) for r in ex.results),
        code_error=(ex.error.name, ex.error.value) if ex.error is not None else None,
        checkpoint=ex.checkpoint,
    )


def _with_duration(o: Outcome, seconds: float) -> Outcome:
    return replace(o, duration=seconds)
