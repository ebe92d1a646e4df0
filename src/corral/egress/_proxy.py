"""`EgressProxy`: the one way out of a sandbox (docs/egress.md).

Each sandbox gets its own Unix socket (bind-mounted into it; the agent bridges 127.0.0.1:3128 to it), so the
socket a connection arrives on says which sandbox, and which policy, it belongs to. Every request or tunnel is
one attempt: policy check -> resolve once -> check every address -> connect to a checked address -> relay, and
exactly one `EgressEvent` when it ends.

Sandboxes on other machines (Pods: `corral egress-proxy`, docs/kubernetes-backend.md) reach one TCP listener
instead (`listen`): there a connection says who it is with `Proxy-Authorization: Basic <sandbox id>:<credential>`,
checked per request by an `Identify` callback that also gives the policy. Their refusals are reported (awaited)
before the sandbox sees them, so the server that ran the command finds them in the shared audit trail.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import ipaddress
import logging
import os
import socket
import ssl
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._exceptions import AuthenticationError, CorralError, InvalidRequestError, NotFoundError, ServerError
from . import _reasons as reasons
from ._addresses import AddressGuard, IPAddress, IPNetwork, embedded_ipv4
from ._ca import CertificateAuthority, upstream_context
from ._events import EgressEvent, EventKind, MirrorResponse, PackageMirrorProtocol
from ._http import (
    CHUNK,
    HOP_BY_HOP,
    MAX_HEAD,
    BadMessage,
    Framing,
    Head,
    HeadTooLarge,
    Mover,
    SocketReader,
    Stall,
    error_response,
    framing,
    parse_status,
    read_head,
    safe_text,
)
from ._policy import HOST_SERVICES, EgressPolicy, parse_host_port
from ._reasons import Refusal
from ._rewrite import Rewriter
from ._secrets import Produced, bound

__all__ = ["EgressProxy", "EventCallback", "Identify"]

log = logging.getLogger("corral.egress")

EventCallback = Callable[[EgressEvent], Awaitable[None] | None]
Identify = Callable[[str, str], Awaitable[EgressPolicy]]
"""(sandbox id, credential) -> the sandbox's policy now. Raises `AuthenticationError` when the credential is not
that sandbox's (or the sandbox is gone): 407; any other `CorralError` when it cannot tell now: 503."""
DENIALS_KEPT = 200  # per sandbox: enough for any one command's notice, bounded for a misbehaving one
_SELF = ({"127.0.0.1", "localhost", "::1"}, 3128)  # the proxy as the sandbox sees it (the agent's bridge)


@dataclass
class _Sandbox:
    id: str
    path: Path | None  # its socket; None for a sandbox known by its credential on the TCP listener
    policy: EgressPolicy
    server: asyncio.AbstractServer | None = None
    connections: set[asyncio.Task[Any]] = field(default_factory=set)
    denials: deque[EgressEvent] = field(default_factory=lambda: deque(maxlen=DENIALS_KEPT))
    detached: bool = False
    produced: Produced = field(default_factory=Produced)  # encoded forms of its secrets the proxy made, to scrub

    @property
    def remote(self) -> bool:
        """Known by its credential: its command's server reads its refusals from the audit trail, not from us."""
        return self.path is None


class _Attempt:
    """One request or tunnel; reported exactly once, however it ends."""

    def __init__(self, kind: EventKind, method: str = "") -> None:
        self.time = time.time()
        self.t0 = time.monotonic()
        self.kind: EventKind = kind
        self.method = method
        self.host = ""
        self.port = 0
        self.path = ""
        self.allowed = False
        self.rule = "error"
        self.reason = ""
        self.up = 0
        self.down = 0
        self.reported = False  # `emit` ran (a remote sandbox's refusal is reported before it is answered)
        self.secrets: set[str] = set()  # names of the secrets put into its requests

    def count_up(self, n: int) -> None:
        self.up += n

    def count_down(self, n: int) -> None:
        self.down += n

    def refuse(self, refusal: Refusal) -> None:
        self.allowed, self.rule, self.reason = False, refusal.rule, refusal.reason

    def event(self, sandbox_id: str) -> EgressEvent:
        return EgressEvent(time=self.time, sandbox_id=sandbox_id, kind=self.kind, method=self.method,
                           host=self.host, port=self.port, allowed=self.allowed, rule=self.rule,
                           reason=self.reason, bytes_up=self.up, bytes_down=self.down,
                           duration=time.monotonic() - self.t0, path=self.path,
                           secrets=tuple(sorted(self.secrets)))


