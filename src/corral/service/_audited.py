"""`Audited`: one operation, one audit record, whether it succeeds or not."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from ..control import Action, AuditEvent, ControlStore, Principal
from ._outcome import outcome_of

__all__ = ["Audited"]


@dataclass
class Audited:
    """Records one operation in the audit trail when the block ends, successful or not.

    Set `status` and add to `outcome` (and `params`) inside the block; an exception is recorded with its
    error code and status, and re-raised. Streamed operations call `record` themselves when the stream ends.
    """

    store: ControlStore
    principal: Principal
    action: Action | str
    target: str | None
    params: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    _recorded: bool = False

    async def __aenter__(self) -> Audited:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.record(exc)

    async def record(self, exc: BaseException | None = None) -> None:
        if self._recorded:  # a stream that failed after its block ended is recorded once, by the stream
            return
        self._recorded = True
        await self.store.audit.append(AuditEvent.by(self.principal, str(self.action), self.target,
                                                    params=self.params,
                                                    outcome=outcome_of(exc, self.status, self.outcome)))
