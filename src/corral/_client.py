"""The Python SDK: `Sandbox` and `AsyncSandbox` over Corral's HTTP API (`docs/api.md`).

Laid out like httpx's `_client.py`: everything that does no I/O (configuration, request bodies, the error table,
the NDJSON decoder) lives in `_BaseClient` and module-level helpers; `_SyncClient` and `_AsyncClient` hold the
I/O; `Sandbox`/`AsyncSandbox` and their `commands`/`files` helpers are thin twins written side by side.

Errors: every failure is a `corral.CorralError`. An API error is rebuilt from the `code` in its body
(`{"error": {"code", "message", "details"}}`), falling back to `_STATUS_CODES` when the body has none; transport
failures (connection refused, timeouts, broken streams) become `ServerError` chained with `raise ... from`.
No httpx exception escapes.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import inspect
import io
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import IO, Any, Self
from urllib.parse import quote

import httpx

from ._config import DEFAULT_REQUEST_TIMEOUT, ConnectionConfig
from ._exceptions import CorralError, NotFoundError, SandboxTimeoutError, ServerError, error_from_code
from ._sdk_models import CommandResult, Entry, SandboxInfo, _b64

__all__ = ["AsyncCommands", "AsyncFiles", "AsyncSandbox", "Commands", "Files", "Sandbox"]

# The one status -> code table, the reverse of the server's (docs/api.md, "Errors"). Used only when an error
# response carries no code of its own (a proxy's HTML page, an empty body).
_STATUS_CODES: dict[int, str] = {
    400: "invalid_request",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    409: "conflict",
    410: "sandbox_timeout",
    422: "invalid_request",  # the API promises 400, but a framework default must not become a ServerError
    429: "quota_exceeded",
    500: "server_error",
    502: "agent_error",
    503: "runtime_unavailable",
    507: "disk_full",
}

_UPLOAD_CHUNK = 256 * 1024

OutputCallback = Callable[[bytes], object]
PathLike = str | os.PathLike[str]
WriteData = bytes | bytearray | memoryview | str | IO[bytes]


# --- I/O-free helpers -------------------------------------------------------------------------------------------


def _error_from_response(status: int, body: bytes, headers: Mapping[str, str]) -> CorralError:
    """The exception for an error response: the body's code if it has one, else the status table."""
    code: str | None = None
    message: str | None = None
    details: dict[str, Any] = {}
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error["code"] if isinstance(error.get("code"), str) else None
        message = error["message"] if isinstance(error.get("message"), str) else None
        details = dict(error["details"]) if isinstance(error.get("details"), dict) else {}
    if code is None:
        code = _STATUS_CODES.get(status, "server_error")
    if not message:
        text = body.decode("utf-8", errors="replace").strip()
        message = f"HTTP {status} from Corral" + (f": {text[:500]}" if text else "")
    details.setdefault("status", status)
    retry_after = headers.get("retry-after")
    if retry_after:
        details.setdefault("retry_after", retry_after)
    return error_from_code(code, message, details)


