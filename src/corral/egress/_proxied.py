"""What the egress proxy holds of a sandbox it serves (`ProxiedSandbox`: its policy, listener, connections, recent
refusals) and of one attempt through it (`Attempt`: a request or a tunnel, reported exactly once as an
`EgressEvent`)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._events import EgressEvent, EventKind
from ._policy import EgressPolicy
from ._reasons import Refusal
from ._secrets import Produced

DENIALS_KEPT = 200  # per sandbox: enough for any one command's notice, bounded for a misbehaving one


@dataclass
class ProxiedSandbox:
    id: str
    path: Path | None  # its socket; None for a sandbox known by its credential on the TCP listener
    policy: EgressPolicy
    server: asyncio.AbstractServer | None = None
    connections: set[asyncio.Task[Any]] = field(default_factory=set)
    denials: deque[EgressEvent] = field(default_factory=lambda: deque(maxlen=DENIALS_KEPT))
    detached: bool = False
    produced: Produced = field(default_factory=Produced)  # encoded forms of its secrets the proxy made, to scrub

    @property
    def remote(self) -> bool:
        """Known by its credential: its command's server reads its refusals from the audit trail, not from us."""
        return self.path is None


class Attempt:
    """One request or tunnel; reported exactly once, however it ends."""

    def __init__(self, kind: EventKind, method: str = "") -> None:
        self.time = time.time()
        self.t0 = time.monotonic()
        self.kind: EventKind = kind
        self.method = method
        self.host = ""
        self.port = 0
        self.path = ""
        self.allowed = False
        self.rule = "error"
        self.reason = ""
        self.up = 0
        self.down = 0
        self.reported = False  # `emit` ran (a remote sandbox's refusal is reported before it is answered)
        self.secrets: set[str] = set()  # names of the secrets put into its requests

    def count_up(self, n: int) -> None:
        self.up += n

    def count_down(self, n: int) -> None:
        self.down += n

    def refuse(self, refusal: Refusal) -> None:
        self.allowed, self.rule, self.reason = False, refusal.rule, refusal.reason

    def event(self, sandbox_id: str) -> EgressEvent:
        return EgressEvent(time=self.time, sandbox_id=sandbox_id, kind=self.kind, method=self.method,
                           host=self.host, port=self.port, allowed=self.allowed, rule=self.rule,
                           reason=self.reason, bytes_up=self.up, bytes_down=self.down,
                           duration=time.monotonic() - self.t0, path=self.path,
                           secrets=tuple(sorted(self.secrets)))
