"""Background processes: `/v1/sandboxes/{id}/processes` to start, list, feed, signal, wait for and attach to.

A background process belongs to its sandbox, not to the request that started it: it ends by itself, at its own
timeout, when killed, or with the sandbox. Closing an attach stream (or any other request) never kills it.
Results and output use exec's wire format (`_exec.result_json`, NDJSON `stdout`/`stderr`/`exit` events).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import signal as signals
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from .._exceptions import CorralError, InvalidRequestError, NotFoundError, ServerError
from ..control import Action, Principal
from ..engine import ExecResult, Processes, ProcessInfo
from ._auth import CurrentPrincipal
from ._context import Audited, Services, services
from ._exec import _outcome, result_json
from ._ndjson import OutputSink, Sink, line, output_stream

router = APIRouter(prefix="/v1/sandboxes")

_STDIN_BATCH = 1024 * 1024  # request body bytes gathered into one write to the agent
_SHELL = ["/bin/bash", "-lc"]


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str]
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout: Annotated[float, Field(gt=0)] | None = None
    max_output: Annotated[int, Field(gt=0)] | None = None
    stdin: bool = False  # keep stdin open for POST .../stdin; otherwise it is /dev/null (or stdin_b64, then EOF)
    stdin_b64: str | None = None


class KillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    signal: StrictInt | StrictStr | None = None


Timeout = Annotated[float | None, Query(ge=0, le=7 * 24 * 3600)]


def _iso(timestamp: float) -> str | None:
    return datetime.fromtimestamp(timestamp, UTC).isoformat() if timestamp else None


def _cmd(argv: list[str]) -> str | list[str]:
    """The command as it was given: a shell string for `bash -lc CMD`, else the argv list."""
    return argv[2] if len(argv) == 3 and argv[:2] == _SHELL else argv


def process_json(info: ProcessInfo) -> dict[str, Any]:
    return {"id": info.id, "pid": info.pid, "cmd": _cmd(info.argv), "argv": info.argv, "pty": info.pty,
            "running": info.running, "started_at": _iso(info.started_at), "exit_code": info.exit_code}


def _stdin_bytes(body: StartRequest) -> bytes | None:
    if body.stdin_b64 is None:
        return None
    try:
        return base64.b64decode(body.stdin_b64, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("stdin_b64 is not valid base64") from None


def _signal(value: int | str | None) -> int | None:
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


async def _processes(svc: Services, principal: Principal, sandbox_id: str) -> Processes:
    # Ownership first: another tenant's sandbox is a 404 before anything about its processes is looked at.
    await svc.store.sandbox_for(principal, sandbox_id, Action.SANDBOX_EXEC)
    return svc.engine.get(sandbox_id).processes


async def _find(processes: Processes, process_id: str) -> ProcessInfo:
    for info in await processes.list():
        if info.id == process_id:
            return info
    raise NotFoundError(f"no process with id {process_id!r} in this sandbox")


@router.post("/{sandbox_id}/processes", status_code=201)
async def start_process(sandbox_id: str, body: StartRequest, request: Request,
                        principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    params: dict[str, Any] = {"cmd": body.cmd, "cwd": body.cwd, "env_names": sorted(body.env),
                              "timeout": body.timeout, "max_output": body.max_output, "stdin": body.stdin}
    async with Audited(svc.store, principal, "process.start", sandbox_id, params=params, status=201) as audit:
        processes = await _processes(svc, principal, sandbox_id)
        stdin = _stdin_bytes(body)
        params["stdin_size"] = len(stdin) if stdin is not None else None
        info = await processes.start(body.cmd, cwd=body.cwd, env=body.env or None, timeout=body.timeout,
                                     max_output=body.max_output, stdin=body.stdin or stdin is not None)
        audit.outcome.update({"process": info.id, "pid": info.pid})
        if stdin is not None:
            await processes.send_stdin(info.id, stdin, eof=not body.stdin)
    started = datetime.now(UTC).timestamp()
    return process_json(ProcessInfo(id=info.id, pid=info.pid, argv=info.argv, running=True, started_at=started))


@router.get("/{sandbox_id}/processes")
async def list_processes(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "process.list", sandbox_id) as audit:
        found = await (await _processes(svc, principal, sandbox_id)).list()
        audit.outcome["count"] = len(found)
    return {"processes": [process_json(p) for p in found]}


@router.get("/{sandbox_id}/processes/{process_id}")
async def get_process(sandbox_id: str, process_id: str, request: Request,
                      principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "process.get", sandbox_id, params={"process": process_id}):
        info = await _find(await _processes(svc, principal, sandbox_id), process_id)
    return process_json(info)


@router.post("/{sandbox_id}/processes/{process_id}/stdin")
async def send_stdin(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                     eof: bool = False) -> dict[str, Any]:
    svc = services(request)
    params: dict[str, Any] = {"process": process_id, "eof": eof}
    async with Audited(svc.store, principal, "process.stdin", sandbox_id, params=params) as audit:
        processes = await _processes(svc, principal, sandbox_id)
        sent = 0
        batch = bytearray()
        async for chunk in request.stream():
            batch += chunk
            if len(batch) >= _STDIN_BATCH:
                await _write_stdin(processes, process_id, bytes(batch))
                sent += len(batch)
                batch.clear()
        await _write_stdin(processes, process_id, bytes(batch), eof=eof)
        sent += len(batch)
        audit.params["size"] = sent
    return {"size": sent}


async def _write_stdin(processes: Processes, process_id: str, data: bytes, *, eof: bool = False) -> None:
    await processes.send_stdin(process_id, data, eof=eof)  # the agent refuses (conflict) a process without stdin


@router.post("/{sandbox_id}/processes/{process_id}/kill", status_code=204)
async def kill_process(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                       body: KillRequest | None = None) -> Response:
    svc = services(request)
    params: dict[str, Any] = {"process": process_id, "signal": body.signal if body else None}
    async with Audited(svc.store, principal, "process.kill", sandbox_id, params=params, status=204):
        processes = await _processes(svc, principal, sandbox_id)
        number = _signal(body.signal if body else None)
        await processes.kill(process_id, number)
    return Response(status_code=204)


@router.get("/{sandbox_id}/processes/{process_id}/wait")
async def wait_process(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                       timeout: Timeout = None) -> dict[str, Any]:
    svc = services(request)
    params: dict[str, Any] = {"process": process_id, "timeout": timeout}
    async with Audited(svc.store, principal, "process.wait", sandbox_id, params=params) as audit:
        result = await (await _processes(svc, principal, sandbox_id)).wait(process_id, timeout)
        if result is None:
            audit.outcome["running"] = True
            return {"id": process_id, "running": True}
        audit.outcome.update(_outcome(result))
    return {"id": process_id, "pid": result.pid, "running": False, **result_json(result)}


@router.get("/{sandbox_id}/processes/{process_id}/attach", response_model=None)
async def attach_process(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                         timeout: Timeout = None) -> StreamingResponse:
    svc = services(request)
    params: dict[str, Any] = {"process": process_id, "timeout": timeout}
    audit = Audited(svc.store, principal, "process.attach", sandbox_id, params=params)
    try:
        processes = await _processes(svc, principal, sandbox_id)
        await _find(processes, process_id)  # an unknown process is a 404 status, not a broken stream
    except BaseException as exc:
        await audit.record(exc)
        raise
    return StreamingResponse(_follow(processes, process_id, timeout, audit), media_type="application/x-ndjson")


async def _follow(processes: Processes, process_id: str, timeout: float | None,
                  audit: Audited) -> AsyncIterator[bytes]:
    """Exec's NDJSON: the kept output so far, then every new byte, then `exit` (or `running` at `timeout`).
    A client that leaves only detaches: the process goes on."""
    async def produce(sink: Sink) -> bytes:
        return await _attach_events(processes, process_id, timeout, audit, sink.stdout, sink.stderr)

    async for chunk in output_stream(produce, audit):
        yield chunk


async def _attach_events(processes: Processes, process_id: str, timeout: float | None, audit: Audited,
                         on_stdout: OutputSink, on_stderr: OutputSink) -> bytes:
    """The last line of an attach stream: `exit`, `running` (the timeout passed first) or `error`."""
    try:
        async with asyncio.timeout(timeout):
            result: ExecResult = await processes.attach(process_id, on_stdout, on_stderr)
    except TimeoutError:
        audit.outcome["running"] = True
        return line({"event": "running", "id": process_id})
    except CorralError as exc:
        audit.outcome["error"] = exc.code
        return line({"event": "error", "error": exc.to_dict()})
    except Exception as exc:
        audit.outcome["error"] = ServerError.code
        return line({"event": "error", "error": ServerError(f"attach failed: {exc}").to_dict()})
    audit.outcome.update(_outcome(result))
    return line({"event": "exit", "id": process_id, "pid": result.pid, **result_json(result, streamed=True)})