@contextlib.contextmanager
def _map_transport_errors(base_url: str) -> Iterator[None]:
    """Turn httpx's exceptions into `ServerError`s that say what failed and where (chained, never leaked)."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise ServerError(
            f"cannot connect to Corral at {base_url}: {exc or 'connection failed'}. "
            "Is `corral serve` running there? (set CORRAL_URL or pass base_url=)",
            details={"url": base_url, "transport_error": "connect"},
        ) from exc
    except httpx.TimeoutException as exc:
        raise ServerError(
            f"timed out talking to Corral at {base_url} ({type(exc).__name__})",
            details={"url": base_url, "transport_error": "timeout"},
        ) from exc
    except httpx.HTTPError as exc:
        raise ServerError(
            f"transport error talking to Corral at {base_url}: {type(exc).__name__}: {exc}",
            details={"url": base_url, "transport_error": type(exc).__name__},
        ) from exc
    except (httpx.InvalidURL, httpx.StreamError) as exc:
        raise ServerError(
            f"cannot send a request to Corral at {base_url}: {type(exc).__name__}: {exc}",
            details={"url": base_url, "transport_error": type(exc).__name__},
        ) from exc


def _sandbox_path(sandbox_id: str, suffix: str = "") -> str:
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"


def _json_dict(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ServerError(f"malformed response from Corral: expected a JSON object for {what}")
    return data


def _create_body(
    template: str,
    timeout: int | None,
    network: str | Sequence[str],
    limits: Mapping[str, Any] | None,
    env: Mapping[str, str] | None,
    metadata: Mapping[str, str] | None,
) -> dict[str, Any]:
    return {
        "template": template,
        "timeout": timeout,
        "network": network if isinstance(network, str) else builtins.list(network),
        "limits": dict(limits or {}),
        "env": dict(env or {}),
        "metadata": dict(metadata or {}),
    }


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


def _list_params(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {f"metadata.{key}": value for key, value in (metadata or {}).items()}


def _upload_kind(data: WriteData) -> bytes | IO[bytes]:
    """The bytes to send, or the binary file object to stream from."""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if isinstance(data, io.TextIOBase):
        raise TypeError("files.write needs a binary file object (open it with 'rb'), not a text file")
    if callable(getattr(data, "read", None)):
        return data
    raise TypeError(f"files.write takes bytes, str or a binary file object, not {type(data).__name__}")


def _check_chunk(chunk: Any) -> bytes:
    if not isinstance(chunk, bytes | bytearray | memoryview):
        raise TypeError(f"files.write: the file object returned {type(chunk).__name__}; open it in binary mode")
    return bytes(chunk)


def _iter_file(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := _check_chunk(f.read(_UPLOAD_CHUNK)):
        yield chunk


async def _aiter_file(f: Any) -> AsyncIterator[bytes]:
    while True:
        chunk = f.read(_UPLOAD_CHUNK)
        if inspect.isawaitable(chunk):  # an async file object (aiofiles, anyio)
            chunk = await chunk
        data = _check_chunk(chunk)
        if not data:
            return
        yield data


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


class _BaseClient:
    """What both clients share without doing I/O: the configuration and the per-call timeouts."""

    def __init__(self, config: ConnectionConfig) -> None:
        self.config = config

    def _client_options(self) -> dict[str, Any]:
        return {
            "base_url": self.config.base_url,
            "headers": self.config.headers(),
            "timeout": self.config.request_timeout,
        }

    def exec_timeout(self, command_timeout: float | None) -> httpx.Timeout:
        """A command may be silent for its whole timeout; wait that long plus the usual margin for a reply."""
        base = self.config.request_timeout
        if base is None:
            return httpx.Timeout(None)
        return httpx.Timeout(base, read=None if command_timeout is None else command_timeout + base)

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        if response.is_error:
            raise _error_from_response(response.status_code, response.content, response.headers)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise ServerError(f"malformed response from Corral: HTTP {response.status_code} body is not JSON") from exc


class _SyncClient(_BaseClient):
    def __init__(self, config: ConnectionConfig, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(config)
        self._http = httpx.Client(transport=transport, **self._client_options())

    def request(self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kwargs: Any) -> Any:
        if timeout is not None:
            kwargs["timeout"] = timeout
        with _map_transport_errors(self.config.base_url):
            response = self._http.request(method, path, **kwargs)
        return self._decode(response)

    @contextlib.contextmanager
    def stream(
        self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kwargs: Any
    ) -> Iterator[httpx.Response]:
        if timeout is not None:
            kwargs["timeout"] = timeout
        with _map_transport_errors(self.config.base_url), self._http.stream(method, path, **kwargs) as response:
            if response.is_error:
                response.read()
                raise _error_from_response(response.status_code, response.content, response.headers)
            yield response

    def close(self) -> None:
        self._http.close()


class _AsyncClient(_BaseClient):
    def __init__(self, config: ConnectionConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(config)
        self._http = httpx.AsyncClient(transport=transport, **self._client_options())

    async def request(self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kwargs: Any) -> Any:
        if timeout is not None:
            kwargs["timeout"] = timeout
        with _map_transport_errors(self.config.base_url):
            response = await self._http.request(method, path, **kwargs)
        return self._decode(response)

    @contextlib.asynccontextmanager
    async def stream(
        self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kwargs: Any
    ) -> AsyncIterator[httpx.Response]:
        if timeout is not None:
            kwargs["timeout"] = timeout
        with _map_transport_errors(self.config.base_url):
            async with self._http.stream(method, path, **kwargs) as response:
                if response.is_error:
                    await response.aread()
                    raise _error_from_response(response.status_code, response.content, response.headers)
                yield response

    async def close(self) -> None:
        await self._http.aclose()


# --- sync -------------------------------------------------------------------------------------------------------


class Commands:
    """`sb.commands`: run commands in the sandbox."""

    def __init__(self, client: _SyncClient, sandbox_id: str) -> None:
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
        path = _sandbox_path(self._sandbox_id, "/exec")
        http_timeout = self._client.exec_timeout(timeout)
        if not streaming:
            data = self._client.request("POST", path, json=body, timeout=http_timeout)
            return CommandResult.from_wire(_json_dict(data, "a command result"))
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


class Files:
    """`sb.files`: the sandbox's files, as exact bytes. Relative paths resolve against `/workspace`."""

    def __init__(self, client: _SyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def _path(self, suffix: str = "") -> str:
        return _sandbox_path(self._sandbox_id, "/files" + suffix)

    def write(self, path: PathLike, data: WriteData, *, mode: int | None = None) -> Entry:
        """Write `data` (bytes, str as UTF-8, or a binary file object, streamed in chunks) to `path`."""
        payload = _upload_kind(data)
        content = payload if isinstance(payload, bytes) else _iter_file(payload)
        params = {"path": os.fspath(path)} | ({} if mode is None else {"mode": str(mode)})
        headers = {"Content-Type": "application/octet-stream"}
        reply = _json_dict(
            self._client.request("PUT", self._path(), params=params, content=content, headers=headers), "a write"
        )
        return Entry.from_wire({"type": "file", **reply})

    def read(self, path: PathLike) -> bytes:
        """The file's exact bytes."""
        out = bytearray()
        with self._client.stream("GET", self._path(), params={"path": os.fspath(path)}) as response:
            for chunk in response.iter_bytes():
                out += chunk
        return bytes(out)

    def read_text(self, path: PathLike, *, encoding: str = "utf-8", errors: str = "replace") -> str:
        """The file as text; undecodable bytes are replaced unless `errors` says otherwise."""
        return self.read(path).decode(encoding, errors=errors)

    def list(self, path: PathLike) -> builtins.list[Entry]:
        data = _json_dict(self._client.request("GET", self._path("/list"), params={"path": os.fspath(path)}), "a list")
        return [Entry.from_wire(e) for e in data.get("entries", [])]

    def exists(self, path: PathLike) -> bool:
        data = self._client.request("GET", self._path("/exists"), params={"path": os.fspath(path)})
        return bool(_json_dict(data, "exists").get("exists"))

    def make_dir(self, path: PathLike) -> bool:
        """Create the directory (and its parents); `False` if it already existed."""
        data = self._client.request("POST", self._path("/mkdir"), json={"path": os.fspath(path)})
        return bool(_json_dict(data, "mkdir").get("created"))

    def remove(self, path: PathLike, *, recursive: bool = False) -> None:
        params = {"path": os.fspath(path)} | ({"recursive": "true"} if recursive else {})
        self._client.request("DELETE", self._path(), params=params)


class _SandboxBase:
    """What `Sandbox` and `AsyncSandbox` share that does no I/O."""

    def __init__(self, info: SandboxInfo) -> None:
        self._info = info
        self._killed = False

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        """The description from the last call that returned one (see `get_info()` for a fresh one)."""
        return self._info

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, template={self._info.template!r})"


