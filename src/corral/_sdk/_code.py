"""`sb.run_code()` and `sb.code`: cells run in stateful sessions in the sandbox, like a notebook (docs/code.md).

What comes back is an `Execution`: output bytes, rich `Result`s (images as bytes, HTML, text, ...) and the
cell's `ExecutionError`, if it raised. A failing cell is a result, never an exception; errors of the request
(unknown sandbox or language, a lost connection) raise `CorralError`s as every call does.

The SDK asks for binary frames (`application/vnd.corral.frames`: output as raw bytes, docs/api.md) and reads
JSON or NDJSON from a server that does not send them. The request body, the wire models and the decoder do no
I/O; `CodeInterpreter` and `AsyncCodeInterpreter` are thin twins written side by side.
"""

from __future__ import annotations

import base64
import builtins
import inspect
import json as _json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from .._exceptions import CorralError, ServerError, error_from_code
from .._output import OutputText
from ._models import _b64, _opt_int
from ._processes import OutputCallback
from ._transport import AsyncClient, SyncClient, json_dict, sandbox_path

__all__ = [
    "AsyncCodeInterpreter",
    "CodeInterpreter",
    "CodeSessionInfo",
    "Execution",
    "ExecutionError",
    "Result",
    "ResultCallback",
]

ResultCallback = Callable[["Result"], object]  # may return an awaitable with AsyncSandbox

# MIME type -> attribute of `Result`, in the order a viewer would prefer them (IPython's display order).
_FORMATS = {
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/svg+xml": "svg",
    "text/html": "html",
    "text/markdown": "markdown",
    "text/latex": "latex",
    "application/json": "json",
    "text/plain": "text",
}
_BINARY = frozenset({"image/png", "image/jpeg"})


@dataclass(frozen=True, repr=False)
class Result:
    """One rich result of a cell: the value of its last expression (`is_main_result`), a `display()`ed object,
    or a matplotlib figure. Each format it came in is an attribute, None when absent; `data` holds them all
    as sent (images base64), other MIME types included."""

    is_main_result: bool = False
    text: str | None = None  # text/plain: repr() of the object
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    latex: str | None = None
    json: Any = None  # application/json, parsed
    png: bytes | None = None
    jpeg: bytes | None = None
    data: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, raw: Any) -> Result:
        body = json_dict(raw, "a code result")
        data = body.get("data")
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ServerError("malformed response from Corral: a code result's data is not a map of strings")
        fields: dict[str, Any] = {}
        for mime, name in _FORMATS.items():
            if mime in data:
                fields[name] = _decode(mime, data[mime])
        return cls(is_main_result=bool(body.get("is_main_result")), data=dict(data), **fields)

    def formats(self) -> builtins.list[str]:
        """The formats present, best first: `["png", "text"]`; MIME types without an attribute as they are."""
        named = [name for mime, name in _FORMATS.items() if mime in self.data]
        return named + [mime for mime in self.data if mime not in _FORMATS]

    def __repr__(self) -> str:  # never the whole image or page
        return f"Result(formats={self.formats()!r}, is_main_result={self.is_main_result!r})"


def _decode(mime: str, value: str) -> Any:
    if mime in _BINARY:
        return _b64(value, mime)
    if mime == "application/json":
        try:
            return _json.loads(value)
        except ValueError as exc:
            raise ServerError("malformed response from Corral: an application/json result is not JSON") from exc
    return value


@dataclass(frozen=True)
class ExecutionError:
    """What the cell raised: the exception's class name, its message and the traceback text. Not raised."""

    name: str
    value: str
    traceback: str

    @classmethod
    def from_wire(cls, raw: Any) -> ExecutionError | None:
        if raw is None:
            return None
        body = json_dict(raw, "a code error")
        return cls(name=str(body.get("name") or ""), value=str(body.get("value") or ""),
                   traceback=str(body.get("traceback") or ""))


