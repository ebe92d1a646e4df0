"""`E2BAdapter`: the same corpus through E2B's code-interpreter SDK, against E2B's cloud or Corral's own E2B API.

`pip install e2b-code-interpreter` (a dev dependency of Corral). Two targets:

* **Corral's E2B API** (`base_url=`, `corral eval run --adapter e2b --local` or `--url`): the SDK is aimed at the
  server with `api_url`/`sandbox_url` (no environment needed) and a developer key of the tenant. Everything that
  API offers is used: network policies at create (`allow_internet_access`, `network={"allow_out": [...],
  "deny_out": ["0.0.0.0/0"]}`) and live (`update_network`), pause and resume (`pause()`, `connect()`), egress
  denials (Corral names them in the command's `error`), the `polyglot` template, code contexts in every language,
  and the runner's loopback server (an `ip:port` allowance of the tenant, accepted in `allow_out`).
* **E2B's cloud** (no `base_url`: `E2B_API_KEY`, `E2B_DOMAIN`): what E2B's cloud is known to offer (code cells,
  packages from the public registries); the rest is skipped, never counted as a pass.

How steps map. Commands go through `commands.run` (`bash -l -c`, as every E2B command; an argv is quoted into one
line); a non-zero exit (`CommandExitException`) and a timeout (`TimeoutException`) are outcomes, and a signal
(`error: "signal: killed"`) is reported as the shell reports it, 128 + its number. A step's stdin goes through
E2B's stdin: the command starts with `stdin=True`, the bytes follow in `send_stdin` chunks, then `close_stdin`.
E2B's SDK decodes command output (and cell output) as UTF-8 text, replacing invalid bytes: tasks that check
output bytes measure what an E2B user gets. Files go through `files.write` and `files.read(format="bytes")`, byte
exact. Cells run in code contexts (`create_code_context`, one per session and language; `run_code(context=)`);
E2B's interpreter shows a string value without its repr quotes, which the outcome says (`text_unquoted`).

Conventions bridged against Corral: the corpus's working directory is `/workspace` (Corral's default), E2B's is
the user's home, so commands, contexts and relative file paths are given `/workspace` explicitly.

Not offered through E2B's API, so skipped (said so, never passed): resource `limits` at create (E2B has no such
parameter), tar uploads (`archive`), and output cut at a cap and flagged with its true size (`output_cap`: E2B's
protocol streams all of it and has no such flag).
"""

from __future__ import annotations

import importlib
import posixpath
import re
import shlex
import signal
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ._adapter import SetupError
from ._outcome import Denial, ErrorInfo, Outcome
from ._task import Checkpoint, Code, Exec, Fingerprint, Pause, Read, Restore, SetNetwork, Step, Task, Write
from ._undo import UndoState, fingerprint_argv, fingerprinted

__all__ = ["E2BAdapter"]

# What each target offers (`CAPABILITIES` in `_task.py`).
CLOUD_CAPABILITIES = frozenset({"code", "packages"})
# `checkpoints`: E2B has no in-place checkpoint, so on Corral's E2B API the task's destructive steps go through
# E2B's SDK and its checkpoint and restore through Corral's own SDK on the same sandbox (`auto_checkpoints` has no
# E2B form: E2B's create cannot ask for it).
CORRAL_CAPABILITIES = frozenset({"code", "packages", "network_policy", "egress_denials", "pause", "polyglot",
                                 "loopback_server", "checkpoints"})

WORKDIR = "/workspace"  # the corpus's working directory (Corral's default); E2B's default is /home/user
ALL_TRAFFIC = "0.0.0.0/0"
_STDIN_CHUNK = 1 << 20  # bytes per `send_stdin`: a handful of requests even for the corpus's 8 MiB