class EgressProxy:
    """The host side of every sandbox's network access.

    **Parameters:**
    * `on_event`: called with every `EgressEvent` (sync or async); its errors are logged, never raised.
    * `mirror`: the package mirror that serves `/pypi/...` and `/npm/...` to sandboxes granted `@packages`.
    * `extra_forbidden`: more networks no sandbox may reach (CIDR strings), beyond the built-in ranges.
    * `idle_timeout`: seconds a client connection may sit without a complete request head.
    * `connect_timeout`: seconds for resolving a name and for connecting to it, each.
    * `io_timeout`: seconds any read or write may stall mid-transfer, and a tunnel may be silent both ways.
    * `ca`: the deployment's CA, to intercept TLS to the hosts a sandbox's secrets are bound to (docs/secrets.md);
      without one, such a tunnel is refused (a secret is never sent where it would stay a placeholder).
    * `upstream_tls`: how those hosts' own certificates are verified (`upstream_context`: the host's trust store
      plus `--upstream-ca`).

    A refused or failed attempt is reported with `allowed=False`; `rule` says which rule or failure decided.
    """

    def __init__(self, on_event: EventCallback | None = None, mirror: PackageMirrorProtocol | None = None,
                 extra_forbidden: Iterable[str | IPNetwork] = (), *, idle_timeout: float = 60.0,
                 connect_timeout: float = 10.0, io_timeout: float = 300.0, ca: CertificateAuthority | None = None,
                 upstream_tls: ssl.SSLContext | None = None) -> None:
        self.on_event = on_event
        self.ca = ca
        self.upstream_tls = upstream_tls or upstream_context()
        self.mirror = mirror
        self.guard = AddressGuard(extra_forbidden)
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self._sandboxes: dict[str, _Sandbox] = {}
        self._callbacks: set[asyncio.Future[Any]] = set()
        self._listeners: list[asyncio.AbstractServer] = []
        self._remote_connections: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        self.guard.own()  # read the host's addresses now, so the first connection does not pay for it

    async def close(self) -> None:
        """Stop every listener and tunnel; wait (briefly) for async event callbacks still running."""
        for sandbox_id in list(self._sandboxes):
            await self.detach(sandbox_id)
        for server in self._listeners:
            server.close()
        self._listeners.clear()
        for task in self._remote_connections:
            task.cancel()
        if self._remote_connections:
            await asyncio.wait(self._remote_connections, timeout=5)
        if self._callbacks:
            await asyncio.wait(self._callbacks, timeout=5)

    async def attach(self, sandbox_id: str, socket_path: Path, policy: EgressPolicy) -> None:
        """Listen for `sandbox_id` at `socket_path` (its directory gates who can connect) under `policy`."""
        await self.detach(sandbox_id)
        socket_path = Path(socket_path)
        sandbox = _Sandbox(sandbox_id, socket_path, policy)
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()  # a stale socket from before a restart

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(sandbox, reader, writer)

        try:
            sandbox.server = await asyncio.start_unix_server(serve, path=str(socket_path), limit=MAX_HEAD)
            socket_path.chmod(0o666)  # sandbox uids differ from ours; the directory is what gates access
        except OSError as exc:
            if sandbox.server is not None:
                sandbox.server.close()
            raise ServerError(f"egress proxy cannot listen on {socket_path}: {exc}") from exc
        self._sandboxes[sandbox_id] = sandbox

    async def listen(self, host: str, port: int, identify: Identify) -> list[tuple[str, int]]:
        """Serve sandboxes that reach this proxy over TCP (Pods: `corral egress-proxy`), each request as the
        sandbox its `Proxy-Authorization` names, under the policy `identify` gives; the addresses bound."""

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve_remote(identify, reader, writer)

        try:
            server = await asyncio.start_server(serve, host, port, limit=MAX_HEAD)
        except OSError as exc:
            raise ServerError(f"egress proxy cannot listen on {host}:{port}: {exc}") from exc
        self._listeners.append(server)
        return [(str(sock.getsockname()[0]), int(sock.getsockname()[1])) for sock in server.sockets]

    def set_policy(self, sandbox_id: str, policy: EgressPolicy) -> None:
        """Replace the policy; it applies to new connections and requests, open tunnels keep running."""
        self._get(sandbox_id).policy = policy

    def policy(self, sandbox_id: str) -> EgressPolicy:
        return self._get(sandbox_id).policy

    async def detach(self, sandbox_id: str) -> None:
        """Close the listener and every open connection of the sandbox, and remove its socket file."""
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return
        sandbox.detached = True  # a connection accepted but not yet served closes as soon as it runs
        if sandbox.server is not None:
            # Let connections asyncio accepted already get their transports (Python 3.11 leaks one whose server
            # closed first), then drain the listen queue and close the listener in the same step.
            for _ in range(3):
                await asyncio.sleep(0)
            _close_backlog(sandbox.server)
            sandbox.server.close()
        for task in sandbox.connections:
            task.cancel()
        if sandbox.connections:
            await asyncio.wait(sandbox.connections, timeout=5)
        if sandbox.path is not None:
            with contextlib.suppress(OSError):
                sandbox.path.unlink()

    def denials(self, sandbox_id: str, since: float) -> list[EgressEvent]:
        """Refused attempts at or after `since` (a `time.time()`), oldest first; the last 200 are kept."""
        sandbox = self._sandboxes.get(sandbox_id)
        return [] if sandbox is None else [e for e in sandbox.denials if e.time >= since]

    def _get(self, sandbox_id: str) -> _Sandbox:
        try:
            return self._sandboxes[sandbox_id]
        except KeyError:
            raise NotFoundError(f"sandbox {sandbox_id!r} has no egress listener") from None

    async def _serve(self, sandbox: _Sandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        sandbox.connections.add(task)
        try:
            if not sandbox.detached:
                await _Connection(self, sandbox, reader, writer).serve()
        except asyncio.CancelledError:
            # Only detach() cancels these tasks; ending normally keeps asyncio from logging the cancellation.
            pass
        except Exception:
            log.exception("egress connection of sandbox %s failed", sandbox.id)
        finally:
            sandbox.connections.discard(task)
            writer.close()

    async def _serve_remote(self, identify: Identify, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._remote_connections.add(task)
        try:
            await _Connection(self, None, reader, writer, identify).serve()
        except asyncio.CancelledError:
            pass  # close() cancels these
        except Exception:
            log.exception("egress connection from %s failed", writer.get_extra_info("peername"))
        finally:
            self._remote_connections.discard(task)
            writer.close()

    def emit(self, sandbox: _Sandbox | None, attempt: _Attempt) -> asyncio.Future[Any] | None:
        """Report the attempt (once; with no sandbox, a 407, there is nobody to attribute it to); the callback's
        future when it is async, which `report_now` waits for."""
        if sandbox is None or attempt.reported:
            return None
        attempt.reported = True
        event = attempt.event(sandbox.id)
        if not event.allowed:
            sandbox.denials.append(event)
        if self.on_event is None:
            return None
        try:
            result = self.on_event(event)
        except Exception:
            log.exception("egress event callback failed")
            return None
        if not inspect.isawaitable(result):
            return None
        future = asyncio.ensure_future(result)
        self._callbacks.add(future)
        future.add_done_callback(self._callback_done)
        return future

    async def report_now(self, sandbox: _Sandbox, attempt: _Attempt) -> None:
        """Report a refusal and wait (bounded) for it to be recorded, before the sandbox is answered; a failure is
        logged by `_callback_done`, and one still running after the wait goes on recording."""
        future = self.emit(sandbox, attempt)
        if future is not None:
            await asyncio.wait({future}, timeout=self.connect_timeout)

    def _callback_done(self, future: asyncio.Future[Any]) -> None:
        self._callbacks.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("egress event callback failed", exc_info=future.exception())


class _Connection:
    """One client connection from a sandbox: requests in turn (keep-alive) until one ends it."""

    def __init__(self, proxy: EgressProxy, sandbox: _Sandbox | None, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, identify: Identify | None = None) -> None:
        self.proxy = proxy
        self.sandbox = sandbox  # None until a request on the TCP listener says whose it is
        self.identify = identify
        self.credentials: tuple[str, str] | None = None  # the last that were checked, for requests without
        self.reader = reader
        self.writer = writer
        self.responded = False  # whether the current request's response has started (too late for a status)
        self.raw: socket.socket | None = None  # the client's socket for raw copies (`_client_socket()`)

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
        attempt = _Attempt("http")
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

    async def _refused(self, attempt: _Attempt, refusal: Refusal) -> bool:
        try:
            await self._fail(attempt, refusal)
        finally:
            self.proxy.emit(self.sandbox, attempt)
        return False

    async def _fail(self, attempt: _Attempt, refusal: Refusal) -> None:
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
            self.sandbox = _Sandbox(credentials[0], None, policy)
        self.sandbox.policy = policy
        self.credentials = credentials

    def _known(self) -> _Sandbox:
        assert self.sandbox is not None, "a request is dispatched only once its sandbox is known"
        return self.sandbox

    def _respond(self, data: bytes) -> None:
        self.responded = True
        self.writer.write(data)

    async def _dispatch(self, head: Head, attempt: _Attempt) -> bool:
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
            return await self._forward(head, body, host, port, path, attempt)
        if target[:8].lower() == "https://":
            raise reasons.https_in_the_clear()
        raise reasons.bad_request(f"unsupported request target {safe_text(target, 80)!r}")

    # -- the way out: policy, resolution, address checks, connection --------------------------------------------

    async def _open(self, host: str, port: int, attempt: _Attempt) -> socket.socket:
        attempt.host, attempt.port = host, port
        policy = self._known().policy  # one snapshot per attempt: set_policy() affects the next one
        decision = policy.check(host, port)
        if not decision.allowed:
            raise reasons.policy_denied(host, port, policy, decision.rule)
        if host == HOST_SERVICES:
            return await self._host_service(host, port, policy, attempt, decision.rule)
        addresses = await self._resolve(host, port)
        lifted = False
        for ip in addresses:
            why = self.proxy.guard.forbidden(ip)
            if why is None:
                continue
            if not _private_allows(policy, ip, port):
                raise reasons.address_forbidden(host, str(ip), port, why, policy)
            lifted = True
        attempt.allowed = True
        attempt.rule = decision.rule + (f" + private {addresses[0]}:{port}" if lifted else "")
        return await self._connect_any(host, port, addresses)

    async def _host_service(self, host: str, port: int, policy: EgressPolicy, attempt: _Attempt,
                            rule: str) -> socket.socket:
        """`host.corral.internal:<port>`: the tenant's one private pair on that port, never a DNS answer."""
        found = policy.host_services(port)
        if not found:
            raise reasons.no_host_service(host, port, policy)
        if len(found) > 1:
            raise reasons.host_service_ambiguous(host, port, found)
        address = ipaddress.ip_address(found[0])
        attempt.allowed = True
        attempt.rule = f"{rule} + host service {found[0]}:{port}"
        return await self._connect_any(host, port, [address])

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        """Resolve once; the proxy connects only to addresses from this list."""
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            pass
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.proxy.connect_timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise reasons.upstream_timeout("resolving", host, port, self.proxy.connect_timeout) from None
        except socket.gaierror as exc:
            raise reasons.unresolvable(host, exc.strerror or str(exc)) from exc
        found = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
        if not found:
            raise reasons.unresolvable(host, "no addresses")
        return found

    async def _connect_any(self, host: str, port: int, addresses: list[IPAddress]) -> socket.socket:
        """A connected, non-blocking socket to the first checked address that answers (no resolution here)."""
        errors: list[str] = []
        try:
            async with asyncio.timeout(self.proxy.connect_timeout):
                for ip in addresses:
                    try:
                        return await _tcp_connect(ip, port)
                    except OSError as exc:
                        errors.append(f"{ip}: {exc.strerror or exc}")
        except TimeoutError:
            raise reasons.upstream_timeout("connecting to", host, port, self.proxy.connect_timeout) from None
        raise reasons.upstream_failed(host, port, "; ".join(errors))

    # -- CONNECT -----------------------------------------------------------------------------------------------

    async def _connect(self, target: str, attempt: _Attempt) -> None:
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

    async def _splice(self, upstream: socket.socket, attempt: _Attempt) -> None:
        """Copy both ways until both ends close, either breaks, or nothing moves for `io_timeout` seconds."""
        self.writer.transport.pause_reading()  # type: ignore[attr-defined]  # a socket transport reads too
        leftover = _take_buffered(self.reader)  # sent right after the CONNECT head, before the 200
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

    def _client_socket(self) -> socket.socket:
        """The client's socket for raw copies: a duplicate descriptor, so the transport's own stays untouched."""
        if self.raw is None:
            sock = self.writer.transport.get_extra_info("socket")
            self.raw = socket.socket(fileno=os.dup(sock.fileno()))
            self.raw.setblocking(False)
            _big_send_buffer(self.raw)
        return self.raw

    async def _client_writable(self) -> socket.socket:
        """The client's socket, once whatever went through the stream writer before has left (bytes written on
        the socket must not overtake it)."""
        transport = self.writer.transport
        if transport.get_write_buffer_size():
            transport.set_write_buffer_limits(high=0)  # drain() now returns only once the buffer is empty
            try:
                async with asyncio.timeout(self.proxy.io_timeout):
                    await self.writer.drain()
            finally:
                transport.set_write_buffer_limits()
        return self._client_socket()

    # -- hosts a secret is bound to (docs/secrets.md): every byte parsed, secrets put in and taken out ------------

    def _rewriter(self, host: str, port: int, upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  attempt: _Attempt) -> Rewriter:
        client = self.writer.get_extra_info("socket")  # below TLS too: the sandbox's socket
        if client is not None:
            _big_send_buffer(client)  # a scrubbed answer is written in pieces of up to 1 MiB: each in one send
        return Rewriter((self.reader, self.writer), upstream, host=host, port=port,
                        secrets=self._known().policy.secrets,
                        timeout=self.proxy.io_timeout, sent_up=attempt.count_up, sent_down=attempt.count_down,
                        produced=self._known().produced)

    async def _forward_rewritten(self, head: Head, body: Framing, host: str, port: int, path: str,
                                 attempt: _Attempt) -> bool:
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
            done = await rewriter.exchange(head, body, path, _host_header(host, port, 80), keep_upstream=False)
            return done.client_keeps
        except TimeoutError:
            raise reasons.upstream_timeout("talking to", host, port, self.proxy.io_timeout) from None
        finally:
            self.responded = self.responded or rewriter.responded
            attempt.secrets |= rewriter.used
            writer.close()

    async def _intercept(self, host: str, port: int, attempt: _Attempt) -> None:
        """CONNECT to a bound host: TLS to the host (its certificate checked here), then TLS with the sandbox under a
        leaf of the deployment's CA, then the sandbox's requests one by one, rewritten, on that one connection."""
        ca = self.proxy.ca
        if ca is None:
            raise reasons.no_interception(host)
        reader, writer = await self._tls_upstream(host, port, attempt)
        client = self.writer.transport  # the plain transport below the TLS one start_tls makes
        try:
            self._respond(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if self.reader._buffer:  # type: ignore[attr-defined]  # see _take_buffered
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
                            attempt: _Attempt) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
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

    async def _rewritten_requests(self, host: str, port: int, rewriter: Rewriter, attempt: _Attempt) -> None:
        """Requests inside the intercepted tunnel until either side is done; a refusal is answered inside it."""
        authority = _host_header(host, port, 443)
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

    async def _refuse_inside(self, rewriter: Rewriter, attempt: _Attempt, refusal: Refusal) -> None:
        attempt.reason = refusal.reason
        if rewriter.responded:
            return
        marker = f"error; host={attempt.host}; port={attempt.port}; rule={refusal.rule}"
        self.writer.write(error_response(refusal.status, refusal.reason, marker=marker))
        with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
            async with asyncio.timeout(self.proxy.io_timeout):
                await self.writer.drain()

    # -- absolute-form HTTP ------------------------------------------------------------------------------------

    async def _forward(self, head: Head, request_body: Framing, host: str, port: int, path: str,
                       attempt: _Attempt) -> bool:
        """One request upstream, its response back: heads parsed here, bodies copied socket to socket."""
        if bound(self._known().policy.secrets, host, port):
            return await self._forward_rewritten(head, request_body, host, port, path, attempt)
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
        client = SocketReader(self._client_socket(), _take_buffered(self.reader), request=True)
        try:
            await client.body(upstream, frame, mover)
        except BadMessage:
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_RDWR)
            raise
        _give_back(self.reader, client.buffer)
        transport.resume_reading()  # type: ignore[attr-defined]

    async def _relay_response(self, request: Head, upstream: SocketReader, mover: Mover, attempt: _Attempt) -> bool:
        client = await self._client_writable()
        while True:  # interim 1xx responses pass through ahead of the final one
            response, status = await self._response_head(upstream, attempt)
            keep = _client_keeps(request)
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

    async def _response_head(self, upstream: SocketReader, attempt: _Attempt) -> tuple[Head, int]:
        try:
            response = await upstream.read_head()
            if response is None:
                raise BadMessage("the server closed the connection without a response")
            return response, parse_status(response)[0]
        except (BadMessage, HeadTooLarge) as exc:
            raise Refusal(502, f"Corral egress: bad response from {attempt.host}:{attempt.port}: {exc}",
                          "bad upstream response") from None

    # -- origin-form: the package mirror and the agent's DNS reports -------------------------------------------

    async def _origin(self, head: Head, body: Framing, path: str, attempt: _Attempt) -> bool:
        # Neither reads a request body: one the client sent is left unread, so the connection cannot go on.
        keep = _client_keeps(head) and not (body.chunked or body.length)
        if urllib.parse.urlsplit(path).path == "/_corral/dns":
            return await self._dns(keep, path, attempt)
        mirror = self.proxy.mirror
        if mirror is not None and mirror.handles(path):
            return await self._mirror(mirror, head, keep, path, attempt)
        raise reasons.not_a_proxy_request(safe_text(path, 80))

    async def _dns(self, keep: bool, path: str, attempt: _Attempt) -> bool:
        names = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("name")
        if not names or not names[0]:
            raise reasons.bad_request("/_corral/dns needs ?name=")
        attempt.kind, attempt.method, attempt.port = "dns", "DNS", 53
        attempt.host = safe_text(names[0], 253)
        attempt.rule, attempt.reason = "dns refused", reasons.dns_refused(attempt.host)
        self._respond(b"HTTP/1.1 204 No Content\r\n" + (b"" if keep else b"Connection: close\r\n") + b"\r\n")
        async with asyncio.timeout(self.proxy.io_timeout):
            await self.writer.drain()
        return keep

    async def _mirror(self, mirror: PackageMirrorProtocol, head: Head, keep: bool, path: str,
                      attempt: _Attempt) -> bool:
        attempt.kind, attempt.host, attempt.path = "mirror", "mirror", safe_text(path, 2000)
        policy = self._known().policy
        if not policy.grants_preset("packages"):
            raise reasons.mirror_denied(policy)
        attempt.allowed, attempt.rule = True, "preset @packages"
        try:
            response = await mirror.handle(head.start[0], path, head.headers)
        except CorralError as exc:
            raise Refusal(502, f"Corral package mirror: {exc.message}", "mirror failed") from exc
        except Exception as exc:  # the mirror's bug must not look like the sandbox's fault
            log.exception("package mirror failed on %s", path)
            raise Refusal(502, f"Corral package mirror failed: {type(exc).__name__}: {exc}", "mirror failed") from exc
        return await self._send_mirror(response, head, keep, attempt)

    async def _send_mirror(self, response: MirrorResponse, request: Head, keep: bool, attempt: _Attempt) -> bool:
        headers = [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP | {"transfer-encoding"}]
        has_length = any(k.lower() == "content-length" for k, _ in headers)
        no_body = request.start[0] == "HEAD" or response.status in (204, 304)
        chunked = not no_body and not has_length and request.start[2] == "HTTP/1.1"
        keep = keep and (no_body or has_length or chunked)
        headers += [("Transfer-Encoding", "chunked")] if chunked else []
        headers += [] if keep else [("Connection", "close")]
        lines = [f"HTTP/1.1 {response.status} {safe_text(response.reason, 200)}"] + [f"{k}: {v}" for k, v in headers]
        out = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._respond(out)
        attempt.count_down(len(out))
        try:
            if not no_body:
                await self._stream_mirror_body(response, chunked, attempt)
            async with asyncio.timeout(self.proxy.io_timeout):
                await self.writer.drain()
        finally:
            aclose = getattr(response.body, "aclose", None)
            if aclose is not None:
                await aclose()
        return keep

    async def _stream_mirror_body(self, response: MirrorResponse, chunked: bool, attempt: _Attempt) -> None:
        async for data in response.body:
            if not data:
                continue
            out = b"%x\r\n%b\r\n" % (len(data), data) if chunked else data
            self.writer.write(out)
            attempt.count_down(len(out))
            if self.writer.transport.get_write_buffer_size() > CHUNK:
                async with asyncio.timeout(self.proxy.io_timeout):
                    await self.writer.drain()
        if chunked:
            self.writer.write(b"0\r\n\r\n")
            attempt.count_down(5)


async def _tcp_connect(ip: IPAddress, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.get_running_loop().sock_connect(sock, (str(ip), port))
    except BaseException:  # cancelled or refused: never leak the descriptor
        sock.close()
        raise
    return sock


SEND_BUFFER = 4 * 1024 * 1024


def _big_send_buffer(sock: socket.socket) -> None:
    """A 4 MiB send buffer toward the sandbox: a Unix socket's default (~208 KiB) makes the copy stop and wait for
    the reader every few calls, which costs a third of the throughput (`corral bench net`). Beyond
    net.core.wmem_max only with CAP_NET_ADMIN (SO_SNDBUFFORCE); else as much as that allows."""
    for option in (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF):
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SEND_BUFFER)
                return


def _take_buffered(reader: asyncio.StreamReader) -> bytes:
    """The bytes a StreamReader holds already. It has no public call for that; CPython keeps them in `_buffer`
    (a bytearray) in every version since 3.4, and without it the tunnel would lose them."""
    buffer: bytearray = reader._buffer  # type: ignore[attr-defined]
    data = bytes(buffer)
    buffer.clear()
    return data


def _give_back(reader: asyncio.StreamReader, data: bytes | bytearray) -> None:
    """Put bytes read past a request body back in front of what the StreamReader holds (see `_take_buffered`)."""
    buffer: bytearray = reader._buffer  # type: ignore[attr-defined]
    buffer[:0] = data


def _close_backlog(server: asyncio.AbstractServer) -> None:
    """Accept and close connections still waiting in the listen queue: closing the listener does not always tell
    their clients (they would wait for an answer that never comes)."""
    for listener in getattr(server, "sockets", ()):
        with socket.socket(fileno=os.dup(listener.fileno())) as sock:
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                while True:
                    sock.accept()[0].close()


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


def _private_allows(policy: EgressPolicy, ip: IPAddress, port: int) -> bool:
    inner = embedded_ipv4(ip)
    return policy.allows_private(str(ip), port) or (inner is not None and policy.allows_private(str(inner), port))


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


def _raise_body_fault(body_task: asyncio.Task[None] | None) -> None:
    """Raise the request body's BadMessage, if that is how the body ended."""
    if body_task is not None and body_task.done() and not body_task.cancelled():
        fault = body_task.exception()
        if isinstance(fault, BadMessage):
            raise fault


def _client_keeps(head: Head) -> bool:
    """HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 clients get one request per connection."""
    return head.start[2] == "HTTP/1.1" and "close" not in head.tokens("connection") | head.tokens("proxy-connection")


def _drop_hop_by_hop(head: Head) -> list[tuple[str, str]]:
    named = head.tokens("connection")  # headers the sender marked as meant for this hop only
    return [(k, v) for k, v in head.headers
            if k.lower() not in HOP_BY_HOP and k.lower() not in named and not k.lower().startswith("proxy-")]


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


def _host_header(host: str, port: int, default: int) -> str:
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
