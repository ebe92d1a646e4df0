"""Background processes: `/v1/sandboxes/{id}/processes` to start, list, feed, signal, wait for and attach to.

A background process belongs to its sandbox, not to the request that started it: it ends by itself, at its own
timeout, when killed, or with the sandbox. Closing an attach stream (or any other request) never kills it.
Results and output use exec's wire format (`_exec.result_json`, NDJSON `stdout`/`stderr`/`exit` events).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from ..engine import ProcessInfo
from ..service import AttachStream
from ._auth import CurrentPrincipal
from ._checkpoints import checkpoint_taken
from ._context import service
from ._exec import CommandBody, result_json
from ._ndjson import Producer, Sink, line, ndjson_response
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)

_SHELL = ["/bin/bash", "-lc"]


class StartRequest(CommandBody):
    stdin: bool = False  # keep stdin open for POST .../stdin; otherwise it is /dev/null (or stdin_b64, then EOF)


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


@router.post("/{sandbox_id}/processes", status_code=201)
async def start_process(sandbox_id: str, body: StartRequest, request: Request,
                        principal: CurrentPrincipal) -> dict[str, Any]:
    info = await service(request).processes.start(principal, sandbox_id, body.command(), keep_stdin=body.stdin)
    return {**process_json(info), "checkpoint": checkpoint_taken()}


@router.get("/{sandbox_id}/processes")
async def list_processes(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    found = await service(request).processes.list(principal, sandbox_id)
    return {"processes": [process_json(p) for p in found]}


@router.get("/{sandbox_id}/processes/{process_id}")
async def get_process(sandbox_id: str, process_id: str, request: Request,
                      principal: CurrentPrincipal) -> dict[str, Any]:
    return process_json(await service(request).processes.get(principal, sandbox_id, process_id))


@router.post("/{sandbox_id}/processes/{process_id}/stdin")
async def send_stdin(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                     eof: bool = False) -> dict[str, Any]:
    size = await service(request).processes.send_stdin(principal, sandbox_id, process_id, request.stream(),
                                                       eof=eof)
    return {"size": size}


@router.post("/{sandbox_id}/processes/{process_id}/kill", status_code=204)
async def kill_process(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                       body: KillRequest | None = None) -> Response:
    await service(request).processes.kill(principal, sandbox_id, process_id, body.signal if body else None)
    return Response(status_code=204)


@router.get("/{sandbox_id}/processes/{process_id}/wait")
async def wait_process(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                       timeout: Timeout = None) -> dict[str, Any]:
    result = await service(request).processes.wait(principal, sandbox_id, process_id, timeout)
    if result is None:
        return {"id": process_id, "running": True}
    return {"id": process_id, "pid": result.pid, "running": False, **result_json(result)}


@router.get("/{sandbox_id}/processes/{process_id}/attach", response_model=None)
async def attach_process(sandbox_id: str, process_id: str, request: Request, principal: CurrentPrincipal,
                         timeout: Timeout = None) -> StreamingResponse:
    stream = await service(request).processes.attach(principal, sandbox_id, process_id, timeout)
    return ndjson_response(_events(stream, process_id), stream.close)


def _events(stream: AttachStream, process_id: str) -> Producer:
    """Exec's NDJSON: the kept output so far, then every new byte, then `exit` (or `running` at the timeout).
    A client that leaves only detaches: the process goes on."""
    async def produce(sink: Sink) -> bytes:
        result = await stream.run(sink.stdout, sink.stderr)
        if result is None:
            return line({"event": "running", "id": process_id})
        return line({"event": "exit", "id": process_id, "pid": result.pid, **result_json(result, streamed=True)})

    return produce
