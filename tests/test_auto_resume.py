"""Auto-resume through Corral's own API and SDK (`Sandbox.create(auto_resume=True)`, docs/lifecycle.md), a real
server and real runc sandboxes: paused in memory or to disk, the sandbox resumes for a command, a file operation
or a code cell and serves it, with its timeout again; reading its record does not wake it; without the option a
paused sandbox refuses as before. E2B's SDKs drive the same in tests/test_e2b_auto_resume.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from corral import AsyncSandbox, ConflictError, QuotaExceededError
from corral.control import Quotas

from .conftest import TEMPLATE
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


def _opts(api: Api, url: str) -> dict[str, Any]:
    return {"api_key": api.keys["a_dev"], "base_url": url}


async def _resumes(api: Api, sandbox_id: str) -> list[tuple[str, bool, int]]:
    records = await api.store.audit.query(action="sandbox.resume", sandbox=sandbox_id)
    return [(r.params["reason"], r.params["to_disk"], r.outcome["status"])
            for r in records if r.params.get("auto_resume")]


async def test_paused_in_memory_or_to_disk_it_resumes_for_the_request(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    async with await AsyncSandbox.create(TEMPLATE, timeout=120, auto_resume=True, **opts) as sb:
        assert sb.info.auto_resume and (await sb.get_info()).auto_resume is True
        await sb.files.write("/workspace/kept.txt", b"kept\x00bytes")
        assert (await sb.run_code("n = 6 * 7")).error is None

        assert (await sb.pause(memory=True)).state == "paused"
        listed = {s.id: s.state for s in await AsyncSandbox.list(**opts)}
        assert listed[sb.id] == "paused"  # reading records never wakes it
        execution = await sb.run_code("n")  # frozen in place: the session's state is still there
        assert execution.error is None and execution.text == "42"

        assert (await sb.pause(memory=False)).paused_to_disk
        r = await sb.commands.run("cat /workspace/kept.txt")
        assert r.exit_code == 0 and r.stdout_bytes == b"kept\x00bytes"
        info = await sb.get_info()
        assert info.state == "running" and not info.paused_to_disk
        left = (datetime.fromisoformat(info.expires_at or "") - datetime.now(UTC)).total_seconds()
        assert left > 250  # at least five minutes from the resume (its own 120 s were less)

        assert (await sb.pause(memory=False)).paused_to_disk
        await sb.files.write("/workspace/new.txt", b"written while it woke")
        assert await sb.files.read("/workspace/new.txt") == b"written while it woke"

    assert sorted(await _resumes(api, sb.id)) == sorted([("sandbox.exec", False, 200), ("sandbox.exec", True, 200),
                                                         ("sandbox.files.write", True, 200)])


async def test_without_auto_resume_a_paused_sandbox_is_refused(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    async with await AsyncSandbox.create(TEMPLATE, timeout=120, **opts) as sb:
        assert sb.info.auto_resume is False
        await sb.pause(memory=False)
        with pytest.raises(ConflictError, match="paused to disk"):
            await sb.commands.run("true")
        with pytest.raises(ConflictError, match="paused"):
            await sb.files.read("/etc/hostname")
        assert (await sb.get_info()).state == "paused"
    assert await _resumes(api, sb.id) == []


async def test_a_resume_the_quotas_refuse_is_the_requests_error_and_changes_nothing(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    await api.store.set_quotas(api.tenants["a"], Quotas(max_sandboxes=1))
    async with await AsyncSandbox.create(TEMPLATE, timeout=120, auto_resume=True, **opts) as sb:
        await sb.pause(memory=False)  # its running slot is free again
        other = await AsyncSandbox.create(TEMPLATE, timeout=120, **opts)
        try:
            with pytest.raises(QuotaExceededError, match="max_sandboxes"):
                await sb.commands.run("true")
            info = await sb.get_info()
            assert info.state == "paused" and info.paused_to_disk
        finally:
            await other.kill()
        assert (await sb.commands.run("echo back")).stdout == "back\n"
    assert sorted(await _resumes(api, sb.id)) == [("sandbox.exec", True, 200), ("sandbox.exec", True, 429)]
