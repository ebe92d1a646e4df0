"""The sync SDK's connections send a request's head and body together (`corral._sdk._corked`)."""

from __future__ import annotations

import socket
import threading

import httpcore
import httpx

from corral._sdk._corked import _CORK_LIMIT, _CorkedStream, corked_transport


class Recorder(httpcore.NetworkStream):
    """A connection that keeps what was sent, each send apart, and answers reads from a script."""

    def __init__(self, answers: list[bytes], fail_writes: bool = False) -> None:
        self.sends: list[bytes] = []
        self.answers = answers
        self.fail_writes = fail_writes

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if self.fail_writes:
            raise httpcore.WriteError("broken pipe")
        self.sends.append(buffer)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.answers.pop(0) if self.answers else b""

    def close(self) -> None:
        pass


def test_head_and_body_leave_in_one_send_before_the_answer_is_read() -> None:
    inner = Recorder([b"answer"])
    stream = _CorkedStream(inner)
    stream.write(b"POST / HTTP/1.1\r\n\r\n")
    stream.write(b'{"cmd": "true"}')
    stream.write(b"")
    assert inner.sends == []
    assert stream.read(100) == b"answer"
    assert inner.sends == [b'POST / HTTP/1.1\r\n\r\n{"cmd": "true"}']


def test_big_bodies_are_not_held() -> None:
    inner = Recorder([])
    stream = _CorkedStream(inner)
    head, chunk = b"head", b"x" * _CORK_LIMIT
    stream.write(head)
    stream.write(chunk)  # the head goes first, then the chunk as it is, never copied into a held buffer
    assert inner.sends == [head, chunk]
    stream.write(b"tail")
    stream.read(10)
    assert inner.sends == [head, chunk, b"tail"]


def test_a_failed_send_still_reads_the_servers_answer() -> None:
    """As httpcore does: a server may answer (413) and close before taking the whole request."""
    stream = _CorkedStream(Recorder([b"HTTP/1.1 413"], fail_writes=True))
    stream.write(b"request")
    assert stream.read(100) == b"HTTP/1.1 413"


def test_a_real_request_arrives_in_one_segment_and_is_answered() -> None:
    """Through the SDK's transport to a plain socket server: the whole request is there at the first recv."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    first: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = conn.recv(65536)
            first.append(data)
            while b'"ok"' not in data:  # (only if it came apart: the assertion below then fails)
                data += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with httpx.Client(transport=corked_transport(), base_url=f"http://127.0.0.1:{port}") as client:
            assert client.post("/x", json={"ok": True}).json() == {}
    finally:
        thread.join(10)
        server.close()
    assert first[0].startswith(b"POST /x HTTP/1.1\r\n") and first[0].endswith(b'{"ok":true}')


def test_every_client_shares_one_tls_context() -> None:
    """Building the root store took ~20 ms per `Sandbox` (each has a client): one context, made once, serves all."""
    from corral._sdk._config import ConnectionConfig
    from corral._sdk._tls import default_ssl_context
    from corral._sdk._transport import AsyncClient, SyncClient

    config = ConnectionConfig.resolve(api_key="k", base_url="https://corral.example", request_timeout=5)
    sync_clients, async_clients = [SyncClient(config) for _ in range(2)], [AsyncClient(config) for _ in range(2)]
    contexts = {id(c._http._transport._pool._ssl_context) for c in sync_clients}  # type: ignore[attr-defined]
    contexts |= {id(c._http._transport._pool._ssl_context) for c in async_clients}  # type: ignore[attr-defined]
    assert contexts == {id(default_ssl_context())}
    assert default_ssl_context().verify_mode.name == "CERT_REQUIRED" and default_ssl_context().check_hostname
    for c in sync_clients:
        c.close()
