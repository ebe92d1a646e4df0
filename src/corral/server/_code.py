"""The code interpreter: `/v1/sandboxes/{id}/code` runs a cell in a stateful session, and `.../code/sessions`
lists, interrupts, restarts and closes sessions (docs/code.md, "HTTP API").

A cell that raises, times out or is OOM-killed is still a 200: those are fields of the result. Streamed, the
output travels as exec's `stdout`/`stderr` events, each rich result as a `result` event when it is produced,
and a last `end` (or `error`) event.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from .._exceptions import CorralError, InvalidRequestError, ServerError
from ..control import Action, Principal
from ..engine import CodeResult, CodeSession, RichResult
from ._auth import CurrentPrincipal
from ._context import Audited, Services, services
from ._ndjson import Sink, b64, line, output_stream

router = APIRouter(prefix="/v1/sandboxes")


SessionName = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[^\x00/]+$")]


class CodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: StrictStr
    language: StrictStr = "python"
    session: SessionName | None = None  # None: "default"
    timeout: Annotated[float, Field(gt=0)] | None = None
    stdin_b64: StrictStr | None = None  # the program's stdin, for c and cpp only
    stream: StrictBool = False

    def stdin(self) -> dict[str, Any]:
        """`run_code`'s stdin argument, only when one was given."""
        if self.stdin_b64 is None:
            return {}
        try:
            return {"stdin": base64.b64decode(self.stdin_b64, validate=True)}
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError("stdin_b64 is not valid base64") from exc


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


def _outcome(result: CodeResult) -> dict[str, Any]:
    outcome: dict[str, Any] = {"timed_out": result.timed_out, "oom_killed": result.oom_killed,
                               "session_restarted": result.session_restarted}
    if result.error is not None:
        outcome["exception"] = result.error.name  # the cell raised: not an error of the request
    return outcome


def _params(body: CodeRequest) -> dict[str, Any]:
    return {"code": body.code, "language": body.language, "session": body.session or "default",
            "timeout": body.timeout, "stream": body.stream,
            **({} if body.stdin_b64 is None else {"stdin": True})}


@router.post("/{sandbox_id}/code", response_model=None)
async def run_code(sandbox_id: str, body: CodeRequest, request: Request,
                   principal: CurrentPrincipal) -> dict[str, Any] | StreamingResponse:
    svc = services(request)
    audit = Audited(svc.store, principal, "code.run", sandbox_id, params=_params(body))
    async with contextlib.AsyncExitStack() as stack:
        try:
            await svc.store.sandbox_for(principal, sandbox_id, Action.SANDBOX_EXEC)
            if body.stream:
                svc.engine.info(sandbox_id)  # a sandbox the engine lost is an error status, not a broken stream
                return StreamingResponse(_stream(svc, sandbox_id, body, audit), media_type="application/x-ndjson")
            stack.push_async_callback(audit.record)
            result = await svc.engine.run_code(sandbox_id, body.code, language=body.language,
                                               session=body.session or "default", timeout=body.timeout,
                                               **body.stdin())
        except BaseException as exc:
            stack.pop_all()
            await audit.record(exc)
            raise
        audit.outcome.update(_outcome(result))
    return code_result_json(result)


async def _stream(svc: Services, sandbox_id: str, body: CodeRequest, audit: Audited) -> AsyncIterator[bytes]:
    """Exec's NDJSON plus `result` events as each rich result is produced, and a last `end` (or `error`)."""
    async def produce(sink: Sink) -> bytes:
        sent_results = 0

        async def on_result(result: RichResult) -> None:
            nonlocal sent_results
            sent_results += 1
            await sink.event({"event": "result", "result": rich_json(result)})

        try:
            result = await svc.engine.run_code(sandbox_id, body.code, language=body.language,
                                               session=body.session or "default", timeout=body.timeout,
                                               on_stdout=sink.stdout, on_stderr=sink.stderr, on_result=on_result,
                                               **body.stdin())
        except CorralError as exc:
            audit.outcome["error"] = exc.code
            return line({"event": "error", "error": exc.to_dict()})
        except Exception as exc:
            audit.outcome["error"] = ServerError.code
            return line({"event": "error", "error": ServerError(f"run_code failed: {exc}").to_dict()})
        audit.outcome.update(_outcome(result))
        for rich in result.results[sent_results:]:  # any the engine did not hand to on_result
            await sink.event({"event": "result", "result": rich_json(rich)})
        end = code_result_json(result, sent_stdout=sink.stdout_sent, sent_stderr=sink.stderr_sent, sent_results=0)
        return line({"event": "end", **end})

    async for chunk in output_stream(produce, audit):  # a client that leaves cancels the engine's call
        yield chunk


async def _sandbox(svc: Services, principal: Principal, sandbox_id: str) -> None:
    # Ownership first: another tenant's sandbox is a 404 before anything about its sessions is looked at.
    await svc.store.sandbox_for(principal, sandbox_id, Action.SANDBOX_EXEC)


@router.get("/{sandbox_id}/code/sessions")
async def list_sessions(sandbox_id: str, request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    svc = services(request)
    async with Audited(svc.store, principal, "code.sessions", sandbox_id) as audit:
        await _sandbox(svc, principal, sandbox_id)
        found = await svc.engine.code_sessions(sandbox_id)
        audit.outcome["count"] = len(found)
    return {"sessions": [session_json(s) for s in found]}


@router.post("/{sandbox_id}/code/sessions/{name}/interrupt", status_code=204)
async def interrupt_session(sandbox_id: str, name: str, request: Request, principal: CurrentPrincipal) -> Response:
    svc = services(request)
    async with Audited(svc.store, principal, "code.interrupt", sandbox_id, params={"session": name}, status=204):
        await _sandbox(svc, principal, sandbox_id)
        await svc.engine.interrupt_code(sandbox_id, name)
    return Response(status_code=204)


@router.post("/{sandbox_id}/code/sessions/{name}/restart", status_code=204)
async def restart_session(sandbox_id: str, name: str, request: Request, principal: CurrentPrincipal) -> Response:
    svc = services(request)
    async with Audited(svc.store, principal, "code.restart", sandbox_id, params={"session": name}, status=204):
        await _sandbox(svc, principal, sandbox_id)
        await svc.engine.restart_code(sandbox_id, name)
    return Response(status_code=204)


@router.delete("/{sandbox_id}/code/sessions/{name}", status_code=204)
async def close_session(sandbox_id: str, name: str, request: Request, principal: CurrentPrincipal) -> Response:
    svc = services(request)
    async with Audited(svc.store, principal, "code.close", sandbox_id, params={"session": name}, status=204):
        await _sandbox(svc, principal, sandbox_id)
        await svc.engine.close_code(sandbox_id, name)
    return Response(status_code=204)
