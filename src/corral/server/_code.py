"""The code interpreter: `/v1/sandboxes/{id}/code` runs a cell in a stateful session, and `.../code/sessions`
lists, interrupts, restarts and closes sessions (docs/code.md, "HTTP API").

A cell that raises, times out or is OOM-killed is still a 200: those are fields of the result. Streamed, the
output travels as exec's `stdout`/`stderr` events, each rich result as a `result` event when it is produced,
and a last `end` (or `error`) event.

A client that accepts `application/vnd.corral.frames` (the SDK) gets binary frames instead of JSON or NDJSON,
streamed or not: output as raw bytes, never base64 in JSON (a 1 MB cell otherwise spends more time in base64 and
JSON than in the sandbox). Frames are `u32 length (big-endian, of what follows) | u8 kind | payload`, like the
agent's protocol: `STDOUT` and `STDERR` carry bytes, `EVENT` a JSON object (`result`, then `end` or `error`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.types import Receive, Scope, Send

from .._negotiation import quality
from ..engine import CodeResult, CodeSession, RichResult
from ..service import Cell, CodeStream
from ._auth import CurrentPrincipal
from ._checkpoints import checkpoint_taken
from ._context import service
from ._exec import Base64
from ._ndjson import NDJSON, Framing, Producer, Sink, b64, line, ndjson_response
from ._routing import AuditedRoute

router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)

FRAMES = "application/vnd.corral.frames"
STDOUT, STDERR, EVENT = 1, 2, 3  # frame kinds
MAX_FRAME = 16 * 1024 * 1024  # a frame's payload at most; more output is sent in several frames
_HEADER = struct.Struct(">IB")


SessionName = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[^\x00/]+$")]


class CodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: StrictStr
    language: StrictStr = "python"
    session: SessionName | None = None  # None: the language's default session (the engine names it)
    timeout: Annotated[float, Field(gt=0)] | None = None
    stdin_b64: Base64 | None = None  # the program's stdin, for c and cpp only
    stream: StrictBool = False
    max_output: Annotated[int, Field(ge=4)] | None = None  # bytes of each stream a whole result keeps

    def cell(self) -> Cell:
        return Cell(self.code, language=self.language, session=self.session, timeout=self.timeout,
                    stdin=self.stdin_b64, max_output=self.max_output)


def rich_json(result: RichResult) -> dict[str, Any]:
    return {"is_main_result": result.is_main_result, "data": dict(result.data)}


def error_json(result: CodeResult) -> dict[str, Any] | None:
    error = result.error
    return None if error is None else {"name": error.name, "value": error.value, "traceback": error.traceback}


def code_result_json(result: CodeResult, *, sent_stdout: int = 0, sent_stderr: int = 0,
                     sent_results: int | None = None) -> dict[str, Any]:
    """The result fields; when streamed, `sent_*` say what the client already got, which is left out (output
    the engine did not hand to a callback stays in `stdout_b64`/`stderr_b64`, so no byte is lost)."""
    streamed = sent_results is not None
    body = _outcome_json(result, kept=not streamed)
    if not streamed:
        body["results"] = [rich_json(r) for r in result.results]
    body["stdout_b64"] = b64(_unsent(result.stdout_bytes, result.stdout_size, sent_stdout))
    body["stderr_b64"] = b64(_unsent(result.stderr_bytes, result.stderr_size, sent_stderr))
    return body


def _outcome_json(result: CodeResult, *, kept: bool) -> dict[str, Any]:
    """`kept`: the result's own output follows (not a stream's, which carried every byte), so it says what of the
    output it kept."""
    body = {"session": result.session, "language": result.language, "error": error_json(result),
            "timed_out": result.timed_out, "oom_killed": result.oom_killed,
            "session_restarted": result.session_restarted, "duration": result.duration,
            "checkpoint": checkpoint_taken()}  # the automatic one taken before the cell (docs/api.md)
    if kept:
        body |= {"truncated": result.truncated, "stdout_size": result.stdout_size,
                 "stderr_size": result.stderr_size, "stdout_cut": result.stdout_cut, "stderr_cut": result.stderr_cut}
    return body


def _unsent(data: bytes, size: int, sent: int) -> bytes:
    """The end of the output a stream has not carried (`size - sent` bytes, all within `data`'s kept tail when
    the result was truncated)."""
    missing = size - sent
    return data[max(0, len(data) - missing):] if missing > 0 else b""


def session_json(session: CodeSession) -> dict[str, Any]:
    started = datetime.fromtimestamp(session.started_at, UTC).isoformat() if session.started_at else None
    return {"name": session.name, "language": session.language, "pid": session.pid, "started_at": started}


class Frames(Framing):
    """The binary framing: output as raw bytes, events as JSON."""

    media_type = FRAMES

    def output(self, kind: str, data: bytes) -> bytes:
        return b"".join(output_frames(STDOUT if kind == "stdout" else STDERR, data))

    def event(self, obj: dict[str, Any]) -> bytes:
        payload = json.dumps(obj, separators=(",", ":")).encode()
        return _HEADER.pack(len(payload) + 1, EVENT) + payload


FRAMING = Frames()


def output_frames(kind: int, data: bytes) -> Iterator[bytes]:
    """Headers and payloads of `data`'s frames (none when empty); the payload is `data` itself when it fits."""
    for start in range(0, len(data), MAX_FRAME):
        chunk = data if len(data) <= MAX_FRAME else data[start:start + MAX_FRAME]
        yield _HEADER.pack(len(chunk) + 1, kind)
        yield chunk


class FramesResponse(Response):
    """A whole result as frames, each part sent as it is: a megabyte of output is not copied into one body."""

    media_type = FRAMES

    def __init__(self, result: CodeResult) -> None:
        end = {"event": "end", **_outcome_json(result, kept=True), "results": [rich_json(r) for r in result.results]}
        self.parts = [*output_frames(STDOUT, result.stdout_bytes), *output_frames(STDERR, result.stderr_bytes),
                      FRAMING.event(end)]
        super().__init__(headers={"content-length": str(sum(len(p) for p in self.parts))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for part in self.parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def accepts_frames(request: Request) -> bool:
    """Whether the client's `Accept` names the frames' media type (with a q above 0)."""
    for item in request.headers.get("accept", "").split(","):
        media, *params = (part.strip() for part in item.split(";"))
        if media.lower() == FRAMES:
            return quality(params) > 0
    return False


@router.post("/{sandbox_id}/code", response_model=None)
async def run_code(sandbox_id: str, body: CodeRequest, request: Request,
                   principal: CurrentPrincipal) -> dict[str, Any] | Response:
    code = service(request).code
    frames = accepts_frames(request)
    if not body.stream:
        result = await code.run(principal, sandbox_id, body.cell())
        return FramesResponse(result) if frames else code_result_json(result)
    stream = await code.stream(principal, sandbox_id, body.cell())
    return ndjson_response(_events(stream, frames=frames), stream.close, FRAMING if frames else NDJSON)


def _events(stream: CodeStream, *, frames: bool) -> Producer:
    """Exec's events plus `result` events as each rich result is produced, and a last `end` (or `error`).
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
        if frames:  # output the engine did not hand to a callback travels as frames too, before the end
            tails = [*output_frames(STDOUT, _unsent(result.stdout_bytes, result.stdout_size, sink.stdout_sent)),
                     *output_frames(STDERR, _unsent(result.stderr_bytes, result.stderr_size, sink.stderr_sent))]
            return b"".join([*tails, FRAMING.event({"event": "end", **_outcome_json(result, kept=False)})])
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
