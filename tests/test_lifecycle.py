"""Sandbox lifecycle on real runc: pause/resume, timeouts, restarts, crash cleanup, concurrency."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest

from corral import CapacityError, ConflictError, InvalidRequestError, NotFoundError
from corral.engine import Adoption, Capacity, SandboxSpec

from .conftest import TEMPLATE, leaks, make_engine, spec

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


async def test_destroy_leaves_nothing(engine, test_home):
    sb = await engine.create(spec())
    await sb.exec("sleep 1000 &")
    await sb.destroy()
    assert not [x for x in leaks(test_home) if sb.id in x]
    with pytest.raises(NotFoundError):
        await sb.exec("true")


async def test_pause_freezes_and_resume_continues(engine):
    async with await engine.create(spec()) as sb:
        await sb.processes.start("i=0; while true; do i=$((i+1)); echo $i > /workspace/n; sleep 0.05; done")
        await anyio.sleep(0.3)
        record = engine.runtime.sandboxes[sb.id].record
        assert not await engine.backend.frozen(record)
        await sb.pause()
        assert await engine.backend.frozen(record)  # what a restarted server asks (runc's own state)
        with pytest.raises(ConflictError, match="paused"):
            await sb.exec("true")
        with pytest.raises(ConflictError, match="paused"):  # files need a running agent too
            await sb.files.read("/workspace/n")
        await anyio.sleep(0.5)
        await sb.resume()
        assert not await engine.backend.frozen(record)
        a = int((await sb.files.read("/workspace/n")).strip())
        await anyio.sleep(0.3)
        b = int((await sb.files.read("/workspace/n")).strip())
        assert b > a
        with pytest.raises(ConflictError):
            await sb.resume()


async def test_pause_while_forking_pauses_or_says_why(engine):
    # Found by the eval corpus: runc's cgroup v1 freezer gives up on a tree that keeps forking ("unable to
    # freeze") and pausing answered a bare runtime failure (a 500 through the API).
    async with await engine.create(spec()) as sb:
        await sb.processes.start("while true; do /bin/true & /bin/true & wait; done")
        await anyio.sleep(0.3)
        paused = 0
        for _ in range(8):
            try:
                await sb.pause()
            except ConflictError as exc:  # the only acceptable failure: retryable, and it says what happened
                assert "could not be paused" in exc.message and exc.details["retryable"] is True
                continue
            paused += 1
            await sb.resume()
        assert paused >= 1
        assert (await sb.exec("echo alive")).stdout == "alive\n"


async def test_the_engine_ends_nothing_by_itself(engine):
    # When a sandbox ends is the store's record; the service's reconciler is the one reaper (test_service_lifecycle).
    sb = await engine.create(SandboxSpec(template=TEMPLATE, timeout=1))
    await anyio.sleep(2.2)
    assert (await sb.exec("echo alive")).stdout == "alive\n"
    await sb.destroy()


async def test_restart_reattaches(test_home):
    first = make_engine(test_home)
    await first.start()
    sb = await first.create(spec())
    await sb.files.write("/workspace/keep.txt", b"still here")
    bg = await sb.processes.start("sleep 1000")
    boot_id = (await sb.exec("cat /proc/sys/kernel/random/boot_id")).stdout
    await first.close()  # the engine goes, the sandbox stays

    second = make_engine(test_home)
    await second.start(adopt={sb.id: Adoption(spec=spec())})  # what the store would say of it
    try:
        assert [s.id for s in second.list()] == [sb.id]
        again = second.get(sb.id)
        assert await again.files.read("/workspace/keep.txt") == b"still here"
        assert any(p.id == bg.id and p.running for p in await again.processes.list())
        assert (await again.exec("cat /proc/sys/kernel/random/boot_id")).stdout == boot_id  # the same boot
    finally:
        await second.close(destroy_all=True)
    assert not leaks(test_home)


BOOT_ID = "/proc/sys/kernel/random/boot_id"


async def _boot_id(sb) -> str:
    r = await sb.exec(f"cat {BOOT_ID}")
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


async def test_each_boot_of_a_sandbox_has_a_boot_id_of_its_own(engine):
    """A pause to disk and resume is a new boot, as on a machine of its own: a new boot id (what E2B's suites
    check); a freeze is not, nor is a second read."""
    host = Path(BOOT_ID).read_text().strip()
    async with await engine.create(spec()) as sb, \
            await engine.create(SandboxSpec(template=TEMPLATE, root=True)) as rooted:
        first = await _boot_id(sb)
        assert first != host and await _boot_id(sb) == first
        assert await _boot_id(rooted) not in (first, host)
        assert (await rooted.exec("id -u", user="root")).stdout == "0\n"
        for attempt in (f"echo x > {BOOT_ID}", f"umount {BOOT_ID}", f"umount -l {BOOT_ID}",
                        f"mount -t tmpfs t {BOOT_ID}"):
            assert (await rooted.exec(attempt, user="root")).exit_code != 0, attempt  # not even its root
        await engine.pause(sb.id)
        await engine.resume(sb.id)
        assert await _boot_id(sb) == first
        await engine.pause(sb.id, memory=False)
        await engine.resume(sb.id)
        second = await _boot_id(sb)
        assert second not in (first, host) and await _boot_id(sb) == second


async def test_second_engine_on_same_home_is_refused(engine, test_home):
    other = make_engine(test_home)
    with pytest.raises(ConflictError, match="owns"):
        await other.start()


async def test_half_created_sandboxes_are_swept(test_home):
    eng = make_engine(test_home)
    await eng.start()
    # The backend finished but the engine never recorded it (as if it crashed in between).
    template = eng.templates.get(TEMPLATE)
    await eng.backend.create("sb-halfmade0001", spec(), template)
    # And a create cancelled half-way cleans up after itself.
    task = asyncio.create_task(eng.create(spec()))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eng.close()
    assert any("sb-halfmade0001" in x for x in leaks(test_home))

    fresh = make_engine(test_home)
    await fresh.start()
    await fresh.close()
    assert not leaks(test_home)


async def test_unknown_template_and_bad_limits(engine):
    with pytest.raises(NotFoundError, match="no-such-template"):
        await engine.create(SandboxSpec(template="no-such-template"))
    with pytest.raises(ValueError, match="memory"):
        spec(memory="1K")
    with pytest.raises(ValueError, match="not a size"):
        spec(disk="lots")


@pytest.mark.slow
async def test_fifty_at_once(engine, test_home):
    async def one(i: int) -> str:
        async with await engine.create(spec(memory="128M")) as sb:
            r = await sb.exec(["python3", "-c", f"print(sum(range({i} * 1000)))"], timeout=120)
            return r.stdout.strip()

    results = await asyncio.gather(*(one(i) for i in range(50)))
    assert results == [str(sum(range(i * 1000))) for i in range(50)]
    assert not leaks(test_home)


async def test_caller_chosen_id(engine):
    async with await engine.create(spec(), sandbox_id="sb-chosen-0001") as sb:
        assert sb.id == "sb-chosen-0001" and (await sb.exec("true")).exit_code == 0
        with pytest.raises(ConflictError):
            await engine.create(spec(), sandbox_id="sb-chosen-0001")
    for bad in ("../x", "sb-A", "sb-", "other-1234", "sb-" + "a" * 70):
        with pytest.raises(InvalidRequestError):
            await engine.create(spec(), sandbox_id=bad)


# -- machine capacity ----------------------------------------------------------------------------------------------


async def test_capacity_count_refuses_with_retry_after_and_creates_nothing(engine, test_home):
    engine.capacity = Capacity(max_sandboxes=1)
    first = await engine.create(spec())
    before = set(leaks(test_home))
    with pytest.raises(CapacityError, match="at most 1 sandboxes") as info:
        await engine.create(spec())
    assert info.value.details["resource"] == "max_sandboxes" and 1 <= info.value.details["retry_after"] <= 300
    assert [s.id for s in engine.list()] == [first.id] and set(leaks(test_home)) == before
    await first.destroy()
    await (await engine.create(spec())).destroy()  # the slot is free again


async def test_capacity_holds_under_concurrent_creates(engine):
    engine.capacity = Capacity(max_sandboxes=2)
    results = await asyncio.gather(*(engine.create(spec()) for _ in range(5)), return_exceptions=True)
    made = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, CapacityError)]
    assert len(made) == 2 and len(refused) == 3, results
    for sb in made:
        await sb.destroy()


@pytest.mark.parametrize(("capacity", "resource"), [
    (Capacity(memory_overcommit=1e-6), "memory_overcommit"),
    (Capacity(min_free_memory=1 << 60), "min_free_memory"),
    (Capacity(min_free_disk=1 << 60), "min_free_disk"),
])
async def test_capacity_resources_are_named(engine, capacity, resource):
    engine.capacity = capacity
    with pytest.raises(CapacityError) as info:
        await engine.create(spec())
    assert info.value.details["resource"] == resource and info.value.details["retry_after"] >= 1
    assert engine.list() == [] and engine.usage().sandboxes == 0
