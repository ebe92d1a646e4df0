"""`Connection`: one client connection from a sandbox, its requests in turn (keep-alive) until one ends it: the
request head read, whose it is (on the TCP listener, `Identify`), then each by its form: CONNECT (a tunnel spliced
both ways, or intercepted for a bound host), absolute-form HTTP (`Forwarding`, `Interception`) or origin form
(`OriginRequests`); a refusal answered with its status, and the attempt reported once."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import urllib.parse
from collections.abc import Awaitable, Callable

from .._exceptions import AuthenticationError, CorralError, InvalidRequestError
from . import _reasons as reasons
from ._connection_base import ProxyHost, take_buffered
from ._http import (
    MAX_HEAD,
    BadMessage,
    Head,
    HeadTooLarge,
    error_response,
    framing,
    read_head,
    safe_text,
)
from ._interception import Interception
from ._mover import Mover, Stall
from ._origin import OriginRequests
from ._policy import EgressPolicy, parse_host_port
from ._proxied import Attempt, ProxiedSandbox
from ._reasons import Refusal
from ._secrets import bound

Identify = Callable[[str, str], Awaitable[EgressPolicy]]
"""(sandbox id, credential) -> the sandbox's policy now. Raises `AuthenticationError` when the credential is not
that sandbox's (or the sandbox is gone): 407; any other `CorralError` when it cannot tell now: 503."""
_SELF = ({"127.0.0.1", "localhost", "::1"}, 3128)  # the proxy as the sandbox sees it (the agent's bridge)


