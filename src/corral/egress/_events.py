"""What the egress proxy reports (`EgressEvent`) and the seam to the package mirror (`PackageMirrorProtocol`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

__all__ = ["EgressEvent", "EventKind", "MirrorResponse", "PackageMirrorProtocol"]

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
