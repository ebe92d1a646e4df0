"""Checks: what a step's `Outcome` must show, each naming the failure mode its failure reveals.

A check's `verify` returns None when it holds, else a `Failure` with the mode and a detail a person can act on
("got 4096 of 10485760 bytes: the data stopped at the NUL byte at offset 4096"). Byte comparisons go through
`classify_bytes`, which tells a NUL cut from a silent truncation from a text re-encoding, so the report names
what really happened rather than "mismatch".

A step that errors fails with the mode of its `Ok` check (default `sandbox_unavailable`; a 500 is always
`unstructured_error`) unless a `Fails` check expected it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import ClassVar

from ._blob import Blob
from ._outcome import Outcome

__all__ = [
    "Check",
    "CodeError",
    "CodeText",
    "Data",
    "Denied",
    "Duration",
    "ExitCode",
    "Fails",
    "Failure",
    "Ok",
    "Oom",
    "RichResult",
    "Stderr",
    "Stdout",
    "TimedOut",
    "Truncated",
    "classify_bytes",
]


@dataclass(frozen=True)
class Failure:
    mode: str
    detail: str


def _clip(data: bytes | str, limit: int = 300) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = text.strip()
    return text if len(text) <= limit else f"...{text[-limit:]}"


def _as_bytes(value: Blob | bytes | str) -> bytes:
    if isinstance(value, Blob):
        return value.bytes()
    return value.encode() if isinstance(value, str) else value


def classify_bytes(expected: bytes, got: bytes, *, what: str = "data") -> Failure | None:
    """None when equal; else the failure mode that best explains how `got` differs from `expected`."""
    if got == expected:
        return None
    n, m = len(got), len(expected)
    if n < m and expected.startswith(got):
        if expected[n] == 0:
            return Failure("nul_truncation", f"{what}: got {n} of {m} bytes; it stopped at the NUL byte at offset {n}")
        return Failure("silent_output_truncation", f"{what}: got only the first {n} of {m} bytes, with no notice")
    if got.replace(b"\r\n", b"\n") == expected:
        return Failure("binary_corruption", f"{what}: line endings were translated to CRLF")
    if got == expected.decode("utf-8", "replace").encode():
        return Failure("binary_corruption", f"{what}: decoded as UTF-8 text with replacement characters and "
                                            f"re-encoded ({m} -> {n} bytes)")
    if got == expected.decode("latin-1").encode():
        return Failure("binary_corruption", f"{what}: bytes were re-encoded as Latin-1 text ({m} -> {n} bytes)")
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(n, m))
    return Failure("binary_corruption",
                   f"{what}: {n} bytes (sha256 {hashlib.sha256(got).hexdigest()[:16]}) instead of {m} "
                   f"(sha256 {hashlib.sha256(expected).hexdigest()[:16]}); first difference at offset {first}")


class Check:
    """Base of every check: `mode` is what a failure of this check reveals; `requires`, the capabilities of the
    service (`CAPABILITIES`) without which the check cannot hold (its task is then skipped, `Task.needs`)."""

    mode: str
    requires: ClassVar[frozenset[str]] = frozenset()

    def verify(self, o: Outcome) -> Failure | None:
        raise NotImplementedError

    def fail(self, detail: str, mode: str | None = None) -> Failure:
        return Failure(mode or self.mode or "wrong_result", detail)


@dataclass(frozen=True)
class Ok(Check):
    """The step succeeded (no error). Names the mode an unexpected error reveals."""

    mode: str = "sandbox_unavailable"

    def verify(self, o: Outcome) -> Failure | None:
        if o.error is None:
            return None
        if (o.error.status or 0) >= 500 and o.error.code == "server_error":
            return self.fail(f"{o.error.code} ({o.error.status}): {_clip(o.error.message)}", "unstructured_error")
        return self.fail(f"{o.error.code}: {_clip(o.error.message)}")


@dataclass(frozen=True)
class Fails(Check):
    """The step must fail with an error of `code` (one of them, if a tuple) whose message matches `matches`."""

    code: str | tuple[str, ...] = "invalid_request"
    matches: str | None = None
    mode: str = "path_traversal_accepted"

    def verify(self, o: Outcome) -> Failure | None:
        codes = (self.code,) if isinstance(self.code, str) else self.code
        if o.error is None:
            return self.fail(f"the step succeeded ({o.summary()}); expected a {'/'.join(codes)} error")
        if o.error.code not in codes:
            mode = "unstructured_error" if (o.error.status or 0) >= 500 else self.mode
            return self.fail(f"expected {'/'.join(codes)}, got {o.error.code}: {_clip(o.error.message)}", mode)
        if self.matches and not re.search(self.matches, o.error.message, re.I | re.S):
            return self.fail(f"the {o.error.code} error does not say /{self.matches}/: {_clip(o.error.message)}",
                             "unclear_error")
        return None


@dataclass(frozen=True)
class ExitCode(Check):
    code: int = 0
    mode: str = "wrong_exit_code"

    def verify(self, o: Outcome) -> Failure | None:
        if o.exit_code == self.code:
            return None
        how = f"exit {o.exit_code}" + (f", signal {o.signal}" if o.signal else "")
        flags = [f for f in ("timed_out", "oom_killed") if getattr(o, f)]
        return self.fail(f"{how}{' (' + ', '.join(flags) + ')' if flags else ''}, expected exit {self.code}; "
                         f"stderr: {_clip(o.stderr)!r}")


@dataclass(frozen=True)
class _Text(Check):
    equals: Blob | bytes | str | None = None
    contains: bytes | str | None = None
    matches: str | None = None
    absent: bytes | str | None = None
    mode: str = ""  # "": `equals` is classified (`classify_bytes`), the rest are `wrong_result`

    stream = "stdout"

    def verify(self, o: Outcome) -> Failure | None:
        got = o.stdout if self.stream == "stdout" else o.stderr
        if self.equals is not None:
            found = classify_bytes(_as_bytes(self.equals), got, what=self.stream)
            if found is not None:
                # A check that names its own mode (stdin echo, say) keeps the classifier's explanation.
                return Failure(self.mode or found.mode, found.detail)
        if self.contains is not None and _as_bytes(self.contains) not in got:
            return self.fail(f"{self.stream} lacks {_clip(_as_bytes(self.contains), 120)!r}: {_clip(got)!r}")
        if self.matches is not None and not re.search(self.matches.encode(), got, re.S | re.M):
            return self.fail(f"{self.stream} does not match /{self.matches}/: {_clip(got)!r}")
        if self.absent is not None and _as_bytes(self.absent) in got:
            return self.fail(f"{self.stream} contains {_clip(_as_bytes(self.absent), 120)!r}: {_clip(got)!r}")
        return None


@dataclass(frozen=True)
class Stdout(_Text):
    """The command's stdout: `equals` (exact bytes), `contains`, `matches` (a regex), `absent`."""

    stream = "stdout"


