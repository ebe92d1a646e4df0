"""`sb.commands`: run commands in a sandbox, waiting for the result, streaming output to callbacks, or in the
background (a `CommandHandle` to wait for, feed, signal or find again later).

The request bodies are built I/O-free here, the NDJSON decoder lives in `_processes`; `Commands` and
`AsyncCommands` are thin twins written side by side.
"""

from __future__ import annotations

import base64
import builtins
from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from ._models import CommandResult
from ._processes import (
    AsyncCommandHandle,
    CommandHandle,
    OutputCallback,
    ProcessInfo,
    Signal,
    _deliver,
    _ExecStream,
    kill_body,
    process_path,
    stdin_bytes,
)
from ._transport import AsyncClient, SyncClient, json_dict, sandbox_path

__all__ = ["AsyncCommands", "Commands", "OutputCallback"]

Stdin = bytes | str | bool | None  # bytes to send (then EOF), or True: keep stdin open for send_stdin()


def _command(cmd: str | Sequence[str]) -> str | builtins.list[str]:
    if isinstance(cmd, bytes | bytearray):
        raise TypeError("cmd must be a str (run by bash -lc) or a sequence of str (argv), not bytes")
    return cmd if isinstance(cmd, str) else builtins.list(cmd)


def _stdin_b64(stdin: bytes | str | None) -> str | None:
    if stdin is None:
        return None
    try:
        return base64.b64encode(stdin_bytes(stdin)).decode("ascii")
    except TypeError:
        raise TypeError(f"stdin must be bytes or str, not {type(stdin).__name__}") from None


def _exec_body(
    cmd: str | Sequence[str],
    *,
    timeout: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: Stdin,
    stream: bool,
    user: str | None = None,
) -> dict[str, Any]:
    if isinstance(stdin, bool):
        raise ValueError("stdin=True keeps stdin open for send_stdin(), which needs background=True")
    return {
        "cmd": _command(cmd),
        "cwd": cwd,
        "env": dict(env or {}),
        "timeout": timeout,
        "stdin_b64": _stdin_b64(stdin),
        "stream": stream,
        **_as(user),
    }


def _start_body(
    cmd: str | Sequence[str], *, timeout: float | None, cwd: str | None, env: Mapping[str, str] | None, stdin: Stdin,
    user: str | None = None,
) -> dict[str, Any]:
    """A background command: stdin is /dev/null, the given bytes then EOF, or (True) a pipe kept open."""
    data = None if isinstance(stdin, bool) else stdin
    return {
        "cmd": _command(cmd),
        "cwd": cwd,
        "env": dict(env or {}),
        "timeout": timeout,
        "stdin": stdin is True,
        "stdin_b64": _stdin_b64(data),
        **_as(user),
    }


def _as(user: str | None) -> dict[str, str]:
    """Who runs the command, only when asked: a request of the sandbox user stays what it was."""
    return {} if user is None else {"user": user}


def _processes(data: Any) -> builtins.list[ProcessInfo]:
    return [ProcessInfo.from_wire(p) for p in json_dict(data, "a process list").get("processes", [])]


class Commands:
    """`sb.commands`: run commands in the sandbox."""

    def __init__(self, client: SyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    @overload
    def run(
        self, cmd: str | Sequence[str], *, timeout: float | None = ..., cwd: str | None = ...,
        env: Mapping[str, str] | None = ..., stdin: bytes | str | None = ..., on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ..., background: Literal[False] = ..., user: str | None = ...,
    ) -> CommandResult: ...
    @overload
    def run(
        self, cmd: str | Sequence[str], *, timeout: float | None = ..., cwd: str | None = ...,
        env: Mapping[str, str] | None = ..., stdin: Stdin = ..., on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ..., background: Literal[True], user: str | None = ...,
    ) -> CommandHandle: ...
    @overload
    def run(
        self, cmd: str | Sequence[str], *, timeout: float | None = ..., cwd: str | None = ...,
        env: Mapping[str, str] | None = ..., stdin: Stdin = ..., on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ..., background: bool = ..., user: str | None = ...,
    ) -> CommandResult | CommandHandle: ...
    def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 30,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        background: bool = False,
        user: str | None = None,
    ) -> CommandResult | CommandHandle:
        """Run `cmd` (a string for `bash -lc`, or an argv list) and wait for it. Never raises on exit != 0.

        With `on_stdout`/`on_stderr` the output is streamed and each callback gets the bytes as they arrive.
        With `background=True` it returns a `CommandHandle` at once; `timeout` still bounds the command (None: it
        runs until killed or the sandbox ends), callbacks get the output while `handle.wait()` runs, and
        `stdin=True` keeps stdin open for `handle.send_stdin()`. `user="root"` runs it as root, in a sandbox
        created with `root=True` (else `PermissionDeniedError`); by default it runs as the sandbox user.
        """
        if background:
            body = _start_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, user=user)
            info = ProcessInfo.from_wire(self._client.request("POST", process_path(self._sandbox_id), json=body))
            return CommandHandle(self._client, self._sandbox_id, info.id, info.pid, on_stdout=on_stdout,
                                 on_stderr=on_stderr)
        streaming = on_stdout is not None or on_stderr is not None
        body = _exec_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, stream=streaming, user=user)
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

    def list(self) -> builtins.list[ProcessInfo]:
        """The sandbox's processes: background commands (running, and the last ended ones), and the commands and
        terminals running now."""
        return _processes(self._client.request("GET", process_path(self._sandbox_id)))

    def connect(
        self, process_id: str, *, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None
    ) -> CommandHandle:
        """A handle on a process started earlier (`NotFoundError` if the sandbox has no such process)."""
        info = ProcessInfo.from_wire(self._client.request("GET", process_path(self._sandbox_id, process_id)))
        return CommandHandle(self._client, self._sandbox_id, info.id, info.pid, on_stdout=on_stdout,
                             on_stderr=on_stderr)

    def kill(self, process_id: str, *, signal: Signal | None = None) -> None:
        """SIGKILL a process's whole tree, or send `signal` (a number or a name like 'SIGTERM') to its group."""
        self._client.request("POST", process_path(self._sandbox_id, process_id, "/kill"), json=kill_body(signal))

    def send_stdin(self, process_id: str, data: bytes | str, *, eof: bool = False) -> None:
        """Write exact bytes to a background command started with `stdin=True`; `eof` closes its stdin."""
        self._client.request("POST", process_path(self._sandbox_id, process_id, "/stdin"),
                             params={"eof": "true" if eof else "false"}, content=stdin_bytes(data))


