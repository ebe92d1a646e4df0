"""envd's `process.Process` service on Corral's processes: Start, Connect, List, SendInput, StreamInput,
SendSignal, CloseStdin and Update.

Every command is a background process that the starting call follows (E2B's semantics: a client that leaves, or a
`background=True` command, leaves it running), named by its real pid in the sandbox or its tag; `Connect`
follows one from now on (no old output), `List` shows the running ones. A command's env is its own, over the
sandbox's, and reaches no later command; its working directory defaults to the user's home; `Connect-Timeout-Ms`
is its timeout. End events say what Go's `ProcessState` would: `exit status N`, or `signal: killed`.
"""

from __future__ import annotations

import signal as signals
from collections.abc import Mapping
from typing import Any

from .._exceptions import InvalidRequestError
from .._output import egress_notice
from ..engine import ExecResult, ProcessInfo, PtySize
from ..service import Command
from ._connect import RpcError
from ._proto import b64, enum_of, field, integer, message_of, process_ref, unb64
from ._rpc import Call, Rpc, Send
from ._user import absolute_path, home_of, service_user

__all__ = ["OOM_NOTICE", "PROCESS_RPCS"]

KEEPALIVE: Mapping[str, Any] = {"event": {"keepalive": {}}}
_SIGNALS = {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}
_MAX_TAG = 256
OOM_NOTICE = "corral: out of memory: the sandbox's memory limit was reached and the kernel killed the command\n"


# -- starting and following ------------------------------------------------------------------------------------


async def start(call: Call, send: Send) -> None:
    command = _command(call)
    stream = await call.service.commands.stream(call.principal, call.sandbox_id, command)
    try:
        result = await stream.run(*_relay(send, pty=command.pty is not None))
    finally:
        await stream.close()
    if result.timed_out and call.deadline is not None:  # the client's deadline ended it, as envd's context does
        raise RpcError("deadline_exceeded", f"the command ran past the request's deadline ({call.deadline:g} s) "
                                            "and was killed")
    await send(_end(result))


