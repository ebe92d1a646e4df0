"""E2B's code interpreter (the server on port 49999 of E2B's `code-interpreter` template), on Corral's code
sessions: `POST /execute` streams a cell's output as newline-delimited JSON, `/contexts` manages contexts.

Lines of `/execute`: `stdout` / `stderr` (`text`, `timestamp`), `result` (a MIME bundle under E2B's keys: text,
html, markdown, svg, png, jpeg, pdf, latex, json, javascript, data, chart, extra; `is_main_result`), `error`
(`name`, `value`, `traceback`), `number_of_executions`, and always `end_of_execution` last. Output is relayed as
the cell produces it; a client that leaves interrupts the cell. Errors before the stream are plain text with E2B's
statuses (404 unknown context, 400 bad request).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .._exceptions import CorralError, InvalidRequestError
from ..engine import CodeResult, RichResult
from ..service import Cell, status_for
from ._auth import sandbox_caller
from ._files import sandbox_of
from ._front import Front, front_of

__all__ = ["INTERPRETER_PORT", "interpreter_app", "result_json"]

INTERPRETER_PORT = 49999
_LANGUAGES = {"python": "python", "js": "javascript", "javascript": "javascript", "ts": "typescript",
              "typescript": "typescript", "bash": "bash", "sh": "bash", "r": "r", "java": "java"}
# MIME types and E2B's result keys; anything else goes under `extra`.
_KEYS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
         "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
         "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
         "e2b/chart": "chart"}
_PARSED = frozenset({"json", "data", "chart"})  # keys whose value is JSON, not text


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str = Field(max_length=16 * 1024 * 1024)
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None


def language_of(name: str | None) -> str:
    language = _LANGUAGES.get((name or "python").strip().lower())
    if language is None:
        raise InvalidRequestError(f"unknown language {name!r}: use one of {', '.join(sorted(set(_LANGUAGES)))}")
    return language


async def execute(request: Request) -> Response:
    svc = front_of(request).service
    try:
        sandbox_id = _sandbox(request)
        principal = await sandbox_caller(svc, request, sandbox_id, ports=True)
        body = ExecuteRequest.model_validate_json(await request.body())
        if body.context_id and body.language:
            raise InvalidRequestError("pass a context or a language, not both")
        cell = Cell(code=body.code, language=language_of(body.language), session=body.context_id or None)
        stream = await svc.code.stream(principal, sandbox_id, cell)
    except ValidationError as exc:
        return PlainTextResponse(f"invalid request: {exc.errors()[0]['msg']}", status_code=400)
    except CorralError as exc:
        return PlainTextResponse(exc.message, status_code=status_for(exc.code))
    return StreamingResponse(_lines(stream), media_type="application/x-ndjson")


async def _lines(stream: Any) -> AsyncIterator[bytes]:
    """The cell's NDJSON lines, produced while it runs (the stream's callbacks feed a queue)."""
    import asyncio

    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}

    def text_of(name: str) -> Any:
        async def emit(chunk: bytes) -> None:
            text = decoders[name].decode(chunk)
            if text:
                await queue.put(_line({"type": name, "text": text, "timestamp": _now()}))
        return emit

    async def on_result(result: RichResult) -> None:
        await queue.put(_line(result_json(result)))

    async def run() -> None:
        try:
            result: CodeResult = await stream.run(on_stdout=text_of("stdout"), on_stderr=text_of("stderr"),
                                                  on_result=on_result)
            for line in _ending(result):
                await queue.put(line)
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    try:
        while (item := await queue.get()) is not None:
            yield item
        if task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        if not task.done():
            task.cancel()  # the client left: the cell is interrupted
        await stream.close()


def _ending(result: CodeResult) -> list[bytes]:
    lines = []
    if result.error is not None:
        lines.append(_line({"type": "error", "name": result.error.name, "value": result.error.value,
                            "traceback": result.error.traceback}))
    elif result.timed_out:
        lines.append(_line({"type": "error", "name": "TimeoutError", "value": "the cell timed out",
                            "traceback": ""}))
    count = getattr(result, "execution_count", None)
    if count is not None:
        lines.append(_line({"type": "number_of_executions", "execution_count": count}))
    lines.append(_line({"type": "end_of_execution"}))
    return lines


def result_json(result: RichResult) -> dict[str, Any]:
    """A rich result as E2B's `result` line: MIME types under E2B's keys, the rest under `extra`."""
    out: dict[str, Any] = {"type": "result", "is_main_result": result.is_main_result}
    extra: dict[str, Any] = {}
    for mime, value in result.data.items():
        key = _KEYS.get(mime)
        if key is None:
            extra[mime] = value
        elif key in _PARSED:
            out[key] = _json(value)
        else:
            out[key] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]  # a string's repr: E2B shows the string itself
    if extra:
        out["extra"] = extra
    return out


def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _sandbox(request: Request) -> str:
    sandbox_id = sandbox_of(request)
    if sandbox_id is None:
        raise InvalidRequestError("no sandbox: send the E2b-Sandbox-Id header")
    return sandbox_id


def interpreter_app(front: Front) -> Starlette:
    app = Starlette(routes=[Route("/execute", execute, methods=["POST"])])
    app.state.front = front
    return app
