"""The SDK's HTTP layer: the error table, httpx error mapping, and the sync and async clients.

Laid out like httpx's `_client.py`: everything that does no I/O (configuration, timeouts, the error table) lives in
`_BaseClient` and module-level helpers; `SyncClient` and `AsyncClient` hold the I/O.

Errors: every failure is a `corral.CorralError`. An API error is rebuilt from the `code` in its body
(`{"error": {"code", "message", "details"}}`), falling back to `_STATUS_CODES` when the body has none; transport
failures become a `corral.TransportError` (`ConnectError`: nothing reached the server; `TransportTimeoutError`:
no answer in time; a broken connection or stream: `TransportError` itself) through `_TRANSPORT_ERRORS`, chained
with `raise ... from`. No httpx exception escapes.

`asyncio` is imported only by the coroutines that need it (which run in a loop that already loaded it), so that
`import corral` stays light for the CLI and sync users.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any
from urllib.parse import quote

import httpx

from .._exceptions import (
    ConnectError,
    CorralError,
    ServerError,
    TransportError,
    TransportTimeoutError,
    error_from_code,
)
from ._config import ConnectionConfig
from ._tls import default_ssl_context

__all__ = ["UPLOAD_CHUNK", "AsyncBufferBody", "AsyncClient", "BufferBody", "SyncClient", "json_dict", "sandbox_path",
           "transport_error"]

# The largest piece of a request body handed to httpx at once (see `BufferBody`).
UPLOAD_CHUNK = 256 * 1024

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


_HINT = "Is `corral serve` running there? (set CORRAL_URL or pass base_url=)"

# Every transport exception httpx has -> (ours, message). Looked up along the raised exception's MRO, so one that a
# later httpx adds lands on its parent's entry; tests/test_sdk_defects.py fails until it is named here.
_TRANSPORT_ERRORS: dict[type[httpx.TransportError], tuple[type[TransportError], str]] = {
    httpx.ConnectError: (ConnectError, "cannot connect to Corral at {url}: {exc}. " + _HINT),
    httpx.ProxyError: (ConnectError, "cannot connect to Corral at {url} through the proxy: {exc}"),
    httpx.UnsupportedProtocol: (ConnectError, "cannot connect to Corral at {url}: {exc} (use http:// or https://)"),
    httpx.ConnectTimeout: (TransportTimeoutError, "timed out talking to Corral at {url} (ConnectTimeout: no "
                                                  "connection). " + _HINT),
    httpx.ReadTimeout: (TransportTimeoutError, "timed out talking to Corral at {url} (ReadTimeout: no answer in "
                                               "time; the request may have been carried out)"),
    httpx.WriteTimeout: (TransportTimeoutError, "timed out talking to Corral at {url} (WriteTimeout: the request "
                                                "could not be sent in time)"),
    httpx.PoolTimeout: (TransportTimeoutError, "timed out talking to Corral at {url} (PoolTimeout: no free "
                                               "connection in time)"),
    httpx.TimeoutException: (TransportTimeoutError, "timed out talking to Corral at {url} ({name})"),
    httpx.ReadError: (TransportError, "the connection to Corral at {url} broke while reading: {exc}"),
    httpx.WriteError: (TransportError, "the connection to Corral at {url} broke while sending: {exc}"),
    httpx.CloseError: (TransportError, "the connection to Corral at {url} failed to close: {exc}"),
    httpx.NetworkError: (TransportError, "network error talking to Corral at {url}: {name}: {exc}"),
    httpx.RemoteProtocolError: (TransportError, "Corral at {url} broke the HTTP protocol (a proxy in between, or "
                                                "the connection ended early?): {exc}"),
    httpx.LocalProtocolError: (TransportError, "cannot send this request to Corral at {url}: {exc}"),
    httpx.ProtocolError: (TransportError, "HTTP protocol error talking to Corral at {url}: {name}: {exc}"),
    httpx.TransportError: (TransportError, "transport error talking to Corral at {url}: {name}: {exc}"),
}


def transport_error(exc: httpx.TransportError, url: str) -> TransportError:
    """Ours for one of httpx's transport exceptions (the caller chains it with `raise ... from exc`)."""
    cls, message = next(_TRANSPORT_ERRORS[c] for c in type(exc).__mro__ if c in _TRANSPORT_ERRORS)
    text = message.format(url=url, name=type(exc).__name__, exc=str(exc) or type(exc).__name__)
    return cls(text, details={"url": url, "transport_error": type(exc).__name__})


@contextlib.contextmanager
def _map_transport_errors(base_url: str) -> Iterator[None]:
    """Turn httpx's exceptions into Corral errors that say what failed and where (chained, never leaked)."""
    try:
        yield
    except httpx.TransportError as exc:
        raise transport_error(exc, base_url) from exc
    except httpx.HTTPError as exc:  # a malformed answer (DecodingError) or TooManyRedirects: the server's fault
        raise ServerError(
            f"unexpected answer from Corral at {base_url}: {type(exc).__name__}: {exc}",
            details={"url": base_url, "transport_error": type(exc).__name__},
        ) from exc
    except (httpx.InvalidURL, httpx.StreamError) as exc:
        raise ServerError(
            f"cannot send a request to Corral at {base_url}: {type(exc).__name__}: {exc}",
            details={"url": base_url, "transport_error": type(exc).__name__},
        ) from exc


def sandbox_path(sandbox_id: str, suffix: str = "") -> str:
    return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"


