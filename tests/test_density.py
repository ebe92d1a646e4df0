"""Density (docs/performance.md, "Density"): what runs out first when a machine holds many sandboxes is refused
with a structured `CapacityError` naming the limit, never an OSError halfway through a create; and the local
backend raises its process's open-files soft limit at start, as far as the hard limit allows."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from corral import CapacityError
from corral.backends.local import LocalBackend, _disk, _system
from corral.engine import SandboxSpec
from corral.server import ServerProcess

from .conftest import TEMPLATE, TEMPLATE_HOME, leaks, started_engine

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


@pytest.fixture
def nofile() -> Iterator[tuple[int, int]]:
    """This process's RLIMIT_NOFILE, put back as it was after the test."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        yield limits
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def _lowered(hard: int) -> int:
    low = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    return low


def test_local_backend_raises_the_soft_open_files_limit(nofile: tuple[int, int], tmp_path: Path) -> None:
    _, hard = nofile
    low = _lowered(hard)
    backend = LocalBackend(tmp_path)
    soft_now, hard_now = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard_now == hard  # never touched: raising it needs CAP_SYS_RESOURCE
    assert soft_now == min(hard, _system.OPEN_FILES_WANTED) >= low
    assert backend.open_files_limit == (soft_now, hard_now)


def test_a_higher_soft_limit_is_never_lowered(nofile: tuple[int, int]) -> None:
    _, hard = nofile
    if hard != resource.RLIM_INFINITY and hard <= 300:
        pytest.skip(f"hard limit {hard} leaves no room above the wanted figure")
    assert _system.raise_open_files_limit(wanted=300)[0] >= 300
    assert _system.raise_open_files_limit(wanted=200)[0] >= 300


def test_the_server_raises_its_soft_open_files_limit_at_start(nofile: tuple[int, int]) -> None:
    _, hard = nofile
    home = Path(f"/var/tmp/corral-test-density-{uuid.uuid4().hex[:8]}")
    low = _lowered(hard)  # the server inherits it, as from a login shell's `ulimit -n 256`
    try:
        server = ServerProcess(home, template_home=TEMPLATE_HOME)
        server.start()
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        try:
            limits = Path(f"/proc/{server.pid}/limits").read_text()
        finally:
            server.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        shutil.rmtree(home, ignore_errors=True)
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    soft = int(line.split()[3])
    assert soft == min(hard, _system.OPEN_FILES_WANTED) > low, line


async def test_create_is_refused_with_capacity_error_when_open_files_run_out(
        nofile: tuple[int, int], test_home: Path) -> None:
    async with started_engine(test_home) as engine:
        _, hard = nofile
        # A few descriptors left under the soft limit: fewer than a create needs.
        resource.setrlimit(resource.RLIMIT_NOFILE, (_system.open_files() + 8, hard))
        with pytest.raises(CapacityError) as caught:
            await engine.create(SandboxSpec(template=TEMPLATE))
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        details = caught.value.details
        assert details["resource"] == "open_files"
        assert details["limit"] < details["current"] + details["requested"]
        assert "RLIMIT_NOFILE" in str(caught.value)
        assert engine.list() == []
        assert leaks(test_home) == []
        sb = await engine.create(SandboxSpec(template=TEMPLATE))  # room again: creates go on
        assert (await sb.exec(["true"])).exit_code == 0
        await sb.destroy()


async def test_create_is_refused_with_capacity_error_when_no_loop_device_is_left(
        monkeypatch: pytest.MonkeyPatch, test_home: Path) -> None:
    def exhausted(image: Path) -> tuple[str, int]:
        # What LOOP_CTL_GET_FREE answers when the kernel has no minor left to give.
        raise OSError(errno.ENOSPC, "No space left on device")

    async with started_engine(test_home) as engine:
        monkeypatch.setattr(_disk._mounts, "attach_loop", exhausted)
        with pytest.raises(CapacityError) as caught:
            await engine.create(SandboxSpec(template=TEMPLATE))
        monkeypatch.undo()
        assert caught.value.details["resource"] == "loop_devices"
        assert "loop device" in str(caught.value)
        assert engine.list() == []
        assert leaks(test_home) == []  # the half-made sandbox (its directory, slot, image) is gone
        sb = await engine.create(SandboxSpec(template=TEMPLATE))
        assert (await sb.exec(["true"])).exit_code == 0
        await sb.destroy()


