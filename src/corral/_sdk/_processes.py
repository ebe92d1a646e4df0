"""Command output streams and background commands.

`_ExecStream` decodes the NDJSON that exec and attach both send (I/O-free). `CommandHandle` and
`AsyncCommandHandle` are background commands, from `commands.run(..., background=True)` or found again with
`commands.connect(id)`; `ProcessInfo` describes one in `commands.list()`. A handle holds no connection: the
command runs in the sandbox whether or not anyone waits for it, and ends by itself, at its timeout, when killed
or with the sandbox.
"""

from __future__ import annotations

import builtins
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload
from urllib.parse import quote

from .._exceptions import ServerError, error_from_code
from ._models import CommandResult, _b64
from ._transport import AsyncClient, SyncClient, json_dict, sandbox_path

__all__ = ["AsyncCommandHandle", "CommandHandle", "OutputCallback", "ProcessInfo"]

OutputCallback = Callable[[bytes], object]
Signal = int | str  # 15, "TERM" or "SIGTERM"
_STREAMS = ("stdout", "stderr")


class _ExecStream:
    """Decodes the NDJSON of a streamed exec or an attach into `(stream, bytes)` events and, at the end, the result.

    The `exit` event's `stdout_b64`/`stderr_b64` hold only what was not streamed before (the kept tail of truncated
    output); it is emitted as a last event too, so callbacks see exactly the bytes the result holds. An attach with a
    timeout may end with `running` instead: the command goes on, and there is no result yet.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._stdout = bytearray()
        self._stderr = bytearray()
        self.result: CommandResult | None = None
        self.running = False

    def feed(self, chunk: bytes) -> builtins.list[tuple[str, bytes]]:
        self._buffer += chunk
        events: builtins.list[tuple[str, bytes]] = []
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            events.extend(self._line(line))
        return events

    def end(self) -> tuple[builtins.list[tuple[str, bytes]], CommandResult | None]:
        """The last events and the result, or None when the stream ended with `running`."""
        events = self._line(bytes(self._buffer))
        self._buffer.clear()
        if self.result is None and not self.running:
            raise ServerError("the command's output stream ended before its exit event (connection lost?)")
        return events, self.result

    def finish(self) -> tuple[builtins.list[tuple[str, bytes]], CommandResult]:
        events, result = self.end()
        if result is None:
            raise ServerError("malformed response from Corral: an exec stream ended with 'running'")
        return events, result

    def _line(self, line: bytes) -> builtins.list[tuple[str, bytes]]:
        if not line.strip():
            return []
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise ServerError("malformed response from Corral: a stream line is not JSON") from exc
        if not isinstance(event, dict):
            raise ServerError("malformed response from Corral: a stream line is not a JSON object")
        kind = event.get("event")
        if kind in _STREAMS:
            data = _b64(event.get("data_b64"), f"{kind} data_b64")
            (self._stdout if kind == "stdout" else self._stderr).extend(data)
            return [(kind, data)] if data else []
        if kind == "exit":
            out, err = bytes(self._stdout), bytes(self._stderr)
            self.result = CommandResult.from_wire(event, stdout_prefix=out, stderr_prefix=err)
            tails = [("stdout", self.result.stdout_bytes[len(out) :]), ("stderr", self.result.stderr_bytes[len(err) :])]
            return [(k, d) for k, d in tails if d]
        if kind == "running":
            self.running = True
            return []
        if kind == "error":
            raw = event.get("error")
            error: dict[str, Any] = raw if isinstance(raw, dict) else {}
            raise error_from_code(
                str(error.get("code") or "server_error"),
                str(error.get("message") or "the command failed after its output began"),
                error.get("details") if isinstance(error.get("details"), dict) else None,
            )
        return []  # an event kind this SDK does not know yet: ignore it, for forward compatibility


async def _deliver(callback: OutputCallback | None, data: bytes) -> None:
    if callback is not None:
        result = callback(data)
        if inspect.isawaitable(result):
            await result


@dataclass(frozen=True)
class ProcessInfo:
    """A process in a sandbox, from `commands.list()`: background commands, and running commands and terminals.

    `cmd` is the command as given (a shell string, or the argv list); `exit_code` is set once it has ended
    (128 + the signal number when a signal ended it). `started_at` is an ISO 8601 time.
    """

    id: str
    pid: int
    cmd: str | builtins.list[str]
    argv: builtins.list[str]
    running: bool
    pty: bool = False
    started_at: str | None = None
    exit_code: int | None = None

    @classmethod
    def from_wire(cls, data: Any) -> ProcessInfo:
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ServerError("malformed response from Corral: expected a process object with an 'id'")
        argv = [str(a) for a in data.get("argv") or []]
        cmd = data.get("cmd")
        return cls(
            id=data["id"],
            pid=int(data.get("pid") or 0),
            cmd=cmd if isinstance(cmd, str) else [str(a) for a in cmd or argv],
            argv=argv,
            running=bool(data.get("running")),
            pty=bool(data.get("pty")),
            started_at=data.get("started_at"),
            exit_code=None if data.get("exit_code") is None else int(data["exit_code"]),
        )


def process_path(sandbox_id: str, process_id: str = "", suffix: str = "") -> str:
    tail = f"/{quote(process_id, safe='')}" if process_id else ""
    return sandbox_path(sandbox_id, f"/processes{tail}{suffix}")


def stdin_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"stdin data must be bytes or str, not {type(data).__name__}")


def kill_body(signal: Signal | None) -> dict[str, Any]:
    if isinstance(signal, bool) or not isinstance(signal, int | str | None):
        raise TypeError(f"signal must be a number or a name like 'SIGTERM', not {type(signal).__name__}")
    return {"signal": signal}


def _wait_params(timeout: float | None) -> dict[str, float]:
    if timeout is not None and timeout < 0:
        raise ValueError("timeout must be >= 0 seconds, or None to wait until the command ends")
    return {} if timeout is None else {"timeout": timeout}


def _wait_result(data: Any) -> CommandResult | None:
    body = json_dict(data, "a wait result")
    return None if body.get("running") else CommandResult.from_wire(body)


class _Delivered:
    """How many bytes of each stream the callbacks already got: every attach replays the output from its start,
    and a second `wait()` must not hand the callbacks the same bytes again. (Of output past `max_output` only the
    kept tail is replayed, so there the count can only approximate.)"""

    def __init__(self) -> None:
        self.given = dict.fromkeys(_STREAMS, 0)
        self.seen = dict.fromkeys(_STREAMS, 0)

    def restart(self) -> None:
        self.seen = dict.fromkeys(_STREAMS, 0)

    def fresh(self, kind: str, data: bytes) -> bytes:
        start = self.seen[kind]
        self.seen[kind] += len(data)
        skip = self.given[kind] - start
        if skip >= len(data):
            return b""
        self.given[kind] = self.seen[kind]
        return data[max(skip, 0) :]


class _HandleBase:
    """What both handles share without I/O."""

    def __init__(self, sandbox_id: str, process_id: str, pid: int, on_stdout: OutputCallback | None,
                 on_stderr: OutputCallback | None) -> None:
        self.id = process_id
        self.pid = pid
        self._sandbox_id = sandbox_id
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._delivered = _Delivered()
        self.result: CommandResult | None = None  # set once a wait saw the command end

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, pid={self.pid}, sandbox={self._sandbox_id!r})"

    def _path(self, suffix: str = "") -> str:
        return process_path(self._sandbox_id, self.id, suffix)

    @property
    def _streaming(self) -> bool:
        return any(cb is not None for cb in self._callbacks.values())

    def _done(self, result: CommandResult | None, timeout: float | None) -> CommandResult | None:
        if result is None and timeout is None:
            raise ServerError("malformed response from Corral: a wait without a timeout ended while still running")
        self.result = result
        return result


class CommandHandle(_HandleBase):
    """A background command: `wait()`, `kill()`, `send_stdin()`. Output goes to `on_stdout`/`on_stderr` while
    `wait()` runs (from the command's start, each byte once), and is in the result either way."""

    def __init__(self, client: SyncClient, sandbox_id: str, process_id: str, pid: int, *,
                 on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None) -> None:
        super().__init__(sandbox_id, process_id, pid, on_stdout, on_stderr)
        self._client = client

    @overload
    def wait(self, timeout: None = None) -> CommandResult: ...
    @overload
    def wait(self, timeout: float) -> CommandResult | None: ...
    def wait(self, timeout: float | None = None) -> CommandResult | None:
        """Wait for the command to end and return its result; with `timeout` (seconds), None if it still runs
        then (it goes on; wait again later). Never raises on exit != 0."""
        if self.result is not None:
            return self.result
        params = _wait_params(timeout)
        http_timeout = self._client.exec_timeout(timeout)
        if not self._streaming:
            return self._done(_wait_result(self._client.request("GET", self._path("/wait"), params=params,
                                                                timeout=http_timeout)), timeout)
        decoder = _ExecStream()
        self._delivered.restart()
        with self._client.stream("GET", self._path("/attach"), params=params, timeout=http_timeout) as response:
            for chunk in response.iter_bytes():
                for kind, data in decoder.feed(chunk):
                    self._emit(kind, data)
        events, result = decoder.end()
        for kind, data in events:
            self._emit(kind, data)
        return self._done(result, timeout)

    def _emit(self, kind: str, data: bytes) -> None:
        callback = self._callbacks[kind]
        if callback is not None and (fresh := self._delivered.fresh(kind, data)):
            callback(fresh)

    def kill(self, signal: Signal | None = None) -> None:
        """SIGKILL the command's whole process tree, or send `signal` (a number or a name) to its process group."""
        self._client.request("POST", self._path("/kill"), json=kill_body(signal))

    def send_stdin(self, data: bytes | str, *, eof: bool = False) -> None:
        """Write exact bytes to the command's stdin (it must be started with `stdin=True`); `eof` closes it."""
        self._client.request("POST", self._path("/stdin"), params={"eof": "true" if eof else "false"},
                             content=stdin_bytes(data))


class AsyncCommandHandle(_HandleBase):
    """`CommandHandle`, awaited. Callbacks may be plain functions or coroutine functions."""

    def __init__(self, client: AsyncClient, sandbox_id: str, process_id: str, pid: int, *,
                 on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None) -> None:
        super().__init__(sandbox_id, process_id, pid, on_stdout, on_stderr)
        self._client = client

    @overload
    async def wait(self, timeout: None = None) -> CommandResult: ...
    @overload
    async def wait(self, timeout: float) -> CommandResult | None: ...
    async def wait(self, timeout: float | None = None) -> CommandResult | None:
        """Wait for the command to end and return its result; with `timeout` (seconds), None if it still runs
        then (it goes on; wait again later). Never raises on exit != 0."""
        if self.result is not None:
            return self.result
        params = _wait_params(timeout)
        http_timeout = self._client.exec_timeout(timeout)
        if not self._streaming:
            data = await self._client.request("GET", self._path("/wait"), params=params, timeout=http_timeout)
            return self._done(_wait_result(data), timeout)
        decoder = _ExecStream()
        self._delivered.restart()
        async with self._client.stream("GET", self._path("/attach"), params=params, timeout=http_timeout) as response:
            async for chunk in response.aiter_bytes():
                for kind, data in decoder.feed(chunk):
                    await self._emit(kind, data)
        events, result = decoder.end()
        for kind, data in events:
            await self._emit(kind, data)
        return self._done(result, timeout)

    async def _emit(self, kind: str, data: bytes) -> None:
        if fresh := self._delivered.fresh(kind, data):
            await _deliver(self._callbacks[kind], fresh)

    async def kill(self, signal: Signal | None = None) -> None:
        """SIGKILL the command's whole process tree, or send `signal` (a number or a name) to its process group."""
        await self._client.request("POST", self._path("/kill"), json=kill_body(signal))

    async def send_stdin(self, data: bytes | str, *, eof: bool = False) -> None:
        """Write exact bytes to the command's stdin (it must be started with `stdin=True`); `eof` closes it."""
        await self._client.request("POST", self._path("/stdin"), params={"eof": "true" if eof else "false"},
                                   content=stdin_bytes(data))
