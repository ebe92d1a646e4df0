"""`POST /v1/sandboxes/{id}/exec`: one JSON result, or NDJSON events as the output is produced."""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .._exceptions import CorralError, InvalidRequestError, ServerError
from ..control import Action
from ..egress import EgressEvent
from ..engine import ExecResult
from ._auth import CurrentPrincipal
from ._context import Audited, services
from ._ndjson import Sink, b64, line, output_stream

router = APIRouter(prefix="/v1/sandboxes")



class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str]
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout: Annotated[float, Field(gt=0)] | None = None
    max_output: Annotated[int, Field(gt=0)] | None = None
    stdin_b64: str | None = None
    stream: bool = False


def result_json(result: ExecResult, *, streamed: bool = False) -> dict[str, Any]:
    """The result fields; once streamed, stdout_b64/stderr_b64 hold only the kept tail of truncated output."""
    out, err = result.stdout_bytes, result.stderr_bytes
    if streamed:
        out = out[result.stdout_cut:] if result.stdout_cut is not None else b""
        err = err[result.stderr_cut:] if result.stderr_cut is not None else b""
    return {
        "exit_code": result.exit_code,
        "signal": result.signal,
        "stdout_b64": b64(out),
        "stderr_b64": b64(err),
        "duration": result.duration,
        "timed_out": result.timed_out,
        "oom_killed": result.oom_killed,
        "killed": result.killed,
        "truncated": result.truncated,
        "stdout_size": result.stdout_size,
        "stderr_size": result.stderr_size,
        "stdout_cut": result.stdout_cut,
        "stderr_cut": result.stderr_cut,
        "egress_denials": [denial_json(d) for d in result.egress_denials],
    }


def denial_json(event: EgressEvent) -> dict[str, Any]:
    """What a client needs to explain a refusal: where, what kind, and the reason with its fix."""
    return {"kind": event.kind, "host": event.host, "port": event.port, "method": event.method,
            "rule": event.rule, "reason": event.reason, "time": event.time}


def _outcome(result: ExecResult) -> dict[str, Any]:
    return {"exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out,
            "oom_killed": result.oom_killed, "truncated": result.truncated}


def _stdin(body: ExecRequest) -> bytes | None:
    if body.stdin_b64 is None:
        return None
    try:
        return base64.b64decode(body.stdin_b64, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("stdin_b64 is not valid base64") from None


@router.post("/{sandbox_id}/exec", response_model=None)
async def exec_command(sandbox_id: str, body: ExecRequest, request: Request,
                       principal: CurrentPrincipal) -> dict[str, Any] | StreamingResponse:
    svc = services(request)
    params: dict[str, Any] = {"cmd": body.cmd, "cwd": body.cwd, "env_names": sorted(body.env),
                              "timeout": body.timeout, "max_output": body.max_output, "stream": body.stream}
    audit = Audited(svc.store, principal, "sandbox.exec", sandbox_id, params=params)
    async with contextlib.AsyncExitStack() as stack:
        try:
            await svc.store.sandbox_for(principal, sandbox_id, Action.SANDBOX_EXEC)
            stdin = _stdin(body)
            params["stdin_size"] = len(stdin) if stdin is not None else None
            if body.stream:
                svc.engine.info(sandbox_id)  # a sandbox the engine lost is an error status, not a broken stream
                return StreamingResponse(_stream(svc.engine, sandbox_id, body, stdin, audit),
                                         media_type="application/x-ndjson")
            stack.push_async_callback(audit.record)
            result = await svc.engine.exec(sandbox_id, body.cmd, cwd=body.cwd, env=body.env or None, stdin=stdin,
                                           timeout=body.timeout, max_output=body.max_output)
        except BaseException as exc:
            stack.pop_all()
            await audit.record(exc)
            raise
        audit.outcome.update(_outcome(result))
    return result_json(result)


async def _stream(engine: Any, sandbox_id: str, body: ExecRequest, stdin: bytes | None,
                  audit: Audited) -> AsyncIterator[bytes]:
    async def produce(sink: Sink) -> bytes:
        try:
            result = await engine.exec(sandbox_id, body.cmd, cwd=body.cwd, env=body.env or None, stdin=stdin,
                                       timeout=body.timeout, max_output=body.max_output,
                                       on_stdout=sink.stdout, on_stderr=sink.stderr)
        except CorralError as exc:
            audit.outcome["error"] = exc.code
            return line({"event": "error", "error": exc.to_dict()})
        except Exception as exc:
            audit.outcome["error"] = ServerError.code
            return line({"event": "error", "error": ServerError(f"exec failed: {exc}").to_dict()})
        audit.outcome.update(_outcome(result))
        return line({"event": "exit", **result_json(result, streamed=True)})

    async for chunk in output_stream(produce, audit):  # a client that leaves cancels the exec: its tree is killed
        yield chunk
