"""`WS /v1/sandboxes/{id}/pty`: an interactive terminal over a WebSocket.

Binary frames carry raw bytes both ways (keystrokes in, terminal output out, never re-encoded); text frames carry
JSON control messages. The client opens with a `start` text frame (command, size, cwd, env: env values stay out
of URLs and access logs); the server answers `started`, streams output, and ends with `exit` and a normal close.
A browser cannot set `Authorization` on a WebSocket handshake: it offers the subprotocols `corral.pty` and
`corral.key.<api key>` instead, and the server accepts with `corral.pty` (never echoing the key).
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

from .._bounds import Duration, EnvVars
from .._exceptions import AuthenticationError, CorralError, InvalidRequestError, ServerError
from ..control import Principal
from ..service import ClientInfo, PtyRequest, Service, Terminal
from ._auth import bearer_key
from ._context import SandboxUser
from ._errors import status_for
from ._routing import AuditedRoute

logger = logging.getLogger("corral.server")
router = APIRouter(prefix="/v1/sandboxes", route_class=AuditedRoute)

START_TIMEOUT = 30.0  # seconds a client has to send its `start` frame
_OUT_CHUNK = 64 * 1024  # output frames stay small for clients with a default 1 MiB message limit
_REASON_BYTES = 123  # the most a WebSocket close reason may hold
_MAX_SIZE = 10_000  # rows or columns; the kernel takes up to 65535, no terminal needs that many
SUBPROTOCOL = "corral.pty"  # what a browser offers (with KEY_SUBPROTOCOL), and what the server then accepts
KEY_SUBPROTOCOL = "corral.key."  # + the API key: a browser's only way to send a credential on the handshake

Size = Annotated[int, Field(ge=1, le=_MAX_SIZE)]
Frame = TypeVar("Frame", bound=BaseModel)


class StartFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["start"]
    cmd: str | list[str] = "bash"
    rows: Size = 24
    cols: Size = 80
    cwd: str | None = None
    env: EnvVars = Field(default_factory=dict)
    timeout: Duration | None = None
    user: SandboxUser | None = None

    def request(self) -> PtyRequest:
        return PtyRequest(cmd=self.cmd, rows=self.rows, cols=self.cols, cwd=self.cwd, env=self.env,
                          timeout=self.timeout, user=self.user)


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


async def _authenticate(ws: WebSocket, svc: Service) -> Principal:
    """The caller of the Bearer key; a refusal is recorded by the service (`auth.denied`), as for any request."""
    client = ClientInfo(ws.client.host if ws.client is not None else None, "GET", ws.url.path)
    try:
        key = bearer_key(ws.headers.get("authorization")) or _subprotocol_key(_offered(ws))
    except AuthenticationError as exc:
        await svc.record_denial(client, exc, None)
        raise
    return await svc.authenticate(key, client)


def _offered(ws: WebSocket) -> list[str]:
    header = ws.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def _subprotocol_key(offered: list[str]) -> str | None:
    keys = [p.removeprefix(KEY_SUBPROTOCOL) for p in offered if p.startswith(KEY_SUBPROTOCOL)]
    if len(keys) > 1:
        raise AuthenticationError(f"more than one {KEY_SUBPROTOCOL}<key> subprotocol")
    if keys and not keys[0]:
        raise AuthenticationError(f"the {KEY_SUBPROTOCOL}<key> subprotocol has no key")
    return keys[0] if keys else None


def _json_frame(text: str) -> dict[str, Any]:
    try:
        frame = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
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


async def _start_frame(ws: WebSocket) -> PtyRequest | None:
    """The terminal the client's `start` frame asks for; None if the client left first."""
    try:
        async with asyncio.timeout(START_TIMEOUT):
            message = await ws.receive()
    except TimeoutError:
        raise InvalidRequestError(f"no start frame within {START_TIMEOUT:g} seconds") from None
    if message["type"] == "websocket.disconnect":
        return None
    text = message.get("text")
    if text is None:
        raise InvalidRequestError('the first frame must be a text frame {"type": "start", ...}')
    return _validated(StartFrame, _json_frame(text)).request()


@router.websocket("/{sandbox_id}/pty")
async def pty(ws: WebSocket, sandbox_id: str) -> None:
    # Accept first: a refusal before the handshake can only be a bare HTTP 403, with no code or reason. A browser
    # that offered subprotocols fails the connection unless one is accepted: `corral.pty`, never the key's.
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in _offered(ws) else None)
    svc: Service = ws.app.state.corral
    try:
        principal = await _authenticate(ws, svc)
        terminal = await svc.pty.open(principal, sandbox_id, lambda: _start_frame(ws))
    except CorralError as exc:
        await _refuse(ws, exc)
        return
    except Exception:  # never a bare 1011: the client gets a code and a reason, the log the traceback
        logger.exception("pty start failed", extra={"sandbox": sandbox_id})
        await _refuse(ws, ServerError("could not start the terminal; see the server log"))
        return
    if terminal is None:
        return  # the client left before its start frame
    error: BaseException | None = None
    disconnected = False
    try:
        error, disconnected = await _session(ws, terminal)
    except WebSocketDisconnect:  # gone before `started` could be sent
        disconnected = True
    finally:
        await terminal.close(error, disconnected=disconnected)  # a terminal still running is killed by this


async def _session(ws: WebSocket, term: Terminal) -> tuple[BaseException | None, bool]:
    """Pump both ways until the process ends or the client goes; how it ended: (an error, the client left)."""
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
        await _refuse(ws, error)
        return error, False
    if isinstance(error, WebSocketDisconnect) or (keys in done and error is None):
        return None, True
    if error is not None:
        logger.error("pty session failed", exc_info=error)
        await _refuse(ws, ServerError("the terminal session failed; see the server log"))
        return error, False
    if term.result is not None:
        await _exit(ws, term)
    return None, False


async def _exit(ws: WebSocket, term: Terminal) -> None:
    result = term.result
    assert result is not None
    fields = {"exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out,
              "killed": result.killed, "duration": result.duration}
    with contextlib.suppress(Exception):  # the client may have gone just as the process ended
        await ws.send_text(json.dumps({"type": "exit", **fields}))
        await ws.close(1000)


async def _pump_output(ws: WebSocket, term: Terminal) -> None:
    async for chunk in term.output():  # then the process ended; `term.result` holds how
        for i in range(0, len(chunk), _OUT_CHUNK):
            await ws.send_bytes(chunk[i : i + _OUT_CHUNK])


async def _pump_input(ws: WebSocket, term: Terminal) -> None:
    """Client -> terminal until the client goes: bytes are keystrokes, text frames are controls."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        if (data := message.get("bytes")) is not None:
            await term.write(data)
        elif (text := message.get("text")) is not None:
            await _control(term, _json_frame(text))


async def _control(term: Terminal, frame: dict[str, Any]) -> None:
    kind = frame.get("type")
    if kind == "resize":
        size = _validated(ResizeFrame, frame)
        await term.resize(size.rows, size.cols)
    elif kind == "kill":
        await term.kill()
    else:
        raise InvalidRequestError(f"unknown control frame type {kind!r}; expected 'resize' or 'kill'")