@dataclass(frozen=True)
class Stderr(_Text):
    """The command's stderr, as `Stdout`."""

    stream = "stderr"


@dataclass(frozen=True)
class Data(Check):
    """The bytes a `Read` brought back equal `equals`; mode from `classify_bytes` unless `mode` is given."""

    equals: Blob | bytes | str = b""
    mode: str = ""

    def verify(self, o: Outcome) -> Failure | None:
        if o.data is None:
            return self.fail(f"nothing was read ({o.summary()})", self.mode or "sandbox_unavailable")
        found = classify_bytes(_as_bytes(self.equals), o.data, what="downloaded file")
        if found is None:
            return None
        return Failure(self.mode or found.mode, found.detail)


@dataclass(frozen=True)
class TimedOut(Check):
    """The command was stopped by its timeout, said so, and the call returned within `within` seconds."""

    within: float | None = None
    mode: str = "timeout_not_enforced"

    def verify(self, o: Outcome) -> Failure | None:
        if not o.timed_out:
            return self.fail(f"not reported as timed out ({o.summary()}) after {o.duration:.1f} s")
        if self.within is not None and o.duration > self.within:
            return self.fail(f"timed out, but the call took {o.duration:.1f} s (allowed {self.within:.1f} s)")
        return None


@dataclass(frozen=True)
class Oom(Check):
    """The command was killed for memory and the outcome says so."""

    mode: str = "oom_not_reported"

    def verify(self, o: Outcome) -> Failure | None:
        return None if o.oom_killed else self.fail(f"not reported as OOM-killed ({o.summary()})")


