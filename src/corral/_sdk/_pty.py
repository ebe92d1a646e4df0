"""`sb.pty`: interactive terminals over the API's WebSocket (`docs/api.md`, "PTY (WebSocket)").

Bytes are bytes: keystrokes go out and terminal output comes back as binary frames, never decoded. The frame
handling (`_Frames`) and the error mapping do no I/O and are shared by `PtySession` (the `websockets` sync client)
and `AsyncPtySession` (its asyncio client). No websockets exception escapes: a close with code 4000 + status is
the error of that status, a failure to connect a `ConnectError`, a timeout a `TransportTimeoutError`, anything
else a `ServerError`, chained with `raise ... from`.

`websockets` (and `asyncio`) load with the first terminal, not with `import corral`: most SDK users never open
one, and the CLI starts faster without them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, overload

from .._exceptions import (
    ConnectError,
    CorralError,
    ServerError,
    TransportError,
    TransportTimeoutError,
    error_from_code,
)
from ._models import CommandResult
from ._processes import OutputCallback, _deliver
from ._transport import _STATUS_CODES, AsyncClient, SyncClient, _error_from_response, sandbox_path

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection as AsyncConnection
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import ClientConnection

__all__ = ["AsyncPty", "AsyncPtySession", "Pty", "PtySession"]

_MAX_MESSAGE = 16 * 1024 * 1024  # the server sends output in 64 KiB frames; this only guards against a runaway


def _ws_url(base_url: str, sandbox_id: str) -> str:
    scheme, sep, rest = base_url.partition("://")
    ws_scheme = {"http": "ws", "https": "wss"}.get(scheme.lower(), scheme)
    return f"{ws_scheme}{sep}{rest}{sandbox_path(sandbox_id, '/pty')}"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _start_frame(cmd: str | Sequence[str], rows: int, cols: int, cwd: str | None, env: Mapping[str, str] | None,
                 timeout: float | None, user: str | None = None) -> str:
    if isinstance(cmd, bytes | bytearray):
        raise TypeError("cmd must be a str (run by bash -lc) or a sequence of str (argv), not bytes")
    _check_size(rows, cols)
    frame = {"type": "start", "cmd": cmd if isinstance(cmd, str) else list(cmd), "rows": rows, "cols": cols,
             "cwd": cwd, "env": dict(env or {}), "timeout": timeout}
    return json.dumps(frame if user is None else {**frame, "user": user})


def _check_size(rows: int, cols: int) -> None:
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000:
            raise ValueError(f"{name} must be an int between 1 and 10000, not {value!r}")


def _resize_frame(rows: int, cols: int) -> str:
    _check_size(rows, cols)
    return json.dumps({"type": "resize", "rows": rows, "cols": cols})


def _keys(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    raise TypeError(f"send() takes bytes or str, not {type(data).__name__}")


def _closed_error(exc: ConnectionClosed) -> CorralError:
    """A close with code 4000 + an HTTP status is the error of that status; any other close a ServerError."""
    code = exc.rcvd.code if exc.rcvd is not None else None
    reason = exc.rcvd.reason if exc.rcvd is not None else ""
    if code is not None and 4000 <= code < 5000:
        error_code = _STATUS_CODES.get(code - 4000, "server_error")
        return error_from_code(error_code, reason or f"the terminal was closed with code {code}",
                               {"close_code": code})
    if code == 1000:
        return ServerError("the terminal session is over: its process ended and the server closed it",
                           details={"close_code": code})
    return ServerError(f"the terminal connection closed unexpectedly (close code {code})",
                       details={"close_code": code})


@contextlib.contextmanager
def _map_ws_errors(url: str) -> Iterator[None]:
    from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

    try:
        yield
    except ConnectionClosed as exc:
        raise _closed_error(exc) from exc
    except InvalidStatus as exc:  # refused before the upgrade: an HTTP error response
        response = exc.response
        raise _error_from_response(response.status_code, bytes(response.body or b""), response.headers) from exc
    except WebSocketException as exc:
        raise TransportError(f"WebSocket error talking to Corral at {url}: {type(exc).__name__}: {exc}",
                             details={"url": url, "transport_error": type(exc).__name__}) from exc
    except TimeoutError as exc:
        raise TransportTimeoutError(f"timed out opening a terminal at {url}",
                                    details={"url": url, "transport_error": type(exc).__name__}) from exc
    except OSError as exc:
        raise ConnectError(f"cannot connect to Corral at {url}: {exc}. Is `corral serve` running there?",
                           details={"url": url, "transport_error": type(exc).__name__}) from exc


def _closing_errors() -> tuple[type[Exception], ...]:
    """What closing a connection may raise once the peer is gone: nothing is left to do then."""
    from websockets.exceptions import WebSocketException

    return (WebSocketException, OSError)


class _Frames:
    """The state of one session, from the frames the server sent: ids, the exit result, errors."""

    def __init__(self) -> None:
        self.id = ""
        self.pid = 0
        self.result: CommandResult | None = None

    def handle(self, message: str | bytes) -> bytes | None:
        """Terminal output for a binary frame; None for a control frame (after acting on it)."""
        if isinstance(message, bytes):
            return message
        try:
            frame = json.loads(message)
        except ValueError as exc:
            raise ServerError("malformed response from Corral: a terminal text frame is not JSON") from exc
        kind = frame.get("type") if isinstance(frame, dict) else None
        if kind == "started":
            self.id, self.pid = str(frame.get("id") or ""), int(frame.get("pid") or 0)
        elif kind == "exit":
            self.result = CommandResult.from_wire(frame)
        elif kind == "error":
            raw = frame.get("error")
            error: dict[str, Any] = raw if isinstance(raw, dict) else {}
            raise error_from_code(str(error.get("code") or "server_error"),
                                  str(error.get("message") or "the terminal failed"),
                                  error.get("details") if isinstance(error.get("details"), dict) else None)
        return None  # unknown kinds are ignored, for forward compatibility


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _SessionBase:
    def __init__(self, frames: _Frames, url: str, on_data: OutputCallback | None) -> None:
        self._frames = frames
        self._url = url
        self._on_data = on_data

    @property
    def id(self) -> str:
        """The terminal's process id in the sandbox (it shows in `commands.list()`)."""
        return self._frames.id

    @property
    def pid(self) -> int:
        return self._frames.pid

    @property
    def result(self) -> CommandResult | None:
        """How the process ended (exit_code, signal, timed_out, killed); None while it runs. The output went to
        `on_data` or the iteration, so `stdout_bytes` is empty."""
        return self._frames.result

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, pid={self.pid})"


