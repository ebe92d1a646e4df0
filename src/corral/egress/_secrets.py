"""Secrets at egress: what the proxy puts into requests to bound hosts, and takes out of their answers
(docs/secrets.md).

A sandbox holds a `placeholder` per secret (`corral-secret-<32 hex>`, unique to the sandbox), never the value.
In a request to a host the secret is bound to (on the binding's port, where it names one), the proxy replaces the
placeholder by the value in the request line and headers (also inside `Authorization: Basic`, whose credentials
are base64) and, when the secret opts in, in the body. In every answer from an intercepted host, each value of
the sandbox's secrets (verbatim or percent-encoded) goes back to its placeholder, and so does every encoded form of
a value the proxy itself made (the Basic credentials it encoded again, verbatim or percent-encoded: `Produced`), so
a server that echoes a request cannot hand the value to the sandbox. Requests to other hosts are never rewritten:
they carry the placeholder. Forms the proxy did not make (a value base64-encoded with other bytes, hex, JSON
escapes) are not recognised: docs/secrets.md, "Limits".
"""

from __future__ import annotations

import base64
import re
import secrets
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ._hosts import Rule

__all__ = ["BODY_MAX", "MAX_FORMS", "PLACEHOLDER", "FormsFull", "Injection", "Produced", "Scrubber", "SecretBinding",
           "new_placeholder"]

PLACEHOLDER = re.compile(r"corral-secret-[0-9a-f]{32}")
BODY_MAX = 8 * 1024 * 1024  # a request body rewritten for a secret is read whole: bounded
MAX_FORMS = 64  # distinct Basic credentials with secrets one sandbox may have the proxy build


def new_placeholder() -> str:
    """Letters, digits and '-' only: it survives URL encoding, base64 decoding and shell quoting unchanged."""
    return f"corral-secret-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class SecretBinding:
    """One secret as the proxy uses it: the value is only ever in this process's memory."""

    name: str
    placeholder: str
    value: str = field(repr=False)
    # Host rules, as network rules are written (`_hosts.Rule`): "api.example.com" on any port, "127.0.0.1:8080" on
    # that port alone, "*.example.com" its subdomains (not itself).
    hosts: tuple[str, ...]
    body: bool = False  # also in request bodies
    rules: tuple[Rule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(Rule.parse(h, what="secret host") for h in self.hosts))

    def binds(self, host: str, port: int) -> bool:
        """Whether a request to `host` (normalised) on `port` gets this secret."""
        return any(rule.matches(host, port) for rule in self.rules)


def bound(bindings: Iterable[SecretBinding], host: str, port: int) -> tuple[SecretBinding, ...]:
    return tuple(b for b in bindings if b.binds(host, port))


class FormsFull(Exception):
    """A sandbox asked for one more encoded form than `Produced` keeps."""


class Produced:
    """The encoded forms of values the proxy made for one sandbox (Basic credentials, base64 again after the
    placeholders were replaced), each with the form the sandbox sent: answers get the sandbox's form back.

    Kept for as long as the proxy serves the sandbox, not per request: a server may hand back later, on another
    connection, what a request brought. So that one cannot be pushed out by others, the set is bounded by refusing
    (`FormsFull`, at `MAX_FORMS`), never by forgetting."""

    def __init__(self) -> None:
        self._forms: dict[str, str] = {}

    def add(self, made: str, sent: str) -> None:
        if made not in self._forms and len(self._forms) >= MAX_FORMS:
            raise FormsFull(made)
        self._forms[made] = sent

    def pairs(self) -> dict[bytes, bytes]:
        """Each form made and its percent-encoding (base64's '+', '/' and '=' are escaped in URLs) -> the sent one."""
        pairs: dict[bytes, bytes] = {}
        for made, sent in self._forms.items():
            pairs[made.encode()] = sent.encode()
            pairs[urllib.parse.quote(made, safe="").encode()] = urllib.parse.quote(sent, safe="").encode()
        return pairs


class Injection:
    """The placeholders of the secrets bound to one host, replaced in one request; `used` names those that were.
    The encoded forms it makes go into `produced`."""

    def __init__(self, bindings: tuple[SecretBinding, ...], produced: Produced | None = None) -> None:
        self.bindings = bindings
        self.produced = produced if produced is not None else Produced()
        self.used: set[str] = set()

    def text(self, text: str) -> str:
        """A request line or header value (latin-1 text, as heads are read): each placeholder -> its value's
        UTF-8 bytes."""
        for b in self.bindings:
            if b.placeholder in text:
                text = text.replace(b.placeholder, b.value.encode().decode("latin-1"))
                self.used.add(b.name)
        return text

    def header(self, name: str, value: str) -> str:
        """`Authorization: Basic ...` hides a placeholder in base64 (git, pip and curl put URL credentials
        there): decoded, replaced, encoded again."""
        if name.lower() == "authorization":
            scheme, _, credentials = value.partition(" ")
            if scheme.lower() == "basic":
                try:
                    decoded = base64.b64decode(credentials.strip(), validate=True).decode("latin-1")
                except ValueError:
                    return self.text(value)
                replaced = self.text(decoded)
                if replaced != decoded:
                    made = base64.b64encode(replaced.encode("latin-1")).decode()
                    self.produced.add(made, credentials.strip())
                    return f"{scheme} {made}"
        return self.text(value)

    def body(self, data: bytes) -> bytes:
        for b in self.bindings:
            if b.body and b.placeholder.encode() in data:
                data = data.replace(b.placeholder.encode(), b.value.encode())
                self.used.add(b.name)
        return data

    @property
    def rewrites_body(self) -> bool:
        return any(b.body for b in self.bindings)


