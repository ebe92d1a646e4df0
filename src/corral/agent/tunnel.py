"""Inbound connections to the sandbox's own ports: the `connect` operation (docs/ports.md).

The host asks `{"op": "connect", "port": N}`. The agent connects to `127.0.0.1:N` inside the sandbox, then to
`[::1]:N` if nothing answers there, and sends one event, `{"event": "connected", "port": N, "address": ...}`.
From then on the agent connection carries no frames: it is a raw two-way byte pipe to that TCP connection.
Each direction ends on its own (a half-close is passed on as one, so a client may finish its request and still
read the answer); an error in either direction ends both, as a reset ends a TCP connection. When nothing
listens the answer is an `agent_error` that names the port, and no pipe follows.

The sandbox keeps its loopback-only network: this is how the server's port forwarding (`sb.get_host(port)`)
reaches a server inside, the way `network` bridges the one road out.

Threads, not the epoll pump of `processes`: a tunnel is a plain blocking splice of two sockets, one thread per
direction (the request's own thread carries host -> sandbox).
"""

from __future__ import annotations

import _socket
import select
import threading

from . import threads
from .network import pump, shutdown
from .process_requests import ProcessError

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

    from .channel import Channel

CONNECT_TIMEOUT = 10.0  # loopback refuses at once; only a server whose listen backlog is full makes us wait
_CHUNK = 256 * 1024
_ADDRESSES = ((_socket.AF_INET, "127.0.0.1"), (_socket.AF_INET6, "::1"))
_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL


def op_connect(ch: Channel, req: dict[str, Any]) -> None:
    port = _port(req.get("port"))
    upstream, address = _connect(port)
    go = threading.Event()
    aborted = threading.Event()
    try:  # before "connected": a sandbox out of threads gets a refusal, not a pipe that never flows
        back = threads.start(_pump_back, upstream, ch.sock, go, aborted)
    except RuntimeError:
        upstream.close()
        raise ProcessError("quota_exceeded", "the sandbox's process limit is reached; "
                                             f"cannot open a connection to port {port}") from None
    try:
        ch.event(event="connected", port=port, address=address)
    except BaseException:
        aborted.set()
        raise
    finally:
        go.set()  # the back pump writes raw bytes only after the event went out (or never, if it did not)
        if aborted.is_set():
            back.join()
            upstream.close()
    pump(ch.sock, upstream)
    back.join()
    upstream.close()


def _port(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ProcessError("invalid_request", f"port must be an integer from 1 to 65535, not {value!r}")
    return value


def _connect(port: int) -> tuple[_socket.socket, str]:
    """A connected socket to the port on loopback (IPv4 first), and the address that answered."""
    tried: list[str] = []
    for family, host in _ADDRESSES:
        sock = _socket.socket(family, _socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect((host, port))
        except TimeoutError:
            sock.close()
            raise ProcessError("agent_error", f"port {port} in the sandbox did not accept a connection within "
                                              f"{CONNECT_TIMEOUT:g} s ({host}): its server is not accepting "
                                              "(a full listen backlog?)") from None
        except OSError as exc:
            sock.close()
            tried.append(f"{host}: {exc.strerror or exc}")
            continue
        sock.settimeout(None)
        sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)  # interactive traffic (WebSockets) first
        return sock, host
    raise ProcessError("agent_error", f"nothing is listening on port {port} in the sandbox ({'; '.join(tried)}); "
                                      "start a server there on 127.0.0.1, ::1 or 0.0.0.0")


def _pump_back(upstream: _socket.socket, host: _socket.socket, go: threading.Event, aborted: threading.Event
               ) -> None:
    """Sandbox -> host, once `go` is set. It also ends when the host hangs up altogether (not a half-close): a
    server that neither writes nor closes after the host left must not keep this thread and its sockets."""
    go.wait()
    if aborted.is_set():
        return
    poller = select.poll()
    poller.register(upstream.fileno(), select.POLLIN)
    poller.register(host.fileno(), 0)  # hang-ups are always reported
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        while True:
            events = dict(poller.poll())
            if events.get(host.fileno(), 0) & _HANGUP and not events.get(upstream.fileno(), 0) & select.POLLIN:
                break
            n = upstream.recv_into(buf)
            if not n:
                shutdown(host, _socket.SHUT_WR)
                shutdown(upstream, _socket.SHUT_RD)
                return
            host.sendall(view[:n])
    except OSError:
        pass
    shutdown(upstream, _socket.SHUT_RDWR)
    shutdown(host, _socket.SHUT_RDWR)



__all__ = ["CONNECT_TIMEOUT", "op_connect"]