class PtySession(_SessionBase):
    """An interactive terminal: `send()` keystrokes, `resize()`, `wait()` (output goes to `on_data` meanwhile)
    or iterate over the output; `close()` hangs up (the process tree is killed). A context manager closes."""

    def __init__(self, ws: ClientConnection, frames: _Frames, url: str, on_data: OutputCallback | None) -> None:
        super().__init__(frames, url, on_data)
        self._ws = ws

    def send(self, data: bytes | str) -> None:
        """Keystrokes, as exact bytes (str is sent as UTF-8); `b"\\x03"` is Ctrl-C, `b"\\x04"` Ctrl-D."""
        with _map_ws_errors(self._url):
            self._ws.send(_keys(data))

    def resize(self, rows: int, cols: int) -> None:
        with _map_ws_errors(self._url):
            self._ws.send(_resize_frame(rows, cols))

    def kill(self) -> None:
        """SIGKILL the terminal's process tree; `wait()` then returns its result."""
        with _map_ws_errors(self._url):
            self._ws.send(json.dumps({"type": "kill"}))

    def _recv(self, timeout: float | None) -> bytes | None:
        """The next output chunk (b"" for a control frame); None when `timeout` passed first."""
        with _map_ws_errors(self._url):
            try:
                message = self._ws.recv(timeout)
            except TimeoutError:
                return None
        return self._frames.handle(message) or b""

    @overload
    def wait(self, timeout: None = None) -> CommandResult: ...
    @overload
    def wait(self, timeout: float) -> CommandResult | None: ...
    def wait(self, timeout: float | None = None) -> CommandResult | None:
        """Deliver output to `on_data` until the process ends and return how it ended; with `timeout` (seconds),
        None if it still runs then (call again to go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.result is None:
            chunk = self._recv(_remaining(deadline))
            if chunk is None:
                return None
            if chunk and self._on_data is not None:
                self._on_data(chunk)
        return self.result

    def __iter__(self) -> Iterator[bytes]:
        """Output chunks until the process ends (then `result` is set); `on_data` is not called for them."""
        while self.result is None:
            chunk = self._recv(None)
            if chunk:
                yield chunk

    def close(self) -> None:
        """Hang up: a process still running is killed. Safe to call twice."""
        with contextlib.suppress(*_closing_errors()):
            self._ws.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncPtySession(_SessionBase):
    """`PtySession`, awaited; `on_data` may be a plain function or a coroutine function."""

    def __init__(self, ws: AsyncConnection, frames: _Frames, url: str, on_data: OutputCallback | None) -> None:
        super().__init__(frames, url, on_data)
        self._ws = ws

    async def send(self, data: bytes | str) -> None:
        """Keystrokes, as exact bytes (str is sent as UTF-8); `b"\\x03"` is Ctrl-C, `b"\\x04"` Ctrl-D."""
        with _map_ws_errors(self._url):
            await self._ws.send(_keys(data))

    async def resize(self, rows: int, cols: int) -> None:
        with _map_ws_errors(self._url):
            await self._ws.send(_resize_frame(rows, cols))

    async def kill(self) -> None:
        """SIGKILL the terminal's process tree; `wait()` then returns its result."""
        with _map_ws_errors(self._url):
            await self._ws.send(json.dumps({"type": "kill"}))

    async def _recv(self, timeout: float | None) -> bytes | None:
        import asyncio  # loaded already: this coroutine runs in its loop

        try:
            async with asyncio.timeout(timeout):
                with _map_ws_errors(self._url):
                    message = await self._ws.recv()  # cancelling recv loses no message (websockets documents it)
        except TimeoutError:
            return None
        return self._frames.handle(message) or b""

    @overload
    async def wait(self, timeout: None = None) -> CommandResult: ...
    @overload
    async def wait(self, timeout: float) -> CommandResult | None: ...
    async def wait(self, timeout: float | None = None) -> CommandResult | None:
        """Deliver output to `on_data` until the process ends and return how it ended; with `timeout` (seconds),
        None if it still runs then (call again to go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.result is None:
            chunk = await self._recv(_remaining(deadline))
            if chunk is None:
                return None
            if chunk:
                await _deliver(self._on_data, chunk)
        return self.result

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Output chunks until the process ends (then `result` is set); `on_data` is not called for them."""
        while self.result is None:
            chunk = await self._recv(None)
            if chunk:
                yield chunk

    async def close(self) -> None:
        """Hang up: a process still running is killed. Safe to call twice."""
        with contextlib.suppress(*_closing_errors()):
            await self._ws.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class Pty:
    """`sb.pty`: start interactive terminals in the sandbox."""

    def __init__(self, client: SyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def create(
        self,
        cmd: str | Sequence[str] = "bash",
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        on_data: OutputCallback | None = None,
        user: str | None = None,
    ) -> PtySession:
        """Start `cmd` (`bash -lc` for a string, or an argv list) on a new terminal of `rows` x `cols`.

        `timeout` (seconds) bounds the process; None: it runs until it exits, is killed, or the session closes.
        `user="root"`: the terminal's process runs as root (a sandbox created with `root=True` only).
        """
        from websockets.sync.client import connect as sync_connect

        start = _start_frame(cmd, rows, cols, cwd, env, timeout, user)
        config = self._client.config
        url = _ws_url(config.base_url, self._sandbox_id)
        with _map_ws_errors(url):
            # legacy=True: the connection itself, owned (and closed) by the session rather than a `with` block
            ws = sync_connect(url, additional_headers=_headers(config.api_key), open_timeout=config.request_timeout,
                              max_size=_MAX_MESSAGE, legacy=True)
        session = PtySession(ws, _Frames(), url, on_data)
        try:
            with _map_ws_errors(url):
                ws.send(start)
                while not session.id:  # the first frame: `started`, or the error that refused the terminal
                    session._frames.handle(ws.recv(config.request_timeout))
        except BaseException:
            session.close()
            raise
        return session


class AsyncPty:
    """`sb.pty` of an `AsyncSandbox`."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    async def create(
        self,
        cmd: str | Sequence[str] = "bash",
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        on_data: OutputCallback | None = None,
        user: str | None = None,
    ) -> AsyncPtySession:
        """Start `cmd` on a new terminal (see `Pty.create`)."""
        import asyncio  # loaded already: this coroutine runs in its loop

        from websockets.asyncio.client import connect as async_connect

        start = _start_frame(cmd, rows, cols, cwd, env, timeout, user)
        config = self._client.config
        url = _ws_url(config.base_url, self._sandbox_id)
        with _map_ws_errors(url):
            ws = await async_connect(url, additional_headers=_headers(config.api_key),
                                     open_timeout=config.request_timeout, max_size=_MAX_MESSAGE)
        session = AsyncPtySession(ws, _Frames(), url, on_data)
        try:
            with _map_ws_errors(url):
                await ws.send(start)
                async with asyncio.timeout(config.request_timeout):
                    while not session.id:
                        session._frames.handle(await ws.recv())
        except BaseException:
            await session.close()
            raise
        return session
