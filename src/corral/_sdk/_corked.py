"""The sync SDK's default transport: httpx's own, on connections that send a request's head and body together.

httpcore writes a request's head and its body in two sends: two packets, and two wakeups of the server (uvicorn
reads the head, starts the request, then waits for the body) for every call, a small part of a short command's
round trip through the API. Imported when the first client is made (httpx imports httpcore there too), never by
`import corral`.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

from ._tls import default_ssl_context

__all__ = ["corked_transport"]

_CORK_LIMIT = 64 * 1024  # bytes a corked stream holds back at most (an upload's big chunks go straight through)


class _CorkedStream(httpcore.NetworkStream):
    """A connection whose writes wait for the next read (or `_CORK_LIMIT` bytes), so that a request's head and its
    body leave in one send: one packet, and one wakeup of the server instead of two (httpcore writes them apart)."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream
        self._held: list[bytes] = []
        self._size = 0

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self._size + len(buffer) > _CORK_LIMIT:
            self._flush(timeout)
            if len(buffer) >= _CORK_LIMIT:
                self._stream.write(buffer, timeout)
                return
        self._held.append(buffer)
        self._size += len(buffer)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            self._flush(timeout)
        except httpcore.WriteError:
            pass  # as httpcore does: a server may have answered (a 413, say) before it closed; read that answer
        return self._stream.read(max_bytes, timeout)

    def _flush(self, timeout: float | None) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._size = 0
            self._stream.write(data, timeout)

    def close(self) -> None:
        self._held.clear()
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        self._flush(timeout)
        return _CorkedStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _CorkedBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _CorkedStream(self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _CorkedStream(self._backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def corked_transport() -> httpx.HTTPTransport:
    """httpx's default transport (what `httpx.Client()` makes: same TLS checks, limits, environment), on
    `_CorkedStream`s. httpx has no parameter for the network backend: its pool is made again with one."""
    transport = httpx.HTTPTransport(verify=default_ssl_context())
    pool = transport._pool
    if type(pool) is not httpcore.ConnectionPool:  # pragma: no cover - an httpx that builds it otherwise
        return transport
    limits = httpx.Limits()
    transport._pool = httpcore.ConnectionPool(
        ssl_context=pool._ssl_context, max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        http1=True, http2=False, network_backend=_CorkedBackend())
    return transport