# E2B exception class (or a base of it) -> the closest Corral error code.
_CODES = {
    "FileNotFoundException": "not_found",
    "SandboxNotFoundException": "not_found",
    "NotFoundException": "not_found",
    "InvalidArgumentException": "invalid_request",
    "AuthenticationException": "unauthenticated",
    "RateLimitException": "quota_exceeded",
    "NotEnoughSpaceException": "disk_full",
    "TimeoutException": "timeout",
}
# E2B's SDKs say other failures as "<HTTP status>: message" (envd's REST routes) or "<Connect code>: message".
_BY_STATUS = {"400": "invalid_request", "401": "unauthenticated", "403": "permission_denied", "404": "not_found",
              "409": "conflict", "429": "quota_exceeded", "500": "server_error", "502": "agent_error",
              "503": "capacity_exceeded", "507": "disk_full"}
_BY_RPC = {"permission_denied": "permission_denied", "failed_precondition": "conflict", "already_exists": "conflict",
           "internal": "server_error", "unknown": "server_error", "unavailable": "agent_error"}
# "403: ...", "400 Bad Request: ..." (the interpreter's), "Code.FAILED_PRECONDITION: ..." (an RPC's)
_PREFIX = re.compile(r"^(?:Code\.)?(\d{3}|[A-Za-z_]+)(?: [A-Z][A-Za-z ]*)?: ")
# Corral's E2B API: "exit status 1; corral: <reason>", one line per refusal; the host is the reason's subject.
_NOTICE = re.compile(r"(?:^|; )corral: ([^\n]+)", re.M)
_SUBJECT = re.compile(r"^(?:Corral egress denied: (.+?) (?:is |resolves |needs |\()|Corral egress: cannot resolve "
                      r"(\S+?):|DNS lookup of (\S+) refused)")
_SIGNAL = re.compile(r"^signal: ([^;\n]+)")
_COMPILED = frozenset({"c", "cpp", "go", "rust"})  # Corral's E2B API compiles and runs these, with no state
_OOM = "corral: out of memory"  # Corral's E2B API: the end event of a command the memory limit killed


def _sdk() -> Any:
    try:
        return importlib.import_module("e2b_code_interpreter")
    except ImportError as exc:
        raise SetupError(ErrorInfo("adapter_unavailable", "the E2B adapter needs the E2B SDK: "
                                   "pip install e2b-code-interpreter")) from exc


def _names(exc: BaseException) -> list[str]:
    return [cls.__name__ for cls in type(exc).__mro__]


def _error(exc: Exception) -> ErrorInfo:
    """The E2B SDK's exception as the runner records it: Corral's code for it, and the status when one is said."""
    name = type(exc).__name__
    message = str(exc)
    code = next((_CODES[n] for n in _names(exc) if n in _CODES), None)
    status = None
    prefix = _PREFIX.match(message)
    if prefix is not None:
        said = prefix.group(1).lower()
        status = int(said) if said.isdigit() else None
        code = code or _BY_STATUS.get(said) or _BY_RPC.get(said)
    return ErrorInfo(code or "server_error", f"{name}: {message}", status)


