"""Checkpoints on the local backend against real runc sandboxes (docs/lifecycle.md, "Checkpoints"): a `rm -rf`
undone byte for byte (modes, owners, symlinks, a deleted template file), files made since gone, paths restored
alone, what changed, a sandbox paused to disk, checkpoints surviving an engine's restart, a full disk."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral._exceptions import CapacityError, ConflictError
from corral.backends import CheckpointArtifact, SandboxSpec
from corral.backends.local import LocalRecord, _disk
from corral.engine import Adoption, Engine, SandboxSession

from .conftest import TEMPLATE, make_engine

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

ROOT = SandboxSpec(template=TEMPLATE, root=True)
# What a restore must bring back: each path's type, mode, owner, size, a symlink's target, the bytes' digest.
SURVEY = ("cd / && find /workspace /etc/adduser.conf /etc/os-release -xdev -printf '%p %y %m %u:%g %s %l\\n' | sort && "
          "find /workspace -xdev -type f -print0 | sort -z | xargs -0 sha256sum")
SETUP = ("mkdir -p /workspace/proj/src /workspace/proj/db && cd /workspace/proj && "
         "printf 'print(1)\\n' > src/main.py && head -c 300000 /dev/urandom > db/data.bin && chmod 640 db/data.bin && "
         "ln -s src/main.py link && printf x > mine && chown 0:0 mine && chmod 4711 mine && "
         "ln db/data.bin hard.bin && printf kept > /workspace/other")


@pytest.fixture
async def home() -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ck-"))  # short: agent sockets live under it
    path.chmod(0o711)  # traverse only: runc reaches the sandboxes' roots through it
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def run(sb: SandboxSession, cmd: str) -> str:
    result = await sb.exec(cmd, user="root")
    assert result.exit_code == 0, result.stderr_bytes.decode()
    return result.stdout_bytes.decode()


def record(engine: Engine, sandbox_id: str) -> LocalRecord:
    rec = engine.lookup(sandbox_id).record
    assert isinstance(rec, LocalRecord)
    return rec


async def test_rm_rf_then_restore_brings_every_byte_mode_owner_and_symlink_back(engine: Engine) -> None:
    async with await engine.create(ROOT) as sb:
        await run(sb, SETUP)
        before = await run(sb, SURVEY)
        ckpt = await engine.checkpoint(sb.id, "ckpt-0000000000000001")
        assert ckpt.size_bytes > 300_000
        unchanged = await engine.checkpoint(sb.id, "ckpt-0000000000000002")
        assert unchanged.size_bytes < 100_000  # the walk and a manifest, no copy
        await run(sb, "rm -rf /workspace/proj && rm /etc/os-release /etc/adduser.conf && printf y > /workspace/new && "
                      "chmod 600 /workspace/other && sleep 1000 &")
        changes = {c.path: c.kind for c in await engine.checkpoint_changes(sb.id, ckpt)}
        assert changes["/workspace/proj"] == changes["/etc/adduser.conf"] == changes["/etc/os-release"] == "deleted"
        assert changes["/workspace/new"] == "added" and changes["/workspace/other"] == "mode"
        assert await engine.checkpoint_read(sb.id, ckpt, "/workspace/proj/src/main.py", 100) == b"print(1)\n"
        assert b"adduser" in (await engine.checkpoint_read(sb.id, ckpt, "/etc/adduser.conf", 10_000) or b"")
        assert await engine.checkpoint_read(sb.id, ckpt, "/etc/os-release", 10_000) is None  # the template's symlink
        await engine.restore_checkpoint(sb.id, ckpt)
        assert await run(sb, SURVEY) == before
        assert "sleep 1000" not in await run(sb, "ps -eo args")  # processes were ended by the restore
        assert await run(sb, "test -e /workspace/new || echo gone") == "gone\n"
        assert await run(sb, "stat -c %i /workspace/proj/db/data.bin /workspace/proj/hard.bin | uniq | wc -l") == "1\n"
        assert await engine.checkpoint_changes(sb.id, ckpt) == []


async def test_restore_of_paths_only_leaves_the_rest(engine: Engine) -> None:
    async with await engine.create(ROOT) as sb:
        await run(sb, SETUP)
        ckpt = await engine.checkpoint(sb.id, "ckpt-0000000000000001")
        await run(sb, "rm -rf /workspace/proj/db && printf changed > /workspace/other && printf n > /workspace/new")
        await engine.restore_checkpoint(sb.id, ckpt, paths=["/workspace/proj/db", "/workspace/new"])
        assert await run(sb, "wc -c < /workspace/proj/db/data.bin") == "300000\n"
        assert await run(sb, "cat /workspace/other; test -e /workspace/new || echo ' no new'") == "changed no new\n"


async def test_a_sandbox_paused_to_disk_is_checkpointed_and_restored_and_stays_paused(engine: Engine) -> None:
    async with await engine.create(ROOT) as sb:
        await run(sb, SETUP)
        await sb.pause(memory=False)
        rec = record(engine, sb.id)
        ckpt = await engine.checkpoint(sb.id, "ckpt-0000000000000001")
        assert not _disk.mounts_under(rec.dir)  # its image was mounted for the call only
        await sb.resume()
        await run(sb, "rm -rf /workspace/proj")
        await sb.pause(memory=False)
        await engine.restore_checkpoint(sb.id, ckpt)
        assert engine.info(sb.id).paused_to_disk and not _disk.mounts_under(rec.dir)
        await sb.resume()
        assert await run(sb, "cat /workspace/proj/src/main.py") == "print(1)\n"
        await sb.pause()  # in memory: its frozen processes would wake on files changed under them
        await engine.checkpoint(sb.id, "ckpt-0000000000000002")  # taken frozen as it is, and left frozen
        assert await engine.backend.frozen(engine.lookup(sb.id).record)
        with pytest.raises(ConflictError, match="resume it, or pause it to disk"):
            await engine.restore_checkpoint(sb.id, ckpt)
        await sb.resume()


async def test_checkpoints_survive_an_engine_restart(home: Path) -> None:
    first = make_engine(home)
    await first.start()
    sb = await first.create(ROOT)
    try:
        await run(sb, SETUP)
        data = (await first.checkpoint(sb.id, "ckpt-0000000000000001")).to_json()
        await first.close()  # the sandbox stays
        second = make_engine(home)  # a new process: it adopts the sandbox the store says is live
        await second.start(adopt={sb.id: Adoption(spec=ROOT)})
        try:
            again = second.get(sb.id)
            await run(again, "rm -rf /workspace")
            await second.restore_checkpoint(sb.id, CheckpointArtifact.from_json(data))
            assert await run(again, "cat /workspace/proj/src/main.py") == "print(1)\n"
            assert await second.checkpoints_size(sb.id) > 300_000
            await second.delete_checkpoint(sb.id, CheckpointArtifact.from_json(data))
            assert await second.checkpoints_size(sb.id) < 100_000
        finally:
            await second.close(destroy_all=True)
    finally:
        await first.close(destroy_all=True)


async def test_a_full_disk_is_a_capacity_error_not_a_hang(engine: Engine) -> None:
    async with await engine.create(SandboxSpec(template=TEMPLATE, limits={"disk": "64M"})) as sb:
        await sb.exec("head -c 40000000 /dev/urandom > /workspace/big")
        with pytest.raises(CapacityError, match="no room"):
            await engine.checkpoint(sb.id, "ckpt-0000000000000001")
        assert (await sb.exec("echo still here")).stdout == "still here\n"  # thawed, its disk as it was
        assert await engine.checkpoints_size(sb.id) < 1_000_000


@pytest.mark.runsc
@pytest.mark.slow
async def test_a_runsc_sandbox_is_restored_too(engine: Engine) -> None:
    async with await engine.create(SandboxSpec(template=TEMPLATE, runtime="runsc")) as sb:
        await sb.exec("mkdir -p /workspace/p && printf hello > /workspace/p/a")
        ckpt = await engine.checkpoint(sb.id, "ckpt-0000000000000001")
        await sb.exec("rm -rf /workspace/p")
        await engine.restore_checkpoint(sb.id, ckpt)
        assert (await sb.exec("cat /workspace/p/a")).stdout == "hello"
