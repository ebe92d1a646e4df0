"""The answer scrub of the rewriting path without sandboxes (docs/secrets.md, issue 29 items 1-3): the encoded forms
the proxy made, the whole head (reason phrase, header names, the words of a refusal), and transfer-codings.
tests/test_secrets_reflection.py proves the same through real sandboxes and the real proxy."""

from __future__ import annotations

import asyncio
import base64
import random
import urllib.parse
from typing import Any

import pytest

from corral.egress._http import parse_response
from corral.egress._reasons import Refusal
from corral.egress._rewrite import Rewriter
from corral.egress._secrets import MAX_FORMS, FormsFull, Injection, Produced, Scrubber, SecretBinding, new_placeholder

A = SecretBinding("A", new_placeholder(), "tok-AAAA/+=", ("api.example.com",))
SPACED = SecretBinding("S", new_placeholder(), "key: abc", ("api.example.com",))


def _basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


def test_the_basic_credentials_made_are_kept_and_scrubbed_back_to_what_was_sent() -> None:
    produced = Produced()
    sent = _basic(f"ab:{A.placeholder}")
    made = Injection((A,), produced).header("Authorization", sent)
    assert made == _basic(f"ab:{A.value}")
    form, theirs = made.split()[1], sent.split()[1]
    quoted, quoted_theirs = urllib.parse.quote(form, safe=""), urllib.parse.quote(theirs, safe="")
    assert quoted != form
    data = f'{{"authorization": "{made}", "q": "{quoted}", "raw": "{A.value}"}}'.encode()
    expected = f'{{"authorization": "{sent}", "q": "{quoted_theirs}", "raw": "{A.placeholder}"}}'.encode()
    rng = random.Random(3)
    for _ in range(50):  # split anywhere: the forms are held back across reads as values are
        scrub = Scrubber([A], produced.pairs())
        out, at = [], 0
        while at < len(data):
            n = rng.randrange(1, 20)
            out.append(scrub.feed(data[at:at + n]))
            at += n
        assert b"".join(out) + scrub.flush() == expected
    # A scrubber made without them (before the fix: every answer's) hands the value back in base64.
    assert form.encode() in Scrubber([A]).replace(data)


def test_forms_are_bounded_by_refusing_not_forgetting() -> None:
    produced = Produced()
    injection = Injection((A,), produced)
    for i in range(MAX_FORMS):
        injection.header("Authorization", _basic(f"u{i}:{A.placeholder}"))
    injection.header("Authorization", _basic(f"u0:{A.placeholder}"))  # one made before: no new room needed
    with pytest.raises(FormsFull):
        injection.header("Authorization", _basic(f"u{MAX_FORMS}:{A.placeholder}"))
    assert len(produced.pairs()) >= MAX_FORMS  # and the first is still scrubbed
    assert base64.b64encode(f"u0:{A.value}".encode()) in produced.pairs()


def _rewriter(*bindings: SecretBinding) -> Rewriter:
    none: Any = (None, None)  # the streams are not used by what these tests call
    rewriter = Rewriter(none, none, host="api.example.com", port=443, secrets=bindings, timeout=5,
                        sent_up=lambda n: None,
                        sent_down=lambda n: None)
    rewriter.scrub = Scrubber(bindings)
    return rewriter


def _head(text: str) -> Any:
    return parse_response(text.encode("latin-1"))


def test_every_piece_of_the_head_is_scrubbed() -> None:
    rewriter = _rewriter(A)
    q = urllib.parse.quote(A.value, safe="")
    head = _head(f"HTTP/1.1 200 ok {A.value}\r\nX-{q}: 1\r\nX-Echo: {A.value}\r\nContent-Length: 2\r\n\r\n")
    out = rewriter._client_head(head, chunked=True, close=False, rewritten=True).decode("latin-1")
    assert A.value not in out and q not in out
    assert out.startswith(f"HTTP/1.1 200 ok {A.placeholder}\r\nX-{A.placeholder}: 1\r\nX-Echo: {A.placeholder}\r\n")
    assert parse_response(out.encode("latin-1"))  # still a well-formed head


def test_a_value_with_a_space_spanning_two_pieces_refuses_the_answer() -> None:
    rewriter = _rewriter(SPACED)
    with pytest.raises(Refusal) as caught:
        rewriter._client_head(_head("HTTP/1.1 200 OK\r\nX-key: abc\r\n\r\n"), chunked=False, close=False)
    assert caught.value.status == 502 and "across two of its parts" in caught.value.reason
    # within one piece it is replaced as any value is
    out = rewriter._client_head(_head("HTTP/1.1 200 OK\r\nX-A: key: abc\r\n\r\n"), chunked=False, close=False)
    assert b"key: abc" not in out and SPACED.placeholder.encode() in out


@pytest.mark.parametrize(("head", "ok"), [
    ("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True),
    ("HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n", True),
    ("HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n", True),
    ("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", False),
    ("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n", False),
    ("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", False),
    ("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", False),
    ("HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", False),
])
def test_only_chunked_or_no_transfer_coding_is_passed_on(head: str, ok: bool) -> None:
    rewriter = _rewriter(A)
    if ok:
        rewriter._framing(_head(head))
        return
    with pytest.raises(Refusal) as caught:
        rewriter._framing(_head(head))
    assert caught.value.status == 502 and "Transfer-Encoding" in caught.value.reason


@pytest.mark.parametrize("head", [
    "HTTP/1.1 2000 {v}\r\n\r\n",                                   # a malformed status line, quoted
    "HTTP/1.1 200 OK\r\nContent-Length: {v}\r\n\r\n",              # an invalid length, quoted to 20 characters
    "HTTP/1.1 200 OK\r\nContent-Encoding: {V}\r\n\r\n",            # an unknown coding, named (lower-cased once)
    "HTTP/1.1 200 OK\r\nTransfer-Encoding: {v}, chunked\r\n\r\n",  # an unknown transfer-coding, named
])
@pytest.mark.anyio
async def test_the_words_of_a_refusal_carry_no_value(head: str) -> None:
    long = SecretBinding("L", new_placeholder(), "LongValue-" + "x1" * 30, ("api.example.com",))
    rewriter = _rewriter(long)
    reader = asyncio.StreamReader()
    reader.feed_data(head.format(v=long.value, V=long.value).encode())
    rewriter.upstream_reader = reader
    with pytest.raises(Refusal) as caught:  # each step as `_response` takes it
        parsed = await rewriter._read_head()
        rewriter._framing(parsed)
        rewriter._decoder(parsed)
    text = caught.value.reason.lower()
    assert caught.value.status == 502 and long.value[:10].lower() not in text, text


def test_a_malformed_head_is_described_from_its_scrubbed_bytes() -> None:
    rewriter = _rewriter(A)
    text = rewriter._fault(f"HTTP/1.1 2000 {A.value}\r\n\r\n".encode())
    assert "malformed status line" in text and A.value not in text and A.placeholder[:20] in text
