"""`ConnectionBase`: what every part of one proxied connection shares: its sandbox's end (the stream, and a raw
duplicate of its socket for copies) and the way out (the policy's decision, one resolution, every address checked,
a connection to a checked address). `Connection` (`_connection.py`) is it with the parts that serve requests."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import ssl
from typing import Any, Protocol

from . import _reasons as reasons
from ._addresses import AddressGuard, IPAddress, embedded_ipv4
from ._ca import CertificateAuthority
from ._events import PackageMirrorProtocol
from ._policy import HOST_SERVICES, EgressPolicy
from ._proxied import Attempt, ProxiedSandbox

SEND_BUFFER = 4 * 1024 * 1024


class ProxyHost(Protocol):
    """What a connection needs of the proxy that accepted it (`EgressProxy`): its settings and its reports."""

    idle_timeout: float
    connect_timeout: float
    io_timeout: float
    guard: AddressGuard
    mirror: PackageMirrorProtocol | None
    ca: CertificateAuthority | None
    upstream_tls: ssl.SSLContext

    def emit(self, sandbox: ProxiedSandbox | None, attempt: Attempt) -> asyncio.Future[Any] | None: ...

    async def report_now(self, sandbox: ProxiedSandbox, attempt: Attempt) -> None: ...


class ConnectionBase:
    """One client connection from a sandbox: its state, and the way out of it."""

    def __init__(self, proxy: ProxyHost, sandbox: ProxiedSandbox | None, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.sandbox = sandbox  # None until a request on the TCP listener says whose it is
        self.credentials: tuple[str, str] | None = None  # the last that were checked, for requests without
        self.reader = reader
        self.writer = writer
        self.responded = False  # whether the current request's response has started (too late for a status)
        self.raw: socket.socket | None = None  # the client's socket for raw copies (`_client_socket()`)

    def _known(self) -> ProxiedSandbox:
        assert self.sandbox is not None, "a request is dispatched only once its sandbox is known"
        return self.sandbox

    def _respond(self, data: bytes) -> None:
        self.responded = True
        self.writer.write(data)

    # -- the way out: policy, resolution, address checks, connection --------------------------------------------

    async def _open(self, host: str, port: int, attempt: Attempt) -> socket.socket:
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

    async def _host_service(self, host: str, port: int, policy: EgressPolicy, attempt: Attempt,
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
                        return await tcp_connect(ip, port)
                    except OSError as exc:
                        errors.append(f"{ip}: {exc.strerror or exc}")
        except TimeoutError:
            raise reasons.upstream_timeout("connecting to", host, port, self.proxy.connect_timeout) from None
        raise reasons.upstream_failed(host, port, "; ".join(errors))

    # -- the sandbox's end, for raw copies ----------------------------------------------------------------------

    def _client_socket(self) -> socket.socket:
        """The client's socket for raw copies: a duplicate descriptor, so the transport's own stays untouched."""
        if self.raw is None:
            sock = self.writer.transport.get_extra_info("socket")
            self.raw = socket.socket(fileno=os.dup(sock.fileno()))
            self.raw.setblocking(False)
            big_send_buffer(self.raw)
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


async def tcp_connect(ip: IPAddress, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.get_running_loop().sock_connect(sock, (str(ip), port))
    except BaseException:  # cancelled or refused: never leak the descriptor
        sock.close()
        raise
    return sock


def big_send_buffer(sock: socket.socket) -> None:
    """A 4 MiB send buffer toward the sandbox: a Unix socket's default (~208 KiB) makes the copy stop and wait for
    the reader every few calls, which costs a third of the throughput (`corral bench net`). Beyond
    net.core.wmem_max only with CAP_NET_ADMIN (SO_SNDBUFFORCE); else as much as that allows."""
    for option in (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF):
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SEND_BUFFER)
                return


def take_buffered(reader: asyncio.StreamReader) -> bytes:
    """The bytes a StreamReader holds already. It has no public call for that; CPython keeps them in `_buffer`
    (a bytearray) in every version since 3.4, and without it the tunnel would lose them."""
    buffer: bytearray = reader._buffer  # type: ignore[attr-defined]
    data = bytes(buffer)
    buffer.clear()
    return data


def give_back(reader: asyncio.StreamReader, data: bytes | bytearray) -> None:
    """Put bytes read past a request body back in front of what the StreamReader holds (see `take_buffered`)."""
    buffer: bytearray = reader._buffer  # type: ignore[attr-defined]
    buffer[:0] = data


def _private_allows(policy: EgressPolicy, ip: IPAddress, port: int) -> bool:
    inner = embedded_ipv4(ip)
    return policy.allows_private(str(ip), port) or (inner is not None and policy.allows_private(str(inner), port))
