"""`sb.commands`: run commands in a sandbox, waiting for the result or streaming output to callbacks.

The NDJSON decoder (`_ExecStream`) and the request body are I/O-free and shared by `Commands` and
`AsyncCommands`, which are thin twins written side by side.
"""

from __future__ import annotations

import base64
import builtins
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._exceptions import ServerError, error_from_code
from ._models import CommandResult, _b64
from ._transport import AsyncClient, SyncClient, json_dict, sandbox_path

__all__ = ["AsyncCommands", "Commands", "OutputCallback"]

OutputCallback = Callable[[bytes], object]


def _exec_body(
    cmd: str | Sequence[str],
    *,
    timeout: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: bytes | str | None,
    stream: bool,
) -> dict[str, Any]:
    if isinstance(cmd, bytes | bytearray):
        raise TypeError("cmd must be a str (run by bash -lc) or a sequence of str (argv), not bytes")
    if isinstance(stdin, str):
        stdin = stdin.encode("utf-8")
    elif stdin is not None and not isinstance(stdin, bytes | bytearray | memoryview):
        raise TypeError(f"stdin must be bytes or str, not {type(stdin).__name__}")
    return {
        "cmd": cmd if isinstance(cmd, str) else builtins.list(cmd),
        "cwd": cwd,
        "env": dict(env or {}),
        "timeout": timeout,
        "stdin_b64": None if stdin is None else base64.b64encode(stdin).decode("ascii"),
        "stream": stream,
    }


class _ExecStream:
    """Decodes the NDJSON of a streamed exec into `(stream, bytes)` events and, at the end, the result.

    The `exit` event's `stdout_b64`/`stderr_b64` hold only what was not streamed before (the kept tail of truncated
    output); it is emitted as a last event too, so callbacks see exactly the bytes the result holds.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._stdout = bytearray()
        self._stderr = bytearray()
        self.result: CommandResult | None = None

    def feed(self, chunk: bytes) -> builtins.list[tuple[str, bytes]]:
        self._buffer += chunk
        events: builtins.list[tuple[str, bytes]] = []
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            events.extend(self._line(line))
        return events

    def finish(self) -> tuple[builtins.list[tuple[str, bytes]], CommandResult]:
        events = self._line(bytes(self._buffer))
        self._buffer.clear()
        if self.result is None:
            raise ServerError("the command's output stream ended before its exit event (connection lost?)")
        return events, self.result

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
        if kind in ("stdout", "stderr"):
            data = _b64(event.get("data_b64"), f"{kind} data_b64")
            (self._stdout if kind == "stdout" else self._stderr).extend(data)
            return [(kind, data)] if data else []
        if kind == "exit":
            out, err = bytes(self._stdout), bytes(self._stderr)
            self.result = CommandResult.from_wire(event, stdout_prefix=out, stderr_prefix=err)
            tails = [("stdout", self.result.stdout_bytes[len(out) :]), ("stderr", self.result.stderr_bytes[len(err) :])]
            return [(k, d) for k, d in tails if d]
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


class Commands:
    """`sb.commands`: run commands in the sandbox."""

    def __init__(self, client: SyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 30,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult:
        """Run `cmd` (a string for `bash -lc`, or an argv list) and wait for it. Never raises on exit != 0.

        With `on_stdout`/`on_stderr` the output is streamed and each callback gets the bytes as they arrive.
        """
        streaming = on_stdout is not None or on_stderr is not None
        body = _exec_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, stream=streaming)
        path = sandbox_path(self._sandbox_id, "/exec")
        http_timeout = self._client.exec_timeout(timeout)
        if not streaming:
            data = self._client.request("POST", path, json=body, timeout=http_timeout)
            return CommandResult.from_wire(json_dict(data, "a command result"))
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        decoder = _ExecStream()
        with self._client.stream("POST", path, json=body, timeout=http_timeout) as response:
            for chunk in response.iter_bytes():
                for kind, data in decoder.feed(chunk):
                    if (callback := callbacks[kind]) is not None:
                        callback(data)
        events, result = decoder.finish()
        for kind, data in events:
            if (callback := callbacks[kind]) is not None:
                callback(data)
        return result


class AsyncCommands:
    """`sb.commands` of an `AsyncSandbox`. Callbacks may be plain functions or coroutine functions."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 30,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult:
        """Run `cmd` (a string for `bash -lc`, or an argv list) and wait for it. Never raises on exit != 0."""
        streaming = on_stdout is not None or on_stderr is not None
        body = _exec_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, stream=streaming)
        path = sandbox_path(self._sandbox_id, "/exec")
        http_timeout = self._client.exec_timeout(timeout)
        if not streaming:
            data = await self._client.request("POST", path, json=body, timeout=http_timeout)
            return CommandResult.from_wire(json_dict(data, "a command result"))
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        decoder = _ExecStream()
        async with self._client.stream("POST", path, json=body, timeout=http_timeout) as response:
            async for chunk in response.aiter_bytes():
                for kind, data in decoder.feed(chunk):
                    await _deliver(callbacks[kind], data)
        events, result = decoder.finish()
        for kind, data in events:
            await _deliver(callbacks[kind], data)
        return result
