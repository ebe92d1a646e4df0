"""What the egress proxy reports (`EgressEvent`) and the seam to the package mirror (`PackageMirrorProtocol`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

__all__ = ["RULE_CLASSES", "EgressEvent", "EventKind", "MirrorResponse", "PackageMirrorProtocol", "rule_class"]

EventKind = Literal["connect", "http", "mirror", "dns"]


@dataclass(frozen=True)
class EgressEvent:
    """One attempt to leave a sandbox, reported once when it ends (audit record and denial log).

    `rule` names what decided ("allow pypi.org", "policy none", "not in allowlist",
    "forbidden address 127.0.0.1 (loopback)"); `reason` is the human text sent back with a refusal.
    """

    time: float  # time.time() when the attempt started
    sandbox_id: str
    kind: EventKind
    method: str
    host: str
    port: int
    allowed: bool
    rule: str
    reason: str = ""
    bytes_up: int = 0  # sandbox -> outside
    bytes_down: int = 0  # outside -> sandbox
    duration: float = 0.0  # seconds
    path: str = ""  # mirror requests only (URLs of proxied requests may carry secrets: never recorded)
    secrets: tuple[str, ...] = ()  # names of the sandbox's secrets the proxy put into it (never their values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The kinds of rule text the proxy writes (`_policy.Decision`, `_reasons.Refusal`), by what follows their fixed
# words: a host, an address or a port would give a metric label one value per destination.
_RULE_PREFIXES = (("allow ", "allowlist"), ("forbidden address ", "forbidden_address"))
_FIXED_RULES = {"policy internet": "internet", "preset @packages": "packages", "policy none": "policy_none",
                "not in allowlist": "not_in_allowlist", "dns refused": "dns", "mirror needs @packages": "mirror",
                "mirror failed": "mirror_failed", "error": "error", "timeout": "timeout",
                "connect failed": "connect_failed", "unresolvable": "unresolvable",
                "bad upstream response": "bad_upstream_response", "bad request": "bad_request",
                "head too large": "head_too_large", "proxy credentials": "proxy_credentials",
                "policy unavailable": "policy_unavailable", "upstream certificate": "upstream_certificate"}
RULE_CLASSES = frozenset({"private", "other", *(c for _, c in _RULE_PREFIXES), *_FIXED_RULES.values()})


def rule_class(rule: str) -> str:
    """What kind of rule decided an attempt, from a small fixed set (`RULE_CLASSES`): `rule` without the host,
    address or port it may name. A private `ip:port` pair that let an address through is `private`."""
    if " + private " in rule:
        return "private"
    for prefix, kind in _RULE_PREFIXES:
        if rule.startswith(prefix):
            return kind
    return _FIXED_RULES.get(rule, "other")


@dataclass
class MirrorResponse:
    """A package-mirror answer; the proxy streams `body` and adds the framing the client needs."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]


class PackageMirrorProtocol(Protocol):
    """The package mirror as the proxy uses it (implemented by `corral.egress.PackageMirror`)."""

    def handles(self, path: str) -> bool:
        """True for the paths the mirror serves: `/pypi/...` and `/npm/...`."""
        ...

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]]) -> MirrorResponse:
        """Answer one origin-form request; errors it raises become a 502 naming them."""
        ...
