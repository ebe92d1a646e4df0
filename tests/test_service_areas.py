"""Each service area can be built alone, from exactly what it depends on (docs/architecture.md, "Which area depends
on what"): no `Service`, no engine where an area only needs sessions, fakes of only those dependencies. A real
`ControlStore` (SQLite in a temporary home) holds the principals and the audit trail the areas write."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corral import AuthenticationError, NotFoundError, PermissionDeniedError, ReplicaUnavailableError
from corral.control import Action, ControlStore, Principal, Role, SandboxRecord
from corral.engine import ExecOptions, ExecResult, SandboxSpec
from corral.service import (
    Auditor,
    Callers,
    ClientInfo,
    Command,
    Commands,
    OnSandbox,
    Replica,
    ReplicaConfig,
    SandboxGate,
    Tenants,
)

pytestmark = pytest.mark.anyio


@dataclass
class Store:
    store: ControlStore
    dev: Principal  # tenant a's developer
    admin: Principal  # tenant a's admin
    other: Principal  # tenant b's developer
    operator: Principal  # tenant a's operator


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[Store]:
    async with ControlStore(home=tmp_path) as store:
        a, b = (await store.create_tenant("a")).id, (await store.create_tenant("b")).id
        dev, admin, other, operator = [
            await store.authenticate((await store.create_key(t, role)).key)
            for t, role in ((a, Role.DEVELOPER), (a, Role.ADMIN), (b, Role.DEVELOPER), (a, Role.OPERATOR))]
        yield Store(store, dev, admin, other, operator)


@dataclass
class FakeSession:
    """What `Commands` uses of a sandbox's session: `run` (a command's `ExecOptions`), recorded."""

    calls: list[ExecOptions] = field(default_factory=list)

    async def run(self, options: ExecOptions, **callbacks: Any) -> ExecResult:
        self.calls.append(options)
        return ExecResult(exit_code=3, stdout_bytes=b"out", stderr_bytes=b"")


@dataclass
class FakeSessions:
    """The `Sessions` an `OnSandbox` area is given (the engine, in a server): one running sandbox."""

    sandbox_id: str
    session: FakeSession = field(default_factory=FakeSession)

    def get(self, sandbox_id: str) -> FakeSession:
        if sandbox_id != self.sandbox_id:
            raise NotFoundError(f"no sandbox {sandbox_id!r}")
        return self.session

    def info(self, sandbox_id: str) -> None:
        self.get(sandbox_id)


@dataclass
class FakeAuthorize:
    """The authorize step, recorded: the sandboxes it knows, each with the tenant that owns it."""

    records: dict[str, SandboxRecord]
    asked: list[tuple[str, str, Action]] = field(default_factory=list)

    async def __call__(self, principal: Principal, sandbox_id: str, action: Action) -> SandboxRecord:
        self.asked.append((principal.key_id, sandbox_id, action))
        record = self.records.get(sandbox_id)
        if record is None or record.tenant_id != principal.tenant_id:
            raise NotFoundError(f"no sandbox {sandbox_id!r}")
        return record


async def test_commands_alone_authorize_run_on_the_session_and_audit(world: Store) -> None:
    record = await world.store.reserve_sandbox(world.dev, SandboxSpec())
    sessions, authorize = FakeSessions(record.id), FakeAuthorize({record.id: record})
    commands = Commands(OnSandbox(authorize, sessions, Auditor(world.store)))  # type: ignore[arg-type]

    result = await commands.run(world.dev, record.id, Command("echo hi", env={"TOKEN": "secret"}))

    assert result.exit_code == 3
    assert authorize.asked == [(world.dev.key_id, record.id, Action.SANDBOX_EXEC)]
    [options] = sessions.session.calls
    assert options.cmd == "echo hi" and options.env == {"TOKEN": "secret"}
    [entry] = await world.store.audit.query(action="sandbox.exec")
    assert entry.target == record.id and entry.params["cmd"] == "echo hi"
    assert entry.params["env_names"] == ["TOKEN"] and "secret" not in str(entry.params)
    assert entry.outcome["exit_code"] == 3 and entry.outcome["status"] == 200


async def test_commands_alone_refused_by_the_authorize_step_never_reach_the_session(world: Store) -> None:
    record = await world.store.reserve_sandbox(world.dev, SandboxSpec())
    sessions, authorize = FakeSessions(record.id), FakeAuthorize({record.id: record})
    commands = Commands(OnSandbox(authorize, sessions, Auditor(world.store)))  # type: ignore[arg-type]

    with pytest.raises(NotFoundError):
        await commands.run(world.other, record.id, Command("id"))
    with pytest.raises(NotFoundError):
        await commands.stream(world.other, record.id, Command("id"))

    assert sessions.session.calls == []
    entries = await world.store.audit.query(action="sandbox.exec")
    assert [e.outcome["error"] for e in entries] == ["not_found", "not_found"]


async def test_the_gate_alone_refuses_another_replicas_sandbox_but_lets_it_be_read(world: Store) -> None:
    mine = await world.store.reserve_sandbox(world.dev, SandboxSpec(), owner="r-here")
    theirs = await world.store.reserve_sandbox(world.dev, SandboxSpec(), owner="r-there")
    for record in (mine, theirs):
        await world.store.mark_running(record.id)
    gate = SandboxGate(world.store, Replica(world.store, None, ReplicaConfig(id="r-here")))  # type: ignore[arg-type]

    assert (await gate(world.dev, mine.id, Action.SANDBOX_EXEC)).id == mine.id
    assert (await gate(world.dev, theirs.id, Action.SANDBOX_READ)).id == theirs.id
    with pytest.raises(ReplicaUnavailableError):
        await gate(world.dev, theirs.id, Action.SANDBOX_EXEC)
    with pytest.raises(NotFoundError):
        await gate(world.other, mine.id, Action.SANDBOX_READ)


async def test_callers_alone_record_a_refused_key(world: Store) -> None:
    callers = Callers(world.store)  # no telemetry: nothing counted, still recorded
    client = ClientInfo("10.0.0.7", "GET", "/v1/sandboxes")

    with pytest.raises(AuthenticationError):
        await callers.authenticate("corral_not-a-real-key", client)

    [denied] = await world.store.audit.query(action="auth.denied")
    assert denied.params["client"] == "10.0.0.7" and denied.outcome["status"] == 401


async def test_tenants_alone_show_another_tenant_to_an_admin_only(world: Store) -> None:
    tenants = Tenants(world.store, Auditor(world.store))

    assert (await tenants.visible(world.operator, "a", Action.TENANT_EGRESS)).id == world.dev.tenant_id
    assert (await tenants.visible(world.operator, world.dev.tenant_id, Action.TENANT_EGRESS)).name == "a"
    assert (await tenants.visible(world.admin, "b", Action.TENANT_EGRESS)).id == world.other.tenant_id
    with pytest.raises(NotFoundError):  # as unknown as a tenant that never existed
        await tenants.visible(world.operator, "b", Action.TENANT_EGRESS)
    with pytest.raises(PermissionDeniedError):  # the role first: a developer may not, whichever tenant
        await tenants.visible(world.dev, "a", Action.TENANT_EGRESS)
    with pytest.raises(NotFoundError):
        await tenants.visible(world.admin, "nobody", Action.TENANT_EGRESS)