@dataclass(frozen=True)
class Truncated(Check):
    """Output went over the cap: flagged as truncated, with the true size kept (`size`, when known)."""

    size: int | None = None
    mode: str = "silent_output_truncation"
    requires: ClassVar[frozenset[str]] = frozenset({"output_cap"})

    def verify(self, o: Outcome) -> Failure | None:
        if not o.truncated:
            return self.fail(f"not flagged as truncated ({o.summary()}, {len(o.stdout)} bytes kept)")
        if self.size is not None and o.stdout_size != self.size:
            return self.fail(f"truncated, but the reported size is {o.stdout_size}, not {self.size}")
        return None


@dataclass(frozen=True)
class Denied(Check):
    """The policy refused `host`, and the refusal came back with a reason that names it."""

    host: str = ""
    mode: str = "unhelpful_network_error"

    def verify(self, o: Outcome) -> Failure | None:
        for d in o.denials:
            if self.host.lower() in d.host.lower():
                if self.host.lower() in d.reason.lower():
                    return None
                return self.fail(f"refusal of {d.host} came back, but its reason does not name it: {d.reason!r}")
        seen = ", ".join(d.host for d in o.denials) or "none"
        return self.fail(f"no refusal of {self.host} came back with the result (refusals: {seen}); "
                         f"stderr: {_clip(o.stderr)!r}")


@dataclass(frozen=True)
class Duration(Check):
    """The step took at most `max` seconds."""

    max: float = 10.0
    mode: str = "hang"

    def verify(self, o: Outcome) -> Failure | None:
        if o.duration <= self.max:
            return None
        return self.fail(f"took {o.duration:.1f} s (allowed {self.max:.1f} s)")


@dataclass(frozen=True)
class CodeText(Check):
    """The cell's last value (as text) equals `equals`, or matches `matches`; no exception raised."""

    equals: str | None = None
    matches: str | None = None
    mode: str = "wrong_result"

    def verify(self, o: Outcome) -> Failure | None:
        if o.code_error is not None:
            return self.fail(f"the cell raised {o.code_error[0]}: {_clip(o.code_error[1])}")
        text = o.text or ""
        if self.equals is not None and not _same_value(text, self.equals, unquoted=o.text_unquoted):
            return self.fail(f"value {_clip(text, 200)!r}, expected {_clip(self.equals, 200)!r}")
        if self.matches is not None and not re.search(self.matches, text, re.S | re.M):
            return self.fail(f"value {_clip(text, 200)!r} does not match /{self.matches}/")
        return None


def _same_value(text: str, expected: str, *, unquoted: bool) -> bool:
    """`text` shows the value `expected` shows; from a service that shows strings bare (`unquoted`), a string's
    repr (`'a'`) is shown without its quotes (`a`), exactly as E2B's interpreter strips them."""
    if text == expected:
        return True
    quoted = len(expected) >= 2 and expected[0] == expected[-1] and expected[0] in "'\""
    return unquoted and quoted and text == expected[1:-1]


@dataclass(frozen=True)
class CodeError(Check):
    """The cell failed with `name` (e.g. `ZeroDivisionError`, `CompileError`), its message matching `matches`."""

    name: str = ""
    matches: str | None = None
    mode: str = "code_error_misreported"

    def verify(self, o: Outcome) -> Failure | None:
        if o.code_error is None:
            return self.fail(f"no error came back (value {_clip(o.text or '', 120)!r}); expected {self.name}")
        name, value = o.code_error
        if self.name and name != self.name:
            return self.fail(f"error {name}: {_clip(value, 160)}, expected {self.name}")
        if self.matches and not re.search(self.matches, value, re.S | re.M):
            return self.fail(f"{name}'s message {_clip(value, 160)!r} does not match /{self.matches}/")
        return None


@dataclass(frozen=True)
class RichResult(Check):
    """The cell produced a rich result of `mime` (e.g. `image/png`) of at least `min_size` characters."""

    mime: str = "image/png"
    min_size: int = 1
    mode: str = "missing_rich_output"

    def verify(self, o: Outcome) -> Failure | None:
        for r in o.results:
            value = r.get(self.mime)
            if isinstance(value, str) and len(value) >= self.min_size:
                return None
        kinds = sorted({k for r in o.results for k in r})
        return self.fail(f"no {self.mime} result (results: {kinds or 'none'}); stderr: {_clip(o.stderr)!r}")
