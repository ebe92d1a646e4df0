"""E2B's code interpreter (the server on port 49999 of E2B's `code-interpreter` template), on Corral's code
sessions: `POST /execute` streams a cell's output as newline-delimited JSON, `/contexts` manages contexts.

Lines of `/execute`: `stdout` / `stderr` (`text`, `timestamp`), `result` (a MIME bundle under E2B's keys: text,
html, markdown, svg, png, jpeg, pdf, latex, json, javascript, data, chart, extra; `is_main_result`), `error`
(`name`, `value`, `traceback`), `number_of_executions`, and always `end_of_execution` last. Output is relayed as
the cell produces it; a client that leaves interrupts the cell. Errors before the stream are plain text with E2B's
statuses (404 unknown context, 400 bad request).
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .._exceptions import AgentError, CorralError, InvalidRequestError, NotFoundError
from ..control import Principal
from ..engine import (
    LANGUAGES,
    SESSION_LANGUAGES,
    CodeResult,
    CodeSession,
    RichResult,
    default_context,
    normalize_language,
)
from ..service import Cell, CodeStream, OutputCallback, status_for
from ._auth import sandbox_caller
from ._files import sandbox_of
from ._front import Front, front_of
from ._user import HOME, absolute_path

__all__ = ["INTERPRETER_PORT", "interpreter_app", "result_json"]

INTERPRETER_PORT = 49999
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


class ContextRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    language: str | None = Field(None, max_length=64)
    cwd: str | None = Field(None, max_length=4096)


async def execute(request: Request) -> Response:
    svc = front_of(request).service
    try:
        sandbox_id, principal = await _caller(request)
        body = ExecuteRequest.model_validate_json(await request.body())
        if body.context_id and body.language:
            raise InvalidRequestError("pass a context or a language, not both")
        cell = _cell(body)
        stream = await svc.code.stream(principal, sandbox_id, cell)
    except ValidationError as exc:
        return PlainTextResponse(f"invalid request: {exc.errors()[0]['msg']}", status_code=400)
    except CorralError as exc:
        return _refusal(exc)
    return await _Cell(stream).response()


async def create_context(request: Request) -> Response:
    svc = front_of(request).service
    try:
        sandbox_id, principal = await _caller(request)
        raw = await request.body()
        body = ContextRequest.model_validate_json(raw) if raw.strip() else ContextRequest.model_validate({})
        language = _language(body.language)
        cwd = absolute_path(body.cwd, what="cwd", default=HOME)
        made = await svc.code.create_context(principal, sandbox_id, language, cwd, show_saved_images=True)
    except ValidationError as exc:
        return PlainTextResponse(f"invalid request: {exc.errors()[0]['msg']}", status_code=400)
    except CorralError as exc:
        return _refusal(exc)
    return JSONResponse(_context_json(made))


async def list_contexts(request: Request) -> Response:
    svc = front_of(request).service
    try:
        sandbox_id, principal = await _caller(request)
        found = await svc.code.contexts(principal, sandbox_id, cwd=HOME, show_saved_images=True)
    except CorralError as exc:
        return _refusal(exc)
    return JSONResponse([_context_json(c) for c in found])


async def restart_context(request: Request) -> Response:
    return await _context_op(request, "restart")


async def remove_context(request: Request) -> Response:
    return await _context_op(request, "close")


async def _context_op(request: Request, operation: str) -> Response:
    svc = front_of(request).service
    try:
        sandbox_id, principal = await _caller(request)
        context_id = request.path_params["context_id"]
        await _known_context(request, sandbox_id, principal, context_id)
        op = svc.code.restart if operation == "restart" else svc.code.close
        await op(principal, sandbox_id, context_id)
    except CorralError as exc:
        return _refusal(exc)
    return Response(status_code=204)


async def _known_context(request: Request, sandbox_id: str, principal: Any, context_id: str) -> None:
    """E2B answers an unknown context with 404; restarting or closing one that never ran is no error here."""
    svc = front_of(request).service
    found = await svc.code.contexts(principal, sandbox_id, cwd=HOME, show_saved_images=True)
    if context_id not in {c.name for c in found}:
        raise NotFoundError(f"context {context_id!r} not found")


def _cell(body: ExecuteRequest) -> Cell:
    env = body.env_vars or None
    if body.context_id:
        return Cell(code=body.code, context=body.context_id, env=env)
    language = normalize_language(body.language or "python")
    if language in COMPILED_LANGUAGES:  # Corral's own: compiled and run, with no state between cells
        return Cell(code=body.code, language=language, env=env)
    # E2B's contexts run in the user's home and show images saved with PIL, as E2B's kernels do.
    return Cell(code=body.code, context=default_context(_language(body.language)), env=env, cwd=HOME,
                show_saved_images=True)


def _language(name: str | None) -> str:
    language = normalize_language(name or "python")
    if language not in SESSION_LANGUAGES:
        known = ", ".join([*SESSION_LANGUAGES, *COMPILED_LANGUAGES])
        raise InvalidRequestError(f"unknown language {name!r}: use one of {known} (or js, ts)")
    return language


def _context_json(context: CodeSession) -> dict[str, Any]:
    return {"id": context.name, "language": context.language, "cwd": context.cwd}


async def _caller(request: Request) -> tuple[str, Principal]:
    sandbox_id = _sandbox(request)
    return sandbox_id, await sandbox_caller(front_of(request).service, request, sandbox_id, ports=True)


def _refusal(exc: CorralError) -> Response:
    """Errors before a stream are plain text, as E2B's server answers them (the SDKs read 404 and the rest)."""
    return PlainTextResponse(exc.message, status_code=status_for(exc.code))


