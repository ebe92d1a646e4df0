"""`EgressPolicy`: what a sandbox may reach, parsed once from the API's `network` value (docs/egress.md).

A policy is `none`, `internet`, or an allowlist of rules (`host`, `host:port`, `*.suffix`, IP literals and
`@preset`s). The rules' grammar (`Rule`, and how hosts are normalised) is `_hosts.py`'s, which secrets' hosts share.
Address checks (loopback, private ranges, the host's own addresses) live in `_addresses.py`: they apply after
resolution, under every policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._exceptions import InvalidRequestError, PermissionDeniedError
from ._hosts import Rule, ip_literal, normalize_host, parse_host_port
from ._secrets import SecretBinding

__all__ = ["HOST_SERVICES", "PRESETS", "Decision", "EgressPolicy", "Rule", "normalize_host", "parse_host_port"]

Mode = Literal["none", "internet", "allowlist"]
PRESETS = {"packages": "the package mirror (pip and npm through the proxy's cache)"}
# The name of the host services an operator allowed for the tenant (its `private` pairs): the proxy resolves
# `host.corral.internal:<port>` to the one pair with that port, so code inside needs no address and no tricks.
HOST_SERVICES = "host.corral.internal"


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
        if ip_literal(host) is None or port is None:
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
