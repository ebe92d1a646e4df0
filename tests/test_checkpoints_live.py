"""Checkpoints through the SDK and the real API on real runc sandboxes (issue 26): an automatic checkpoint before a
`rm -rf` of a project, what it changed, the restore in place (every byte back, the sandbox running again with the
same id, what it stopped), a restore of some paths, and the REST errors on a real sandbox."""

from __future__ import annotations

from typing import Any

import pytest

from corral import AsyncSandbox, InvalidRequestError, NotFoundError

from .conftest import TEMPLATE
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

_PROJECT = ("mkdir -p /workspace/project/src /workspace/project/data && "
            "printf 'print(1)\\n' > /workspace/project/src/main.py && "
            "head -c 300000 /dev/urandom > /workspace/project/data/blob.bin && "
            "chmod 0751 /workspace/project/src && ln -s src/main.py /workspace/project/entry")
_DIGEST = "cd /workspace/project && find . -printf '%p %m %y %l\\n' | sort && sha256sum data/blob.bin src/main.py"


def _opts(api: Api, url: str) -> dict[str, Any]:
    return {"api_key": api.keys["a_dev"], "base_url": url}


async def test_an_rm_rf_undone_through_the_sdk(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, checkpoints="auto", **_opts(api, live_url)) as sb:
        assert (await sb.commands.run(_PROJECT)).exit_code == 0
        before = (await sb.commands.run(_DIGEST)).stdout
        wiped = await sb.commands.run("rm -rf /workspace/project")
        assert wiped.exit_code == 0 and wiped.checkpoint is not None
        assert (await sb.commands.run("test -e /workspace/project")).exit_code == 1
        changes = await sb.changes(since=wiped.checkpoint)
        deleted = {c.path for c in changes if c.kind == "deleted"}
        assert {"/workspace/project", "/workspace/project/src/main.py", "/workspace/project/data/blob.bin"} <= deleted
        result = await sb.restore(wiped.checkpoint)
        assert result.checkpoint.id == wiped.checkpoint and result.checkpoint.command == "rm -rf /workspace/project"
        assert (await sb.commands.run(_DIGEST)).stdout == before  # every byte, mode, type and link target
        assert (await sb.get_info()).id == sb.id
        # What changed since the checkpoint is nothing now, and the restored sandbox takes checkpoints again.
        again = await sb.commands.run("echo more > /workspace/project/more.txt")
        assert again.checkpoint is not None and again.checkpoint != wiped.checkpoint
        assert [c.path for c in await sb.changes(since=again.checkpoint)] == ["/workspace/project/more.txt"]


async def test_restore_of_paths_and_what_it_stopped(api: Api, live_url: str) -> None:
    async with await AsyncSandbox.create(TEMPLATE, **_opts(api, live_url)) as sb:
        await sb.files.write("/workspace/db/rows.txt", b"1\n2\n3\n")
        await sb.files.write("/workspace/notes.txt", b"old\n")
        cp = await sb.checkpoint("good")
        assert cp.automatic is False and cp.size >= 10
        await sb.commands.run("rm -rf /workspace/db && echo new > /workspace/notes.txt")
        await sb.commands.run("sleep 600", background=True)
        result = await sb.restore("good", paths=["/workspace/db"])
        assert result.paths == ["/workspace/db"]
        assert any(p.cmd == "sleep 600" for p in result.stopped_processes), result
        assert await sb.files.read("/workspace/db/rows.txt") == b"1\n2\n3\n"
        assert await sb.files.read("/workspace/notes.txt") == b"new\n"
        diff = await sb.changes(since="good", diff=True)
        notes = next(c for c in diff if c.path == "/workspace/notes.txt")
        assert notes.kind == "modified" and "-old\n+new\n" in (notes.diff or "")
        with pytest.raises(InvalidRequestError):
            await sb.restore("good", paths=["relative"])
        with pytest.raises(NotFoundError):
            await sb.restore("nope")
