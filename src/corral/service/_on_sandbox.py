"""What the areas that act on one running sandbox (commands, code, files, processes, PTY) need, and no more:
the authorize step, the sandbox's session, the auditor, and the hook before a change to its files (automatic
checkpoints, `service/_checkpoints.py`).

`Authorize` is the step every operation on a sandbox takes first: the sandbox's record if the caller may do
the action on it (another tenant's is as unknown as a missing one), refused with the reason if another replica
runs it or it is lost. `SandboxGate` is that step over the store and this replica; `Sandboxes.authorized` is the
same gate. An area built on `OnSandbox` can be built alone, with any of the three replaced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..control import Action, ControlStore, Principal, SandboxRecord
from ..engine import SandboxInfo, SandboxSession
from ._audited import Audited, Auditor
from ._replicas import Replica

__all__ = ["Authorize", "BeforeChange", "OnSandbox", "SandboxGate", "Sessions"]


class Authorize(Protocol):
    async def __call__(self, principal: Principal, sandbox_id: str, action: Action) -> SandboxRecord: ...


class Sessions(Protocol):
    """Where a running sandbox's session is found (the engine): `NotFoundError` for one it does not have."""

    def get(self, sandbox_id: str) -> SandboxSession: ...

    def info(self, sandbox_id: str) -> SandboxInfo: ...


class BeforeChange(Protocol):
    """The hook before an operation that can change the sandbox's files (`Checkpoints.before_change`): an
    automatic checkpoint where the sandbox asked for them; its id, or None."""

    async def __call__(self, principal: Principal, record: SandboxRecord, command: str,
                       audit: Audited) -> str | None: ...


@dataclass(frozen=True)
class SandboxGate:
    """The authorize step over the store (ownership, role) and this replica (`Replica.check_local`)."""

    store: ControlStore
    replica: Replica

    async def __call__(self, principal: Principal, sandbox_id: str, action: Action) -> SandboxRecord:
        record = await self.store.sandbox_for(principal, sandbox_id, action)
        self.replica.check_local(record, action)
        return record


@dataclass(frozen=True)
class OnSandbox:
    """The dependencies of an area that operates on a running sandbox."""

    authorize: Authorize
    sessions: Sessions
    audited: Auditor
    before_change: BeforeChange | None = None  # None: no automatic checkpoints (an area built alone)

    async def changing(self, principal: Principal, record: SandboxRecord, command: str,
                       audit: Audited) -> str | None:
        """Call before an operation that can change files, once it is authorized (`before_change`)."""
        if self.before_change is None or record.spec.checkpoints != "auto":
            return None
        return await self.before_change(principal, record, command, audit)
