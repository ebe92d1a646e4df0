"""The sandbox's only ways toward the network: the egress bridge and the refusing DNS responder (docs/egress.md).

* `127.0.0.1:3128`: each TCP connection is spliced to the host's egress proxy through the Unix socket mounted
  at /.corral/egress/proxy.sock; the proxy knows the sandbox by that socket and applies its policy. The
  sandbox itself has loopback only, so this is the one road out.
* `127.0.0.1:53` (UDP and TCP): every query is answered REFUSED at once, so a lookup fails immediately rather
  than after a resolver timeout, and the name is reported to the proxy, which records the refusal where the
  command's result, the SDK and the audit trail will show it.

Threads, not the epoll pump of `processes`: a handful of long-lived connections, each a plain blocking splice.
"""

from __future__ import annotations

import _socket
import threading
import time

PROXY_PORT = 3128
DNS_PORT = 53
EGRESS_SOCKET = "/.corral/egress/proxy.sock"
_CHUNK = 256 * 1024
_DNS_REPORT_GAP = 2.0  # a resolver asks for A and AAAA, and retries: one report per name per gap is enough

_NO_PROXY = (b"HTTP/1.1 502 Corral egress proxy unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
             b"Content-Length: 72\r\n\r\nThe egress proxy is not running: sandboxes reach out only through it.\r\n")


def start(egress_socket: str = EGRESS_SOCKET) -> None:
    """Start the bridge and the DNS responder in daemon threads; a port that cannot be bound is skipped."""
    for target, args in ((_serve_bridge, (egress_socket,)), (_serve_dns_udp, (egress_socket,)),
                         (_serve_dns_tcp, ())):
        threading.Thread(target=target, args=args, daemon=True).start()


def _listen(kind: int, port: int) -> _socket.socket | None:
    sock = _socket.socket(_socket.AF_INET, kind)
    try:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        if kind == _socket.SOCK_STREAM:
            sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock


# -- the egress bridge -------------------------------------------------------------------------------------------


def _serve_bridge(egress_socket: str) -> None:
    listener = _listen(_socket.SOCK_STREAM, PROXY_PORT)
    if listener is None:
        return
    while True:
        try:
            client = _accept(listener)
        except OSError:
            time.sleep(0.05)  # EMFILE and friends: the sandbox's own limit; try again shortly
            continue
        threading.Thread(target=_bridge, args=(client, egress_socket), daemon=True).start()


def _bridge(client: _socket.socket, egress_socket: str) -> None:
    upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        upstream.connect(egress_socket)
    except OSError:
        _send_quietly(client, _NO_PROXY)
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def pump(src: _socket.socket, dst: _socket.socket) -> None:
    """Copy until EOF and pass the end on as a half-close (the peer sees the end of this direction too); an
    error ends both directions. The egress bridge and inbound tunnels (`tunnel.py`) both copy with it."""
    buf = bytearray(_CHUNK)  # one buffer per direction, reused: no allocation per read
    view = memoryview(buf)
    try:
        while n := src.recv_into(buf):
            dst.sendall(view[:n])
    except OSError:
        shutdown(src, _socket.SHUT_RDWR)
        shutdown(dst, _socket.SHUT_RDWR)
        return
    shutdown(dst, _socket.SHUT_WR)
    shutdown(src, _socket.SHUT_RD)


def shutdown(sock: _socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _accept(listener: _socket.socket) -> _socket.socket:
    fd, _ = listener._accept()  # type: ignore[attr-defined]  # _socket.socket has it; typeshed omits it
    return _socket.socket(fileno=fd)


def _send_quietly(sock: _socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


# -- the refusing DNS responder ----------------------------------------------------------------------------------


def refusal(query: bytes) -> tuple[bytes, str] | None:
    """A REFUSED answer to a DNS query (RFC 1035 header, question echoed) and the name asked; None if malformed."""
    if len(query) < 12:
        return None
    name, end = _question(query)
    if end is None:
        return None
    flags = 0x8000 | (query[2] & 0x79) << 8 | 0x80 | 5  # QR, the query's opcode and RD, RA, RCODE=REFUSED
    header = query[0:2] + flags.to_bytes(2, "big") + b"\x00\x01\x00\x00\x00\x00\x00\x00"
    return header + query[12:end], name


def _question(query: bytes) -> tuple[str, int | None]:
    labels: list[str] = []
    i = 12
    while i < len(query):
        n = query[i]
        if n == 0:
            end = i + 5  # the zero byte, QTYPE, QCLASS
            return ".".join(labels), (end if end <= len(query) else None)
        if n & 0xC0 or i + 1 + n > len(query):  # no compression in a question; no overrun
            return "", None
        labels.append(query[i + 1:i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    return "", None


def _serve_dns_udp(egress_socket: str) -> None:
    sock = _listen(_socket.SOCK_DGRAM, DNS_PORT)
    if sock is None:
        return
    reporter = _Reporter(egress_socket)
    while True:
        try:
            query, peer = sock.recvfrom(4096)
        except OSError:
            time.sleep(0.01)
            continue
        answer = refusal(query)
        if answer is not None:
            threading.Thread(target=_report_then_answer, args=(reporter, sock, peer, answer), daemon=True).start()


def _report_then_answer(reporter: _Reporter, sock: _socket.socket, peer: tuple[str, int],
                        answer: tuple[bytes, str]) -> None:
    # Reported before answering: by the time the lookup fails in the command, the refusal is on record, so the
    # command's result can list it.
    reporter.report(answer[1])
    try:
        sock.sendto(answer[0], peer)
    except OSError:
        pass


def _serve_dns_tcp() -> None:
    """Resolvers fall back to TCP for some queries: refuse there too (length-prefixed, RFC 1035 4.2.2)."""
    listener = _listen(_socket.SOCK_STREAM, DNS_PORT)
    if listener is None:
        return
    while True:
        try:
            conn = _accept(listener)
        except OSError:
            time.sleep(0.05)
            continue
        try:
            conn.settimeout(2)
            data = conn.recv(4096)
            answer = refusal(data[2:]) if len(data) > 2 else None
            if answer is not None:
                conn.sendall(len(answer[0]).to_bytes(2, "big") + answer[0])
        except OSError:
            pass
        finally:
            conn.close()


class _Reporter:
    """Tells the proxy which names were looked up directly (`GET /_corral/dns?name=`), once per name per gap."""

    def __init__(self, egress_socket: str) -> None:
        self.egress_socket = egress_socket
        self.last: dict[str, float] = {}

    def report(self, name: str) -> None:
        """Blocks until the proxy has the report (at most a second); repeated names return at once."""
        now = time.monotonic()
        if not name or now - self.last.get(name, -_DNS_REPORT_GAP) < _DNS_REPORT_GAP:
            return
        if len(self.last) > 1000:
            self.last.clear()
        self.last[name] = now
        self._send(name)

    def _send(self, name: str) -> None:
        from urllib.parse import quote  # here, not at the top: only sandboxes that try DNS pay for the import

        safe = quote(name[:253], safe="")
        request = f"GET /_corral/dns?name={safe} HTTP/1.1\r\nHost: corral\r\nConnection: close\r\n\r\n"
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(1)  # a lookup waits on this report: never long
            sock.connect(self.egress_socket)
            sock.sendall(request.encode("ascii"))
            sock.recv(1024)
        except OSError:
            pass
        finally:
            sock.close()
