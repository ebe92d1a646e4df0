"""Warm pools (docs/performance.md): real runc sandboxes started ahead of demand, claimed by creates through the
engine and through the API, with the caller's env, policy and metadata applied at claim; never shared, never
counted against a tenant; given back under memory pressure and for a caller's create that needs the room."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from corral import Admin, CapacityError, InvalidRequestError, Sandbox
from corral.cli import app
from corral.control import Quotas
from corral.engine import Capacity, Engine, SandboxSpec, WarmPool, parse_pools
from corral.engine._models import Runtime
from corral.engine._pool_sizing import AutoSize
from corral.server import ServerProcess

from .conftest import TEMPLATE, TEMPLATE_HOME, spec, started_engine
from .test_server_api import Api, create, error_code, run
from .test_server_api import api as api  # the fixture: the app over `engine` (here: with a pool), tenants a and b

pytestmark = [pytest.mark.anyio]

POOL = 2
_FILL_TIMEOUT = 60.0


async def _filled(engine: Engine, size: int = POOL) -> None:
    """Wait, bounded, until the pools hold `size` ready members."""
    deadline = time.monotonic() + _FILL_TIMEOUT
    while engine.pool_ready < size:
        assert time.monotonic() < deadline, f"the pool holds {engine.pool_ready} of {size} after {_FILL_TIMEOUT}s"
        await asyncio.sleep(0.05)


def _stats(engine: Engine) -> dict[str, int]:
    (stats,) = engine.pool_stats().values()
    return {"claimed": stats.claimed, "missed": stats.missed, "made": stats.made, "evicted": stats.evicted}


@pytest.fixture
async def engine(test_home: Path) -> AsyncIterator[Engine]:
    async with started_engine(test_home, pools=[WarmPool(SandboxSpec(template=TEMPLATE), POOL)]) as eng:
        await _filled(eng)
        yield eng


# -- configuration -------------------------------------------------------------------------------------------


def test_pool_descriptions_parse_and_bad_ones_say_what_is_expected() -> None:
    pool = WarmPool.parse("default/root/runsc=20:5")
    assert (pool.spec.template, pool.spec.root, pool.spec.runtime, pool.size, pool.refill) == \
        ("default", True, Runtime.RUNSC, 20, 5.0)
    assert pool.describe() == "default/root/runsc=20:5"
    assert [p.describe() for p in parse_pools(["default=50 python=3", "default/root=2"])] == \
        ["default=50", "python=3", "default/root=2"]
    assert parse_pools([""]) == []
    for bad, says in [("default", "expected TEMPLATE"), ("default=-1", "expected TEMPLATE"),
                      ("default/gpu=2", "unknown flag 'gpu'"), ("default=20001", "between 0 and"),
                      ("=3", "expected TEMPLATE")]:
        with pytest.raises(InvalidRequestError, match=says):
            parse_pools([bad])
    with pytest.raises(InvalidRequestError, match="same sandboxes"):
        parse_pools(["default=2", "default=3"])


# -- the engine ------------------------------------------------------------------------------------------------


@pytest.mark.runc  # a pool of real sandboxes
async def test_create_is_served_from_the_pool_with_the_callers_spec_applied(engine: Engine) -> None:
    members = set(engine.pool.ready)
    mine = SandboxSpec(template=TEMPLATE, env={"MINE": "yes"}, metadata={"who": "caller"}, timeout=77)
    sb = await engine.create(mine)
    assert sb.id in members and _stats(engine)["claimed"] == 1
    info = sb.info
    assert info.metadata == {"who": "caller"} and info.env == {"MINE": "yes"}
    result = await sb.exec("echo $MINE; hostname")
    assert result.stdout == "yes\nsandbox\n"
    # refilled in the quiet after the claim: back to full, with a new member
    await _filled(engine)
    assert sb.id not in engine.pool.ready and _stats(engine)["made"] == POOL + 1


@pytest.mark.runc  # a pool of real sandboxes
async def test_a_destroyed_sandbox_never_returns_to_the_pool(engine: Engine) -> None:
    first = await engine.create(SandboxSpec(template=TEMPLATE))
    await first.files.write("/workspace/secret.txt", b"tenant a was here")
    await first.exec("sleep 300 & echo started")
    await first.destroy()
    await _filled(engine)
    for _ in range(POOL + 1):  # every member there is, and one made cold after them
        sb = await engine.create(SandboxSpec(template=TEMPLATE))
        assert sb.id != first.id
        assert (await sb.exec("ls /workspace; pgrep -c sleep || true")).stdout == "0\n"


@pytest.mark.runc  # a pool of real sandboxes
async def test_a_spec_the_pool_cannot_serve_starts_cold_and_leaves_the_pool_alone(engine: Engine) -> None:
    sb = await engine.create(spec(disk="512M"))  # a disk is made at start: another pool key
    assert sb.id not in engine.pool.ready and engine.pool_ready == POOL
    assert _stats(engine)["claimed"] == 0 and sb.info.limits.disk == 512 * 1024**2


@pytest.mark.runc  # a pool of real sandboxes
async def test_memory_cpu_and_pids_limits_are_applied_at_the_claim_and_enforced(engine: Engine) -> None:
    # Both differ from the pool's (512M, 1 CPU, 256 pids) only in what the local backend resizes in place (at
    # 384M and more, /tmp and /dev/shm keep their default sizes: the same pool key).
    small = await engine.create(spec(memory="384M", cpus=0.5, pids=40))
    big = await engine.create(spec(memory="1G", cpus=2))
    assert _stats(engine)["claimed"] == 2, _stats(engine)
    assert small.info.limits.memory == 384 * 1024**2 and big.info.limits.memory == 1024**3

    def hog(mib: int) -> str:  # touch every page, so the memory is really charged
        return f"python3 -c 'b = bytearray({mib} * 2**20); b[::4096] = bytes(len(b[::4096])); print(len(b))'"

    result = await small.exec(hog(450))  # fits the pool's 512M, not the claim's 384M
    assert result.oom_killed, result
    assert (await big.exec(hog(700))).stdout == f"{700 * 2**20}\n"  # over the pool's 512M, within the claim's 1G
    forks = await small.exec("for i in $(seq 60); do sleep 5 & done 2>&1 | grep -c fork || true")
    assert int(forks.stdout) > 0, forks  # 40 pids: some of the 60 sleeps could not start
    quota = await big.exec("cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    assert quota.stdout.split()[0] == "200000", quota


@pytest.mark.runc  # a pool of real sandboxes
async def test_a_claim_for_more_memory_than_fits_takes_the_pools_room_and_never_fails_for_it(
        test_home: Path) -> None:
    pools = [WarmPool(SandboxSpec(template=TEMPLATE), POOL)]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    overcommit = (POOL * 512 + 256) * 1024**2 / total  # room for the two 512M members and 256M more
    async with started_engine(test_home, pools=pools, capacity=Capacity(memory_overcommit=overcommit)) as engine:
        await _filled(engine)
        # 1G does not fit beside the members: the claimed one is dropped, the other given back, and it starts cold.
        sb = await engine.create(spec(memory="1G"))
        assert sb.info.limits.memory == 1024**3 and (await sb.exec("true")).exit_code == 0
        assert _stats(engine)["claimed"] == 1 and _stats(engine)["evicted"] == 1 and engine.pool_ready == 0
        assert not engine.pool.claimed
        with pytest.raises(CapacityError):  # no member left to make room with: the machine is full
            await engine.create(spec(memory="1G"))


@pytest.mark.runc  # a pool of real sandboxes
async def test_a_member_whose_agent_died_is_replaced_under_the_same_id(engine: Engine) -> None:
    # Kill the agent (the sandbox's PID 1) of the newest member, the one a claim takes, from the host.
    newest = engine.pool.states[engine.pool.key(SandboxSpec(template=TEMPLATE))].members[-1]
    record = engine.pool.ready[newest].record
    os.kill(int((record.dir / "pid").read_text()), signal.SIGKILL)  # type: ignore[attr-defined]
    sb = await engine.create(SandboxSpec(template=TEMPLATE))
    assert sb.id == newest
    assert (await sb.exec("echo alive")).stdout == "alive\n"


@pytest.mark.runc  # a pool of real sandboxes
async def test_pools_give_members_back_under_memory_pressure_and_do_not_refill(engine: Engine) -> None:
    engine.pool_memory_floor = 1 << 60  # more than any machine has: always under pressure
    engine.pool.wake.set()
    deadline = time.monotonic() + _FILL_TIMEOUT
    while engine.pool_ready and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.pool_ready == 0 and _stats(engine)["evicted"] == POOL
    await asyncio.sleep(1.5)  # a few looks of the filler: still nothing started
    assert engine.pool_ready == 0 and _stats(engine)["made"] == POOL
    sb = await engine.create(SandboxSpec(template=TEMPLATE))  # creates still work, cold
    assert (await sb.exec("true")).exit_code == 0 and _stats(engine)["missed"] == 1


@pytest.mark.runc  # a pool of real sandboxes
async def test_a_callers_create_takes_the_room_of_pool_members(test_home: Path) -> None:
    pools = [WarmPool(SandboxSpec(template=TEMPLATE), POOL)]
    async with started_engine(test_home, pools=pools, capacity=Capacity(max_sandboxes=POOL)) as engine:
        await _filled(engine)
        sb = await engine.create(spec(memory="256M"))  # not the pool's spec, and the machine is "full"
        assert (await sb.exec("true")).exit_code == 0
        assert engine.pool_ready == POOL - 1 and _stats(engine)["evicted"] == 1
        other = await engine.create(spec(memory="256M"))
        assert engine.pool_ready == 0
        with pytest.raises(CapacityError):  # no member left to give back
            await engine.create(spec(memory="256M"))
        await other.destroy()


@pytest.mark.runc  # a pool of real sandboxes
async def test_a_self_sizing_pool_grows_to_the_burst_it_saw_and_serves_the_next_one_warm(test_home: Path) -> None:
    pools = [WarmPool(SandboxSpec(template=TEMPLATE), auto=AutoSize(rest=1))]
    async with started_engine(test_home, pools=pools) as engine:
        await _filled(engine, 1)
        first = await asyncio.gather(*(engine.create(SandboxSpec(template=TEMPLATE)) for _ in range(3)))
        assert _stats(engine)["claimed"] == 1 and _stats(engine)["missed"] == 2
        await asyncio.gather(*(sb.destroy() for sb in first))
        await _filled(engine, 3)  # the burst's size, not the rest size
        (stats,) = engine.pool_stats().values()
        assert stats.target == 3
        second = await asyncio.gather(*(engine.create(SandboxSpec(template=TEMPLATE)) for _ in range(3)))
        assert _stats(engine)["claimed"] == 4 and _stats(engine)["missed"] == 2, "the second burst: all warm"
        assert [(await sb.exec("true")).exit_code for sb in second] == [0, 0, 0]
        await asyncio.gather(*(sb.destroy() for sb in second))


# -- through the API ---------------------------------------------------------------------------------------


@pytest.mark.runc  # the api fixture's engine: this file's pooled one, not the fake
async def test_api_creates_claim_members_and_the_pool_counts_against_no_tenant(api: Api) -> None:
    await api.store.set_quotas(api.tenants["a"], Quotas(max_sandboxes=1))
    members = set(api.engine.pool.ready)
    async with api.client("a_dev") as dev, api.client("admin") as admin:
        sb = await create(dev, env={"WHO": "a"}, metadata={"k": "v"}, network="none")
        assert sb["id"] in members and sb["metadata"] == {"k": "v"}
        assert base64.b64decode((await run(dev, sb["id"], "echo $WHO"))["stdout_b64"]) == b"a\n"
        # The tenant's quota of one is used by its sandbox, not by the pool's ready members.
        r = await dev.post("/v1/sandboxes", json={"template": TEMPLATE})
        assert r.status_code == 429 and error_code(r) == "quota_exceeded"
        # The member claimed for the refused create is named in its audit record: destroyed, never pooled again.
        audit = (await admin.get("/v1/audit", params={"action": "sandbox.create"})).json()["records"]
        assert audit[0]["target"] == sb["id"]
        refused = audit[1]["target"]
        assert refused not in api.engine.pool.ready and refused not in api.engine.pool.claimed
        assert refused not in {info.id for info in api.engine.list()}
        # Another tenant cannot see the sandbox, nor the pool's members.
    async with api.client("b_dev") as other:
        listed = (await other.get("/v1/sandboxes")).json()["sandboxes"]
        assert listed == []
        for member in set(api.engine.pool.ready):
            assert (await other.post(f"/v1/sandboxes/{member}/exec", json={"cmd": "true"})).status_code == 404


@pytest.mark.runc  # the api fixture's engine: this file's pooled one, not the fake
async def test_pool_metrics_count_claims_and_misses(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("admin") as admin:
        for _ in range(POOL + 1):
            await create(dev)
        text = (await admin.get("/metrics")).text
    assert f'corral_pool_claimed_total{{pool="{TEMPLATE}={POOL}"}} {float(POOL)}' in text
    assert f'corral_pool_missed_total{{pool="{TEMPLATE}={POOL}"}} 1.0' in text


def test_serve_refuses_a_bad_pool_with_a_clear_error(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["serve", "--pool", "default=many"], env={"CORRAL_HOME": str(tmp_path)})
    assert r.exit_code == 2 and "--pool" in r.output and "TEMPLATE[/root][/runsc]=SIZE" in r.output, r.output
    assert not (tmp_path / "engine").exists()  # refused before anything started


# -- the README's server -------------------------------------------------------------------------------------


def _pool_samples(server: ServerProcess) -> dict[str, float]:
    """The self-sizing pool's gauges and counters from the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.admin_key}"},
                     timeout=30).text
    out = {}
    for name in ("members_ready", "target", "claimed_total", "missed_total"):
        match = re.search(rf'^corral_pool_{name}{{pool="default=auto"}} ([0-9.e+]+)$', text, re.M)
        assert match, f"no corral_pool_{name} for default=auto in /metrics"
        out[name] = float(match[1])
    return out


