"""`Audited`: one operation, one audit record, whether it succeeds or not."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._exceptions import CorralError
from ..control import Action, AuditEvent, ControlStore, Principal
from ._outcome import outcome_of
from ._requests import current_request

if TYPE_CHECKING:
    from ._telemetry import Telemetry

__all__ = ["Audited", "Auditor"]


@dataclass
class Audited:
    """Records one operation in the audit trail when the block ends, successful or not.

    Set `status` and add to `outcome` (and `params`) inside the block; an exception is recorded with its
    error code and status, and re-raised. Streamed operations call `record` themselves when the stream ends.
    The record is also where the operation is counted (`telemetry`, its duration from this object's making)
    and where the request being served learns what it did (`RequestInfo`), and gives the record its id.
    """

    store: ControlStore
    principal: Principal
    action: Action | str
    target: str | None
    params: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    telemetry: Telemetry | None = None
    _recorded: bool = False
    _started: float = field(default_factory=time.perf_counter)

    async def __aenter__(self) -> Audited:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.record(exc)

    async def record(self, exc: BaseException | None = None) -> None:
        if self._recorded:  # a stream that failed after its block ended is recorded once, by the stream
            return
        self._recorded = True
        action = str(self.action)
        outcome = outcome_of(exc, self.status, self.outcome)
        request = current_request()
        if request is not None:
            request.operation(action, self.target, outcome.get("error"), self.principal)
        if self.telemetry is not None:
            self.telemetry.operation(action, self.principal.tenant_id, time.perf_counter() - self._started,
                                     exc if isinstance(exc, CorralError) else None, self.params, outcome)
        await self.store.audit.append(AuditEvent.by(self.principal, action, self.target, params=self.params,
                                                    outcome=outcome,
                                                    request_id=request.request_id if request else None))


@dataclass(frozen=True)
class Auditor:
    """What an area needs to audit its operations: `auditor(principal, action, target, ...)` opens one `Audited`
    on the store's trail, counted by `telemetry` (None: nothing counted). Areas take this, not the `Service`."""

    store: ControlStore
    telemetry: Telemetry | None = None

    def __call__(self, principal: Principal, action: Action | str, target: str | None, *,
                 params: dict[str, Any] | None = None, status: int = 200) -> Audited:
        return Audited(self.store, principal, action, target, params=params or {}, status=status,
                       telemetry=self.telemetry)
