"""The host grammar of egress, one for network rules and secret bindings alike (docs/egress.md, docs/secrets.md).

A host rule is an exact host, an IP literal or a `*.suffix` wildcard, each with an optional port: `pypi.org`,
`*.example.com:443`, `127.0.0.1:8080`, `[::1]:8080`. Hosts are normalised once (IDNA 2008 with UTS 46 mapping:
case, width, A-labels; no trailing dot), in rules and in requests alike, so that matching is plain string
comparison. `Rule.parse` is the one parser: a network rule and a secret's host are the same strings, refused for
the same reasons.

A leaf of `corral.egress`: the error tree and `idna` only.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import idna

from .._exceptions import InvalidRequestError

__all__ = ["Rule", "ip_literal", "normalize_host", "parse_host_port"]

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_ASCII_NAME = re.compile(r"(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")


def _refuse(what: object, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid host {what!r}: {why}", details={"why": why})


def ip_literal(text: str) -> str | None:
    """The canonical text of an IP literal (brackets stripped), or None when `text` is a name."""
    try:
        return str(ipaddress.ip_address(text.removeprefix("[").removesuffix("]")))
    except ValueError:
        return None


def normalize_host(host: str) -> str:
    """Lower-case A-label (`xn--`) form without a trailing dot; IP literals in canonical form without brackets.

    Names are IDNA 2008 with UTS 46 mapping (non-transitional, as browsers and curl resolve them: `straße.de` is
    `xn--strae-oqa.de`, not `strasse.de`; full-width letters, digits and dots are mapped). ASCII labels are
    letters, digits, '-' and '_' (IDNA does not allow '_', DNS names do), and `xn--` labels must be valid.
    Raises `InvalidRequestError` for anything that is not a usable host name (empty, NUL, spaces, bad labels).
    """
    if not isinstance(host, str):
        raise _refuse(host, "a host must be a string")
    if any(c in host for c in "\x00\r\n\t /\\@?#"):
        raise _refuse(host, "a host may not contain NUL, whitespace, '/', '\\', '@', '?' or '#'")
    literal = ip_literal(host)
    if literal is not None:
        return literal
    if host.isascii():  # what UTS 46 does to ASCII (std3_rules off, so '_' stays): lower-case it
        name = host.lower().removesuffix(".")  # "example.com." is the same host as "example.com"
    else:
        name = _uts46(host).removesuffix(".")
        literal = ip_literal(name)  # full-width digits and dots map to an IP literal
        if literal is not None:
            return literal
    if not name:
        raise _refuse(host, "the host is empty")
    ascii_name = name  # the common case, checked in one match: plain ASCII labels
    if not name.isascii() or "xn--" in name or not _ASCII_NAME.fullmatch(name):
        ascii_name = ".".join(_a_label(label, host) for label in name.split("."))
    if len(ascii_name) > 253:
        raise _refuse(host, "a host name is at most 253 characters")
    return ascii_name


def _uts46(host: str) -> str:
    try:
        return idna.uts46_remap(host, std3_rules=False)
    except idna.IDNAError as exc:
        raise _refuse(host, f"not a valid IDNA 2008 host name: {exc}") from None


def _a_label(label: str, host: str) -> str:
    """One mapped label, as an A-label (a U-label is converted, an `xn--` label checked) or a plain ASCII label."""
    if not label:
        raise _refuse(host, "not a valid IDNA host name: an empty label")
    try:
        if not label.isascii():
            return idna.alabel(label).decode("ascii")
        if label.startswith("xn--"):
            idna.ulabel(label)  # a valid A-label decodes to a valid U-label whose A-label it is
    except idna.IDNAError as exc:
        raise _refuse(host, f"not a valid IDNA 2008 host name: label {label!r}: {exc}") from None
    if len(label) > 63:
        raise _refuse(host, f"not a valid IDNA host name: label {label[:20]!r}... is longer than 63 characters")
    if not _LABEL.match(label):
        raise _refuse(host, f"bad label {label!r} (letters, digits, '-' and '_', 1-63 characters)")
    return label


def _port(text: str, rule: object) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise _refuse(rule, f"bad port {text[:20]!r} (1-65535)")
    return int(text)


def parse_host_port(text: str, *, default_port: int | None = None) -> tuple[str, int | None]:
    """Split `host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 literal; the host comes back normalised."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _refuse(text, "unclosed '[' in an IPv6 literal")
        host, rest = text[1:end], text[end + 1:]
        if ip_literal(host) is None or ":" not in host:
            raise _refuse(text, "only IPv6 literals go in brackets")
        if rest and not rest.startswith(":"):
            raise _refuse(text, "expected ':port' after ']'")
        return normalize_host(host), _port(rest[1:], text) if rest else default_port
    if text.count(":") > 1:  # a bare IPv6 literal has no room for a port
        if ip_literal(text) is None:
            raise _refuse(text, "not an IPv6 address; write [v6]:port for a port")
        return normalize_host(text), default_port
    host, sep, port = text.partition(":")
    return normalize_host(host), _port(port, text) if sep else default_port


@dataclass(frozen=True, order=True)
class Rule:
    """One allowlist entry: an exact host, an IP literal or a `*.suffix` wildcard, with an optional port."""

    host: str  # normalised; for a wildcard, the suffix without "*."
    port: int | None = None
    wildcard: bool = False

    @classmethod
    def parse(cls, text: str, *, what: str = "network rule") -> Rule:
        """`InvalidRequestError("invalid <what> '<text>': <why>")`, with `details["why"]`, for anything else."""
        try:
            return cls._parse(text)
        except InvalidRequestError as exc:  # say what the caller wrote ("network rule", "secret host")
            why = exc.details.get("why", exc.message)
            raise InvalidRequestError(f"invalid {what} {text!r}: {why}", details={"why": why}) from None

    @classmethod
    def _parse(cls, text: str) -> Rule:
        if not isinstance(text, str):
            raise _refuse(text, "each rule must be a string")
        if "://" in text:
            raise _refuse(text, "give a host name (e.g. 'pypi.org'), not a URL")
        wildcard = text.startswith("*.")
        body = text[2:] if wildcard else text
        if "*" in body:
            raise _refuse(text, "a wildcard is only allowed as a whole first label, as in '*.example.com'")
        host, port = parse_host_port(body)
        if wildcard and ip_literal(host) is not None:
            raise _refuse(text, "a wildcard needs a domain, not an IP address")
        return cls(host=host, port=port, wildcard=wildcard)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        host = f"*.{host}" if self.wildcard else host
        return host if self.port is None else f"{host}:{self.port}"

    def matches(self, host: str, port: int) -> bool:
        """`host` is normalised. A wildcard matches strict subdomains only, and never IP literals."""
        if self.port is not None and self.port != port:
            return False
        if self.wildcard:
            return host.endswith("." + self.host) and ip_literal(host) is None
        return host == self.host

    def covers(self, other: Rule) -> bool:
        """Whether everything `other` allows, this rule allows too (for ceilings)."""
        if self.port is not None and self.port != other.port:
            return False
        if not self.wildcard:
            return not other.wildcard and other.host == self.host
        if other.wildcard and other.host == self.host:
            return True
        return other.host.endswith("." + self.host) and ip_literal(other.host) is None