@dataclass(frozen=True)
class Execution(OutputText):
    """The outcome of one cell. Never raised: an exception in the cell is `error`, a timeout or an OOM kill
    are flags.

    **Fields:**

    * `results` - rich results in the order produced; `text` is the main result's text/plain.
    * `stdout_bytes`, `stderr_bytes` - the exact bytes (`stdout`, `stderr`: text views, never raising).
    * `error` - the cell's exception (`name`, `value`, `traceback`), or None; the session's state survives it.
    * `timed_out`, `oom_killed` - how the cell ended, if not by itself; `session_restarted`: the session was
      killed on the way (its state is gone).
    * `truncated` - a stream went over `max_output` (16 MiB unless the call said): `stdout_bytes`/`stderr_bytes`
      hold its first three quarters and last quarter, `stdout_cut`/`stderr_cut` the offset where the middle was
      left out, `stdout_size`/`stderr_size` count every byte. Never with callbacks: they get every byte.
    """

    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    results: tuple[Result, ...] = ()
    error: ExecutionError | None = None
    session: str = "default"
    language: str = "python"
    timed_out: bool = False
    oom_killed: bool = False
    session_restarted: bool = False
    duration: float = 0.0
    truncated: bool = False
    stdout_size: int = 0
    stderr_size: int = 0
    stdout_cut: int | None = None
    stderr_cut: int | None = None
    checkpoint: str | None = None  # the automatic checkpoint taken before the cell (`checkpoints="auto"`)

    @property
    def main_result(self) -> Result | None:
        return next((r for r in self.results if r.is_main_result), None)

    @property
    def text(self) -> str | None:
        """The main result's text/plain (`"2"` for `1+1`), None when the cell ended without a value."""
        main = self.main_result
        return None if main is None else main.text

    @classmethod
    def from_wire(cls, raw: Any, *, stdout_prefix: bytes = b"", stderr_prefix: bytes = b"",
                  results: tuple[Result, ...] = ()) -> Execution:
        """Build from the API's result (or a stream's `end` event, after what the stream already carried)."""
        body = json_dict(raw, "a code execution")
        wire_results = body.get("results") or []
        if not isinstance(wire_results, list):
            raise ServerError("malformed response from Corral: a code execution's results is not a list")
        stdout = stdout_prefix + _b64(body.get("stdout_b64"), "stdout_b64")
        stderr = stderr_prefix + _b64(body.get("stderr_b64"), "stderr_b64")
        return cls(
            stdout_bytes=stdout,
            stderr_bytes=stderr,
            truncated=bool(body.get("truncated")),
            stdout_size=_opt_int(body.get("stdout_size")) or len(stdout),
            stderr_size=_opt_int(body.get("stderr_size")) or len(stderr),
            stdout_cut=_opt_int(body.get("stdout_cut")),
            stderr_cut=_opt_int(body.get("stderr_cut")),
            results=results + tuple(Result.from_wire(r) for r in wire_results),
            error=ExecutionError.from_wire(body.get("error")),
            session=str(body.get("session") or "default"),
            language=str(body.get("language") or ""),
            timed_out=bool(body.get("timed_out")),
            oom_killed=bool(body.get("oom_killed")),
            session_restarted=bool(body.get("session_restarted")),
            duration=float(body.get("duration") or 0.0),
            checkpoint=body.get("checkpoint") if isinstance(body.get("checkpoint"), str) else None,
        )


@dataclass(frozen=True)
class CodeSessionInfo:
    """A running code session in a sandbox (`sb.code.sessions()`)."""

    name: str
    language: str
    pid: int | None = None
    started_at: str | None = None

    @classmethod
    def from_wire(cls, raw: Any) -> CodeSessionInfo:
        body = json_dict(raw, "a code session")
        pid = body.get("pid")
        return cls(name=str(body.get("name") or ""), language=str(body.get("language") or ""),
                   pid=None if pid is None else int(pid), started_at=body.get("started_at"))


Event = tuple[str, "bytes | Result"]  # ("stdout" | "stderr", bytes) or ("result", Result)

FRAMES = "application/vnd.corral.frames"
_FRAME_HEADER = struct.Struct(">IB")  # u32 length (of kind and payload) | u8 kind
_FRAME_KINDS = {1: "stdout", 2: "stderr", 3: "event"}


def _accept(stream: bool) -> dict[str, str]:
    """Frames first; the format a server without them sends otherwise."""
    return {"Accept": f"{FRAMES}, {'application/x-ndjson' if stream else 'application/json'}"}


