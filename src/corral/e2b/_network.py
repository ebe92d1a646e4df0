"""E2B's sandbox network settings, as Corral egress policies (docs/egress.md).

E2B: `allow_internet_access` (default true), and `network` with `allowOut` / `denyOut` lists of IPs, CIDR ranges
or domains (`allowOut` wins over `denyOut`; `denyOut: ["0.0.0.0/0"]` blocks everything not allowed), plus
`allowPublicTraffic` for the sandbox's ports. Corral's egress proxy allows by host name (domains, wildcards) or
everything public ("internet"); it never opens private ranges to a sandbox. So:

* nothing said, or `allow_internet_access: true`: "internet" (public addresses only), within the tenant's ceiling;
  with nothing said and a tenant whose ceiling is narrower, the ceiling itself;
* `allow_internet_access: false`, or `denyOut` holding `0.0.0.0/0`: "none", plus the domains of `allowOut`;
* a single address in `allowOut` (`1.1.1.1`, `1.1.1.1/32`) is a rule for that address (a private one is refused,
  as always); a wider range other than `0.0.0.0/0`, or a `denyOut` entry other than `0.0.0.0/0`, is refused with
  the reason (the proxy cannot express them), never silently widened or narrowed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from .._exceptions import InvalidRequestError, PermissionDeniedError
from ..control import TenantEgress
from ..service import check_network

__all__ = ["ALL_TRAFFIC", "egress_policy"]

ALL_TRAFFIC = "0.0.0.0/0"


def egress_policy(allow_internet: bool | None, allow_out: Sequence[str] | None, deny_out: Sequence[str] | None,
                  egress: TenantEgress) -> str | list[str]:
    """The Corral policy for E2B's settings, checked against the tenant's `egress` ceiling."""
    allowed = [entry.strip() for entry in allow_out or () if entry.strip()]
    denied = [entry.strip() for entry in deny_out or () if entry.strip()]
    for entry in denied:
        if entry != ALL_TRAFFIC:
            raise InvalidRequestError(
                f"denyOut entry {entry!r} is not supported: Corral's egress proxy allows by host name or allows every "
                f"public address; deny everything with {ALL_TRAFFIC!r} and list what is allowed in allowOut")
    if ALL_TRAFFIC in allowed or (allow_internet is not False and not denied and not allowed):
        wanted = "internet"
        if allow_internet is None and not allowed:  # E2B's default, not the caller's explicit wish
            return _within_ceiling(wanted, egress)
        return check_network(wanted, egress)
    domains = [_domain(entry) for entry in allowed]
    return check_network(domains or "none", egress)


def _domain(entry: str) -> str:
    """A host rule of Corral's policy: a name as it is, one address as itself (`1.1.1.1`, `1.1.1.1/32`)."""
    try:
        network = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return entry
    if network.num_addresses == 1:
        address = network.network_address
        return str(address) if address.version == 4 else f"[{address}]"
    raise InvalidRequestError(
        f"allowOut entry {entry!r} is an address range: Corral's egress proxy allows sandboxes to reach hosts by name "
        f"(e.g. 'pypi.org', '*.example.com'), or every public address with {ALL_TRAFFIC!r}; private ranges are never "
        "reachable")


def _within_ceiling(wanted: str, egress: TenantEgress) -> str | list[str]:
    try:
        return check_network(wanted, egress)
    except PermissionDeniedError:
        return check_network(egress.ceiling, egress)