def _until(server: ServerProcess, ready: Callable[[dict[str, float]], bool], what: str) -> dict[str, float]:
    deadline = time.monotonic() + _SERVE_FILL_TIMEOUT
    while not ready(samples := _pool_samples(server)):
        assert time.monotonic() < deadline, f"{what} within {_SERVE_FILL_TIMEOUT:g}s: {samples}"
        time.sleep(0.25)
    return samples


_SERVE_FILL_TIMEOUT = 240.0  # members start one per core in idle time; a loaded machine is slow at it
_BURST = 6


@pytest.mark.runc
@pytest.mark.skipif(TEMPLATE != "default", reason="the README's server pools the default template")
def test_a_default_serve_keeps_a_self_sizing_pool_that_refills_to_the_burst_after_claims(test_home: Path,
                                                                                         unique: str) -> None:
    with ServerProcess(test_home / f"auto-{unique}", template_home=TEMPLATE_HOME, default_pool=True) as server:
        assert "warm pools: default=auto (self-sizing" in server.log_tail(), "serve says its pool choice"
        rest = _until(server, lambda s: s["members_ready"] >= s["target"] > 0, "the pool at rest")
        assert rest["target"] < _BURST, "at rest the pool keeps a few members"
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create(f"auto-{unique}")
            key = admin.keys.create(f"auto-{unique}", "developer").key

        def burst() -> list[Sandbox]:
            with concurrent.futures.ThreadPoolExecutor(_BURST) as agents:
                return list(agents.map(lambda _: Sandbox.create(template=TEMPLATE, api_key=key,
                                                                base_url=server.url), range(_BURST)))

        first = burst()
        after = _pool_samples(server)
        assert after["claimed_total"] + after["missed_total"] == _BURST and after["target"] == _BURST
        for sb in first:
            sb.kill()
        grown = _until(server, lambda s: s["members_ready"] >= _BURST, "the pool refilled to the burst")
        second = burst()
        served = _pool_samples(server)
        assert served["claimed_total"] - grown["claimed_total"] == _BURST, "the second burst: all warm"
        assert [sb.commands.run("true").exit_code for sb in second] == [0] * _BURST
        for sb in second:
            sb.kill()