class AsyncCommands:
    """`sb.commands` of an `AsyncSandbox`. Callbacks may be plain functions or coroutine functions."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    @overload
    async def run(
        self, cmd: str | Sequence[str], *, timeout: float | None = ..., cwd: str | None = ...,
        env: Mapping[str, str] | None = ..., stdin: bytes | str | None = ..., on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ..., background: Literal[False] = ..., user: str | None = ...,
    ) -> CommandResult: ...
    @overload
    async def run(
        self, cmd: str | Sequence[str], *, timeout: float | None = ..., cwd: str | None = ...,
        env: Mapping[str, str] | None = ..., stdin: Stdin = ..., on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ..., background: Literal[True], user: str | None = ...,
    ) -> AsyncCommandHandle: ...
    @overload
    async def run(
        self, cmd: str | Sequence[str], *, timeout: float | None = ..., cwd: str | None = ...,
        env: Mapping[str, str] | None = ..., stdin: Stdin = ..., on_stdout: OutputCallback | None = ...,
        on_stderr: OutputCallback | None = ..., background: bool = ..., user: str | None = ...,
    ) -> CommandResult | AsyncCommandHandle: ...
    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = 30,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        background: bool = False,
        user: str | None = None,
    ) -> CommandResult | AsyncCommandHandle:
        """Run `cmd` (a string for `bash -lc`, or an argv list) and wait for it. Never raises on exit != 0.

        `background=True` returns an `AsyncCommandHandle` at once (see `Commands.run`).
        """
        if background:
            body = _start_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, user=user)
            info = ProcessInfo.from_wire(await self._client.request("POST", process_path(self._sandbox_id), json=body))
            return AsyncCommandHandle(self._client, self._sandbox_id, info.id, info.pid, on_stdout=on_stdout,
                                      on_stderr=on_stderr)
        streaming = on_stdout is not None or on_stderr is not None
        body = _exec_body(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin, stream=streaming, user=user)
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

    async def list(self) -> builtins.list[ProcessInfo]:
        """The sandbox's processes (see `Commands.list`)."""
        return _processes(await self._client.request("GET", process_path(self._sandbox_id)))

    async def connect(
        self, process_id: str, *, on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None
    ) -> AsyncCommandHandle:
        """A handle on a process started earlier (`NotFoundError` if the sandbox has no such process)."""
        info = ProcessInfo.from_wire(await self._client.request("GET", process_path(self._sandbox_id, process_id)))
        return AsyncCommandHandle(self._client, self._sandbox_id, info.id, info.pid, on_stdout=on_stdout,
                                  on_stderr=on_stderr)

    async def kill(self, process_id: str, *, signal: Signal | None = None) -> None:
        """SIGKILL a process's whole tree, or send `signal` (a number or a name like 'SIGTERM') to its group."""
        await self._client.request("POST", process_path(self._sandbox_id, process_id, "/kill"),
                                   json=kill_body(signal))

    async def send_stdin(self, process_id: str, data: bytes | str, *, eof: bool = False) -> None:
        """Write exact bytes to a background command started with `stdin=True`; `eof` closes its stdin."""
        await self._client.request("POST", process_path(self._sandbox_id, process_id, "/stdin"),
                                   params={"eof": "true" if eof else "false"}, content=stdin_bytes(data))