class E2BAdapter:
    """Runs tasks through E2B's code-interpreter SDK.

    **Parameters:**

    * **base_url** - Corral's E2B API (the server's own URL); None: E2B's cloud (`E2B_API_KEY`, `E2B_DOMAIN`).
    * **api_key** - a developer key of the Corral tenant the tasks run as, or an E2B key (default `E2B_API_KEY`).
    * **capabilities** - what to claim (default: what the target offers, see the module's doc).
    * **template** - the E2B template for the corpus's `default` (E2B's cloud: its own default when None).
    * **request_timeout** - seconds for calls that are not commands or cells.
    """

    name = "e2b"
    default_capabilities = CLOUD_CAPABILITIES

    def __init__(self, *, base_url: str | None = None, api_key: str | None = None,
                 capabilities: frozenset[str] | None = None, template: str | None = None,
                 request_timeout: float = 120.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.capabilities = capabilities if capabilities is not None else (
            CORRAL_CAPABILITIES if base_url is not None else CLOUD_CAPABILITIES)
        self.template = template
        self.options: dict[str, Any] = {"api_key": api_key, "request_timeout": request_timeout}
        if base_url is not None:
            self.options |= {"api_url": base_url, "sandbox_url": base_url, "validate_api_key": False}

    @property
    def on_corral(self) -> bool:
        return self.base_url is not None

    async def open(self, task: Task) -> E2BSession:
        sdk = _sdk()
        setup = task.setup
        started = time.monotonic()
        template = self.template if setup.template == "default" and not self.on_corral else setup.template
        try:
            sb = await sdk.AsyncSandbox.create(
                template=template, timeout=setup.timeout, envs=dict(setup.env) or None,
                metadata={"eval": task.id[:200]}, **_create_network(setup.network), **self.options)
        except Exception as exc:  # the SDK's errors have no common base we can name without importing it
            raise SetupError(_error(exc), seconds=time.monotonic() - started) from exc
        corral = (self.base_url, self.api_key) if self.base_url is not None and self.api_key is not None else None
        session = E2BSession(sb, time.monotonic() - started, workdir=WORKDIR if self.on_corral else None,
                             corral=corral)
        try:
            for path, blob in setup.files:
                await sb.files.write(session.path(path), blob.bytes())
        except Exception as exc:
            await session.close()
            info = _error(exc)
            raise SetupError(ErrorInfo(info.code, f"uploading the task's files: {info.message}", info.status),
                             seconds=session.create_seconds) from exc
        return session

    async def aclose(self) -> None:
        """Nothing is shared between sessions."""


def _create_network(network: str | tuple[str, ...]) -> dict[str, Any]:
    """The corpus's policy as E2B's create parameters: "none" and "internet" as `allow_internet_access`, a list
    as hosts allowed out of a sandbox that denies everything else."""
    if network == "none":
        return {"allow_internet_access": False}
    if network == "internet":
        return {"allow_internet_access": True}
    return {"network": _allow_only(network)}


def _network_update(network: str | tuple[str, ...]) -> dict[str, Any]:
    """The policy as `update_network` takes it (the whole configuration: what is left out is cleared)."""
    if network == "none":
        return {"deny_out": [ALL_TRAFFIC]}
    if network == "internet":
        return {}
    return _allow_only(network)


def _allow_only(hosts: str | tuple[str, ...]) -> dict[str, Any]:
    return {"allow_out": [hosts] if isinstance(hosts, str) else list(hosts), "deny_out": [ALL_TRAFFIC]}


class E2BSession:
    def __init__(self, sandbox: Any, create_seconds: float, *, workdir: str | None,
                 corral: tuple[str, str] | None = None) -> None:
        self.sandbox = sandbox
        self.create_seconds = create_seconds
        self.workdir = workdir
        self.corral = corral  # Corral's (base URL, key) when the target is Corral's E2B API: checkpoints
        self.undo = UndoState()
        self._contexts: dict[tuple[str | None, str], Any] = {}

    def path(self, path: str) -> str:
        """A relative path of the corpus is relative to its working directory, as E2B's to the user's home."""
        if self.workdir is None or path.startswith("/") or not path:
            return path
        return posixpath.join(self.workdir, path)

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
            return await self._code(step)
        if isinstance(step, Write):
            await sb.files.write(self.path(step.path), step.data.bytes())
            return Outcome("write")
        if isinstance(step, Read):
            return Outcome("read", data=bytes(await sb.files.read(self.path(step.path), format="bytes")))
        if isinstance(step, SetNetwork):
            await sb.update_network(_network_update(step.network))
            return Outcome("set_network")
        if isinstance(step, Pause):
            await sb.pause()
            self.sandbox = await sb.connect()  # E2B's resume: connecting to a paused sandbox resumes it
            return Outcome("pause")
        if isinstance(step, Fingerprint):
            r = await self._exec(Exec(tuple(fingerprint_argv(step)), timeout=120))
            return fingerprinted(step, r, self.undo)
        if isinstance(step, Checkpoint | Restore):
            return await self._through_corral(step)
        raise TypeError(f"the E2B adapter cannot run a {step.kind} step")

    async def _through_corral(self, step: Checkpoint | Restore) -> Outcome:
        """E2B has no checkpoint: Corral's own SDK takes and restores it, on the very sandbox E2B's SDK drives."""
        from .._sdk import AsyncSandbox

        if self.corral is None:
            raise TypeError(f"a {step.kind} step needs Corral's E2B API (E2B has no checkpoints)")
        base_url, api_key = self.corral
        sb = await AsyncSandbox.connect(self.sandbox.sandbox_id, api_key=api_key, base_url=base_url)
        try:  # closed, never killed (`async with` would kill it): E2B's SDK still drives it
            if isinstance(step, Checkpoint):
                self.undo.checkpoints[step.label] = (await sb.checkpoint()).id
                return Outcome("checkpoint")
            target = self.undo.checkpoint_id(step.to)
            if target is None:
                raise TypeError(f"no checkpoint {step.to!r} was taken before this restore: the task is malformed")
            result = await sb.restore(target, paths=list(step.paths) if step.paths is not None else None)
        finally:
            await sb.close()
        self._contexts.clear()  # a restore restarts the sandbox's code sessions
        return Outcome("restore", stopped=tuple(p.cmd for p in result.stopped_processes))

    # -- commands ----------------------------------------------------------------------------------------------

    async def _exec(self, step: Exec) -> Outcome:
        """`commands.run` as a handle (what `run` itself waits on), so that a command stopped by its timeout
        still shows the output it printed before, as the handle holds it."""
        cmd = step.cmd if isinstance(step.cmd, str) else shlex.join(step.cmd)
        handle = await self.sandbox.commands.run(
            cmd, background=True, stdin=step.stdin is not None, timeout=step.timeout, cwd=step.cwd or self.workdir,
            envs=dict(step.env) or None)
        try:
            if step.stdin is not None:
                await self._send_stdin(handle.pid, step.stdin.bytes())
            result = await handle.wait()
        except Exception as exc:
            names = _names(exc)
            if "CommandExitException" in names:
                result = exc
            elif "TimeoutException" in names:
                out, err = _text(handle.stdout), _text(handle.stderr)
                return Outcome("exec", timed_out=True, stdout=out, stderr=err, stdout_size=len(out),
                               stderr_size=len(err), extra={"message": str(exc)})
            else:
                raise
        return _exec_outcome(result)

    async def _send_stdin(self, pid: int, data: bytes) -> None:
        """The bytes, then EOF. A program that stops reading and exits (`head -c 10`) ends the stream early:
        what it read is its output, as with a pipe."""
        commands = self.sandbox.commands
        try:
            for i in range(0, len(data), _STDIN_CHUNK):
                await commands.send_stdin(pid, data[i:i + _STDIN_CHUNK])
            await commands.close_stdin(pid)
        except Exception as exc:
            # Gone (not_found) or its stdin closed (conflict: Corral's failed_precondition) once it has exited.
            if _error(exc).code not in ("not_found", "conflict"):
                raise

    # -- code cells --------------------------------------------------------------------------------------------

    async def _code(self, step: Code) -> Outcome:
        context = await self._context(step.session, step.language)
        try:
            if context is None:
                ex = await self.sandbox.run_code(step.code, language=step.language, timeout=step.timeout)
            else:
                ex = await self.sandbox.run_code(step.code, context=context, timeout=step.timeout)
        except Exception as exc:
            if "TimeoutException" in _names(exc):  # the SDK stops waiting at `timeout`; the server interrupts
                return Outcome("code", timed_out=True, extra={"message": str(exc)})
            raise
        return _code_outcome(ex)

    async def _context(self, session: str | None, language: str) -> Any:
        """The context of (session, language), made on first use in the corpus's working directory; on E2B's
        cloud, the language's default context when no session is named."""
        key = (session, language)
        if language in _COMPILED:
            return None  # a whole program per cell, compiled and run: no context holds it
        if key not in self._contexts:
            if session is None and self.workdir is None:
                return None
            self._contexts[key] = await self.sandbox.create_code_context(cwd=self.workdir, language=language)
        return self._contexts[key]

    async def close(self) -> None:
        try:
            await self.sandbox.kill()
        except Exception:  # best effort: the sandbox's own timeout removes it
            return


def _text(output: str | None) -> bytes:
    """Output as the SDK gives it (text, invalid UTF-8 already replaced), as bytes for the checks."""
    return (output or "").encode()


def _exec_outcome(r: Any) -> Outcome:
    out, err = _text(r.stdout), _text(r.stderr)
    exit_code, number = int(r.exit_code), None
    error = str(getattr(r, "error", None) or "")
    said = _SIGNAL.match(error)
    if said is not None:  # E2B ends a signalled process with exit code -1 and "signal: <name>"
        number = _signal_number(said.group(1))
        exit_code = 128 + number if number is not None else exit_code
    return Outcome("exec", exit_code=exit_code, signal=number, stdout=out, stderr=err, stdout_size=len(out),
                   stderr_size=len(err), denials=_denials(error), oom_killed=_OOM in error)


def _signal_number(name: str) -> int | None:
    """The number of a signal as Go's `ProcessState` names it ("killed", "segmentation fault")."""
    wanted = name.strip().lower().removeprefix("signal ")
    if wanted.isdigit():
        return int(wanted)
    for sig in signal.Signals:
        if (signal.strsignal(sig) or "").lower() == wanted:
            return int(sig)
    return None


def _denials(error: str) -> tuple[Denial, ...]:
    """Corral's E2B API names each refused connection in the command's error, a `corral: <reason>` line each (the
    egress notice of `corral/_output.py`); the reason's subject (a host, `host:port`, "package mirror") stands for
    the host. E2B's cloud says nothing, and so nothing comes back."""
    found = []
    for m in _NOTICE.finditer(error):
        reason = m.group(1)
        if f"corral: {reason}".startswith(_OOM):
            continue  # not a refusal: the command was killed for memory
        subject = _SUBJECT.match(reason)
        host = next((g for g in subject.groups() if g), reason) if subject is not None else reason
        found.append(Denial(host, None, reason))
    return tuple(found)


def _code_outcome(ex: Any) -> Outcome:
    out = "".join(ex.logs.stdout).encode()
    err = "".join(ex.logs.stderr).encode()
    results: list[dict[str, Any]] = []
    text = None
    for r in ex.results:
        results.append(_mime_bundle(r))
        if getattr(r, "is_main_result", False):
            text = getattr(r, "text", None)
    error = (str(ex.error.name), str(ex.error.value)) if ex.error is not None else None
    return Outcome("code", stdout=out, stderr=err, stdout_size=len(out), stderr_size=len(err), text=text,
                   results=tuple(results), code_error=error, text_unquoted=True)


def _mime_bundle(result: Any) -> dict[str, Any]:
    """E2B's result fields back under their MIME types, as Corral's results carry them."""
    data = {mime: getattr(result, attr) for attr, mime in _MIMES.items() if getattr(result, attr, None) is not None}
    extra = getattr(result, "extra", None)
    if isinstance(extra, Mapping):
        data |= dict(extra)
    return data


_MIMES = {"png": "image/png", "jpeg": "image/jpeg", "svg": "image/svg+xml", "html": "text/html",
          "markdown": "text/markdown", "latex": "text/latex", "text": "text/plain", "pdf": "application/pdf",
          "json": "application/json", "javascript": "application/javascript"}
