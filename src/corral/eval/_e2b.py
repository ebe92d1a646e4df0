"""`E2BAdapter`: the same corpus against any E2B-compatible service, through the E2B code-interpreter SDK.

Not installed with Corral and not run in CI (it needs an E2B account): `pip install e2b-code-interpreter`, set
`E2B_API_KEY` (and `E2B_DOMAIN` for a self-hosted service), then `corral eval run --adapter e2b`.

How steps map: commands go through `sandbox.commands.run` (E2B raises `CommandExitException` for a non-zero
exit and `TimeoutException` for a timeout: both become outcomes, as Corral's results are); output arrives as
text, so tasks that check bytes measure exactly what an agent on E2B would get. E2B commands take no stdin
bytes directly, so a step's stdin is uploaded to a file and redirected (`cmd < file`). Files go through
`sandbox.files`, code cells through `sandbox.run_code` (image results arrive base64, as Corral sends them).
E2B has no per-sandbox allowlists, resource limits at create, tar uploads, templates named like Corral's or a
runner-reachable loopback: tasks that need them are skipped, never counted as passes.
"""

from __future__ import annotations

import importlib
import shlex
import time
from dataclasses import replace
from typing import Any

from ._adapter import SetupError
from ._outcome import ErrorInfo, Outcome
from ._task import Code, Exec, Read, Step, Task, Write

__all__ = ["E2BAdapter"]

# E2B exception class name -> the closest Corral error code.
_CODES = {
    "NotFoundException": "not_found",
    "InvalidArgumentException": "invalid_request",
    "AuthenticationException": "unauthenticated",
    "RateLimitException": "quota_exceeded",
    "NotEnoughSpaceException": "disk_full",
    "TimeoutException": "timeout",
}


def _sdk() -> Any:
    try:
        return importlib.import_module("e2b_code_interpreter")
    except ImportError as exc:
        raise SetupError(ErrorInfo("adapter_unavailable", "the E2B adapter needs the E2B SDK: "
                                   "pip install e2b-code-interpreter")) from exc


def _error(exc: Exception) -> ErrorInfo:
    name = type(exc).__name__
    return ErrorInfo(_CODES.get(name, "server_error"), f"{name}: {exc}")


class E2BAdapter:
    """Runs tasks on E2B (or a compatible service). `template` maps Corral's `default` to E2B's own default."""

    name = "e2b"
    default_capabilities = frozenset({"code", "packages"})

    def __init__(self, *, api_key: str | None = None, capabilities: frozenset[str] = default_capabilities,
                 template: str | None = None) -> None:
        self.api_key = api_key
        self.capabilities = capabilities
        self.template = template

    async def open(self, task: Task) -> E2BSession:
        sdk = _sdk()
        started = time.monotonic()
        template = self.template if task.setup.template == "default" else task.setup.template
        try:
            sb = await sdk.AsyncSandbox.create(template=template, timeout=task.setup.timeout,
                                               envs=dict(task.setup.env) or None, api_key=self.api_key)
        except Exception as exc:  # the SDK's errors have no common base we can name without importing it
            raise SetupError(_error(exc), seconds=time.monotonic() - started) from exc
        session = E2BSession(sb, time.monotonic() - started)
        try:
            for path, blob in task.setup.files:
                await sb.files.write(path, blob.bytes())
        except Exception as exc:
            await session.close()
            raise SetupError(_error(exc), seconds=session.create_seconds) from exc
        return session

    async def aclose(self) -> None:
        """Nothing is shared between sessions."""


class E2BSession:
    def __init__(self, sandbox: Any, create_seconds: float) -> None:
        self.sandbox = sandbox
        self.create_seconds = create_seconds
        self._stdin_files = 0

    async def run(self, step: Step) -> Outcome:
        started = time.monotonic()
        try:
            outcome = await self._dispatch(step)
        except Exception as exc:
            return Outcome(step.kind, time.monotonic() - started, error=_error(exc))
        return replace(outcome, duration=time.monotonic() - started)

    async def _dispatch(self, step: Step) -> Outcome:
        sb = self.sandbox
        if isinstance(step, Exec):
            return await self._exec(step)
        if isinstance(step, Code):
            ex = await sb.run_code(step.code, language=step.language, timeout=step.timeout)
            return _code_outcome(ex)
        if isinstance(step, Write):
            await sb.files.write(step.path, step.data.bytes())
            return Outcome("write")
        if isinstance(step, Read):
            return Outcome("read", data=bytes(await sb.files.read(step.path, format="bytes")))
        raise TypeError(f"the E2B adapter cannot run a {step.kind} step")

    async def _exec(self, step: Exec) -> Outcome:
        cmd = step.cmd if isinstance(step.cmd, str) else shlex.join(step.cmd)
        if step.stdin is not None:
            self._stdin_files += 1
            path = f"/tmp/.corral-eval-stdin-{self._stdin_files}"
            await self.sandbox.files.write(path, step.stdin.bytes())
            cmd = f"({cmd}) < {path}"
        try:
            r = await self.sandbox.commands.run(cmd, timeout=step.timeout, cwd=step.cwd,
                                                envs=dict(step.env) or None)
        except Exception as exc:
            name = type(exc).__name__
            if name == "CommandExitException":
                r = exc
            elif name == "TimeoutException":
                return Outcome("exec", timed_out=True, extra={"message": str(exc)})
            else:
                raise
        out, err = str(r.stdout or "").encode(), str(r.stderr or "").encode()
        return Outcome("exec", exit_code=int(r.exit_code), stdout=out, stderr=err, stdout_size=len(out),
                       stderr_size=len(err))

    async def close(self) -> None:
        try:
            await self.sandbox.kill()
        except Exception:  # best effort: the sandbox's own timeout removes it
            return


def _code_outcome(ex: Any) -> Outcome:
    out = "".join(ex.logs.stdout).encode()
    err = "".join(ex.logs.stderr).encode()
    results: list[dict[str, Any]] = []
    text = None
    for r in ex.results:
        data = {mime: getattr(r, attr) for attr, mime in _MIMES.items() if getattr(r, attr, None) is not None}
        results.append(data)
        if getattr(r, "is_main_result", False):
            text = getattr(r, "text", None)
    error = (str(ex.error.name), str(ex.error.value)) if ex.error is not None else None
    return Outcome("code", stdout=out, stderr=err, stdout_size=len(out), stderr_size=len(err), text=text,
                   results=tuple(results), code_error=error)


_MIMES = {"png": "image/png", "jpeg": "image/jpeg", "svg": "image/svg+xml", "html": "text/html",
          "markdown": "text/markdown", "latex": "text/latex", "text": "text/plain"}