class Scrubber:
    """Streams an answer's bytes with every value of the sandbox's secrets replaced by its placeholder, also where
    a value is split between two reads: the last `len(longest value) - 1` bytes wait for the next.

    Each read is first searched for each value as a plain substring (`in`: several GB/s, where the alternation
    regex over all values runs at ~1 GB/s for one secret and ~130 MB/s for three); only the values found there go
    into a regex, which then finds their leftmost-longest occurrences exactly as one over all values would (a
    value absent from the buffer matches nowhere in it).

    `forms`: more forms to replace, each by its own replacement (`Produced.pairs`)."""

    def __init__(self, bindings: Iterable[SecretBinding], forms: Mapping[bytes, bytes] | None = None) -> None:
        pairs: dict[bytes, bytes] = dict(forms or {})
        for b in bindings:
            pairs[b.value.encode()] = b.placeholder.encode()
            pairs[urllib.parse.quote(b.value, safe="").encode()] = b.placeholder.encode()
        self._pairs = pairs
        self._ordered = sorted(pairs, key=len, reverse=True)  # the longest form first where two start at one place
        self._patterns: dict[tuple[bytes, ...], re.Pattern[bytes]] = {}
        self._pattern = self._compile(tuple(self._ordered)) if self._ordered else None
        self._keep = max((len(p) for p in self._ordered), default=1) - 1
        self._spaced = tuple(p for p in self._ordered if b" " in p)
        self._pending = b""
        self.hits = 0

    def _compile(self, values: tuple[bytes, ...]) -> re.Pattern[bytes]:
        pattern = self._patterns.get(values)
        if pattern is None:
            pattern = self._patterns[values] = re.compile(b"|".join(re.escape(p) for p in values))
        return pattern

    def text(self, text: str) -> str:
        """A piece of a head (latin-1 text): the reason phrase, a header's name or value."""
        return self._replace(text.encode("latin-1")).decode("latin-1")

    def replace(self, data: bytes) -> bytes:
        """Bytes complete in themselves (a whole head), not part of the stream `feed` scrubs."""
        return self._replace(data)

    def straddles(self, head: bytes) -> bool:
        """Whether a value shows in a head assembled from pieces `text` scrubbed one by one. Pieces are joined with
        ' ', ': ' and CRLF, and no value holds CR or LF, so only a value with a space can span two of them."""
        return any(p in head for p in self._spaced)

    def feed(self, data: bytes) -> bytes:
        return b"".join(self.feed_parts(data))

    def feed_parts(self, data: bytes) -> list[bytes | memoryview]:
        """What `feed` returns, as pieces to join (or frame) with one copy: the bytes held back from the last
        read, then views of this one."""
        if self._pattern is None:
            return [data]
        pending = self._pending
        found = tuple(p for p in self._ordered if p in data)
        if pending:
            # A value split across reads lies within the held-back bytes and the first len(value) - 1 of these.
            seam = pending + data[:self._keep]
            found += tuple(p for p in self._ordered if p not in found and p in seam)
        if not found:
            view = memoryview(data)
            if len(data) >= self._keep:
                cut = len(data) - self._keep
                self._pending = bytes(view[cut:])
                return [pending, view[:cut]]
            keep_all = pending + data  # shorter than a value: all of it may start one
            cut = max(0, len(keep_all) - self._keep)
            self._pending = keep_all[cut:]
            return [keep_all[:cut]]
        buffer = pending + data
        safe = len(buffer) - self._keep  # a value starting before here is wholly in the buffer
        out: list[bytes | memoryview] = []
        at = 0
        for match in self._compile(found).finditer(buffer):
            if match.start() >= safe:
                break
            out += [buffer[at:match.start()], self._pairs[match.group()]]
            at = match.end()
            self.hits += 1
        cut = max(at, safe)
        out.append(buffer[at:cut])
        self._pending = buffer[cut:]
        return out

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._replace(rest)

    def _replace(self, data: bytes) -> bytes:
        if self._pattern is None:
            return data
        replaced, count = self._pattern.subn(lambda m: self._pairs[m.group()], data)
        self.hits += count
        return replaced
