"""The lifecycle services against the fake backend: what the store records, what the quotas count, what the
audit says, and what is undone when a step fails (a stop that fails, a snapshot over quota, a fork the backend
refuses). tests/test_lifecycle_live.py proves the same on real runc sandboxes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pydantic
import pytest
from sqlalchemy import update

from corral import ConflictError, InvalidRequestError, NotFoundError, QuotaExceededError, ServerError
from corral.backends import SandboxState
from corral.control import Quotas
from corral.control._models import SandboxRow
from corral.service import CreateSandbox, ForkSandbox

from .test_service import Setup, _create
from .test_service import setup as setup  # the fixture: a Service over FakeBackend, tenants a and b

pytestmark = pytest.mark.anyio


async def test_pause_to_disk_moves_the_sandbox_from_running_to_paused_quotas(setup: Setup) -> None:
    s = setup
    await s.store.set_quotas(s.tenants["a"], Quotas(max_sandboxes=1, max_paused=1))
    first = await _create(s)
    record = await s.service.sandboxes.pause(s.who["a_dev"], first, memory=False)
    assert record.state is SandboxState.PAUSED and record.paused_to_disk and record.ttl_left is not None
    assert s.backend.called("stop") == [first]
    second = await _create(s)  # the paused one holds no running slot
    with pytest.raises(QuotaExceededError, match="max_paused"):
        await s.service.sandboxes.pause(s.who["a_dev"], second, memory=False)
    assert (await s.store.get_sandbox(second)).state is SandboxState.RUNNING  # refused: nothing changed
    with pytest.raises(QuotaExceededError, match="max_sandboxes"):  # resuming takes the running slot again
        await s.service.sandboxes.resume(s.who["a_dev"], first)
    assert (await s.store.get_sandbox(first)).paused_to_disk and s.backend.called("boot") == []
    await s.service.sandboxes.kill(s.who["a_dev"], second)
    resumed = await s.service.sandboxes.resume(s.who["a_dev"], first)
    assert resumed.state is SandboxState.RUNNING and not resumed.paused_to_disk
    assert s.backend.called("boot") == [first]
    audit = await s.last("sandbox.pause")
    assert audit.params == {"memory": False, "to_disk": False}


async def test_a_stop_that_fails_leaves_the_record_as_it_was(setup: Setup) -> None:
    s = setup
    sandbox_id = await _create(s)

    async def broken(record: object) -> None:
        raise ServerError("the fake runtime cannot stop it")

    s.backend.stop = broken  # type: ignore[method-assign]
    with pytest.raises(ServerError):
        await s.service.sandboxes.pause(s.who["a_dev"], sandbox_id, memory=False)
    record = await s.store.get_sandbox(sandbox_id)
    assert record.state is SandboxState.RUNNING and not record.paused_to_disk


async def test_snapshot_quota_and_refusals_keep_nothing(setup: Setup) -> None:
    s = setup
    sandbox_id = await _create(s)
    await s.store.set_quotas(s.tenants["a"], Quotas(max_snapshot_bytes=100))  # the fake's snapshots are 4096
    with pytest.raises(QuotaExceededError, match="max_snapshot_bytes"):
        await s.service.snapshots.create(s.who["a_dev"], sandbox_id)
    assert s.backend.world.snapshots == {}  # the copy made before the size was known is gone again
    await s.store.set_quotas(s.tenants["a"], Quotas())
    snap = await s.service.snapshots.create(s.who["a_dev"], sandbox_id, "named")
    with pytest.raises(ConflictError, match="named"):
        await s.service.snapshots.create(s.who["a_dev"], sandbox_id, "named")
    assert list(s.backend.world.snapshots) == [snap.id]
    with pytest.raises(NotFoundError):  # another tenant's sandbox, and another tenant's snapshot
        await s.service.snapshots.create(s.who["b_dev"], sandbox_id)
    with pytest.raises(NotFoundError):
        await s.service.snapshots.get(s.who["b_dev"], snap.id)
    with pytest.raises(InvalidRequestError, match=snap.id):
        await s.service.sandboxes.create(s.who["b_dev"], CreateSandbox(template=snap.id))
    child = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox(template=snap.id))
    assert child.template == snap.id
    await s.service.snapshots.delete(s.who["a_dev"], "named")
    assert s.backend.world.snapshots == {} and await s.service.snapshots.list(s.who["a_dev"]) == []
    assert (await s.last("snapshot.delete")).outcome["status"] == 204


async def test_fork_counts_against_quotas_and_a_failed_fork_frees_its_reservation(setup: Setup) -> None:
    s = setup
    parent = await _create(s, env={"K": "v"}, metadata={"m": "1"})
    [child] = await s.service.sandboxes.fork(s.who["a_dev"], parent, ForkSandbox(metadata={"m": "2"}))
    assert child.id != parent and child.metadata == {"m": "2"} and child.env_names == ("K",)
    assert s.backend.world.snapshots == {}  # the fork's snapshot lives only for the child's create
    assert (await s.last("sandbox.fork")).outcome["sandbox_ids"] == [child.id]
    await s.store.set_quotas(s.tenants["a"], Quotas(max_sandboxes=2))
    with pytest.raises(QuotaExceededError):
        await s.service.sandboxes.fork(s.who["a_dev"], parent, ForkSandbox())
    await s.store.set_quotas(s.tenants["a"], Quotas())
    s.backend.fail_create = True
    with pytest.raises(ServerError):
        await s.service.sandboxes.fork(s.who["a_dev"], parent, ForkSandbox())
    live = {r.id for r in await s.store.list_sandboxes(s.tenants["a"])}
    assert live == {parent, child.id}  # the failed one stopped counting
    s.backend.fail_create = False
    await s.store.set_quotas(s.tenants["a"], Quotas(max_sandboxes=4))
    with pytest.raises(QuotaExceededError):  # room for two more, not for three: none starts
        await s.service.sandboxes.fork(s.who["a_dev"], parent, ForkSandbox(count=3))
    assert {r.id for r in await s.store.list_sandboxes(s.tenants["a"])} == {parent, child.id}
    assert len(s.engine.list()) == 2
    snapshots = len(s.backend.called("snapshot"))
    twins = await s.service.sandboxes.fork(s.who["a_dev"], parent, ForkSandbox(count=2))
    assert len(twins) == 2 and len(s.backend.called("snapshot")) == snapshots + 1  # one freeze and copy for both
    with pytest.raises(pydantic.ValidationError):
        ForkSandbox.model_validate({"count": 101})
    with pytest.raises(NotFoundError):
        await s.service.sandboxes.fork(s.who["b_dev"], parent, ForkSandbox())


async def test_reconciler_auto_pauses_and_destroys_the_forgotten(setup: Setup) -> None:
    s = setup
    pausing = await _create(s, on_timeout="pause")
    killing = await _create(s)
    past = datetime.now(UTC) - timedelta(seconds=1)
    async with s.store._db.write() as session:  # both at the end of their time to live
        await session.execute(update(SandboxRow).values(expires_at=past))
    ended = await s.service.reconciler.expire()
    assert set(ended) == {pausing, killing}
    record = await s.store.get_sandbox(pausing)
    assert record.live and record.paused_to_disk and s.engine.info(pausing).paused_to_disk
    assert not (await s.store.get_sandbox(killing)).live
    assert (await s.last("sandbox.auto_pause")).outcome == {"status": "paused", "reason": "timeout", "to_disk": True}
    assert await s.service.reconciler.expire() == []  # its clock stands still while paused
    assert await s.service.reconciler.remove_forgotten() == []
    await s.store.set_quotas(s.tenants["a"], Quotas(max_paused_seconds=0))
    assert await s.service.reconciler.remove_forgotten() == [pausing]
    assert not (await s.store.get_sandbox(pausing)).live and pausing not in {i.id for i in s.engine.list()}


async def test_auto_pause_over_the_paused_quota_destroys_and_says_why(setup: Setup) -> None:
    s = setup
    await s.store.set_quotas(s.tenants["a"], Quotas(max_paused=0))
    sandbox_id = await _create(s, on_timeout="pause")
    async with s.store._db.write() as session:
        await session.execute(update(SandboxRow).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    assert await s.service.reconciler.expire() == [sandbox_id]
    assert not (await s.store.get_sandbox(sandbox_id)).live
    assert "max_paused" in (await s.last("sandbox.expire")).outcome["reason"]


async def test_checkpoint_pause_is_refused_and_changes_nothing(setup: Setup) -> None:
    s = setup
    sandbox_id = await _create(s)
    with pytest.raises(Exception, match="CRIU") as info:
        await s.service.sandboxes.pause(s.who["a_dev"], sandbox_id, memory=True, to_disk=True)
    assert info.value.code == "runtime_unavailable"  # type: ignore[attr-defined]
    assert (await s.store.get_sandbox(sandbox_id)).state is SandboxState.RUNNING
    assert s.backend.called("pause") == [] and s.backend.called("stop") == []
