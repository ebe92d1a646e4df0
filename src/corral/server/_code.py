"""The code interpreter: `/v1/sandboxes/{id}/code` runs a cell in a stateful session, and `.../code/sessions`
lists, interrupts, restarts and closes sessions (docs/code.md, "HTTP API").

A cell that raises, times out or is OOM-killed is still a 200: those are fields of the result. Streamed, the
output travels as exec's `stdout`/`stderr` events, each rich result as a `result` event when it is produced,
and a last `end` (or `error`) event.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from ..engine import CodeResult, CodeSession, RichResult
from ..service import Cell, CodeStream
from ._auth import CurrentPrincipal
from ._context import service
from ._exec import Base64
from ._ndjson import Producer, Sink, b64, line, ndjson_response
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)


SessionName = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[^\x00/]+$")]


class CodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: StrictStr
    language: StrictStr = "python"
    session: SessionName | None = None  # None: the language's default session (the engine names it)
    timeout: Annotated[float, Field(gt=0)] | None = None
    stdin_b64: Base64 | None = None  # the program's stdin, for c and cpp only
    stream: StrictBool = False

    def cell(self) -> Cell:
        return Cell(self.code, language=self.language, session=self.session, timeout=self.timeout,
                    stdin=self.stdin_b64)


def rich_json(result: RichResult) -> dict[str, Any]:
    return {"is_main_result": result.is_main_result, "data": dict(result.data)}


def error_json(result: CodeResult) -> dict[str, Any] | None:
    error = result.error
    return None if error is None else {"name": error.name, "value": error.value, "traceback": error.traceback}


def code_result_json(result: CodeResult, *, sent_stdout: int = 0, sent_stderr: int = 0,
                     sent_results: int | None = None) -> dict[str, Any]:
    """The result fields; when streamed, `sent_*` say what the client already got, which is left out (output
    the engine did not hand to a callback stays in `stdout_b64`/`stderr_b64`, so no byte is lost)."""
    body: dict[str, Any] = {"session": result.session, "language": result.language}
    if sent_results is None:
        body["results"] = [rich_json(r) for r in result.results]
    body.update({
        "stdout_b64": b64(_unsent(result.stdout_bytes, sent_stdout)),
        "stderr_b64": b64(_unsent(result.stderr_bytes, sent_stderr)),
        "error": error_json(result),
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "session_restarted": result.session_restarted,
        "duration": result.duration,
    })
    return body


def _unsent(data: bytes, sent: int) -> bytes:
    return data[sent:] if sent <= len(data) else b""


def session_json(session: CodeSession) -> dict[str, Any]:
    started = datetime.fromtimestamp(session.started_at, UTC).isoformat() if session.started_at else None
    return {"name": session.name, "language": session.language, "pid": session.pid, "started_at": started}


@router.post("/{sandbox_id}/code", response_model=None)
async def run_code(sandbox_id: str, body: CodeRequest, request: Request,
                   principal: CurrentPrincipal) -> dict[str, Any] | StreamingResponse:
    code = service(request).code
    if not body.stream:
        return code_result_json(await code.run(principal, sandbox_id, body.cell()))
    stream = await code.stream(principal, sandbox_id, body.cell())
    return ndjson_response(_events(stream), stream.close)


def _events(stream: CodeStream) -> Producer:
    """Exec's NDJSON plus `result` events as each rich result is produced, and a last `end` (or `error`).
    A client that leaves cancels the engine's call."""
    async def produce(sink: Sink) -> bytes:
        sent_results = 0

        async def on_result(result: RichResult) -> None:
            nonlocal sent_results
            sent_results += 1
            await sink.event({"event": "result", "result": rich_json(result)})

        result = await stream.run(sink.stdout, sink.stderr, on_result)
        for rich in result.results[sent_results:]:  # any the engine did not hand to on_result
            await sink.event({"event": "result", "result": rich_json(rich)})
        end = code_result_json(result, sent_stdout=sink.stdout_sent, sent_stderr=sink.stderr_sent, sent_results=0)
        return line({"event": "end", **end})

    return produce


@router.get("/{sandbox_id}/code/sessions")
async def list_sessions(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    found = await service(request).code.sessions(principal, sandbox_id)
    return {"sessions": [session_json(s) for s in found]}


@router.post("/{sandbox_id}/code/sessions/{name}/interrupt", status_code=204)
async def interrupt_session(sandbox_id: str, name: str, request: Request,
                            principal: CurrentPrincipal) -> Response:
    await service(request).code.interrupt(principal, sandbox_id, name)
    return Response(status_code=204)


@router.post("/{sandbox_id}/code/sessions/{name}/restart", status_code=204)
async def restart_session(sandbox_id: str, name: str, request: Request,
                          principal: CurrentPrincipal) -> Response:
    await service(request).code.restart(principal, sandbox_id, name)
    return Response(status_code=204)


@router.delete("/{sandbox_id}/code/sessions/{name}", status_code=204)
async def close_session(sandbox_id: str, name: str, request: Request, principal: CurrentPrincipal) -> Response:
    await service(request).code.close(principal, sandbox_id, name)
    return Response(status_code=204)