class Sandbox(_SandboxBase):
    """A sandbox on a Corral server. Make one with `Sandbox.create()` or `Sandbox.connect()`.

    Used as a context manager, leaving the block kills the sandbox.
    """

    def __init__(self, info: SandboxInfo, client: _SyncClient) -> None:
        super().__init__(info)
        self._client = client
        self.commands = Commands(client, info.id)
        self.files = Files(client, info.id)

    @classmethod
    def create(
        cls,
        template: str = "default",
        *,
        timeout: int | None = 300,
        network: str | Sequence[str] = "none",
        limits: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> Sandbox:
        """Start a new sandbox. `timeout` is its time to live in seconds; `api_key`/`base_url` default to
        `$CORRAL_API_KEY`/`$CORRAL_URL`; `transport` is an httpx transport (for tests)."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        client = _SyncClient(config, transport)
        try:
            body = _create_body(template, timeout, network, limits, env, metadata)
            info = SandboxInfo.from_wire(client.request("POST", "/v1/sandboxes", json=body))
        except BaseException:
            client.close()
            raise
        return cls(info, client)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> Sandbox:
        """Attach to an existing sandbox (`NotFoundError` if it does not exist for this key)."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        client = _SyncClient(config, transport)
        try:
            info = SandboxInfo.from_wire(client.request("GET", _sandbox_path(sandbox_id)))
        except BaseException:
            client.close()
            raise
        return cls(info, client)

    @classmethod
    def list(
        cls,
        *,
        metadata: Mapping[str, str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The caller's tenant's sandboxes, optionally only those whose metadata has every given KEY=VALUE."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        client = _SyncClient(config, transport)
        try:
            data = _json_dict(client.request("GET", "/v1/sandboxes", params=_list_params(metadata)), "a list")
        finally:
            client.close()
        return [SandboxInfo.from_wire(s) for s in data.get("sandboxes", [])]

    def get_info(self) -> SandboxInfo:
        self._info = SandboxInfo.from_wire(self._client.request("GET", _sandbox_path(self.id)))
        return self._info

    def set_timeout(self, seconds: int) -> SandboxInfo:
        """Let the sandbox live `seconds` from now."""
        data = self._client.request("POST", _sandbox_path(self.id, "/timeout"), json={"timeout": seconds})
        self._info = SandboxInfo.from_wire(data)
        return self._info

    def kill(self) -> None:
        """Destroy the sandbox now, and close this object's connection."""
        if self._killed:
            return
        try:
            self._client.request("DELETE", _sandbox_path(self.id))
            self._killed = True
        finally:
            self._client.close()

    def close(self) -> None:
        """Close the connection; the sandbox keeps running until its timeout (reattach with `connect`)."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._killed:
            self._client.close()
            return
        with contextlib.suppress(NotFoundError, SandboxTimeoutError):  # already gone: the goal is met
            self.kill()


# --- async ------------------------------------------------------------------------------------------------------


async def _deliver(callback: OutputCallback | None, data: bytes) -> None:
    if callback is not None:
        result = callback(data)
        if inspect.isawaitable(result):
            await result


class AsyncCommands:
    """`sb.commands` of an `AsyncSandbox`. Callbacks may be plain functions or coroutine functions."""

    def __init__(self, client: _AsyncClient, sandbox_id: str) -> None:
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
        path = _sandbox_path(self._sandbox_id, "/exec")
        http_timeout = self._client.exec_timeout(timeout)
        if not streaming:
            data = await self._client.request("POST", path, json=body, timeout=http_timeout)
            return CommandResult.from_wire(_json_dict(data, "a command result"))
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


class AsyncFiles:
    """`sb.files` of an `AsyncSandbox`."""

    def __init__(self, client: _AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self._sandbox_id = sandbox_id

    def _path(self, suffix: str = "") -> str:
        return _sandbox_path(self._sandbox_id, "/files" + suffix)

    async def write(self, path: PathLike, data: WriteData, *, mode: int | None = None) -> Entry:
        """Write `data` (bytes, str as UTF-8, or a binary file object, sync or async, streamed) to `path`."""
        payload = _upload_kind(data)
        content = payload if isinstance(payload, bytes) else _aiter_file(payload)
        params = {"path": os.fspath(path)} | ({} if mode is None else {"mode": str(mode)})
        headers = {"Content-Type": "application/octet-stream"}
        reply = await self._client.request("PUT", self._path(), params=params, content=content, headers=headers)
        return Entry.from_wire({"type": "file", **_json_dict(reply, "a write")})

    async def read(self, path: PathLike) -> bytes:
        out = bytearray()
        async with self._client.stream("GET", self._path(), params={"path": os.fspath(path)}) as response:
            async for chunk in response.aiter_bytes():
                out += chunk
        return bytes(out)

    async def read_text(self, path: PathLike, *, encoding: str = "utf-8", errors: str = "replace") -> str:
        return (await self.read(path)).decode(encoding, errors=errors)

    async def list(self, path: PathLike) -> builtins.list[Entry]:
        data = await self._client.request("GET", self._path("/list"), params={"path": os.fspath(path)})
        return [Entry.from_wire(e) for e in _json_dict(data, "a list").get("entries", [])]

    async def exists(self, path: PathLike) -> bool:
        data = await self._client.request("GET", self._path("/exists"), params={"path": os.fspath(path)})
        return bool(_json_dict(data, "exists").get("exists"))

    async def make_dir(self, path: PathLike) -> bool:
        data = await self._client.request("POST", self._path("/mkdir"), json={"path": os.fspath(path)})
        return bool(_json_dict(data, "mkdir").get("created"))

    async def remove(self, path: PathLike, *, recursive: bool = False) -> None:
        params = {"path": os.fspath(path)} | ({"recursive": "true"} if recursive else {})
        await self._client.request("DELETE", self._path(), params=params)


class AsyncSandbox(_SandboxBase):
    """`Sandbox`, awaited: `async with await AsyncSandbox.create() as sb: await sb.commands.run("ls")`."""

    def __init__(self, info: SandboxInfo, client: _AsyncClient) -> None:
        super().__init__(info)
        self._client = client
        self.commands = AsyncCommands(client, info.id)
        self.files = AsyncFiles(client, info.id)

    @classmethod
    async def create(
        cls,
        template: str = "default",
        *,
        timeout: int | None = 300,
        network: str | Sequence[str] = "none",
        limits: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        client = _AsyncClient(config, transport)
        try:
            body = _create_body(template, timeout, network, limits, env, metadata)
            info = SandboxInfo.from_wire(await client.request("POST", "/v1/sandboxes", json=body))
        except BaseException:
            await client.close()
            raise
        return cls(info, client)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        client = _AsyncClient(config, transport)
        try:
            info = SandboxInfo.from_wire(await client.request("GET", _sandbox_path(sandbox_id)))
        except BaseException:
            await client.close()
            raise
        return cls(info, client)

    @classmethod
    async def list(
        cls,
        *,
        metadata: Mapping[str, str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[SandboxInfo]:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout)
        client = _AsyncClient(config, transport)
        try:
            data = await client.request("GET", "/v1/sandboxes", params=_list_params(metadata))
        finally:
            await client.close()
        return [SandboxInfo.from_wire(s) for s in _json_dict(data, "a list").get("sandboxes", [])]

    async def get_info(self) -> SandboxInfo:
        self._info = SandboxInfo.from_wire(await self._client.request("GET", _sandbox_path(self.id)))
        return self._info

    async def set_timeout(self, seconds: int) -> SandboxInfo:
        data = await self._client.request("POST", _sandbox_path(self.id, "/timeout"), json={"timeout": seconds})
        self._info = SandboxInfo.from_wire(data)
        return self._info

    async def kill(self) -> None:
        if self._killed:
            return
        try:
            await self._client.request("DELETE", _sandbox_path(self.id))
            self._killed = True
        finally:
            await self._client.close()

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._killed:
            await self._client.close()
            return
        with contextlib.suppress(NotFoundError, SandboxTimeoutError):
            await self.kill()