async def test_any_other_loop_failure_stays_a_server_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(image: Path) -> tuple[str, int]:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(_disk._mounts, "attach_loop", broken)
    image = tmp_path / "disk.img"
    image.write_bytes(b"")
    with pytest.raises(Exception) as caught:
        await _disk.mount_image(image, tmp_path / "disk")
    assert not isinstance(caught.value, CapacityError)
    assert "mounting the sandbox disk failed" in str(caught.value)


async def test_a_sandbox_s_mounts_are_found_and_undone_by_their_own_lines(tmp_path: Path) -> None:
    """Destroy reads only the mount table's lines that name the sandbox's directory (a thousand sandboxes make it
    4,000 lines): names with spaces, mounts below mounts, and a sibling whose name starts the same way."""
    base = Path(f"/var/tmp/corral-test-density-{uuid.uuid4().hex[:8]}")
    sandbox, sibling = base / "sb 1", base / "sb 10"
    points = [sandbox / "disk", sandbox / "disk" / "up per", sibling / "disk"]
    try:
        for point in points:
            point.mkdir(parents=True, exist_ok=True)
            _disk.mount_tmpfs(point, size=1 << 20, inodes=16, mode=0o755, owner=0)
        assert sorted(_disk.mounts_under(sandbox)) == sorted(map(str, points[:2]))
        assert _disk.is_mounted(sandbox / "disk") and not _disk.is_mounted(sandbox)
        done = await _disk.unmount_all([sandbox / "disk" / "up per", sandbox / "disk", sandbox / "rootfs"])
        assert set(done) == {sandbox / "disk" / "up per", sandbox / "disk"}
        assert done[sandbox / "disk"] == "tmpfs"
        assert _disk.mounts_under(sandbox) == []
        assert _disk.mounts_under(base) == [str(sibling / "disk")]  # the sibling was not touched
    finally:
        await _disk.unmount_all(reversed(points))
        shutil.rmtree(base, ignore_errors=True)


async def test_alive_reads_proc_not_runc_and_agrees_with_runc(monkeypatch: pytest.MonkeyPatch,
                                                               test_home: Path) -> None:
    """`alive` (an engine's restart asks it once per sandbox) answers from /proc, without a `runc state` that reads
    the whole mount table; running and frozen are alive, an init that died is not, as runc says."""
    async with started_engine(test_home) as engine:
        sb = await engine.create(SandboxSpec(template=TEMPLATE))
        record = engine.runtime.sandboxes[sb.id].record
        backend = engine.backend
        assert isinstance(backend, LocalBackend)
        runtime = backend.runtimes[record.runtime]  # type: ignore[attr-defined]

        async def no_runc(self: object, container_id: str) -> None:
            raise AssertionError("alive ran `runc state`")

        async def runc_says() -> bool:
            monkeypatch.undo()
            state = await runtime.state(sb.id)
            return state is not None and state.get("status") in ("running", "paused")

        monkeypatch.setattr(type(runtime), "state", no_runc)
        assert await backend.alive(record) is True
        assert await runc_says() is True
        await runtime.pause(sb.id)
        monkeypatch.setattr(type(runtime), "state", no_runc)
        assert await backend.alive(record) is True
        assert await runc_says() is True
        await runtime.resume(sb.id)
        pid = int((record.dir / "pid").read_text())  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):  # its pid namespace ends with it; the runtime reaps it
            if not await backend.alive(record):
                break
            await anyio.sleep(0.01)
        monkeypatch.setattr(type(runtime), "state", no_runc)
        assert await backend.alive(record) is False
        assert await runc_says() is False
        await sb.destroy()