class Connection(Interception, OriginRequests):
    """One client connection from a sandbox: requests in turn (keep-alive) until one ends it."""

    def __init__(self, proxy: ProxyHost, sandbox: ProxiedSandbox | None, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, identify: Identify | None = None) -> None:
        super().__init__(proxy, sandbox, reader, writer)
        self.identify = identify

    async def serve(self) -> None:
        try:
            while await self._one():
                pass
        finally:
            if self.raw is not None:
                self.raw.close()

    async def _one(self) -> bool:
        """Serve one request; True to wait for another on this connection."""
        self.responded = False
        attempt = Attempt("http")
        try:
            async with asyncio.timeout(self.proxy.idle_timeout):
                head = await read_head(self.reader)
        except TimeoutError:
            return False  # idle: no attempt was made, nothing to report
        except HeadTooLarge:
            return await self._refused(attempt, Refusal(431, f"Corral egress proxy: request head larger than "
                                                             f"{MAX_HEAD} bytes", "head too large"))
        except BadMessage as exc:
            return await self._refused(attempt, reasons.bad_request(str(exc)))
        except OSError:
            return False
        if head is None:
            return False
        attempt.method = safe_text(head.start[0], 32)
        try:
            if self.identify is not None:
                await self._identify(head, self.identify)
            return await self._dispatch(head, attempt)
        except Refusal as refusal:
            await self._fail(attempt, refusal)
        except BadMessage as exc:
            await self._fail(attempt, reasons.bad_request(str(exc)))
        except TimeoutError:
            await self._fail(attempt, reasons.upstream_timeout("talking to", attempt.host, attempt.port,
                                                               self.proxy.io_timeout))
        except OSError as exc:
            attempt.reason = f"connection lost: {exc}"
        finally:
            self.proxy.emit(self.sandbox, attempt)
        return False

    async def _refused(self, attempt: Attempt, refusal: Refusal) -> bool:
        try:
            await self._fail(attempt, refusal)
        finally:
            self.proxy.emit(self.sandbox, attempt)
        return False

    async def _fail(self, attempt: Attempt, refusal: Refusal) -> None:
        """Answer a refusal; once a response has started, only record it (the connection then closes)."""
        if self.responded:
            attempt.reason = refusal.reason
            return
        attempt.refuse(refusal)
        if self.sandbox is not None and self.sandbox.remote:
            await self.proxy.report_now(self.sandbox, attempt)
        kind = "denied" if refusal.status == 403 else "error"
        marker = f"{kind}; host={attempt.host}; port={attempt.port}; rule={refusal.rule}"
        self.writer.write(error_response(refusal.status, refusal.reason, marker=marker,
                                         extra={"host": attempt.host, "port": attempt.port, "rule": refusal.rule}))
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(self.proxy.io_timeout):
                await self.writer.drain()

    async def _identify(self, head: Head, identify: Identify) -> None:
        """Whose request this is, and the policy that applies now. Clients send the proxy's credentials with every
        request; one without them goes on as the connection's earlier ones. The package mirror's requests are
        origin-form, sent to the proxy as a server: those carry them as `Authorization` (PIP_INDEX_URL's)."""
        header = head.get("proxy-authorization")
        if header is None and head.start[1].startswith("/"):
            header = head.get("authorization")
        credentials = _basic_credentials(header) if header is not None else self.credentials
        if credentials is None:
            raise reasons.proxy_credentials_needed("no Proxy-Authorization" if header is None else
                                                   "Proxy-Authorization is not Basic <sandbox id>:<credential>")
        try:
            policy = await identify(*credentials)
        except AuthenticationError as exc:
            raise reasons.proxy_credentials_needed(exc.message) from None
        except CorralError as exc:
            raise reasons.policy_unavailable(credentials[0], exc.message) from None
        if self.sandbox is None or self.sandbox.id != credentials[0]:
            self.sandbox = ProxiedSandbox(credentials[0], None, policy)
        self.sandbox.policy = policy
        self.credentials = credentials

    async def _dispatch(self, head: Head, attempt: Attempt) -> bool:
        method, target, _ = head.start
        if method == "CONNECT":
            attempt.kind = "connect"
            await self._connect(target, attempt)
            return False
        body = framing(head, request=True)  # before anything else: a request framed two ways goes nowhere
        if target.startswith("/"):
            return await self._origin(head, body, target, attempt)
        if target[:7].lower() == "http://":
            host, port, path = _split_url(target)
            if host in _SELF[0] and port == _SELF[1]:  # a client that proxies even its requests to the proxy
                return await self._origin(head, body, path, attempt)
            if bound(self._known().policy.secrets, host, port):
                return await self._forward_rewritten(head, body, host, port, path, attempt)
            return await self._forward(head, body, host, port, path, attempt)
        if target[:8].lower() == "https://":
            raise reasons.https_in_the_clear()
        raise reasons.bad_request(f"unsupported request target {safe_text(target, 80)!r}")

    # -- CONNECT -----------------------------------------------------------------------------------------------

    async def _connect(self, target: str, attempt: Attempt) -> None:
        try:
            host, port = parse_host_port(_authority(target))
        except InvalidRequestError as exc:
            raise reasons.bad_request(exc.message) from None
        if port is None:
            raise reasons.bad_request(f"CONNECT needs host:port, got {safe_text(target, 80)!r}")
        if bound(self._known().policy.secrets, host, port):
            await self._intercept(host, port, attempt)
            return
        with await self._open(host, port, attempt) as upstream:
            self._respond(b"HTTP/1.1 200 Connection established\r\n\r\n")
            async with asyncio.timeout(self.proxy.io_timeout):
                await self.writer.drain()
            await self._splice(upstream, attempt)

    async def _splice(self, upstream: socket.socket, attempt: Attempt) -> None:
        """Copy both ways until both ends close, either breaks, or nothing moves for `io_timeout` seconds."""
        self.writer.transport.pause_reading()  # type: ignore[attr-defined]  # a socket transport reads too
        leftover = take_buffered(self.reader)  # sent right after the CONNECT head, before the 200
        client = self._client_socket()
        stall = Stall(self.proxy.io_timeout)
        movers = Mover(attempt.count_up, stall), Mover(attempt.count_down, stall)

        async def pump(src: socket.socket, dst: socket.socket, mover: Mover, first: bytes) -> None:
            await mover.send(dst, first)
            await mover.pump(src, dst)
            with contextlib.suppress(OSError):  # pass the half-close on: the other direction may still be talking
                dst.shutdown(socket.SHUT_WR)

        tasks = {asyncio.create_task(pump(client, upstream, movers[0], leftover)),
                 asyncio.create_task(pump(upstream, client, movers[1], b""))}
        try:
            async with stall:
                while tasks:
                    done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    if any(not t.cancelled() and t.exception() is not None for t in done):
                        break  # a reset on either side ends the tunnel
        except TimeoutError:
            attempt.reason = f"tunnel idle for {self.proxy.io_timeout:g} s, closed"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for mover in movers:
                mover.close()


def _basic_credentials(header: str) -> tuple[str, str] | None:
    """`Basic base64(<sandbox id>:<credential>)` -> (id, credential); None for anything else."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, colon, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return (urllib.parse.unquote(user), urllib.parse.unquote(password)) if colon and user else None


def _split_url(target: str) -> tuple[str, int, str]:
    """`http://host[:port]/path?query` -> (normalised host, port, origin-form path)."""
    rest = target[7:]
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:].split("#", 1)[0]
    path = path if path.startswith("/") else "/" + path
    if "@" in authority:
        raise reasons.bad_request("credentials in the URL; send an Authorization header instead")
    try:
        host, port = parse_host_port(_authority(authority), default_port=80)
    except InvalidRequestError as exc:
        raise reasons.bad_request(exc.message) from None
    assert port is not None
    return host, port, path


def _authority(text: str) -> str:
    """A request's `host[:port]` as text: heads are read as latin-1, but a non-ASCII name is UTF-8 on the wire
    (clients should send A-labels, `xn--...`; `normalize_host` maps either to the same)."""
    if text.isascii():
        return text
    try:
        return text.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        raise reasons.bad_request(f"invalid host {safe_text(text, 80)!r}: not UTF-8 (send names as A-labels, "
                                  "xn--...)") from None
