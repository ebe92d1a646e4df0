"""`EgressPolicy`: what a sandbox may reach, parsed once from the API's `network` value (docs/egress.md).

A policy is `none`, `internet`, or an allowlist of rules (`host`, `host:port`, `*.suffix`, IP literals and
`@preset`s). Hosts are normalised once (IDNA 2008 with UTS 46 mapping: case, width, A-labels; no trailing dot), in
rules and in requests alike, so that matching is plain string comparison.
Address checks (loopback, private ranges, the host's own addresses) live in `_addresses.py`: they apply after
resolution, under every policy.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import idna

from .._exceptions import InvalidRequestError, PermissionDeniedError
from ._secrets import SecretBinding

__all__ = ["HOST_SERVICES", "PRESETS", "Decision", "EgressPolicy", "Rule", "normalize_host", "parse_host_port"]

Mode = Literal["none", "internet", "allowlist"]
PRESETS = {"packages": "the package mirror (pip and npm through the proxy's cache)"}
# The name of the host services an operator allowed for the tenant (its `private` pairs): the proxy resolves
# `host.corral.internal:<port>` to the one pair with that port, so code inside needs no address and no tricks.
HOST_SERVICES = "host.corral.internal"

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_ASCII_NAME = re.compile(r"(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")


def _refuse(what: object, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid host {what!r}: {why}", details={"why": why})


def _ip_literal(text: str) -> str | None:
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
    literal = _ip_literal(host)
    if literal is not None:
        return literal
    if host.isascii():  # what UTS 46 does to ASCII (std3_rules off, so '_' stays): lower-case it
        name = host.lower().removesuffix(".")  # "example.com." is the same host as "example.com"
    else:
        name = _uts46(host).removesuffix(".")
        literal = _ip_literal(name)  # full-width digits and dots map to an IP literal
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
        if _ip_literal(host) is None or ":" not in host:
            raise _refuse(text, "only IPv6 literals go in brackets")
        if rest and not rest.startswith(":"):
            raise _refuse(text, "expected ':port' after ']'")
        return normalize_host(host), _port(rest[1:], text) if rest else default_port
    if text.count(":") > 1:  # a bare IPv6 literal has no room for a port
        if _ip_literal(text) is None:
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
    def parse(cls, text: str) -> Rule:
        try:
            return cls._parse(text)
        except InvalidRequestError as exc:  # say "rule", not "host": the caller wrote a rule
            why = exc.details.get("why", exc.message)
            raise InvalidRequestError(f"invalid network rule {text!r}: {why}", details={"why": why}) from None

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
        if wildcard and _ip_literal(host) is not None:
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
            return host.endswith("." + self.host) and _ip_literal(host) is None
        return host == self.host

    def covers(self, other: Rule) -> bool:
        """Whether everything `other` allows, this rule allows too (for ceilings)."""
        if self.port is not None and self.port != other.port:
            return False
        if not self.wildcard:
            return not other.wildcard and other.host == self.host
        if other.wildcard and other.host == self.host:
            return True
        return other.host.endswith("." + self.host) and _ip_literal(other.host) is None


@dataclass(frozen=True)
class Decision:
    """The policy's verdict on a host:port, before any address check. `rule` says which rule decided."""

    allowed: bool
    rule: str


