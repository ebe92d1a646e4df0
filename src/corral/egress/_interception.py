"""`Interception`: requests to the hosts a sandbox's secrets are bound to (docs/secrets.md), every byte parsed by a
`Rewriter` that puts secrets in and takes them out: plain HTTP one exchange at a time, and CONNECT as TLS to the
host (its certificate checked here) and TLS with the sandbox under a leaf of the deployment's CA."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl

from . import _reasons as reasons
from ._connection_base import big_send_buffer
from ._forwarding import Forwarding, host_header
from ._http import (
    MAX_HEAD,
    BadMessage,
    Framing,
    Head,
    HeadTooLarge,
    error_response,
    framing,
    read_head,
    safe_text,
)
from ._mover import Mover, Stall
from ._proxied import Attempt
from ._reasons import Refusal
from ._rewrite import Rewriter


class Interception(Forwarding):
    """The rewriting of requests to bound hosts, one part of a `Connection` (it copies unchanged bodies as
    `Forwarding` does)."""

    def _rewriter(self, host: str, port: int, upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  attempt: Attempt) -> Rewriter:
        client = self.writer.get_extra_info("socket")  # below TLS too: the sandbox's socket
        if client is not None:
            big_send_buffer(client)  # a scrubbed answer is written in pieces of up to 1 MiB: each in one send
        return Rewriter((self.reader, self.writer), upstream, host=host, port=port,
                        secrets=self._known().policy.secrets,
                        timeout=self.proxy.io_timeout, sent_up=attempt.count_up, sent_down=attempt.count_down,
                        produced=self._known().produced)

    async def _forward_rewritten(self, head: Head, body: Framing, host: str, port: int, path: str,
                                 attempt: Attempt) -> bool:
        """A plain-HTTP request to a bound host: one exchange, on a connection of its own upstream."""
        upstream = await self._open(host, port, attempt)
        reader, writer = await asyncio.open_connection(sock=upstream, limit=MAX_HEAD)
        rewriter = self._rewriter(host, port, (reader, writer), attempt)

        async def copy_body(frame: Framing) -> None:
            """A body no secret goes into: socket to socket, exactly as framed (as `_forward` sends one)."""
            with socket.socket(fileno=os.dup(upstream.fileno())) as raw:  # the transport keeps its own
                raw.setblocking(False)
                stall = Stall(self.proxy.io_timeout)
                mover = Mover(attempt.count_up, stall)
                try:
                    async with stall:
                        await self._request_body(raw, frame, mover)
                finally:
                    mover.close()

        rewriter.copy_body = copy_body
        try:
            done = await rewriter.exchange(head, body, path, host_header(host, port, 80), keep_upstream=False)
            return done.client_keeps
        except TimeoutError:
            raise reasons.upstream_timeout("talking to", host, port, self.proxy.io_timeout) from None
        finally:
            self.responded = self.responded or rewriter.responded
            attempt.secrets |= rewriter.used
            writer.close()

    async def _intercept(self, host: str, port: int, attempt: Attempt) -> None:
        """CONNECT to a bound host: TLS to the host (its certificate checked here), then TLS with the sandbox under a
        leaf of the deployment's CA, then the sandbox's requests one by one, rewritten, on that one connection."""
        ca = self.proxy.ca
        if ca is None:
            raise reasons.no_interception(host)
        reader, writer = await self._tls_upstream(host, port, attempt)
        client = self.writer.transport  # the plain transport below the TLS one start_tls makes
        try:
            self._respond(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if self.reader._buffer:  # type: ignore[attr-defined]  # see take_buffered
                attempt.reason = "the client sent bytes before the tunnel was established"
                return
            try:
                await self.writer.start_tls(ca.server_context(host),
                                            ssl_handshake_timeout=self.proxy.connect_timeout)
            except (ssl.SSLError, OSError, TimeoutError) as exc:
                attempt.reason = (f"the sandbox did not accept the proxy's certificate for {host} ({exc}); it must "
                                  "trust Corral's CA (SSL_CERT_FILE and the other variables Corral sets)")
                return
            await self._rewritten_requests(host, port, self._rewriter(host, port, (reader, writer), attempt), attempt)
        finally:
            await _close_tls(writer, writer.transport)
            await _close_tls(self.writer, client)

    async def _tls_upstream(self, host: str, port: int,
                            attempt: Attempt) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        upstream = await self._open(host, port, attempt)
        try:
            async with asyncio.timeout(self.proxy.connect_timeout):
                return await asyncio.open_connection(sock=upstream, ssl=self.proxy.upstream_tls,
                                                     server_hostname=host, limit=MAX_HEAD)
        except ssl.SSLCertVerificationError as exc:
            upstream.close()
            raise reasons.upstream_untrusted(host, port, exc.verify_message or str(exc)) from None
        except TimeoutError:
            upstream.close()
            raise reasons.upstream_timeout("TLS with", host, port, self.proxy.connect_timeout) from None
        except (ssl.SSLError, OSError) as exc:
            upstream.close()
            raise reasons.upstream_failed(host, port, f"TLS: {exc}") from None

    async def _rewritten_requests(self, host: str, port: int, rewriter: Rewriter, attempt: Attempt) -> None:
        """Requests inside the intercepted tunnel until either side is done; a refusal is answered inside it."""
        authority = host_header(host, port, 443)
        try:
            while True:
                async with asyncio.timeout(self.proxy.idle_timeout):
                    head = await read_head(self.reader)
                if head is None:
                    return
                target = head.start[1]
                if not target.startswith("/"):
                    raise reasons.bad_request("inside a tunnel, requests are origin-form, not "
                                              f"{safe_text(target, 80)!r}")
                done = await rewriter.exchange(head, framing(head, request=True), target, authority,
                                               keep_upstream=True)
                if not (done.client_keeps and done.upstream_keeps):
                    return
        except Refusal as refusal:
            await self._refuse_inside(rewriter, attempt, refusal)
        except (BadMessage, HeadTooLarge) as exc:
            await self._refuse_inside(rewriter, attempt, reasons.bad_request(str(exc)))
        except TimeoutError:
            attempt.reason = f"tunnel idle or stalled for {self.proxy.io_timeout:g} s, closed"
        finally:
            attempt.secrets |= rewriter.used

    async def _refuse_inside(self, rewriter: Rewriter, attempt: Attempt, refusal: Refusal) -> None:
        attempt.reason = refusal.reason
        if rewriter.responded:
            return
        marker = f"error; host={attempt.host}; port={attempt.port}; rule={refusal.rule}"
        self.writer.write(error_response(refusal.status, refusal.reason, marker=marker))
        with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
            async with asyncio.timeout(self.proxy.io_timeout):
                await self.writer.drain()


async def _close_tls(writer: asyncio.StreamWriter, below: asyncio.BaseTransport) -> None:
    """Close a TLS stream, waiting briefly for the peer's close_notify; then the transport below it, whatever the
    peer did (a TLS shutdown that never completes would keep its socket open until the process ends)."""
    try:
        writer.close()
        with contextlib.suppress(Exception):  # a peer gone mid-shutdown: nothing left to tell it
            async with asyncio.timeout(1):
                await writer.wait_closed()
    finally:  # cancelled too (a detach): the socket must not outlive the connection
        if isinstance(below, asyncio.WriteTransport):
            below.abort()
        else:
            below.close()