def json_dict(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ServerError(f"malformed response from Corral: expected a JSON object for {what}")
    return data


class BufferBody:
    """A bytes-like request body (with its length, for Content-Length), sent in `UPLOAD_CHUNK` slices.

    Why slices: given one large buffer, httpcore's sync stream copies the unsent rest of it after every
    `send()` (`buffer = buffer[n:]`), and asyncio's transport moves its unsent rest down a bytearray after
    every send: both quadratic in the body's size (100 MiB of bytes uploaded at a quarter of the speed of the
    same bytes from a file object, which was always read in chunks). The slices are memoryviews of the caller's
    buffer: nothing is copied before h11 frames each one. Unlike a generator it can be sent again (a retry).
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        self._view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())

    def __len__(self) -> int:
        return self._view.nbytes

    def __iter__(self) -> Iterator[memoryview]:
        view = self._view
        for start in range(0, view.nbytes, UPLOAD_CHUNK):
            yield view[start:start + UPLOAD_CHUNK]


class AsyncBufferBody:
    """A `BufferBody` for the async client (httpx takes an async body only as an async iterable)."""

    def __init__(self, body: BufferBody) -> None:
        self._body = body

    def __len__(self) -> int:
        return len(self._body)

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        for piece in self._body:
            yield piece


_RETRIED_STATUSES = frozenset({429, 503})
_BACKOFF_BASE = 0.5


class _BaseClient:
    """What both clients share without doing I/O: the configuration and the per-call timeouts."""

    def __init__(self, config: ConnectionConfig) -> None:
        self.config = config

    def _client_options(self) -> dict[str, Any]:
        return {
            "base_url": self.config.base_url,
            "headers": self.config.headers(),
            "timeout": self.config.request_timeout,
            "verify": default_ssl_context(),
        }

    def exec_timeout(self, command_timeout: float | None) -> httpx.Timeout:
        """A command may be silent for its whole timeout; wait that long plus the usual margin for a reply."""
        base = self.config.request_timeout
        if base is None:
            return httpx.Timeout(None)
        return httpx.Timeout(base, read=None if command_timeout is None else command_timeout + base)

    def retry_delay(self, response: httpx.Response, attempt: int, kwargs: dict[str, Any]) -> float | None:
        """Seconds to wait before sending the request again, or None to give the answer to the caller.

        Only 429 (quota) and 503 (capacity, runtime) are retried: the API promises they changed nothing. The wait
        is the server's `Retry-After`, else (503 only) a short exponential backoff: a 429 without one is a quota
        that waiting does not free (snapshots, volumes, paused sandboxes, one sandbox's limits). A `Retry-After`
        longer than `retry_max_wait` is the caller's decision (the error carries it), and a body streamed from a
        file object or an iterator cannot be sent twice (a `BufferBody` can).
        """
        if response.status_code not in _RETRIED_STATUSES or attempt >= self.config.max_retries:
            return None
        if not isinstance(kwargs.get("content"), bytes | BufferBody | AsyncBufferBody | None):
            return None
        try:
            wait = float(response.headers["retry-after"])
        except (KeyError, ValueError):
            if response.status_code == 429:
                return None
            wait = _BACKOFF_BASE * 2**attempt
        return wait if 0 <= wait <= self.config.retry_max_wait else None

    @staticmethod
    def _ok(response: httpx.Response) -> httpx.Response:
        if response.is_error:
            raise _error_from_response(response.status_code, response.content, response.headers)
        return response

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise ServerError(f"malformed response from Corral: HTTP {response.status_code} body is not JSON") from exc


class SyncClient(_BaseClient):
    def __init__(self, config: ConnectionConfig, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(config)
        self.transport = transport  # kept for the clients of sandboxes this one makes (`fork`)
        if transport is None:
            from ._corked import corked_transport  # httpcore: loaded by httpx's first client anyway, not by `import`

            # Proxies from the environment are mounted by httpx beside this transport, as beside its own.
            transport = corked_transport()
        self._http = httpx.Client(transport=transport, **self._client_options())

    def request(self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kwargs: Any) -> Any:
        return self._decode(self.send(method, path, timeout=timeout, **kwargs))

    def send(self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kwargs: Any) -> httpx.Response:
        """The response, read whole and retried as `request` does, for a caller that decodes its body itself (an
        error status raises, as `request` does)."""
        if timeout is not None:
            kwargs["timeout"] = timeout
        for attempt in itertools.count():
            with _map_transport_errors(self.config.base_url):
                response = self._http.request(method, path, **kwargs)
            delay = self.retry_delay(response, attempt, kwargs)
            if delay is None:
                break
            time.sleep(delay)
        return self._ok(response)

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


class AsyncClient(_BaseClient):
    def __init__(self, config: ConnectionConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(config)
        self.transport = transport
        self._http = httpx.AsyncClient(transport=transport, **self._client_options())

    async def request(self, method: str, path: str, *, timeout: httpx.Timeout | None = None, **kwargs: Any) -> Any:
        return self._decode(await self.send(method, path, timeout=timeout, **kwargs))

    async def send(self, method: str, path: str, *, timeout: httpx.Timeout | None = None,
                   **kwargs: Any) -> httpx.Response:
        """The response, read whole and retried as `request` does, for a caller that decodes its body itself (an
        error status raises, as `request` does)."""
        if timeout is not None:
            kwargs["timeout"] = timeout
        for attempt in itertools.count():
            with _map_transport_errors(self.config.base_url):
                response = await self._http.request(method, path, **kwargs)
            delay = self.retry_delay(response, attempt, kwargs)
            if delay is None:
                break
            import asyncio  # loaded already: this coroutine runs in its loop

            await asyncio.sleep(delay)
        return self._ok(response)

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
