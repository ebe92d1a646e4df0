"""`Forwarding`: absolute-form HTTP (`GET http://host/path`) to a host no secret is bound to: one request upstream in
origin form, hop-by-hop headers dropped, its response back, heads parsed here and bodies copied socket to socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from . import _reasons as reasons
from ._connection_base import ConnectionBase, give_back, take_buffered
from ._http import (
    HOP_BY_HOP,
    BadMessage,
    Framing,
    Head,
    HeadTooLarge,
    SocketReader,
    framing,
    parse_status,
)
from ._mover import Mover, Stall
from ._proxied import Attempt
from ._reasons import Refusal


class Forwarding(ConnectionBase):
    """The forwarding of plain HTTP requests, one part of a `Connection`."""

    async def _forward(self, head: Head, request_body: Framing, host: str, port: int, path: str,
                       attempt: Attempt) -> bool:
        """One request upstream, its response back: heads parsed here, bodies copied socket to socket (a host a
        secret is bound to goes through `Interception` instead)."""
        upstream = await self._open(host, port, attempt)
        stall = Stall(self.proxy.io_timeout)  # anything moving either way, request body included, counts

        def sent(n: int) -> None:
            attempt.count_down(n)
            self.responded = True  # from the first byte the client has, a failure can only close the connection

        up, down = Mover(attempt.count_up, stall), Mover(sent, stall)
        body_task: asyncio.Task[None] | None = None
        try:
            async with stall:
                await up.send(upstream, _upstream_head(head, host, port, path))
                if request_body.chunked or request_body.length:
                    # Concurrently with the response: a server may answer (or send 100 Continue) before the body.
                    body_task = asyncio.create_task(self._request_body(upstream, request_body, up))
                try:
                    keep = await self._relay_response(head, SocketReader(upstream), down, attempt)
                except Refusal:
                    _raise_body_fault(body_task)  # why the server got no whole request, and so gave no response
                    raise
                if body_task is not None:
                    keep = keep and body_task.done() and not body_task.cancelled() and body_task.exception() is None
                return keep
        except TimeoutError:
            doing = "talking to" if self.responded else "waiting for"
            raise reasons.upstream_timeout(doing, host, port, self.proxy.io_timeout) from None
        finally:
            if body_task is not None:
                body_task.cancel()  # no-op once done
                await asyncio.gather(body_task, return_exceptions=True)
            up.close()
            down.close()
            upstream.close()

    async def _request_body(self, upstream: socket.socket, frame: Framing, mover: Mover) -> None:
        """The client's request body, read from its socket (the transport paused meanwhile), exactly as framed;
        bytes the client sent after it (its next request) go back to the stream reader. A malformed body cuts the
        server off (it must not wait for the rest, nor answer half a request): the response relay then ends too."""
        transport = self.writer.transport
        transport.pause_reading()  # type: ignore[attr-defined]
        client = SocketReader(self._client_socket(), take_buffered(self.reader), request=True)
        try:
            await client.body(upstream, frame, mover)
        except BadMessage:
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_RDWR)
            raise
        give_back(self.reader, client.buffer)
        transport.resume_reading()  # type: ignore[attr-defined]

    async def _relay_response(self, request: Head, upstream: SocketReader, mover: Mover, attempt: Attempt) -> bool:
        client = await self._client_writable()
        while True:  # interim 1xx responses pass through ahead of the final one
            response, status = await self._response_head(upstream, attempt)
            keep = client_keeps(request)
            no_body = request.start[0] == "HEAD" or status in (204, 304) or status < 200
            body = Framing(0) if no_body else _response_framing(response)
            keep = keep and not body.until_close
            out = _client_head(response, close=not keep and status >= 200)
            if status >= 200 or status == 101:
                break
            await mover.send(client, out)
        try:
            await upstream.body(client, body, mover, prefix=out)  # the head goes with the body's first bytes
        except BadMessage as exc:
            raise Refusal(502, f"Corral egress: bad response from {attempt.host}:{attempt.port}: {exc}",
                          "bad upstream response") from None
        return keep and status != 101

    async def _response_head(self, upstream: SocketReader, attempt: Attempt) -> tuple[Head, int]:
        try:
            response = await upstream.read_head()
            if response is None:
                raise BadMessage("the server closed the connection without a response")
            return response, parse_status(response)[0]
        except (BadMessage, HeadTooLarge) as exc:
            raise Refusal(502, f"Corral egress: bad response from {attempt.host}:{attempt.port}: {exc}",
                          "bad upstream response") from None


def _raise_body_fault(body_task: asyncio.Task[None] | None) -> None:
    """Raise the request body's BadMessage, if that is how the body ended."""
    if body_task is not None and body_task.done() and not body_task.cancelled():
        fault = body_task.exception()
        if isinstance(fault, BadMessage):
            raise fault


def client_keeps(head: Head) -> bool:
    """HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 clients get one request per connection."""
    return head.start[2] == "HTTP/1.1" and "close" not in head.tokens("connection") | head.tokens("proxy-connection")


def _drop_hop_by_hop(head: Head) -> list[tuple[str, str]]:
    named = head.tokens("connection")  # headers the sender marked as meant for this hop only
    return [(k, v) for k, v in head.headers
            if k.lower() not in HOP_BY_HOP and k.lower() not in named and not k.lower().startswith("proxy-")]


def host_header(host: str, port: int, default: int) -> str:
    authority = f"[{host}]" if ":" in host else host
    return authority + ("" if port == default else f":{port}")


def _upstream_head(head: Head, host: str, port: int, path: str) -> bytes:
    """Origin-form request line, Host from the URL, hop-by-hop and Proxy-* headers dropped, one request only."""
    method, _, version = head.start
    authority = f"[{host}]" if ":" in host else host
    authority += "" if port == 80 else f":{port}"
    headers = [(k, v) for k, v in _drop_hop_by_hop(head) if k.lower() != "host"]
    lines = [f"{method} {path} {version}", f"Host: {authority}", *(f"{k}: {v}" for k, v in headers),
             "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _response_framing(response: Head) -> Framing:
    try:
        return framing(response, request=False)
    except BadMessage as exc:
        raise Refusal(502, f"Corral egress: bad response from upstream: {exc}", "bad upstream response") from None


def _client_head(response: Head, *, close: bool) -> bytes:
    """Hop-by-hop headers dropped, and Content-Length when there is a Transfer-Encoding: that overrides it, and a
    proxy must not pass both on (RFC 9112 6.3)."""
    drop = "content-length" if response.get("transfer-encoding") is not None else ""
    lines = [" ".join(response.start).rstrip(),
             *(f"{k}: {v}" for k, v in _drop_hop_by_hop(response) if k.lower() != drop)]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
