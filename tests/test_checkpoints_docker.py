"""Checkpoints on the Docker backend against a real dockerd (docs/lifecycle.md, "Checkpoints"): a sandbox's disk
(/workspace, /home/user, /var/tmp) recorded, a `rm -rf` undone byte for byte with the container stopped and
started again, paths restored alone, what changed, checkpoints gone with their sandbox. Skipped, saying why, when
no daemon answers (tests/test_docker_backend.py's fixtures)."""



from __future__ import annotations

from pathlib import Path

import pytest

from corral.backends.docker._checkpoints import disk_path, sandbox_path
from corral.engine import Engine

from .test_docker_backend import docker_client, engine, home, spec, template  # noqa: F401 - fixtures

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

SURVEY = ("find /workspace /home/user -xdev -printf '%p %y %m %u:%g %s %l\\n' | sort && "
          "find /workspace /home/user -xdev -type f -print0 | sort -z | xargs -0 sha256sum")
SETUP = ("mkdir -p /workspace/proj/src /workspace/proj/db && cd /workspace/proj && "
         "printf 'print(1)\\n' > src/main.py && head -c 300000 /dev/urandom > db/data.bin && chmod 640 db/data.bin && "
         "ln -s src/main.py link && ln db/data.bin hard.bin && printf rc > /home/user/.myrc && printf k > /workspace/k")


def test_sandbox_paths_map_onto_the_disk_and_back() -> None:
    assert disk_path("/home/user/a/b") == "/home/a/b" and sandbox_path("/home/a/b") == "/home/user/a/b"
    assert disk_path("/workspace") == "/workspace" and disk_path("/etc/passwd") is None
    assert sandbox_path("/lost+found") is None


async def test_rm_rf_then_restore_on_docker(engine: Engine, home: Path) -> None:  # noqa: F811
    async with await engine.create(spec()) as sb:
        assert (await sb.exec(SETUP)).exit_code == 0
        before = (await sb.exec(SURVEY)).stdout
        ckpt = await engine.checkpoint(sb.id, "ckpt-0000000000000001")
        assert ckpt.size_bytes > 300_000
        assert (await engine.checkpoint(sb.id, "ckpt-0000000000000002")).size_bytes < 100_000
        await sb.exec("rm -rf /workspace/proj /home/user/.myrc && printf n > /workspace/new && chmod 600 /workspace/k")
        changes = {c.path: c.kind for c in await engine.checkpoint_changes(sb.id, ckpt)}
        assert changes["/workspace/proj"] == changes["/home/user/.myrc"] == "deleted"
        assert changes["/workspace/new"] == "added" and changes["/workspace/k"] == "mode"
        assert await engine.checkpoint_read(sb.id, ckpt, "/home/user/.myrc", 10) == b"rc"
        await engine.restore_checkpoint(sb.id, ckpt)
        assert (await sb.exec(SURVEY)).stdout == before
        assert (await sb.exec("test -e /workspace/new || echo gone")).stdout == "gone\n"
        await sb.exec("rm -rf /workspace/proj/db && printf changed > /workspace/k")
        await engine.restore_checkpoint(sb.id, ckpt, paths=["/workspace/proj"])
        assert (await sb.exec("wc -c < /workspace/proj/db/data.bin; cat /workspace/k")).stdout == "300000\nchanged"
        assert (home / "docker-checkpoints" / sb.id).is_dir()
    assert not (home / "docker-checkpoints" / sb.id).exists()  # gone with the sandbox
