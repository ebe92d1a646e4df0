"""The same bundle under gVisor (runsc, ptrace platform): the hardened runtime class."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.control import ControlStore, Role
from corral.engine import Engine, SandboxSpec
from corral.service import Command, CreateSandbox, Service

from .conftest import TEMPLATE

pytestmark = [pytest.mark.anyio, pytest.mark.runsc]

BOOT_ID = "/proc/sys/kernel/random/boot_id"


async def test_gvisor_sandbox_reports_gvisor_and_works(engine):
    async with await engine.create(SandboxSpec(template=TEMPLATE, runtime="runsc")) as sb:
        r = await sb.exec("dmesg | head -1; id -u; uname -r", timeout=60)
        lines = r.stdout.splitlines()
        assert "gVisor" in lines[0] and lines[1] == "1000"
        host_release = Path("/proc/sys/kernel/osrelease").read_text().strip()
        assert lines[2] != host_release  # gVisor's own kernel, not the host's
        data = bytes(range(256)) * 100
        await sb.files.write("/workspace/x.bin", data)
        assert await sb.files.read("/workspace/x.bin") == data
        r = await sb.exec("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=2)'",
                          timeout=60)
        assert r.exit_code != 0  # loopback only


async def test_runc_sandbox_reports_host_kernel(sandbox):
    r = await sandbox.exec("uname -r")
    assert r.stdout.strip() == Path("/proc/sys/kernel/osrelease").read_text().strip()


async def test_gvisor_snapshot_fork_and_pause_to_disk(engine):
    """gVisor writes through its gofer to the same upper layer, so the lifecycle works the same under runsc."""
    runsc = SandboxSpec(template=TEMPLATE, runtime="runsc")
    async with await engine.create(runsc) as sb:
        await sb.files.write("/workspace/g.txt", b"under gvisor")
        await sb.files.write("/tmp/t.txt", b"tmpfs")
        artifact = await engine.snapshot(sb.id)
        try:
            async with await engine.create(runsc, source=artifact) as child:
                assert await child.files.read("/workspace/g.txt") == b"under gvisor"
                assert not await child.files.exists("/tmp/t.txt")  # memory: not in a snapshot
        finally:
            await engine.delete_snapshot(artifact)
        async with await engine.fork(sb.id) as forked:
            assert await forked.files.read("/workspace/g.txt") == b"under gvisor"
        await engine.pause(sb.id, memory=False)
        assert engine.info(sb.id).paused_to_disk
        await engine.resume(sb.id)
        assert await sb.files.read("/workspace/g.txt") == b"under gvisor"
        assert await sb.files.read("/tmp/t.txt") == b"tmpfs"
        r = await sb.exec("dmesg | head -1", timeout=60)
        assert "gVisor" in r.stdout


async def test_a_tenant_that_requires_runsc_gets_gvisor_when_it_asks_for_the_default(engine: Engine,
                                                                                     tmp_path: Path) -> None:
    """The tenant's runtime policy (docs/security.md): the caller asks for nothing (runc), the sandbox is gVisor."""
    async with ControlStore(home=tmp_path) as store:
        tenant = await store.create_tenant("hardened", required_runtime="runsc")
        dev = await store.authenticate((await store.create_key(tenant.id, Role.DEVELOPER)).key)
        service = Service(engine, store)  # not started: the engine fixture and the store are
        record = await service.sandboxes.create(dev, CreateSandbox(template=TEMPLATE))
        try:
            assert record.spec.runtime.value == "runsc"
            result = await service.commands.run(dev, record.id, Command("dmesg | head -1; uname -r", timeout=60))
            first, release = result.stdout.splitlines()[:2]
            assert "gVisor" in first
            assert release != Path("/proc/sys/kernel/osrelease").read_text().strip()
        finally:
            await service.sandboxes.kill(dev, record.id)


async def test_gvisor_gives_each_boot_a_boot_id_of_its_own(engine: Engine) -> None:
    """gVisor's kernel makes its own boot id for each sandbox it boots: a pause to disk and resume is a new one,
    a freeze is not (runc's sandboxes get theirs from the backend: tests/test_backend_lifecycle.py)."""
    host = Path(BOOT_ID).read_text().strip()
    runsc = SandboxSpec(template=TEMPLATE, runtime="runsc")
    async with await engine.create(runsc) as sb, await engine.create(runsc) as other:
        first = (await sb.exec(f"cat {BOOT_ID}", timeout=60)).stdout.strip()
        assert first not in ("", host)
        assert (await sb.files.read(BOOT_ID)).decode().strip() == first
        assert (await sb.exec(f"echo x > {BOOT_ID}", timeout=60)).exit_code != 0  # read-only
        mount = (await sb.exec(f"grep ' {BOOT_ID} ' /proc/self/mountinfo", timeout=60)).stdout
        assert " ro," in mount and str(engine.home) not in mount
        assert (await other.exec(f"cat {BOOT_ID}", timeout=60)).stdout.strip() not in (first, host)
        await engine.pause(sb.id)
        await engine.resume(sb.id)
        assert (await sb.exec(f"cat {BOOT_ID}", timeout=60)).stdout.strip() == first
        await engine.pause(sb.id, memory=False)
        await engine.resume(sb.id)
        assert (await sb.exec(f"cat {BOOT_ID}", timeout=60)).stdout.strip() not in (first, host, "")
