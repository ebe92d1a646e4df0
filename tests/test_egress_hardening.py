"""The egress proxy against malformed and smuggling-shaped HTTP (RFC 9112), over real sockets: a client on the
sandbox's Unix socket, an origin on loopback that records every byte the proxy sends it. Every refusal is a
response whose reason names the fault, an event, and never a traceback. Every wait is bounded."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from corral import InvalidRequestError
from corral.egress import EgressEvent, EgressPolicy, EgressProxy
from corral.egress._http import safe_text
from corral.egress._policy import normalize_host

pytestmark = pytest.mark.anyio

WAIT = 20.0
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Origin:
    """A loopback origin: per connection, reads a head (and up to `body_end`, when set), records what it read, then
    writes `reply`; with no reply it reads on until the proxy closes (a server waiting for the rest of a body)."""

    reply: bytes | None = OK
    body_end: bytes | None = None
    received: bytearray = field(default_factory=bytearray)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.received += await reader.readuntil(b"\r\n\r\n")
            if self.body_end is not None:
                self.received += await reader.readuntil(self.body_end)
            if self.reply is None:
                while data := await reader.read(65536):
                    self.received += data
            else:
                writer.write(self.reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@dataclass
class Rig:
    proxy: EgressProxy
    sock: Path
    events: list[EgressEvent]
    origin: Origin

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.origin.port}"

    async def request(self, raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
        """Send one request on a new connection; read until the proxy closes it."""
        async with asyncio.timeout(WAIT):
            reader, writer = await asyncio.open_unix_connection(str(self.sock))
            writer.write(raw)
            data = await reader.read()
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {k.decode().lower(): v.decode().strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        return lines[0], headers, body

    def policy(self, network: object) -> None:
        self.proxy.set_policy("sb1", EgressPolicy.parse(network, private=[f"127.0.0.1:{self.origin.port}"]))

    async def settle(self, count: int) -> None:
        async with asyncio.timeout(WAIT):
            while len(self.events) < count:
                await asyncio.sleep(0.01)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    events: list[EgressEvent] = []
    origin = Origin()
    server = await asyncio.start_server(origin.handle, "127.0.0.1", 0)
    origin.port = server.sockets[0].getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="eh-", dir="/tmp"))
    proxy = EgressProxy(on_event=events.append, idle_timeout=2.0, connect_timeout=3.0, io_timeout=3.0)
    await proxy.start()
    await proxy.attach("sb1", tmp / "proxy.sock", EgressPolicy.parse("none"))
    rig = Rig(proxy, tmp / "proxy.sock", events, origin)
    rig.policy("internet")
    try:
        yield rig
    finally:
        await proxy.close()
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def refused(rig: Rig, raw: bytes, status: int, words: str) -> str:
    """Send `raw`; check the answer is `status` with `words` in its reason, with the marker, as one event."""
    line, headers, body = await rig.request(raw)
    assert line.startswith(b"HTTP/1.1 %d " % status), line
    reason = line.decode()[13:]
    assert words in reason, reason
    assert headers["x-corral-egress"].startswith("error; ") and headers["connection"] == "close"
    assert body.split(b"\n")[0].decode() == reason
    await rig.settle(1)
    (event,) = rig.events
    assert not event.allowed and safe_text(event.reason) == reason
    assert event in rig.proxy.denials("sb1", 0)
    return reason


# -- 1. the request line and header lines ------------------------------------------------------------------------


@pytest.mark.parametrize("char", [b"\x00", b"\x01", b"\t", b"\x0b", b"\x1b", b"\x7f", b"\r", b"\n"])
async def test_control_characters_in_the_target_are_400_and_never_forwarded(rig: Rig, char: bytes):
    raw = b"GET %b/x%by HTTP/1.1\r\nHost: a\r\n\r\n" % (rig.base.encode(), char)
    reason = await refused(rig, raw, 400, "in the request target")
    assert repr(char.decode("latin-1")) in reason
    assert rig.origin.received == b""


async def test_a_space_in_the_target_is_400(rig: Rig):
    await refused(rig, f"GET {rig.base}/x y HTTP/1.1\r\n\r\n".encode(), 400, "invalid character ' ' in the request")
    assert rig.origin.received == b""


@pytest.mark.parametrize("line", [b"X-A: 1\x012", b"X-A: 1\x7f2", b"X-A: 1\x0b2", b"X-A: 1\x0c2", b"X-A: 1\x002",
                                  b"X-A: 1\r2", b"X-A: 1\n2", b"X-A: 1\x1f"])
async def test_control_characters_in_request_headers_are_400(rig: Rig, line: bytes):
    raw = b"GET %b/ HTTP/1.1\r\n%b\r\nHost: a\r\n\r\n" % (rig.base.encode(), line)
    reason = await refused(rig, raw, 400, "invalid character in header X-A")
    assert "1" not in reason.replace("HTTP/1", "")  # the value may be a secret: named, never echoed
    assert rig.origin.received == b""


@pytest.mark.parametrize(("line", "words"), [
    (b" folded", "obsolete line folding"),
    (b"\tfolded", "obsolete line folding"),
    (b"X-A : b", "malformed header line 'X-A '"),
    (b"X A: b", "malformed header line 'X A'"),
    (b": b", "malformed header line ''"),
    (b"X-\xe9: b", "malformed header line"),
    (b"no colon", "malformed header line"),
])
async def test_header_lines_outside_the_grammar_are_400(rig: Rig, line: bytes, words: str):
    raw = b"GET %b/ HTTP/1.1\r\nHost: a\r\n%b\r\n\r\n" % (rig.base.encode(), line)
    await refused(rig, raw, 400, words)
    assert rig.origin.received == b""


@pytest.mark.parametrize("raw", [
    b"GET http://a/ HTTP/1.1\nHost: a\r\n\r\n",
    b"GET http://a/ HTTP/1.1\r\nX: 1\n\r\n\r\n",
    b"GET http://a/ HTTP/2.0\r\n\r\n",
    b"GET http://a/ http/1.1\r\n\r\n",
    b"G\x00T http://a/ HTTP/1.1\r\n\r\n",
    b"GET http://a/ HTTP/1.1 \r\n\r\n",
])
async def test_malformed_request_lines_are_400(rig: Rig, raw: bytes):
    await refused(rig, raw, 400, "bad request: ")


async def test_obs_text_and_tabs_in_values_still_pass(rig: Rig):
    raw = b"GET %b/p?q=%%41 HTTP/1.1\r\nX-A:\t\xe9 t\tu \r\nX-B:\r\nConnection: close\r\n\r\n" % rig.base.encode()
    line, _, body = await rig.request(raw)
    assert line == b"HTTP/1.1 200 OK" and body == b"ok"
    assert rig.origin.received.startswith(b"GET /p?q=%41 HTTP/1.1\r\n")
    assert b"\r\nX-A: \xe9 t\tu\r\nX-B: \r\n" in rig.origin.received


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 O\rK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 O\nK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: 1\n2\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: 1\x0b2\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX-A: 1\x002\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
])
async def test_malformed_response_heads_are_502(rig: Rig, reply: bytes):
    rig.origin.reply = reply
    await refused(rig, f"GET {rig.base}/ HTTP/1.1\r\n\r\n".encode(), 502, "bad response from 127.0.0.1")


async def test_responses_follow_h11s_grammar_which_tolerates_other_control_characters(rig: Rig):
    """What real servers send (and h11, httpx, curl accept): a missing reason, a cookie with \\x01 in it."""
    rig.origin.reply = b"HTTP/1.1 200\r\nSet-Cookie: a=\x01b\r\nContent-Length: 2\r\n\r\nok"
    line, headers, body = await rig.request(f"GET {rig.base}/ HTTP/1.1\r\n\r\n".encode())
    assert line == b"HTTP/1.1 200" and headers["set-cookie"] == "a=\x01b" and body == b"ok"


@pytest.mark.parametrize("line", [b"X-A:" + b" " * 60_000 + b"\x00", b"X-A:" + b" \t" * 30_000 + b"\x01",
                                  b"X-A: a" + b" " * 60_000 + b"\x7f", b"X" * 60_000 + b" : a"])
async def test_long_malformed_header_lines_are_refused_in_linear_time(rig: Rig, line: bytes):
    """A grammar with two optional whitespace runs side by side takes 20 s on these (the event loop of every
    sandbox's proxy); requests and responses alike."""
    begun = time.monotonic()
    await refused(rig, b"GET %b/ HTTP/1.1\r\n%b\r\n\r\n" % (rig.base.encode(), line), 400, "header")
    line = line[:-1] + b"\x00"  # a response may hold other control characters
    rig.origin.reply = b"HTTP/1.1 200 OK\r\n%b\r\nContent-Length: 0\r\n\r\n" % line
    line_, _, _ = await rig.request(f"GET {rig.base}/ HTTP/1.1\r\n\r\n".encode())
    assert line_.startswith(b"HTTP/1.1 502 ") and time.monotonic() - begun < 2


# -- 2. Transfer-Encoding and chunked bodies ---------------------------------------------------------------------


@pytest.mark.parametrize("codings", [[b"chunked, identity"], [b"identity, chunked"], [b"gzip, chunked"],
                                     [b"chunked, chunked"], [b"chunked", b"chunked"], [b"identity"], [b""],
                                     [b"chunked;q=1"], [b"xchunked"], [b",chunked"]])
async def test_request_transfer_codings_other_than_exactly_chunked_are_400(rig: Rig, codings: list[bytes]):
    te = b"".join(b"Transfer-Encoding: %b\r\n" % c for c in codings)
    raw = b"POST %b/ HTTP/1.1\r\n%b\r\n5\r\nhello\r\n0\r\n\r\n" % (rig.base.encode(), te)
    await refused(rig, raw, 400, "Transfer-Encoding")
    assert rig.origin.received == b""


async def test_transfer_encoding_in_an_http10_request_is_400(rig: Rig):
    raw = b"POST %b/ HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" % rig.base.encode()
    await refused(rig, raw, 400, "HTTP/1.0")
    assert rig.origin.received == b""


BODY_END = b"0\r\nX-T: t\r\n\r\n"


async def test_chunk_extensions_and_trailers_that_follow_the_grammar_pass_exactly(rig: Rig):
    body = b'5;a=b ; c="q\\"\\tv";d\r\nhello\r\n3 \r\nabc\r\n' + BODY_END
    rig.origin.body_end = BODY_END
    raw = b"POST %b/ HTTP/1.1\r\nTransfer-Encoding: Chunked\r\nConnection: close\r\n\r\n%b" % (rig.base.encode(), body)
    line, _, got = await rig.request(raw)
    assert line == b"HTTP/1.1 200 OK" and got == b"ok"
    assert rig.origin.received.endswith(b"\r\n\r\n" + body)


@pytest.mark.parametrize(("body", "words"), [
    (b"5;ext\nx\r\nhello\r\n0\r\n\r\n", "malformed chunk extension"),
    (b"5;e=a\rb\r\nhello\r\n0\r\n\r\n", "malformed chunk extension"),
    (b"5;e=\x01\r\nhello\r\n0\r\n\r\n", "malformed chunk extension"),
    (b'5;e="a\nb"\r\nhello\r\n0\r\n\r\n', "malformed chunk extension"),
    (b"5;\r\nhello\r\n0\r\n\r\n", "malformed chunk extension"),
    (b"5\nhello\r\n0\r\n\r\n", "malformed chunk size"),
    (b"0\r\nX-T: a\nb\r\n\r\n", "malformed trailer line"),
    (b"0\r\nX-T: a\x01\r\n\r\n", "malformed trailer line"),
    (b"0\r\nX-T: a\rb\r\n\r\n", "malformed trailer line"),
    (b"0\r\nbad trailer\r\n\r\n", "malformed trailer line"),
    (b"0\r\n folded\r\n\r\n", "malformed trailer line"),
])
async def test_malformed_chunk_lines_in_a_request_body_are_400(rig: Rig, body: bytes, words: str):
    """The bad line never goes upstream (a desync needs it there); the origin, left waiting, is cut off."""
    rig.origin.reply = None
    raw = b"POST %b/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n%b" % (rig.base.encode(), body)
    await refused(rig, raw, 400, words)
    bad = body.split(b"\r\n")[0] if words != "malformed trailer line" else body.split(b"\r\n")[1]
    assert rig.origin.received.startswith(b"POST / HTTP/1.1\r\n") and bad not in rig.origin.received


@pytest.mark.parametrize("body", [b"5;e=a\nb\r\nhello\r\n0\r\n\r\n", b"5\r\nhello\r\n0\r\nX-T: a\rb\r\n\r\n"])
async def test_malformed_chunk_lines_in_a_response_are_502(rig: Rig, body: bytes):
    rig.origin.reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    line, _, got = await rig.request(f"GET {rig.base}/ HTTP/1.1\r\n\r\n".encode())
    assert line.startswith(b"HTTP/1.1 502 ") and b"malformed" in line, line
    assert b"hello" not in got


# -- 3. Content-Length -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "words"), [
    ([b"9" * 5000], "Content-Length of 5000 digits"),
    ([b"1" + b"0" * 18], "Content-Length of 19 digits"),
    ([b"5", b"5"], "more than one Content-Length"),
    ([b"5", b"6"], "more than one Content-Length"),
    ([b"5, 5"], "invalid Content-Length"),
    ([b"+5"], "invalid Content-Length"),
    ([b"-1"], "invalid Content-Length"),
    ([b"5 5"], "invalid Content-Length"),
    ([b"\xb2"], "invalid Content-Length"),  # '\xb2' (superscript two) is a digit to str.isdigit()
    ([b""], "invalid Content-Length"),
])
async def test_bad_request_content_lengths_are_400(rig: Rig, lengths: list[bytes], words: str,
                                                   caplog: pytest.LogCaptureFixture):
    cl = b"".join(b"Content-Length: %b\r\n" % v for v in lengths)
    await refused(rig, b"POST %b/ HTTP/1.1\r\n%b\r\nhello" % (rig.base.encode(), cl), 400, words)
    assert rig.origin.received == b""
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_content_length_and_transfer_encoding_together_are_400(rig: Rig):
    raw = b"POST %b/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n" % rig.base.encode()
    await refused(rig, raw, 400, "both Transfer-Encoding and Content-Length")
    assert rig.origin.received == b""