def _is_frames(response: httpx.Response) -> bool:
    return str(response.headers.get("content-type", "")).split(";")[0].strip().lower() == FRAMES


class _CodeStream:
    """Decodes a cell's output, binary frames or NDJSON lines, into events as they come and, at the `end` event,
    the `Execution` (which holds every streamed byte and result too).

    A failure (an `error` event, a malformed line or frame) is raised by `finish()`, after the events before it
    were handed out: the callbacks see all the output that arrived, even when it came in one chunk with the error.
    """

    def __init__(self, *, frames: bool = False) -> None:
        self._frames = frames
        self._buffer = bytearray()
        self._stdout: builtins.list[bytes] = []
        self._stderr: builtins.list[bytes] = []
        self._results: builtins.list[Result] = []
        self.execution: Execution | None = None
        self._failure: CorralError | None = None

    def feed(self, chunk: bytes) -> builtins.list[Event]:
        events: builtins.list[Event] = []
        if self._failure is not None or self.execution is not None:  # nothing counts after the end
            return events
        try:
            if self._frames:
                self._feed_frames(chunk, events)
            else:
                self._feed_lines(chunk, events)
        except CorralError as exc:
            self._failure = exc
        return events

    def finish(self) -> tuple[builtins.list[Event], Execution]:
        if self._failure is not None:
            raise self._failure
        events = [] if self._frames or self.execution is not None else self._line(bytes(self._buffer))
        self._buffer.clear()
        if self.execution is None:
            raise ServerError("the cell's output stream ended before its end event (connection lost?)")
        return events, self.execution

    def _feed_lines(self, chunk: bytes, events: builtins.list[Event]) -> None:
        self._buffer += chunk
        while self.execution is None and (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            events.extend(self._line(line))

    def _feed_frames(self, chunk: bytes, events: builtins.list[Event]) -> None:
        """Whole frames are read from the chunk itself (a body read at once is copied only into its payloads);
        only an incomplete frame's bytes wait in the buffer for the next chunk."""
        if self._buffer:
            self._buffer += chunk
            used = self._frames_in(self._buffer, events)
            del self._buffer[:used]
        else:
            used = self._frames_in(chunk, events)
            self._buffer += chunk[used:]

    def _frames_in(self, data: bytes | bytearray, events: builtins.list[Event]) -> int:
        """Decode the whole frames at the start of `data`; how many bytes they took."""
        pos = 0
        with memoryview(data) as view:
            while len(view) - pos >= _FRAME_HEADER.size:
                length, kind = _FRAME_HEADER.unpack_from(view, pos)
                if length < 1:
                    raise ServerError("malformed response from Corral: a frame of length 0")
                end = pos + 4 + length
                if end > len(view):
                    break
                payload = bytes(view[pos + _FRAME_HEADER.size:end])
                pos = end
                events.extend(self._frame(kind, payload))
                if self.execution is not None:  # nothing counts after the end
                    break
        return pos

    def _frame(self, kind: int, payload: bytes) -> builtins.list[Event]:
        name = _FRAME_KINDS.get(kind)
        if name == "event":
            try:
                event = _json.loads(payload)
            except ValueError as exc:
                raise ServerError("malformed response from Corral: an event frame is not JSON") from exc
            return self._event(json_dict(event, "an event frame"))
        if name is not None:
            return self._output(name, payload)
        return []  # a frame kind this SDK does not know yet: skip it, for forward compatibility

    def _line(self, line: bytes) -> builtins.list[Event]:
        if not line.strip():
            return []
        try:
            event = _json.loads(line)
        except ValueError as exc:
            raise ServerError("malformed response from Corral: a stream line is not JSON") from exc
        event = json_dict(event, "a stream line")
        kind = event.get("event")
        if kind in ("stdout", "stderr"):
            return self._output(kind, _b64(event.get("data_b64"), f"{kind} data_b64"))
        return self._event(event)

    def _output(self, kind: str, data: bytes) -> builtins.list[Event]:
        (self._stdout if kind == "stdout" else self._stderr).append(data)
        return [(kind, data)] if data else []

    def _event(self, event: dict[str, Any]) -> builtins.list[Event]:
        kind = event.get("event")
        if kind == "result":
            result = Result.from_wire(event.get("result"))
            self._results.append(result)
            return [("result", result)]
        if kind == "end":
            return self._end(event)
        if kind == "error":
            raise _stream_error(event.get("error"))
        return []  # an event kind this SDK does not know yet: ignore it, for forward compatibility

    def _end(self, event: dict[str, Any]) -> builtins.list[Event]:
        """The execution, and as last events whatever the `end` event carries that was not streamed before."""
        out, err, results = b"".join(self._stdout), b"".join(self._stderr), tuple(self._results)
        self.execution = Execution.from_wire(event, stdout_prefix=out, stderr_prefix=err, results=results)
        tails: builtins.list[Event] = [("stdout", self.execution.stdout_bytes[len(out):]),
                                       ("stderr", self.execution.stderr_bytes[len(err):])]
        extra: builtins.list[Event] = [("result", r) for r in self.execution.results[len(results):]]
        return [(k, d) for k, d in tails if d] + extra


def _execution(response: httpx.Response) -> Execution:
    """A whole response's `Execution`: frames, or the JSON result of a server that does not send frames."""
    if _is_frames(response):
        decoder = _CodeStream(frames=True)
        decoder.feed(response.content)
        return decoder.finish()[1]
    try:
        data = response.json()
    except ValueError as exc:
        raise ServerError(f"malformed response from Corral: HTTP {response.status_code} body is not JSON") from exc
    return Execution.from_wire(data)


def _stream_error(raw: Any) -> CorralError:
    error: dict[str, Any] = raw if isinstance(raw, dict) else {}
    details = error.get("details")
    return error_from_code(str(error.get("code") or "server_error"),
                           str(error.get("message") or "the cell failed after its output began"),
                           details if isinstance(details, dict) else None)


def _code_body(code: str, *, language: str, session: str | None, timeout: float | None,
               stream: bool, stdin: bytes | str | None = None, max_output: int | None = None) -> dict[str, Any]:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, not {type(code).__name__}")
    body = {"code": code, "language": language, "session": session, "timeout": timeout, "stream": stream}
    if max_output is not None:
        body["max_output"] = max_output
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        body["stdin_b64"] = base64.b64encode(data).decode()
    return body


def _session_path(sandbox_id: str, name: str = "", action: str = "") -> str:
    tail = f"/{quote(name, safe='')}" if name else ""
    return sandbox_path(sandbox_id, f"/code/sessions{tail}{action}")


def _sessions(data: Any) -> builtins.list[CodeSessionInfo]:
    found = json_dict(data, "a code session list").get("sessions") or []
    return [CodeSessionInfo.from_wire(s) for s in found]


class _Callbacks:
    """Where each kind of stream event goes."""

    def __init__(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None,
                 on_result: ResultCallback | None) -> None:
        self.by_kind: dict[str, Callable[[Any], object] | None] = {
            "stdout": on_stdout, "stderr": on_stderr, "result": on_result}

    @property
    def any(self) -> bool:
        return any(cb is not None for cb in self.by_kind.values())

    def deliver(self, kind: str, value: bytes | Result) -> None:
        if (callback := self.by_kind[kind]) is not None:
            callback(value)

    async def adeliver(self, kind: str, value: bytes | Result) -> None:
        if (callback := self.by_kind[kind]) is not None and inspect.isawaitable(result := callback(value)):
            await result


class CodeInterpreter:
    """`sb.code`: run cells and manage the sandbox's code sessions."""

    def __init__(self, client: SyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def run(
        self,
        code: str,
        *,
        language: str = "python",
        session: str | None = None,
        timeout: float | None = 60,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
        stdin: bytes | str | None = None,
        max_output: int | None = None,
    ) -> Execution:
        """Run `code` in `session` and wait for it; the session keeps its state for the next call. None: the
        language's own default session (`"default"` for python, the language's name for the others, so a
        javascript cell never lands in the python session). Never raises for a failing cell: see
        `Execution.error`, `.timed_out`, `.oom_killed`.

        With callbacks the cell's output is streamed: `on_stdout`/`on_stderr` get bytes as they are written,
        `on_result` each `Result` as it is produced. `timeout` (seconds, None: none) interrupts the cell.
        Without them, `max_output` bytes of each stream are kept (None: the server's 16 MiB; see
        `Execution.truncated`).
        """
        callbacks = _Callbacks(on_stdout, on_stderr, on_result)
        body = _code_body(code, language=language, session=session, timeout=timeout, stream=callbacks.any,
                          stdin=stdin, max_output=max_output)
        path = sandbox_path(self._sandbox_id, "/code")
        http_timeout = self._client.exec_timeout(timeout)
        headers = _accept(callbacks.any)
        if not callbacks.any:
            return _execution(self._client.send("POST", path, json=body, timeout=http_timeout, headers=headers))
        with self._client.stream("POST", path, json=body, timeout=http_timeout, headers=headers) as response:
            decoder = _CodeStream(frames=_is_frames(response))
            for chunk in response.iter_bytes():
                for kind, value in decoder.feed(chunk):
                    callbacks.deliver(kind, value)
        events, execution = decoder.finish()
        for kind, value in events:
            callbacks.deliver(kind, value)
        return execution

    def sessions(self) -> builtins.list[CodeSessionInfo]:
        """The sandbox's running code sessions."""
        return _sessions(self._client.request("GET", _session_path(self._sandbox_id)))

    def interrupt(self, name: str = "default") -> None:
        """Interrupt the cell running in session `name` (KeyboardInterrupt in it); its state survives."""
        self._client.request("POST", _session_path(self._sandbox_id, name, "/interrupt"))

    def restart(self, name: str = "default") -> None:
        """Restart session `name` with a fresh process: its variables and imports are gone."""
        self._client.request("POST", _session_path(self._sandbox_id, name, "/restart"))

    def close(self, name: str = "default") -> None:
        """End session `name`; the next cell sent to that name starts a new one."""
        self._client.request("DELETE", _session_path(self._sandbox_id, name))


class AsyncCodeInterpreter:
    """`sb.code` of an `AsyncSandbox`. Callbacks may be plain functions or coroutine functions."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    async def run(
        self,
        code: str,
        *,
        language: str = "python",
        session: str | None = None,
        timeout: float | None = 60,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
        stdin: bytes | str | None = None,
        max_output: int | None = None,
    ) -> Execution:
        """Run `code` in `session` and wait for it (see `CodeInterpreter.run`)."""
        callbacks = _Callbacks(on_stdout, on_stderr, on_result)
        body = _code_body(code, language=language, session=session, timeout=timeout, stream=callbacks.any,
                          stdin=stdin, max_output=max_output)
        path = sandbox_path(self._sandbox_id, "/code")
        http_timeout = self._client.exec_timeout(timeout)
        headers = _accept(callbacks.any)
        if not callbacks.any:
            return _execution(await self._client.send("POST", path, json=body, timeout=http_timeout,
                                                      headers=headers))
        async with self._client.stream("POST", path, json=body, timeout=http_timeout, headers=headers) as response:
            decoder = _CodeStream(frames=_is_frames(response))
            async for chunk in response.aiter_bytes():
                for kind, value in decoder.feed(chunk):
                    await callbacks.adeliver(kind, value)
        events, execution = decoder.finish()
        for kind, value in events:
            await callbacks.adeliver(kind, value)
        return execution

    async def sessions(self) -> builtins.list[CodeSessionInfo]:
        """The sandbox's running code sessions."""
        return _sessions(await self._client.request("GET", _session_path(self._sandbox_id)))

    async def interrupt(self, name: str = "default") -> None:
        """Interrupt the cell running in session `name` (KeyboardInterrupt in it); its state survives."""
        await self._client.request("POST", _session_path(self._sandbox_id, name, "/interrupt"))

    async def restart(self, name: str = "default") -> None:
        """Restart session `name` with a fresh process: its variables and imports are gone."""
        await self._client.request("POST", _session_path(self._sandbox_id, name, "/restart"))

    async def close(self, name: str = "default") -> None:
        """End session `name`; the next cell sent to that name starts a new one."""
        await self._client.request("DELETE", _session_path(self._sandbox_id, name))
