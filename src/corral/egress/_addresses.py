"""Addresses no sandbox may reach under any policy, and the host's own addresses (docs/egress.md).

The proxy resolves a name once, asks `AddressGuard.forbidden()` about every address, and connects only to an
address it checked. Embedded IPv4 addresses (IPv4-mapped, 6to4, NAT64) are judged by the address they carry, so
`::ffff:127.0.0.1` or `64:ff9b::a9fe:a9fe` are as forbidden as the plain forms.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["AddressGuard", "IPAddress", "host_addresses"]

log = logging.getLogger("corral.egress")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Checked in order: the first match names the range in refusals. Anything not here that Python does not call
# globally routable is refused as "reserved" (the catch-all keeps new IANA special-purpose ranges out).
_RANGES: list[tuple[IPNetwork, str]] = [(ipaddress.ip_network(net), label) for net, label in [
    ("0.0.0.0/8", "unspecified"),
    ("127.0.0.0/8", "loopback"),
    ("10.0.0.0/8", "private, RFC 1918"),
    ("172.16.0.0/12", "private, RFC 1918"),
    ("192.168.0.0/16", "private, RFC 1918"),
    ("169.254.169.254/32", "link-local, cloud metadata"),
    ("169.254.0.0/16", "link-local"),
    ("100.64.0.0/10", "shared address space, CGNAT"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("198.18.0.0/15", "benchmarking"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "broadcast"),
    ("240.0.0.0/4", "reserved"),
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "IPv4-compatible, deprecated"),
    ("64:ff9b:1::/48", "NAT64 local-use"),
    ("100::/64", "discard-only"),
    ("2001::/32", "Teredo"),
    ("fc00::/7", "unique local, ULA"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local, deprecated"),
    ("ff00::/8", "multicast"),
]]
# Documentation ranges (RFC 5737, RFC 3849) are not private networks: no host of anyone's infrastructure lives
# there, so refusing them protects nothing; and some networks route their way out through them (this project's
# CI resolves every package registry to 203.0.113.80, its egress gateway). They pass the catch-all below.
_NOT_PRIVATE: list[IPNetwork] = [ipaddress.ip_network(net) for net in
                                 ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_OWN_TTL = 30.0  # interfaces change rarely; re-read them this often


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, well-known NAT64), if any."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _fib_trie_local(text: str) -> set[IPAddress]:
    """IPv4 addresses /proc/net/fib_trie marks `host LOCAL` (every address on every interface)."""
    found: set[IPAddress] = set()
    lines = text.splitlines()
    for prev, line in itertools.pairwise(lines):
        if "/32 host LOCAL" in line and "|--" in prev:
            try:
                found.add(ipaddress.ip_address(prev.split("|--", 1)[1].strip()))
            except ValueError:
                continue
    return found


def _if_inet6(text: str) -> set[IPAddress]:
    """IPv6 addresses from /proc/net/if_inet6 (32 hex digits first on each line)."""
    found: set[IPAddress] = set()
    for line in text.splitlines():
        fields = line.split()
        if fields and len(fields[0]) == 32:
            try:
                found.add(ipaddress.IPv6Address(int(fields[0], 16)))
            except ValueError:
                continue
    return found


def host_addresses(proc: Path = Path("/proc/net")) -> frozenset[IPAddress]:
    """Every address of this host's interfaces, in the network namespace this process runs in."""
    found: set[IPAddress] = set()
    for name, parse in (("fib_trie", _fib_trie_local), ("if_inet6", _if_inet6)):
        try:
            found |= parse((proc / name).read_text())
        except OSError as exc:  # e.g. no IPv6 in this kernel: then there is nothing of that family to protect
            log.debug("cannot read %s: %s", proc / name, exc)
    return frozenset(found)


class AddressGuard:
    """Says why an address is forbidden (or None), with the host's own addresses refreshed every 30 s."""

    def __init__(self, extra_forbidden: Iterable[str | IPNetwork] = ()) -> None:
        self.extra = [ipaddress.ip_network(n, strict=False) if isinstance(n, str) else n for n in extra_forbidden]
        self._own: frozenset[IPAddress] = frozenset()
        self._own_read = float("-inf")

    def own(self) -> frozenset[IPAddress]:
        if time.monotonic() - self._own_read > _OWN_TTL:
            self._own = host_addresses()
            self._own_read = time.monotonic()
        return self._own

    def forbidden(self, ip: IPAddress) -> str | None:
        """A short label for why `ip` may not be reached ("loopback", "this host's own address"...), or None."""
        inner = embedded_ipv4(ip)
        if inner is not None:
            why = self.forbidden(inner)
            return f"embeds {inner}: {why}" if why else None
        if not ip.is_loopback and ip in self.own():  # before the ranges: the more useful name for it
            return "this host's own address"
        for net, label in _RANGES:
            if ip.version == net.version and ip in net:
                return label
        for net in self.extra:
            if ip.version == net.version and ip in net:
                return "forbidden by the operator"
        if not ip.is_global and not any(ip.version == net.version and ip in net for net in _NOT_PRIVATE):
            return "reserved"
        return None
