"""Auto-resume (E2B's `autoResume`, docs/lifecycle.md): a sandbox created with `auto_resume` that is paused (by
its timeout, `on_timeout="pause"`/`"pause_memory"`, or by a caller, in memory or to disk) is resumed by the first
request that reaches it, which is then served as if it had never been paused.

The one place it happens is the authorize step every operation on a sandbox takes (`Waking`, around
`SandboxGate`; `Sandboxes.authorized` and the areas built on `OnSandbox` are given it): the actions
that reach into a sandbox (`WAKING_ACTIONS`: commands, processes, terminals, code, files) wake it, whatever the
front end (REST, E2B's envd and code interpreter, MCP); the ports route (`Ports.open`), which finds its sandbox
by itself, asks here too. Reading a sandbox's record, its health, pausing, killing or snapshotting it never
wakes it. Without `auto_resume`, nothing here runs and a paused sandbox answers as before.

Concurrent requests to one paused sandbox cause one resume: they queue on the sandbox's lock, and those after the
first find it running. Each resume is audited as `sandbox.resume` with `{"auto_resume": true, "reason": <the
action that woke it>}`, attributed to the caller (or only to the tenant, for a public port's anonymous visitor).
After it, the sandbox has its own timeout again, counted from the resume, and at least `MIN_TIMEOUT` (E2B's rule).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from .._exceptions import QuotaExceededError
from ..backends import SandboxState
from ..control import Action, AuditEvent, ControlStore, Principal, SandboxRecord
from ._on_sandbox import Authorize
from ._outcome import outcome_of
from ._requests import current_request

__all__ = ["MIN_TIMEOUT", "PORT_REASON", "WAKING_ACTIONS", "AutoResume", "Waking"]

# What reaches into a sandbox: these wake it. Reading its record (`sandbox.read`) or changing its lifecycle
# (`sandbox.update`: pause, resume, timeout, snapshot) does not.
WAKING_ACTIONS = frozenset({Action.SANDBOX_EXEC, Action.SANDBOX_FILES_READ, Action.SANDBOX_FILES_WRITE})
PORT_REASON = "sandbox.port"  # the reason of a resume caused by a request to one of its ports
MIN_TIMEOUT = 300.0  # seconds a sandbox has at least after an automatic resume

Resume = Callable[[SandboxRecord], Awaitable[SandboxRecord]]


class AutoResume:
    """Wakes paused `auto_resume` sandboxes for the requests that reach them. `resume` is the lifecycle's own
    (`Sandboxes._resume`: the store's record and quotas, then the engine)."""

    def __init__(self, store: ControlStore, resume: Resume) -> None:
        self._store = store
        self._resume = resume
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # requests holding or waiting for each lock: the last one drops it

    async def awake(self, record: SandboxRecord, principal: Principal | None, reason: str) -> SandboxRecord:
        """`record` as it is once a request (`reason`: its action) may be served: resumed first if it is paused
        and was created with `auto_resume`; otherwise as it was (a paused sandbox stays paused)."""
        if record.state is not SandboxState.PAUSED or not record.spec.auto_resume:
            return record
        sandbox_id = record.id
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        self._users[sandbox_id] = self._users.get(sandbox_id, 0) + 1
        try:
            async with lock:
                current = await self._store.get_sandbox(sandbox_id)
                if current.state is not SandboxState.PAUSED:
                    return current  # woken by the request before this one (or ended: the operation says so)
                return await self._wake(current, principal, reason)
        finally:
            self._users[sandbox_id] -= 1
            if not self._users[sandbox_id]:
                del self._users[sandbox_id], self._locks[sandbox_id]

    async def _wake(self, record: SandboxRecord, principal: Principal | None, reason: str) -> SandboxRecord:
        params = {"auto_resume": True, "reason": reason, "to_disk": record.paused_to_disk}
        outcome: dict[str, Any] = {}
        failure: BaseException | None = None
        try:
            seconds = max(MIN_TIMEOUT, record.spec.timeout)
            if record.paused_to_disk:  # its clock is what it had left: set before it boots, so it cannot expire then
                await self._extend(record, seconds, left=record.ttl_left)
            resumed = await self._resume(record)
            if not record.paused_to_disk:
                left = (resumed.expires_at - datetime.now(UTC)).total_seconds()
                resumed = await self._extend(resumed, seconds, left=left)
            outcome["resumed"] = True
            return resumed
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await asyncio.shield(self._record(record, principal, params, outcome_of(failure, 200, outcome)))

    async def _extend(self, record: SandboxRecord, seconds: float, *, left: float | None) -> SandboxRecord:
        """At least `seconds` more to live (never less than it had); within the tenant's `max_sandbox_timeout`,
        else its own timeout, which that limit allowed when it was created."""
        if left is not None and left >= seconds:
            return record
        try:
            return await self._store.set_sandbox_timeout(record.id, seconds)
        except QuotaExceededError:
            return await self._store.set_sandbox_timeout(record.id, record.spec.timeout)

    async def _record(self, record: SandboxRecord, principal: Principal | None, params: dict[str, Any],
                      outcome: dict[str, Any]) -> None:
        request = current_request()
        request_id = request.request_id if request else None
        if principal is not None:
            event = AuditEvent.by(principal, "sandbox.resume", record.id, params=params, outcome=outcome,
                                  request_id=request_id)
        else:
            event = AuditEvent(action="sandbox.resume", target=record.id, tenant_id=record.tenant_id,
                               params=params, outcome=outcome, request_id=request_id)
        await self._store.audit.append(event)


class Waking:
    """The authorize step (`Authorize`) that wakes what it lets through: `authorize`'s record, resumed first by
    `auto_resume` when the action reaches into the sandbox (`WAKING_ACTIONS`)."""

    def __init__(self, authorize: Authorize, auto_resume: AutoResume) -> None:
        self._authorize = authorize
        self._auto_resume = auto_resume

    async def __call__(self, principal: Principal, sandbox_id: str, action: Action) -> SandboxRecord:
        record = await self._authorize(principal, sandbox_id, action)
        if action in WAKING_ACTIONS:
            record = await self._auto_resume.awake(record, principal, action.value)
        return record
