"""A response of known length leaves uvicorn's socket corked from its head to its body (`server._packets`)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from starlette.types import Message

from corral.server._packets import one_packet

pytestmark = pytest.mark.anyio


class FakeSocket:
    def __init__(self, family: int = socket.AF_INET) -> None:
        self.family = family
        self.log: list[Any] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        assert (level, option) == (socket.IPPROTO_TCP, socket.TCP_CORK)
        self.log.append(("cork", value))


class FakeTransport:
    def __init__(self, sock: FakeSocket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None


class Cycle:
    """Stands for uvicorn's RequestResponseCycle: its `send` is a bound method, its `transport` the connection's."""

    def __init__(self, sock: FakeSocket) -> None:
        self.transport = FakeTransport(sock)
        self.sock = sock

    async def send(self, message: Message) -> None:
        self.sock.log.append(message["type"])


def start(*headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http.response.start", "status": 200, "headers": list(headers)}


BODY = {"type": "http.response.body", "body": b"{}"}


async def test_a_response_of_known_length_is_corked_from_its_head_to_its_body() -> None:
    sock = FakeSocket()
    send = one_packet(Cycle(sock).send)
    assert send is not None
    await send(start((b"content-type", b"application/json"), (b"content-length", b"2")))
    await send(BODY)
    send.release()  # nothing left to release
    assert sock.log == [("cork", 1), "http.response.start", "http.response.body", ("cork", 0)]


async def test_a_streamed_response_is_never_held_back() -> None:
    sock = FakeSocket()
    send = one_packet(Cycle(sock).send)
    assert send is not None
    await send(start((b"content-type", b"application/x-ndjson")))
    await send({**BODY, "more_body": True})
    await send(BODY)
    assert sock.log == ["http.response.start", "http.response.body", "http.response.body"]


async def test_a_head_whose_body_is_late_is_not_held_back() -> None:
    """A proxied port's upstream may be slow to send the body: the head leaves at the loop's next turn."""
    sock = FakeSocket()
    send = one_packet(Cycle(sock).send)
    assert send is not None
    await send(start((b"Content-Length", b"2")))
    assert sock.log == [("cork", 1), "http.response.start"]
    await asyncio.sleep(0)
    assert sock.log == [("cork", 1), "http.response.start", ("cork", 0)]
    await send(BODY)
    assert sock.log[-1] == "http.response.body"


async def test_a_response_that_never_got_its_body_is_released() -> None:
    sock = FakeSocket()
    send = one_packet(Cycle(sock).send)
    assert send is not None
    await send(start((b"Content-Length", b"2")))
    send.release()  # the app failed after the head: what was sent must not wait for a body that never comes
    assert sock.log == [("cork", 1), "http.response.start", ("cork", 0)]
    await asyncio.sleep(0)  # the scheduled release finds nothing to do
    assert sock.log == [("cork", 1), "http.response.start", ("cork", 0)]


async def test_other_servers_and_unix_sockets_keep_their_send() -> None:
    async def plain(message: Message) -> None:
        pass

    assert one_packet(plain) is None  # a test's ASGI transport, another server
    assert one_packet(Cycle(FakeSocket(socket.AF_UNIX)).send) is None