@pytest.mark.parametrize("length", [b"9" * 5000, b"5, 6", b"x"])
async def test_bad_response_content_lengths_are_502(rig: Rig, length: bytes, caplog: pytest.LogCaptureFixture):
    rig.origin.reply = b"HTTP/1.1 200 OK\r\nContent-Length: %b\r\n\r\nhello" % length
    await refused(rig, f"GET {rig.base}/ HTTP/1.1\r\n\r\n".encode(), 502, "Content-Length")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


MALFORMED = [
    b"\xff\xfe\xfd\r\n\r\n",
    b"\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET  HTTP/1.1\r\n\r\n",
    b"GET http:// HTTP/1.1\r\n\r\n",
    b"GET http://[::1 HTTP/1.1\r\n\r\n",
    b"GET http://[zz]/ HTTP/1.1\r\n\r\n",
    b"GET http://a.org:" + b"9" * 5000 + b"/ HTTP/1.1\r\n\r\n",
    b"CONNECT a.org:" + b"9" * 5000 + b" HTTP/1.1\r\n\r\n",
    b"CONNECT :443 HTTP/1.1\r\n\r\n",
    b"CONNECT \xc3\x28.org:443 HTTP/1.1\r\n\r\n",
    b"CONNECT \xe2\x98\x83.org:443 HTTP/1.1\r\n\r\n",
    b"CONNECT xn--zz.org:443 HTTP/1.1\r\n\r\n",
    b"GET http://" + b"a." * 200 + b"org/ HTTP/1.1\r\n\r\n",
    b"GET /pypi/x HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
    b"GET /_corral/dns?name=x HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
    b"GET /_corral/dns?name=%ff%00 HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
]


