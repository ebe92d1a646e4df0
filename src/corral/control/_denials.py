"""Audit records for failed authentication (401), bounded per client address.

Requests without a valid key are recorded as `auth.denied`, but an unauthenticated flood must not grow the log
without bound, so records are aggregated per client address: the first denial from an address is recorded at
once, with its details; further denials from that address in the next `window` seconds (default 60) are only
counted, and when the window ends one record sums them up (`params.count`, the key prefixes tried, the last
method and path). The next denial after that opens a new window. An address therefore costs at most two records
per window however fast it tries, and memory holds at most `max_clients` addresses: beyond that, new addresses
share one bucket (`client` "*"), so even a flood from many addresses adds at most two records per window each
for the first `max_clients` addresses and the bucket.

Aggregating rather than dropping (a plain rate limit) keeps the size of a flood in the log: how many attempts,
from where, with which key prefixes, is what an operator needs. `params.count` summed over the `auth.denied`
records is the number of denied requests. Only a key's prefix is recorded, never its secret, and only when the
presented key is well-formed (anything else may be a secret of some other system pasted by mistake).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from ._audit import AuditEvent, AuditLog

logger = logging.getLogger("corral.control")

AUTH_DENIED = "auth.denied"
DENIAL_WINDOW = 60.0
MAX_CLIENTS = 10_000
OVERFLOW_CLIENT = "*"
UNKNOWN_CLIENT = "unknown"
_MAX_PREFIXES = 20  # distinct key prefixes listed in one summary
_MAX_TEXT = 512  # method and path are the client's: cap what is stored


@dataclass(frozen=True)
class Denial:
    """One refused request: where it came from, what it asked for, which key prefix (if well-formed) and why."""

    client: str | None
    method: str
    path: str
    key_prefix: str | None
    reason: str

    def params(self, client: str) -> dict[str, Any]:
        return {"client": client, "method": self.method[:_MAX_TEXT], "path": self.path[:_MAX_TEXT],
                "key_prefix": self.key_prefix}


@dataclass
class _Window:
    """Denials from one address after its recorded one, counted until the window ends."""

    count: int = 0
    last: Denial | None = None
    prefixes: set[str] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class AuthDenials:
    """Records `auth.denied` events in `audit`, aggregated per client address (see the module docstring)."""

    def __init__(self, audit: AuditLog, *, window: float = DENIAL_WINDOW, max_clients: int = MAX_CLIENTS) -> None:
        self._audit = audit
        self._window = window
        self._max_clients = max_clients
        self._windows: dict[str, _Window] = {}
        self._pending: set[asyncio.Task[None]] = set()

    async def record(self, denial: Denial) -> None:
        """Record `denial` now if its address has no open window; otherwise count it for the window's summary."""
        client = self._bucket(denial.client or UNKNOWN_CLIENT)
        window = self._windows.get(client)
        if window is not None:
            window.count += 1
            window.last = denial
            if denial.key_prefix is not None and len(window.prefixes) < _MAX_PREFIXES:
                window.prefixes.add(denial.key_prefix)
            return
        window = self._windows[client] = _Window()
        window.timer = asyncio.get_running_loop().call_later(self._window, self._close, client)
        prefixes = [denial.key_prefix] if denial.key_prefix is not None else []
        await self._audit.append(_event(client, denial, 1, prefixes, aggregated=False))

    async def flush(self) -> None:
        """Write the summaries of all open windows now (the store calls this when it closes)."""
        for client in list(self._windows):
            self._close(client)
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    def _bucket(self, client: str) -> str:
        if client in self._windows or len(self._windows) < self._max_clients:
            return client
        return OVERFLOW_CLIENT

    def _close(self, client: str) -> None:
        window = self._windows.pop(client, None)
        if window is None:
            return
        if window.timer is not None:
            window.timer.cancel()
        if window.count == 0 or window.last is None:
            return
        summary = _event(client, window.last, window.count, sorted(window.prefixes), aggregated=True)
        task = asyncio.get_running_loop().create_task(self._append(summary))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _append(self, event: AuditEvent) -> None:
        try:
            await self._audit.append(event)
        except Exception:  # started by a timer: there is no caller to raise to, so log it
            logger.exception("could not record aggregated auth.denied events", extra={"params": event.params})


def _event(client: str, denial: Denial, count: int, prefixes: list[str], *, aggregated: bool) -> AuditEvent:
    params = {**denial.params(client), "count": count, "key_prefixes": prefixes}
    outcome = {"status": 401, "error": "unauthenticated", "reason": denial.reason, "aggregated": aggregated}
    return AuditEvent(action=AUTH_DENIED, params=params, outcome=outcome)
