"""Resource metrics: `Backend.usage` against real runc sandboxes (CPU burnt, memory held, files written show), the
cgroup v1 and v2 formats it parses, the service's sampler over the fake backend (first sample, CPU %, ring bound,
pause, removal, windows), and `sandboxes.metrics` authorized and audited like `get`.

The REST route and the SDK's `get_metrics` are in tests/test_server_api.py and tests/test_sdk_live.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from corral import InvalidRequestError, NotFoundError
from corral.backends import SandboxState, SandboxUsage
from corral.backends.local import _cgroups, _disk
from corral.engine import Engine, Runtime, SandboxSession
from corral.service import CreateSandbox, MetricsSampler, SandboxMetric
from corral.service._metrics import cpu_percent

from .conftest import spec
from .fakes import FakeBackend, FakeTemplates, World, idle_usage
from .test_service import Setup
from .test_service import setup as setup  # the fixture: a started Service over the fake backend, tenants a and b

pytestmark = pytest.mark.anyio

MiB = 1024**2
T0 = 1_800_000_000.0  # a whole second: the unix time of the fake readings
BURN_HALF_A_CPU_SECOND = "import time\nwhile time.process_time() < 0.5: pass"  # however busy the host is


# -- the backend: what a real sandbox uses ----------------------------------------------------------------------


async def _usage(engine: Engine, sb: SandboxSession) -> SandboxUsage:
    usage = await engine.sandbox_usage(sb.id)
    assert usage is not None
    return usage


@pytest.mark.runc
async def test_a_real_sandbox_reports_its_limits_and_cpu_memory_and_disk_as_they_grow(engine: Engine) -> None:
    sb = await engine.create(spec(memory="256M", cpus=0.5, disk="512M"))
    try:
        base = await _usage(engine, sb)
        assert base.memory_limit == 256 * MiB and base.cpus == 0.5
        assert 400 * MiB < base.disk_total <= 512 * MiB and base.disk_used < 8 * MiB  # ext4 keeps a little
        assert 0 < base.memory_bytes < 64 * MiB and abs(base.at - time.time()) < 5

        assert (await sb.exec(["python3", "-c", BURN_HALF_A_CPU_SECOND], timeout=60)).exit_code == 0
        burnt = await _usage(engine, sb)
        assert burnt.cpu_seconds - base.cpu_seconds >= 0.5
        assert 0 < cpu_percent(base, burnt) <= 100

        await sb.exec("head -c 40M /dev/urandom > /workspace/blob && sync")
        written = await _usage(engine, sb)
        assert written.disk_used - base.disk_used >= 39 * MiB
        assert written.memory_cache_bytes - base.memory_cache_bytes >= 30 * MiB  # its pages, until reclaimed

        holder = await sb.processes.start(["python3", "-c", "import time; b = bytearray(96 << 20); "
                                                            "b[::4096] = b'x' * (96 << 8); time.sleep(60)"])
        held = await _until(lambda u: u.memory_bytes - written.memory_bytes >= 90 * MiB, engine, sb)
        assert held.memory_bytes <= held.memory_limit
        await sb.processes.kill(holder.id)
        await sb.exec("head -c 30M /dev/zero > /tmp/in-memory")  # a tmpfs: memory the kernel cannot drop
        on_tmpfs = await _until(lambda u: u.memory_bytes - written.memory_bytes >= 28 * MiB, engine, sb)
        assert on_tmpfs.disk_used - written.disk_used < 4 * MiB  # and not on the disk
    finally:
        await sb.destroy()
    with pytest.raises(NotFoundError):
        await engine.sandbox_usage(sb.id)


async def _until(good: Callable[[SandboxUsage], bool], engine: Engine, sb: SandboxSession,
                 timeout: float = 10.0) -> SandboxUsage:
    """The first reading `good` accepts (a process allocating memory takes a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = await _usage(engine, sb)
        if good(usage) or time.monotonic() > deadline:
            assert good(usage), usage
            return usage
        await asyncio.sleep(0.1)


@pytest.mark.runsc
async def test_a_gvisor_sandbox_reports_its_usage_from_the_host_side_too(engine: Engine) -> None:
    sb = await engine.create(spec(memory="256M").model_copy(update={"runtime": Runtime.RUNSC}))
    try:
        base = await _usage(engine, sb)
        assert base.memory_limit == 256 * MiB and base.cpus == 1.0 and base.memory_bytes > 0
        await sb.exec(["python3", "-c", BURN_HALF_A_CPU_SECOND], timeout=60)
        await sb.exec("head -c 16M /dev/urandom > /workspace/blob && sync")
        after = await _usage(engine, sb)
        # The sentry's CPU time, which includes the guest's; the files, through the gofer, on the sandbox's disk.
        assert after.cpu_seconds - base.cpu_seconds >= 0.5 and after.disk_used - base.disk_used >= 15 * MiB
    finally:
        await sb.destroy()


@pytest.mark.runc
async def test_a_sandbox_paused_to_disk_has_no_usage_and_boots_with_fresh_counters(
        engine: Engine, sandbox: SandboxSession) -> None:
    await sandbox.exec(["python3", "-c", BURN_HALF_A_CPU_SECOND], timeout=60)
    before = await _usage(engine, sandbox)
    await sandbox.pause()
    frozen = await _usage(engine, sandbox)  # frozen in memory: still there to measure, using no CPU
    await asyncio.sleep(0.5)
    assert (await _usage(engine, sandbox)).cpu_seconds == frozen.cpu_seconds
    await sandbox.resume()
    await engine.pause(sandbox.id, memory=False)
    assert await engine.sandbox_usage(sandbox.id) is None  # no cgroup, no disk mounted: nothing to ask
    await engine.resume(sandbox.id)
    booted = await _usage(engine, sandbox)
    assert booted.cpu_seconds < before.cpu_seconds and booted.disk_total == before.disk_total


@pytest.mark.runc
async def test_a_reading_is_cheap(engine: Engine, sandbox: SandboxSession) -> None:
    """What one sample of one sandbox costs (`-s` prints it; the sampler's docstring quotes it)."""
    await _usage(engine, sandbox)
    count = 500
    started = time.perf_counter()
    for _ in range(count):
        await engine.sandbox_usage(sandbox.id)
    each = (time.perf_counter() - started) / count
    print(f"\none reading of a real sandbox: {each * 1e6:.0f} us")
    assert each < 0.005


def test_cgroup_v2_files_are_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    for name, text in {"cpu.stat": "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
                       "memory.current": "104857600\n", "memory.max": "268435456\n", "cpu.max": "50000 100000\n",
                       "memory.stat": "anon 50000000\nfile 40000000\nshmem 1000\ninactive_file 30000000\n"}.items():
        (tmp_path / name).write_text(text)
    got = _cgroups.usage_v2(tmp_path)
    assert got == _cgroups.CgroupUsage(cpu_seconds=2.5, memory_bytes=104857600 - 30000000,
                                       memory_cache_bytes=40000000, memory_limit=256 * MiB, cpus=0.5)
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    unlimited = _cgroups.usage_v2(tmp_path)
    assert unlimited.memory_limit is None and unlimited.cpus is None
    (tmp_path / "memory.stat").write_text("anon 1\n")
    with pytest.raises(ValueError, match="inactive_file"):
        _cgroups.usage_v2(tmp_path)


def test_cgroup_v1_files_are_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    memory, cpu, cpuacct = tmp_path / "memory", tmp_path / "cpu", tmp_path / "cpuacct"
    for d in (memory, cpu, cpuacct):
        d.mkdir()
    (cpuacct / "cpuacct.usage").write_text("1500000000\n")
    (memory / "memory.usage_in_bytes").write_text("73400320\n")
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (memory / "memory.stat").write_text("cache 1\ninactive_file 2\ntotal_cache 20971520\n"
                                        "total_inactive_file 10485760\n")
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    got = _cgroups.usage_v1(memory, cpu, cpuacct)
    assert got == _cgroups.CgroupUsage(cpu_seconds=1.5, memory_bytes=60 * MiB, memory_cache_bytes=20 * MiB,
                                       memory_limit=None, cpus=None)
    (cpu / "cpu.cfs_quota_us").write_text("200000\n")
    assert _cgroups.usage_v1(memory, cpu, cpuacct).cpus == 2.0
    assert _cgroups.usage("/corral-test-no-such-cgroup/sb-x") is None  # gone: None, never an error


def test_a_directory_without_a_filesystem_of_its_own_has_no_disk_usage(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    assert _disk.filesystem_usage(tmp_path / "disk") is None  # unmounted: never the host's figures
    assert _disk.filesystem_usage(tmp_path / "missing") is None
    used, total = _disk.filesystem_usage(Path("/proc")) or (0, 0)  # a mount point: answers (proc: zeros)
    assert used == total == 0


# -- the sampler over the fake backend ------------------------------------------------------------------------


@dataclass
class Node:
    engine: Engine
    world: World

    def reads(self, sandbox_id: str, at: float, cpu_seconds: float, **figures: float) -> None:
        """What the backend reports of the sandbox from now on."""
        self.world.usage[sandbox_id] = idle_usage(at, cpu_seconds, **figures)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    home = Path(tempfile.mkdtemp(prefix="cm-", dir="/tmp"))  # short: the fake agents' Unix sockets live here
    world = World(home / "world")
    world.dir.mkdir()
    engine = Engine(home, FakeBackend(home, world), templates=FakeTemplates())  # type: ignore[arg-type]
    await engine.start()
    try:
        yield Node(engine, world)
    finally:
        await engine.close(destroy_all=True)
        shutil.rmtree(home, ignore_errors=True)


def at(seconds: float) -> datetime:
    """`seconds` after T0."""
    return datetime.fromtimestamp(T0 + seconds, UTC)


def _seconds(samples: list[SandboxMetric]) -> list[float]:
    return [m.timestamp.timestamp() for m in samples]


async def test_a_new_sandbox_gets_a_baseline_then_its_first_sample_one_tick_later(node: Node) -> None:
    sampler = MetricsSampler(node.engine, interval=5, tick=0.5)
    sb = await node.engine.create()
    node.reads(sb.id, T0, cpu_seconds=10.0)
    assert await sampler.sample(now=100.0) == 0 and sampler.window(sb.id) == []  # the baseline
    node.reads(sb.id, T0 + 0.5, cpu_seconds=10.25)
    assert await sampler.sample(now=100.5) == 1
    [first] = sampler.window(sb.id)
    assert first == SandboxMetric(timestamp=datetime.fromtimestamp(T0, UTC), cpus=1.0, cpu_used_pct=50.0,
                                  memory_used=8 * MiB, memory_total=512 * MiB, memory_cache=1 * MiB,
                                  disk_used=64 * 1024, disk_total=1024 * MiB)
    assert await sampler.sample(now=104.9) == 0  # not due before `interval`
    node.reads(sb.id, T0 + 5.5, cpu_seconds=12.75, cpus=2.0)
    assert await sampler.sample(now=105.5) == 1
    assert sampler.window(sb.id)[-1].cpu_used_pct == 25.0  # 2.5 s of 2 CPUs over 5 s


def test_cpu_percent_is_of_the_sandboxs_cpus_between_two_readings() -> None:
    assert cpu_percent(idle_usage(T0, 1.0), idle_usage(T0 + 2, 2.0)) == 50.0
    assert cpu_percent(idle_usage(T0, 1.0), idle_usage(T0 + 2, 2.0, cpus=0.5)) == 100.0
    assert cpu_percent(idle_usage(T0, 1.0), idle_usage(T0 + 1, 9.0)) == 100.0  # a burst past the quota: capped
    assert cpu_percent(idle_usage(T0, 5.0), idle_usage(T0 + 1, 0.2)) == 0.0  # booted again: the counter restarted
    assert cpu_percent(idle_usage(T0, 1.0), idle_usage(T0, 2.0)) == 0.0  # no time passed (a clock step)


async def test_the_ring_keeps_the_last_retention_of_samples_oldest_first(node: Node) -> None:
    sampler = MetricsSampler(node.engine, interval=5, retention=20, tick=1)  # 4 samples
    sb = await node.engine.create()
    for i in range(8):
        node.reads(sb.id, T0 + 5 * i, cpu_seconds=i, disk_used=i * MiB)
        await sampler.sample(now=5.0 * i)
    kept = sampler.window(sb.id)
    assert _seconds(kept) == [T0 + 5 * i for i in range(4, 8)]
    assert [m.disk_used for m in kept] == [i * MiB for i in range(4, 8)]
    assert sampler.capacity == 4


async def test_windows_are_inclusive_to_the_second_and_before_creation_is_empty(node: Node) -> None:
    sampler = MetricsSampler(node.engine, interval=5, tick=1)
    sb = await node.engine.create()
    for i in range(4):  # samples at T0+5, +10, +15 (the first reading is the baseline)
        node.reads(sb.id, T0 + 5 * i + 0.7, cpu_seconds=i)
        await sampler.sample(now=5.0 * i)
    assert _seconds(sampler.window(sb.id)) == [T0 + 5, T0 + 10, T0 + 15]
    assert _seconds(sampler.window(sb.id, at(5.9), at(10.2))) == [T0 + 5, T0 + 10]  # both ends, to the second
    assert _seconds(sampler.window(sb.id, start=at(11))) == [T0 + 15]
    assert _seconds(sampler.window(sb.id, end=at(9))) == [T0 + 5]
    assert sampler.window(sb.id, at(-3600), at(-1800)) == []  # before the sandbox existed
    assert sampler.window("sb-never") == []


async def test_a_paused_sandbox_gets_no_samples_and_a_new_baseline_when_it_runs_again(node: Node) -> None:
    sampler = MetricsSampler(node.engine, interval=5, tick=1)
    sb = await node.engine.create()
    node.reads(sb.id, T0, cpu_seconds=1.0)
    await sampler.sample(now=0)
    node.reads(sb.id, T0 + 1, cpu_seconds=1.5)
    assert await sampler.sample(now=1) == 1
    await sb.pause()
    for now in (10.0, 20.0):
        assert await sampler.sample(now=now) == 0
    await sb.resume()
    node.reads(sb.id, T0 + 30, cpu_seconds=9.0)
    assert await sampler.sample(now=30) == 0  # a baseline: nothing to measure CPU % from across the pause
    node.reads(sb.id, T0 + 31, cpu_seconds=9.25)
    assert await sampler.sample(now=31) == 1
    assert _seconds(sampler.window(sb.id)) == [T0 + 1, T0 + 31]  # the samples before the pause stay
    assert sampler.window(sb.id)[-1].cpu_used_pct == 25.0


async def test_samples_go_with_their_sandbox_and_an_unreadable_one_is_tried_again(node: Node) -> None:
    sampler = MetricsSampler(node.engine, interval=5, tick=1)
    gone, kept = await node.engine.create(), await node.engine.create()
    for i in range(2):
        for sb in (gone, kept):
            node.reads(sb.id, T0 + i, cpu_seconds=i)
        await sampler.sample(now=i)
    assert len(sampler.window(gone.id)) == len(sampler.window(kept.id)) == 1
    await gone.destroy()
    node.world.running.discard(kept.id)  # the backend cannot read it for now (the fake answers None)
    assert await sampler.sample(now=10) == 0
    assert sampler.window(gone.id) == [] and len(sampler.window(kept.id)) == 1
    node.world.running.add(kept.id)
    node.reads(kept.id, T0 + 11, cpu_seconds=1)
    assert await sampler.sample(now=10.5) == 0  # not due: a failed reading is tried again one tick later
    assert await sampler.sample(now=11) == 0  # and is a baseline again
    node.reads(kept.id, T0 + 12, cpu_seconds=1.5)
    assert await sampler.sample(now=12) == 1


async def test_the_sampler_runs_on_its_own_and_stops(node: Node) -> None:
    sampler = MetricsSampler(node.engine, interval=5, tick=0.1)
    sb = await node.engine.create()
    sampler.start()
    try:
        for _ in range(50):
            if sampler.window(sb.id):
                break
            await asyncio.sleep(0.05)
        assert len(sampler.window(sb.id)) == 1
    finally:
        await sampler.close()
    assert sampler._task is None


async def test_a_sampler_with_impossible_periods_is_refused(node: Node) -> None:
    for periods in ({"tick": 0}, {"tick": 6}, {"retention": 0}):
        with pytest.raises(ValueError):
            MetricsSampler(node.engine, interval=5, **periods)


async def test_a_pass_over_a_thousand_idle_sandboxes_is_cheap(node: Node) -> None:
    """The sampler's own cost per pass, for 1,000 sandboxes with nothing due (`-s` prints it)."""
    sampler = MetricsSampler(node.engine, interval=5, tick=0.5)
    states = {f"sb-{i:016x}": SandboxState.RUNNING for i in range(1000)}
    node.engine.states = lambda: states  # type: ignore[method-assign]  # 1,000 without 1,000 agents
    node.engine.sandbox_usage = _fake_reading  # type: ignore[method-assign]
    await sampler.sample(now=0)  # baselines
    started = time.perf_counter()
    assert await sampler.sample(now=0.5) == 1000  # first samples
    due = time.perf_counter() - started
    started = time.perf_counter()
    assert await sampler.sample(now=1.0) == 0
    idle = time.perf_counter() - started
    print(f"\na pass over 1,000 sandboxes: {idle * 1e3:.2f} ms with none due, {due * 1e3:.1f} ms with all due "
          f"(readings not counted); a full ring: {sampler.capacity} samples, {sampler.capacity * 32} bytes")
    assert idle < 0.1 and sampler.capacity == 720


async def _fake_reading(sandbox_id: str) -> SandboxUsage:
    return idle_usage(time.time())


# -- the service method --------------------------------------------------------------------------------------


async def test_metrics_are_the_tenants_own_audited_and_checked(setup: Setup) -> None:
    s = setup
    record = await s.service.sandboxes.create(s.who["a_dev"], CreateSandbox())
    for _ in range(40):  # the service's own sampler: a baseline within a tick, the first sample a tick later
        if await s.service.sandboxes.metrics(s.who["a_dev"], record.id):
            break
        await asyncio.sleep(0.1)
    [first] = await s.service.sandboxes.metrics(s.who["a_dev"], record.id)
    assert abs(first.timestamp.timestamp() - time.time()) < 5 and first.memory_total == 512 * MiB
    audit = await s.last("sandbox.metrics")
    assert audit.target == record.id and audit.outcome == {"status": 200, "count": 1}

    naive_now = datetime.now(UTC).replace(tzinfo=None)  # naive: UTC
    assert await s.service.sandboxes.metrics(s.who["a_dev"], record.id, naive_now - timedelta(minutes=1),
                                             naive_now + timedelta(minutes=1)) == [first]
    assert await s.service.sandboxes.metrics(s.who["a_dev"], record.id, naive_now - timedelta(hours=1),
                                             naive_now - timedelta(minutes=30)) == []
    with pytest.raises(NotFoundError):  # another tenant's sandbox does not exist
        await s.service.sandboxes.metrics(s.who["b_dev"], record.id)
    assert (await s.last("sandbox.metrics")).outcome["status"] == 404
    with pytest.raises(InvalidRequestError, match="is after end"):
        await s.service.sandboxes.metrics(s.who["a_dev"], record.id, naive_now, naive_now - timedelta(seconds=1))
    refused = await s.last("sandbox.metrics")
    assert refused.outcome["status"] == 400 and refused.params["start"] == naive_now.replace(tzinfo=UTC).isoformat()
    await s.service.sandboxes.kill(s.who["a_dev"], record.id)
    with pytest.raises(NotFoundError):
        await s.service.sandboxes.metrics(s.who["a_dev"], record.id)

