"""`WS /v1/sandboxes/{id}/pty`: an interactive terminal over a WebSocket.

Binary frames carry raw bytes both ways (keystrokes in, terminal output out, never re-encoded); text frames carry
JSON control messages. The client opens with a `start` text frame (command, size, cwd, env: env values stay out
of URLs and access logs); the server answers `started`, streams output, and ends with `exit` and a normal close.
Every failure is an `error` text frame followed by a close whose code is 4000 + the error's HTTP status (4401,
4403, 4404, 4400, 4409, 4500, 4502, ...), never a bare 1011. Closing the socket hangs up the terminal: its
process tree is killed, as a terminal's is when its window closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field
from starlette.websockets import WebSocketDisconnect

from .._exceptions import AgentError, AuthenticationError, CorralError, InvalidRequestError, ServerError
from ..agent.protocol import ProtocolError
from ..control import Action, Principal
from ..engine import PtySession
from ._context import Audited, Services
from ._errors import status_for

logger = logging.getLogger("corral.server")
router = APIRouter(prefix="/v1/sandboxes")

START_TIMEOUT = 30.0  # seconds a client has to send its `start` frame
_OUT_CHUNK = 64 * 1024  # output frames stay small for clients with a default 1 MiB message limit
_REASON_BYTES = 123  # the most a WebSocket close reason may hold
_MAX_SIZE = 10_000  # rows or columns; the kernel takes up to 65535, no terminal needs that many
_AGENT_ERRORS = (OSError, asyncio.IncompleteReadError, ProtocolError)

Size = Annotated[int, Field(ge=1, le=_MAX_SIZE)]
Frame = TypeVar("Frame", bound=BaseModel)


class StartFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["start"]
    cmd: str | list[str] = "bash"
    rows: Size = 24
    cols: Size = 80
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout: Annotated[float, Field(gt=0)] | None = None


class ResizeFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["resize"]
    rows: Size
    cols: Size


def close_code(exc: CorralError) -> int:
    return 4000 + status_for(exc.code)


def _reason(message: str) -> str:
    return message.encode()[:_REASON_BYTES].decode("utf-8", errors="ignore")


async def _refuse(ws: WebSocket, exc: CorralError) -> None:
    """The whole error as a text frame (a close reason holds 123 bytes), then the close code."""
    with contextlib.suppress(Exception):  # the client may be gone already; nothing is left to tell it
        await ws.send_text(json.dumps({"type": "error", "error": exc.to_dict()}))
        await ws.close(close_code(exc), _reason(exc.message))


async def _authenticate(ws: WebSocket, svc: Services) -> Principal:
    header = ws.headers.get("authorization")
    if header is None:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthenticationError("the Authorization header must be 'Bearer <key>'")
    return await svc.store.authenticate(key.strip())


def _json_frame(text: str) -> dict[str, Any]:
    try:
        frame = json.loads(text)
    except ValueError:
        raise InvalidRequestError("a text frame must be a JSON object") from None
    if not isinstance(frame, dict):
        raise InvalidRequestError("a text frame must be a JSON object")
    return frame


def _validated(model: type[Frame], frame: dict[str, Any]) -> Frame:
    try:
        return model.model_validate(frame)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'frame'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequestError(f"invalid {frame.get('type')!r} frame: {problems}") from None


async def _start_frame(ws: WebSocket) -> StartFrame:
    try:
        async with asyncio.timeout(START_TIMEOUT):
            message = await ws.receive()
    except TimeoutError:
        raise InvalidRequestError(f"no start frame within {START_TIMEOUT:g} seconds") from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        raise InvalidRequestError('the first frame must be a text frame {"type": "start", ...}')
    return _validated(StartFrame, _json_frame(text))


@router.websocket("/{sandbox_id}/pty")
async def pty(ws: WebSocket, sandbox_id: str) -> None:
    # Accept first: a refusal before the handshake can only be a bare HTTP 403, with no code or reason.
    await ws.accept()
    svc: Services = ws.app.state.corral
    try:
        principal = await _authenticate(ws, svc)
    except CorralError as exc:
        await _refuse(ws, exc)
        return
    audit = Audited(svc.store, principal, "sandbox.pty", sandbox_id)
    try:
        term = await _open(ws, svc, principal, sandbox_id, audit)
    except WebSocketDisconnect:
        audit.outcome["disconnected"] = True
        await audit.record()
        return
    except CorralError as exc:
        await audit.record(exc)
        await _refuse(ws, exc)
        return
    except Exception as exc:  # never a bare 1011: the client gets a code and a reason, the log the traceback
        logger.exception("pty start failed", extra={"sandbox": sandbox_id})
        await audit.record(exc)
        await _refuse(ws, ServerError("could not start the terminal; see the server log"))
        return
    try:
        await _session(ws, term, audit)
    except WebSocketDisconnect:  # gone before `started` could be sent
        audit.outcome["disconnected"] = True
    finally:
        with contextlib.suppress(*_AGENT_ERRORS):
            await term.close()  # a terminal still running is killed by this hang-up
        await audit.record()


async def _open(ws: WebSocket, svc: Services, principal: Principal, sandbox_id: str, audit: Audited) -> PtySession:
    await svc.store.sandbox_for(principal, sandbox_id, Action.SANDBOX_EXEC)
    start = await _start_frame(ws)
    audit.params.update({"cmd": start.cmd, "rows": start.rows, "cols": start.cols, "cwd": start.cwd,
                         "env_names": sorted(start.env), "timeout": start.timeout})
    try:
        term = await svc.engine.get(sandbox_id).pty(start.cmd, rows=start.rows, cols=start.cols, cwd=start.cwd,
                                                    env=start.env or None, timeout=start.timeout)
    except _AGENT_ERRORS as exc:
        raise _lost(exc) from exc
    audit.outcome.update({"process": term.id, "pid": term.pid})
    return term


async def _session(ws: WebSocket, term: PtySession, audit: Audited) -> None:
    await ws.send_text(json.dumps({"type": "started", "id": term.id, "pid": term.pid}))
    output = asyncio.create_task(_pump_output(ws, term))
    keys = asyncio.create_task(_pump_input(ws, term))
    try:
        done, _ = await asyncio.wait({output, keys}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (output, keys):
            task.cancel()
        results = await asyncio.gather(output, keys, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)),
                 None)
    if isinstance(error, CorralError):
        audit.outcome["error"] = error.code
        await _refuse(ws, error)
    elif isinstance(error, WebSocketDisconnect) or (keys in done and error is None):
        audit.outcome["disconnected"] = True
    elif error is not None:
        logger.error("pty session failed", exc_info=error)
        audit.outcome["error"] = ServerError.code
        await _refuse(ws, ServerError("the terminal session failed; see the server log"))
    elif term.result is not None:
        await _exit(ws, term, audit)


async def _exit(ws: WebSocket, term: PtySession, audit: Audited) -> None:
    result = term.result
    assert result is not None
    fields = {"exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out,
              "killed": result.killed, "duration": result.duration}
    audit.outcome.update(fields)
    with contextlib.suppress(Exception):  # the client may have gone just as the process ended
        await ws.send_text(json.dumps({"type": "exit", **fields}))
        await ws.close(1000)


async def _pump_output(ws: WebSocket, term: PtySession) -> None:
    chunks = term.__aiter__()
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            return  # the process ended; `term.result` holds how
        except _AGENT_ERRORS as exc:  # only the agent's side: a client that went is not an agent failure
            raise _lost(exc) from exc
        for i in range(0, len(chunk), _OUT_CHUNK):
            await ws.send_bytes(chunk[i : i + _OUT_CHUNK])


def _lost(exc: BaseException) -> AgentError:
    return AgentError(f"lost the terminal's connection to the sandbox (stopped or killed?): {exc!r}")


async def _pump_input(ws: WebSocket, term: PtySession) -> None:
    """Client -> terminal until the client goes: bytes are keystrokes, text frames are controls."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        try:
            if (data := message.get("bytes")) is not None:
                await term.write(data)
            elif (text := message.get("text")) is not None:
                await _control(term, _json_frame(text))
        except _AGENT_ERRORS as exc:
            raise _lost(exc) from exc


async def _control(term: PtySession, frame: dict[str, Any]) -> None:
    kind = frame.get("type")
    if kind == "resize":
        size = _validated(ResizeFrame, frame)
        await term.resize(size.rows, size.cols)
    elif kind == "kill":
        await term.kill()
    else:
        raise InvalidRequestError(f"unknown control frame type {kind!r}; expected 'resize' or 'kill'")