# Beside E2B's kernels, Corral compiles and runs these (docs/code.md): a cell is a whole program.
COMPILED_LANGUAGES = tuple(language for language in LANGUAGES if language not in SESSION_LANGUAGES)
_REFUSAL_WAIT = 2.0
_KEEPALIVE_EVERY = 30.0
_KEEPALIVE = b'{"type":"keepalive"}\n'


class _Cell:
    """A cell running for an `/execute` request: its NDJSON lines in a queue, fed by the stream's callbacks."""

    def __init__(self, stream: CodeStream) -> None:
        self.stream = stream
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}
        self.task = asyncio.create_task(self._run())

    def _text(self, name: str) -> OutputCallback:
        async def emit(chunk: bytes) -> None:
            text = self._decoders[name].decode(chunk)
            if text:
                await self.queue.put(_line({"type": name, "text": text, "timestamp": _now()}))
        return emit

    async def _result(self, result: RichResult) -> None:
        await self.queue.put(_line(result_json(result)))

    async def _run(self) -> None:
        try:
            result = await self.stream.run(on_stdout=self._text("stdout"), on_stderr=self._text("stderr"),
                                           on_result=self._result)
            for line in _ending(result):
                await self.queue.put(line)
        finally:
            await self.queue.put(None)

    async def response(self) -> Response:
        """The stream of lines; a cell refused before any output (an unknown context, a language the template
        lacks) is answered with its error's status instead, as E2B's server answers it."""
        try:  # a refusal comes within milliseconds; a quiet cell must not keep the answer's headers waiting
            async with asyncio.timeout(_REFUSAL_WAIT):
                first: bytes | None = await self.queue.get()
        except TimeoutError:
            first = _KEEPALIVE
        # A sandbox killed (or its agent lost) under a cell is no refusal, however soon it came: the stream is
        # cut, as E2B's is, and the SDK then asks whether the sandbox still runs to say it was killed.
        failed = self.task.exception() if first is None else None
        if failed is not None and not isinstance(failed, AgentError):
            await self.stream.close()
            if isinstance(failed, CorralError):
                return _refusal(failed)
            raise failed
        return StreamingResponse(self._lines(first), media_type="application/x-ndjson")

    async def _lines(self, first: bytes | None) -> AsyncIterator[bytes]:
        try:
            item = first
            while item is not None:
                yield item
                try:  # a line now and then keeps proxies from closing a quiet stream (the SDKs skip it)
                    async with asyncio.timeout(_KEEPALIVE_EVERY):
                        item = await self.queue.get()
                except TimeoutError:
                    item = _KEEPALIVE
            if (failed := self.task.exception()) is not None:
                raise failed  # after the stream began: cut, and the SDK asks /health whether the sandbox is gone
        finally:
            if not self.task.done():
                self.task.cancel()  # the client left: the cell is interrupted
            await self.stream.close()


def _ending(result: CodeResult) -> list[bytes]:
    lines = []
    if result.error is not None:
        lines.append(_line({"type": "error", "name": result.error.name, "value": result.error.value,
                            "traceback": result.error.traceback}))
    elif result.timed_out:
        lines.append(_line({"type": "error", "name": "TimeoutError", "value": "the cell timed out",
                            "traceback": ""}))
    count = result.execution_count
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
    app = Starlette(routes=[
        Route("/execute", execute, methods=["POST"]),
        Route("/contexts", create_context, methods=["POST"]),
        Route("/contexts", list_contexts, methods=["GET"]),
        Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
        Route("/contexts/{context_id}", remove_context, methods=["DELETE"]),
    ])
    app.state.front = front
    return app