def _command(call: Call) -> Command:
    config = message_of(call.message, "process")
    program = field(config, "cmd")
    if not isinstance(program, str) or not program:
        raise InvalidRequestError("process.cmd is required")
    args = field(config, "args") or []
    envs = field(config, "envs") or {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidRequestError("process.args must be a list of strings")
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
        raise InvalidRequestError("process.envs must map names to strings")
    tag = field(call.message, "tag")
    if tag is not None and (not isinstance(tag, str) or not 0 < len(tag) <= _MAX_TAG):
        raise InvalidRequestError(f"tag must be 1 to {_MAX_TAG} characters")
    pty = _pty(call.message)
    keep_stdin = pty is None and field(call.message, "stdin") is not False  # envd's default: the pipe stays open
    cwd = field(config, "cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise InvalidRequestError("process.cwd must be text")
    home = home_of(call.user)
    return Command(cmd=[program, *args], cwd=absolute_path(cwd, what="cwd", default=home, home=home), env=envs,
                   timeout=call.deadline, user=service_user(call.user),
                   detached=True, tag=tag, pty=pty, keep_stdin=keep_stdin)


def _pty(message: Mapping[str, Any]) -> PtySize | None:
    pty = field(message, "pty")
    if pty is None:
        return None
    size = message_of(pty if isinstance(pty, dict) else {}, "size")
    rows, cols = integer(field(size, "rows"), "pty.size.rows"), integer(field(size, "cols"), "pty.size.cols")
    if not (0 < rows < 10000 and 0 < cols < 10000):
        raise InvalidRequestError("pty rows and cols must be between 1 and 9999")
    return PtySize(rows=rows, cols=cols)


def _relay(send: Send, *, pty: bool) -> tuple[Any, Any, Any]:
    """The output callbacks: each chunk a data event (a terminal's as `pty`), the start event first."""

    async def on_stdout(chunk: bytes) -> None:
        await send({"event": {"data": {"pty" if pty else "stdout": b64(chunk)}}})

    async def on_stderr(chunk: bytes) -> None:
        await send({"event": {"data": {"stderr": b64(chunk)}}})

    async def on_start(_process_id: str, pid: int) -> None:
        await send({"event": {"start": {"pid": pid}}})

    return on_stdout, on_stderr, on_start


async def connect(call: Call, send: Send) -> None:
    ref = process_ref(call.message)
    info = await call.service.processes.get(call.principal, call.sandbox_id, ref)
    stream = await call.service.processes.attach(call.principal, call.sandbox_id, ref, replay=False)
    try:
        result = await stream.run(*_relay(send, pty=info.pty))
    finally:
        await stream.close()
    if result is not None:
        await send(_end(result))


def _end(result: ExecResult) -> dict[str, Any]:
    """envd's end event, as Go's `os.ProcessState` describes the exit."""
    if result.signal is None:
        code = result.exit_code if result.exit_code is not None else -1
        status = f"exit status {code}"
        end: dict[str, Any] = {"exitCode": code, "exited": True, "status": status}
        if code != 0:
            end["error"] = status
    else:
        status = f"signal: {_signal_name(result.signal)}"
        end = {"exitCode": -1, "exited": False, "status": status, "error": status}
    notice = egress_notice((d.host, d.port, d.reason) for d in result.egress_denials)
    if result.oom_killed:  # E2B's end event has no flag for it: say so where the SDKs show the error
        notice = OOM_NOTICE + notice
    if notice:  # curl and git print only "403": the reason reaches the agent in the command's error
        end["error"] = "; ".join(filter(None, (end.get("error"), notice.strip())))
    return {"event": {"end": end}}


def _signal_name(number: int) -> str:
    try:
        return (signals.strsignal(number) or f"signal {number}").lower()
    except ValueError:
        return f"signal {number}"


# -- the others: one request, one answer ------------------------------------------------------------------------


async def list_processes(call: Call) -> dict[str, Any]:
    found = await call.service.processes.list(call.principal, call.sandbox_id)
    return {"processes": [_info(p) for p in found if p.running]}


def _info(info: ProcessInfo) -> dict[str, Any]:
    config: dict[str, Any] = {"cmd": info.argv[0] if info.argv else "", "args": info.argv[1:], "envs": info.env}
    if info.cwd:
        config["cwd"] = info.cwd
    out: dict[str, Any] = {"config": config, "pid": info.pid}
    if info.tag:
        out["tag"] = info.tag
    return out


async def send_input(call: Call) -> dict[str, Any]:
    data = _input(message_of(call.message, "input"))
    await call.service.processes.send_stdin(call.principal, call.sandbox_id, process_ref(call.message), data)
    return {}


def _input(message: Mapping[str, Any]) -> bytes:
    if field(message, "pty") is not None:
        return unb64(field(message, "pty"), "input.pty")
    return unb64(field(message, "stdin"), "input.stdin")


async def stream_input(call: Call, messages: Any) -> dict[str, Any]:
    """A client stream: a `start` naming the process, then `data` messages, in order (keepalives skipped)."""
    ref = None
    async for message in messages:
        if field(message, "start") is not None:
            ref = process_ref(message_of(message, "start"))
        elif field(message, "data") is not None:
            if ref is None:
                raise InvalidRequestError("the input stream must begin with a start message naming the process")
            data = _input(message_of(message_of(message, "data"), "input"))
            await call.service.processes.send_stdin(call.principal, call.sandbox_id, ref, data)
    return {}


async def send_signal(call: Call) -> dict[str, Any]:
    number = enum_of(field(call.message, "signal"), _SIGNALS, "signal")
    if number not in (9, 15):
        raise InvalidRequestError("signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL")
    # SIGKILL: the whole tree, and answered once the process is reaped (its pid no longer answers `kill -0`).
    await call.service.processes.kill(call.principal, call.sandbox_id, process_ref(call.message),
                                      None if number == 9 else number)
    return {}


async def close_stdin(call: Call) -> dict[str, Any]:
    await call.service.processes.close_stdin(call.principal, call.sandbox_id, process_ref(call.message))
    return {}


async def update(call: Call) -> dict[str, Any]:
    size = _pty(call.message)
    if size is not None:
        await call.service.processes.resize(call.principal, call.sandbox_id, process_ref(call.message),
                                            size.rows, size.cols)
    return {}


PROCESS_RPCS: Mapping[str, Rpc] = {
    "process.Process/Start": Rpc("stream", start, KEEPALIVE),
    "process.Process/Connect": Rpc("stream", connect, KEEPALIVE),
    "process.Process/List": Rpc("unary", list_processes),
    "process.Process/SendInput": Rpc("unary", send_input),
    "process.Process/StreamInput": Rpc("client", stream_input),
    "process.Process/SendSignal": Rpc("unary", send_signal),
    "process.Process/CloseStdin": Rpc("unary", close_stdin),
    "process.Process/Update": Rpc("unary", update),
}