def _parse_private(entries: Iterable[str]) -> tuple[str, ...]:
    out = []
    for entry in entries:
        if not isinstance(entry, str):
            raise InvalidRequestError(f"invalid private address {entry!r}: must be a string 'ip:port'")
        try:
            host, port = parse_host_port(entry)
        except InvalidRequestError as exc:
            why = exc.details.get("why", exc.message)
            raise InvalidRequestError(f"invalid private address {entry!r}: {why}") from None
        if _ip_literal(host) is None or port is None:
            raise InvalidRequestError(f"invalid private address {entry!r}: give an exact IP address and port, "
                                      "e.g. '10.0.0.5:5432' or '[fd00::5]:443'")
        out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class EgressPolicy:
    """A sandbox's egress policy. Build it with `EgressPolicy.parse`; compare with `==`."""

    mode: Mode = "none"
    rules: tuple[Rule, ...] = ()
    presets: tuple[str, ...] = ()
    private: tuple[str, ...] = ()  # exact "ip:port" pairs exempt from the forbidden-address ranges
    # The sandbox's secrets (docs/secrets.md): not part of what the policy allows, so never compared or shown.
    secrets: tuple[SecretBinding, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def parse(cls, network: str | Sequence[str] | EgressPolicy | None,
              private: Iterable[str] = ()) -> EgressPolicy:
        """`"none"`, `"internet"` or a list of rules (`"pypi.org"`, `"*.example.com:443"`, `"@packages"`)."""
        if isinstance(network, EgressPolicy):
            return cls(network.mode, network.rules, network.presets, _parse_private(private) or network.private)
        priv = _parse_private(private)
        if network is None or network == "none":
            return cls("none", private=priv)
        if network == "internet":
            return cls("internet", private=priv)
        if isinstance(network, str) or not isinstance(network, Sequence):
            raise InvalidRequestError(f"invalid network {network!r}: use 'none', 'internet' or a list of hosts, "
                                      "e.g. ['pypi.org', '*.example.com:443', '@packages']")
        rules: set[Rule] = set()
        presets: set[str] = set()
        for item in network:
            if item in ("none", "internet"):
                raise InvalidRequestError(f"invalid network rule {item!r}: use network={item!r} on its own, "
                                          "not inside a list")
            if isinstance(item, str) and item.startswith("@"):
                if item[1:] not in PRESETS:
                    raise InvalidRequestError(f"invalid network rule {item!r}: unknown preset (known: "
                                              f"{', '.join('@' + p for p in PRESETS)})")
                presets.add(item[1:])
            else:
                rules.add(Rule.parse(item))
        if not rules and not presets:
            return cls("none", private=priv)
        return cls("allowlist", tuple(sorted(rules)), tuple(sorted(presets)), priv)

    def to_wire(self) -> str | list[str]:
        """The API form; `EgressPolicy.parse(p.to_wire(), p.private) == p`."""
        if self.mode != "allowlist":
            return self.mode
        return [str(r) for r in self.rules] + [f"@{p}" for p in self.presets]

    def describe(self, limit: int = 120) -> str:
        """Short text for refusal messages: `none`, `internet` or the rules, comma-separated."""
        wire = self.to_wire()
        text = wire if isinstance(wire, str) else ", ".join(wire)
        return text if len(text) <= limit else text[: limit - 3] + "..."

    def grants_preset(self, name: str) -> bool:
        # `internet` reaches what every preset fetches anyway, so it implies them.
        return self.mode == "internet" or name in self.presets

    def check(self, host: str, port: int) -> Decision:
        """The verdict for a normalised host and a port, before address checks."""
        if self.mode == "internet":
            return Decision(True, "policy internet")
        for rule in self.rules:
            if rule.matches(host, port):
                return Decision(True, f"allow {rule}")
        return Decision(False, "policy none" if self.mode == "none" else "not in allowlist")

    def host_services(self, port: int) -> list[str]:
        """The addresses of the `private` pairs on `port` (what `host.corral.internal:<port>` means)."""
        found = []
        for pair in self.private:
            host, _, pair_port = pair.rpartition(":")
            if int(pair_port) == port:
                found.append(host.strip("[]"))
        return found

    def allows_private(self, ip: str, port: int) -> bool:
        host = f"[{ip}]" if ":" in ip else ip
        return f"{host}:{port}" in self.private

    def within(self, ceiling: EgressPolicy) -> None:
        """Raise `PermissionDeniedError` naming everything this policy grants beyond `ceiling`."""
        excess = self._excess(ceiling)
        if excess:
            raise PermissionDeniedError(
                f"network policy exceeds the tenant's egress ceiling (ceiling: {ceiling.describe()}): "
                + ", ".join(excess), details={"exceeds": excess, "ceiling": ceiling.to_wire()})

    def _excess(self, ceiling: EgressPolicy) -> list[str]:
        excess = [f"private {p!r}" for p in self.private if p not in ceiling.private]
        if ceiling.mode == "internet":
            return excess
        if self.mode == "internet":
            return ["'internet'", *excess]
        excess += [f"'@{p}'" for p in self.presets if not ceiling.grants_preset(p)]
        excess += [f"{str(r)!r}" for r in self.rules if not any(c.covers(r) for c in ceiling.rules)]
        return excess