async def test_no_malformed_input_gets_a_traceback_or_no_answer(rig: Rig, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG)
    for raw in MALFORMED:
        line, _, _ = await rig.request(raw)
        assert line.startswith((b"HTTP/1.1 4", b"HTTP/1.1 5")), (raw[:60], line)
    await rig.settle(len(MALFORMED))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


async def test_a_body_sent_to_the_proxy_itself_ends_the_connection(rig: Rig):
    """The DNS report reads no body: what follows the head is that body, never the next request."""
    line, headers, body = await rig.request(b"GET /_corral/dns?name=a.test HTTP/1.1\r\nContent-Length: 36\r\n\r\n"
                                            b"GET http://a.test/ HTTP/1.1\r\n\r\n")
    assert line == b"HTTP/1.1 204 No Content" and headers["connection"] == "close" and body == b""
    await rig.settle(1)
    assert [e.kind for e in rig.events] == ["dns"]


# -- 4. response framing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("te", [b"chunked", b"gzip, chunked"])
async def test_a_chunked_response_loses_its_content_length(rig: Rig, te: bytes):
    rig.origin.reply = (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: %b\r\n\r\n"
                        b"5\r\nhello\r\n0\r\n\r\n" % te)
    line, headers, body = await rig.request(f"GET {rig.base}/ HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    assert line == b"HTTP/1.1 200 OK" and headers["transfer-encoding"] == te.decode()
    assert "content-length" not in headers and body == b"5\r\nhello\r\n0\r\n\r\n"


async def test_a_response_not_finally_chunked_is_read_until_close(rig: Rig):
    rig.origin.reply = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\nContent-Length: 3\r\n\r\nnot chunks"
    line, headers, body = await rig.request(f"GET {rig.base}/ HTTP/1.1\r\n\r\n".encode())
    assert line == b"HTTP/1.1 200 OK" and headers["connection"] == "close"
    assert "content-length" not in headers and body == b"not chunks"


# -- 5. host names: IDNA 2008 with UTS 46 mapping ----------------------------------------------------------------


@pytest.mark.parametrize(("rule", "wire"), [
    ("straße.de", "xn--strae-oqa.de"),
    ("*.straße.de:443", "*.xn--strae-oqa.de:443"),
    ("XN--STRAE-OQA.de", "xn--strae-oqa.de"),
    ("\uff22\u00fccher\uff0e\uff24\uff25", "xn--bcher-kva.de"),  # full-width B, dot, D, E
    ("\uff21\uff22\uff23.com", "abc.com"),
    ("ςόλος.gr", "xn--wxaihc1c.gr"),
    ("\uff11\uff12\uff17\uff0e\uff10\uff0e\uff10\uff0e\uff11", "127.0.0.1"),  # full-width
])
def test_rules_are_idna_2008_with_uts46_mapping(rule: str, wire: str):
    assert EgressPolicy.parse([rule]).to_wire() == [wire]


def test_clients_sending_a_labels_match_unicode_rules():
    policy = EgressPolicy.parse(["straße.de", "*.ςόλος.gr"])
    for host in ("xn--strae-oqa.de", "XN--STRAE-OQA.DE.", "straße.de", "STRASSE.de"):
        assert policy.check(normalize_host(host), 443).allowed is (host != "STRASSE.de"), host
    assert policy.check(normalize_host("a.xn--wxaihc1c.gr"), 443).allowed


@pytest.mark.parametrize(("rule", "words"), [
    ("xn--zz.de", "not a valid IDNA 2008 host name"),
    ("xn--abc-.de", "not a valid IDNA 2008 host name"),
    ("xn--n3h.net", "not a valid IDNA 2008 host name"),  # the A-label of '☃.net' (IDNA 2003 only)
    ("☃.net", "not a valid IDNA 2008 host name"),
    ("\u0301a.de", "not a valid IDNA 2008 host name"),
    ("a\u200cb.de", "not a valid IDNA 2008 host name"),
    ("bü_cher.de", "not a valid IDNA 2008 host name"),
    ("a.org:" + "9" * 5000, "bad port"),
])
def test_invalid_names_in_rules_are_clear_errors(rule: str, words: str):
    with pytest.raises(InvalidRequestError) as info:
        EgressPolicy.parse([rule])
    assert info.value.message.startswith(f"invalid network rule {rule!r}: ") and words in info.value.message


@pytest.mark.parametrize("target", [b"xn--strae-oqa.invalid:443", b"XN--STRAE-OQA.invalid:443",
                                    "straße.invalid:443".encode()])
@pytest.mark.parametrize("form", ["connect", "absolute"])
async def test_the_proxy_matches_a_labels_against_unicode_rules(rig: Rig, target: bytes, form: str):
    """Allowed by the rule, so the refusal is the name's resolution (.invalid never resolves), not the policy."""
    rig.policy(["straße.invalid"])
    if form == "connect":
        raw = b"CONNECT %b HTTP/1.1\r\n\r\n" % target
    else:
        raw = b"GET http://%b/ HTTP/1.1\r\n\r\n" % target
    await refused(rig, raw, 502, "cannot resolve xn--strae-oqa.invalid")
    assert rig.events[0].host == "xn--strae-oqa.invalid" and rig.events[0].rule == "unresolvable"


@pytest.mark.parametrize("target", [b"xn--zz.example:443", b"\xe2\x98\x83.example:443", b"\xc3\x28.example:443"])
async def test_invalid_requested_names_are_400_with_the_reason(rig: Rig, target: bytes):
    await refused(rig, b"CONNECT %b HTTP/1.1\r\n\r\n" % target, 400, "invalid host")
