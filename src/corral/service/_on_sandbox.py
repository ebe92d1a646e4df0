"""What the areas that act on one running sandbox (commands, code, files, processes, PTY) need, and no more:
the authorize step, the sandbox's session, and the auditor.

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
from ._audited import Auditor
from ._replicas import Replica

__all__ = ["Authorize", "OnSandbox", "SandboxGate", "Sessions"]


class Authorize(Protocol):
    async def __call__(self, principal: Principal, sandbox_id: str, action: Action) -> SandboxRecord: ...


class Sessions(Protocol):
    """Where a running sandbox's session is found (the engine): `NotFoundError` for one it does not have."""

    def get(self, sandbox_id: str) -> SandboxSession: ...

    def info(self, sandbox_id: str) -> SandboxInfo: ...


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
