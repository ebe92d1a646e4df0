"""What a bound host can hand back of a secret, and what the proxy scrubs (docs/secrets.md, issue 29 items 1-3):
with curl inside real runc sandboxes, through the real egress proxy, against a loopback server of the test's own
that reflects the value in each way a probe found:

- the Basic credentials the proxy built (`curl -u`, URL credentials; plain HTTP and inside an intercepted TLS
  tunnel), echoed as they were sent, percent-encoded,
  and later, from another connection;
- in the answer's head outside header values: the reason phrase, a header's name, and the texts of the proxy's
  own refusals of a malformed head (which quoted the server's bytes);
- under a transfer-coding other than chunked (`gzip, chunked`; chunked framing in an HTTP/1.0 answer), which the
  proxy refuses on scrubbed answers rather than passing it on undecoded.

The server gets the value in the request line (`?$TOKEN`, replaced on the way) and reflects what it got.
"""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from .test_secrets import BOUND, VALUE, Echo, secret_spec, sh
from .test_secrets import egress as egress  # the fixtures: a real engine (runc) behind a real proxy
from .test_secrets import pki as pki
from .test_secrets import tls as tls  # an echo server over TLS, its certificate from `pki`

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


class Reflector:
    """HTTP on 127.0.0.1 that reflects the query (or the Authorization header) in the ways a probe found."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []
        reflector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                route, _, query = self.path.partition("?")
                auth = self.headers.get("Authorization")
                if auth is not None:
                    reflector.authorizations.append(auth)
                value = urllib.parse.unquote(query).encode("latin-1")
                getattr(self, "_" + route.strip("/").replace("-", "_"))(value)

            def _basic(self, _: bytes) -> None:
                auth = self.headers.get("Authorization", "")
                self._send(200, json.dumps({"authorization": auth, "quoted": urllib.parse.quote(auth, safe="")}),
                           [("X-Echo-Auth", auth)])

            def _stored(self, _: bytes) -> None:  # what an earlier request brought, handed back later
                self._send(200, json.dumps({"authorization": reflector.authorizations[0]}), [])

            def _reason(self, value: bytes) -> None:
                self._raw(b"HTTP/1.1 200 " + value + b"\r\nContent-Length: 2\r\n\r\nok")

            def _name(self, value: bytes) -> None:
                self._raw(b"HTTP/1.1 200 OK\r\nX-" + value + b": 1\r\nContent-Length: 2\r\n\r\nok")

            def _te(self, value: bytes) -> None:
                data = gzip.compress(b"value=" + value)
                self._raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                          + b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))

            def _te10(self, value: bytes) -> None:  # chunked framing where HTTP/1.0 has none: the value in halves
                half = len(value) // 2
                self._raw(b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
                    b"%x\r\n%b\r\n" % (len(p), p) for p in (value[:half], value[half:])) + b"0\r\n\r\n")
                self.close_connection = True

            def _status(self, value: bytes) -> None:
                self._raw(b"HTTP/1.1 2000 " + value + b"\r\n\r\n")
                self.close_connection = True

            def _ce(self, value: bytes) -> None:
                self._raw(b"HTTP/1.1 200 OK\r\nContent-Encoding: " + value + b"\r\nContent-Length: 2\r\n\r\nok")

            def _cl(self, value: bytes) -> None:
                self._raw(b"HTTP/1.1 200 OK\r\nContent-Length: " + value + b"\r\n\r\nok")
                self.close_connection = True

            def _send(self, status: int, body: str, headers: list[tuple[str, str]]) -> None:
                data = body.encode()
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _raw(self, data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def reflector() -> Iterator[Reflector]:
    server = Reflector()
    yield server
    server.close()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _quoted(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def _nothing_of_the_value(text: str) -> None:
    """Neither the value nor a piece of it that says much (a refusal's text once quoted 20 or 80 characters)."""
    for piece in (VALUE, VALUE[:12], VALUE[-12:]):
        assert piece.lower() not in text.lower(), text


async def test_basic_credentials_the_proxy_built_come_back_as_the_placeholder(egress: Any,
                                                                               reflector: Reflector) -> None:
    engine, _, _ = egress
    base = f"http://{BOUND}:{reflector.port}"
    async with await engine.create(secret_spec(engine, reflector)) as sb:
        placeholder = (await sh(sb, 'echo -n "$TOKEN"')).stdout
        for user, command in (("ab", f'curl -sS -D - -u "ab:$TOKEN" {base}/basic'),
                              ("git", f'curl -sS -D - "http://git:$TOKEN@{BOUND}:{reflector.port}/basic"')):
            r = await sh(sb, command)
            assert r.exit_code == 0, r.stderr
            sent, theirs = _b64(f"{user}:{VALUE}"), _b64(f"{user}:{placeholder}")
            assert reflector.authorizations[-1] == f"Basic {sent}"  # the host got the value
            assert sent not in r.stdout and _quoted(sent) not in r.stdout, r.stdout
            assert _quoted(sent) != sent  # the percent-encoded form is one of its own ('=' in it)
            echoed = json.loads(r.stdout.split("\r\n\r\n", 1)[1])
            assert echoed == {"authorization": f"Basic {theirs}", "quoted": _quoted(f"Basic {theirs}")}
            assert f"X-Echo-Auth: Basic {theirs}" in r.stdout
        # Another connection, no credentials of its own: what the server kept from the first is scrubbed too.
        r = await sh(sb, f"curl -sS {base}/stored")
        assert r.exit_code == 0 and json.loads(r.stdout) == {"authorization": f"Basic {_b64(f'ab:{placeholder}')}"}


async def test_inside_an_intercepted_tunnel_too(egress: Any, tls: Echo) -> None:
    engine, _, _ = egress
    async with await engine.create(secret_spec(engine, tls)) as sb:
        placeholder = (await sh(sb, 'echo -n "$TOKEN"')).stdout
        r = await sh(sb, f'curl -sS -D - -u "ab:$TOKEN" https://{BOUND}:{tls.port}/basic')
        assert r.exit_code == 0, r.stderr
        assert tls.seen[-1].headers["Authorization"] == f"Basic {_b64(f'ab:{VALUE}')}"
        assert _b64(f"ab:{VALUE}") not in r.stdout
        assert f"X-Echo-Auth: Basic {_b64(f'ab:{placeholder}')}" in r.stdout, r.stdout


@pytest.mark.parametrize("route", ["reason", "name"])
async def test_the_reason_phrase_and_header_names_are_scrubbed(egress: Any, reflector: Reflector, route: str) -> None:
    engine, _, _ = egress
    async with await engine.create(secret_spec(engine, reflector)) as sb:
        placeholder = (await sh(sb, 'echo -n "$TOKEN"')).stdout
        r = await sh(sb, f'curl -sS -D - "http://{BOUND}:{reflector.port}/{route}?$TOKEN"')
        assert r.exit_code == 0, r.stderr
        _nothing_of_the_value(r.stdout)
        head = r.stdout.split("\r\n\r\n", 1)[0]
        assert (f"HTTP/1.1 200 {placeholder}\r\n" in head + "\r\n") if route == "reason" else \
            (f"\r\nX-{placeholder}: 1" in head), head


@pytest.mark.parametrize("route", ["te", "te10"])
async def test_transfer_codings_other_than_chunked_are_refused(egress: Any, reflector: Reflector, route: str) -> None:
    engine, _, events = egress
    async with await engine.create(secret_spec(engine, reflector)) as sb:
        r = await sh(sb, f'curl -sS -D - --raw "http://{BOUND}:{reflector.port}/{route}?$TOKEN" | gzip -dcf')
        assert r.stdout.startswith("HTTP/1.1 502 "), r.stdout
        assert "Transfer-Encoding" in r.stdout.split("\r\n", 1)[0]  # the reason says why
        _nothing_of_the_value(r.stdout)
    assert any(e.rule == "bad upstream response" and "Transfer-Encoding" in e.reason for e in events)


@pytest.mark.parametrize("route", ["status", "ce", "cl"])
async def test_refusals_of_a_bad_answer_do_not_quote_the_value(egress: Any, reflector: Reflector,
                                                               route: str) -> None:
    engine, _, events = egress
    async with await engine.create(secret_spec(engine, reflector)) as sb:
        r = await sh(sb, f'curl -sS -D - "http://{BOUND}:{reflector.port}/{route}?$TOKEN"')
        assert r.stdout.startswith("HTTP/1.1 502 "), r.stdout
        _nothing_of_the_value(r.stdout)
    assert not any(VALUE.lower() in repr(e).lower() for e in events)  # nor in what the audit trail gets
