"""E2B's auto-resume (`lifecycle={"auto_resume": True}`), driven by E2B's own SDK against a real `corral serve` and
real runc sandboxes: a paused sandbox created with it resumes when a command, a file read or a request to one of
its ports reaches it, and serves that request; concurrent requests resume it once; without it, a paused sandbox
refuses as before (docs/e2b.md, docs/lifecycle.md)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxState
from e2b.exceptions import SandboxException
from e2b_code_interpreter import Sandbox as CodeSandbox

from .e2b_support import Cleanup, E2BServer
from .e2b_support import cleanup as cleanup  # fixtures
from .e2b_support import e2b_env as e2b_env
from .e2b_support import e2b_fake_server as e2b_fake_server
from .e2b_support import e2b_front as e2b_front
from .e2b_support import e2b_server as e2b_server

pytestmark = [pytest.mark.runc]

_AUTO = {"on_timeout": "pause", "auto_resume": True}


def _resumes(server: E2BServer, sandbox_id: str) -> list[dict[str, Any]]:
    """The sandbox's automatic resumes in the audit trail, oldest first (read as the admin)."""
    r = httpx.get(f"{server.url}/v1/audit", params={"sandbox": sandbox_id, "action": "sandbox.resume"},
                  headers={"Authorization": f"Bearer {server.server.admin_key}"}, timeout=30)
    assert r.status_code == 200, r.text
    return [rec for rec in r.json()["records"] if rec["params"].get("auto_resume")]


def _state(sbx: Sandbox) -> SandboxState:
    return Sandbox.get_info(sbx.sandbox_id).state  # the control plane's record: reading it never wakes it


def _port_get(server: E2BServer, sbx: Sandbox, port: int) -> httpx.Response:
    return httpx.get(f"{server.url}/", headers={"Host": sbx.get_host(port),
                                               "E2B-Traffic-Access-Token": sbx.traffic_access_token or ""},
                     timeout=60)


def test_commands_files_and_ports_resume_a_paused_sandbox(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(Sandbox.create("base", timeout=600, lifecycle=_AUTO))
    assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
    sbx.files.write("/home/user/marker", "kept")
    server = sbx.commands.run("cd /home/user && python3 -m http.server 8000", background=True)
    for _ in range(100):
        if _port_get(e2b_env, sbx, 8000).status_code == 200:
            break
        time.sleep(0.1)

    sbx.pause()
    assert _state(sbx) is SandboxState.PAUSED
    assert not sbx.is_running()  # a health check does not wake it
    r = sbx.commands.run("cat /home/user/marker")
    assert r.exit_code == 0 and r.stdout == "kept"
    assert _state(sbx) is SandboxState.RUNNING

    sbx.pause()
    assert _state(sbx) is SandboxState.PAUSED
    assert sbx.files.read("/home/user/marker") == "kept"
    assert _state(sbx) is SandboxState.RUNNING

    sbx.pause()
    assert _state(sbx) is SandboxState.PAUSED
    r = _port_get(e2b_env, sbx, 8000)  # frozen in place: the server inside is still there, and answers
    assert r.status_code == 200 and "marker" in r.text
    assert _state(sbx) is SandboxState.RUNNING
    server.kill()

    reasons = [(rec["params"]["reason"], rec["outcome"]["status"]) for rec in _resumes(e2b_env, sbx.sandbox_id)]
    assert sorted(reasons) == sorted([("sandbox.exec", 200), ("sandbox.files.read", 200), ("sandbox.port", 200)])


def test_the_code_interpreter_resumes_it(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(CodeSandbox.create(timeout=600, lifecycle=_AUTO))
    assert sbx.run_code("x = 41").error is None
    sbx.pause()
    assert _state(sbx) is SandboxState.PAUSED
    execution = sbx.run_code("x + 1")  # frozen in place: the session's state is kept
    assert execution.error is None and execution.text == "42"
    assert [rec["params"]["reason"] for rec in _resumes(e2b_env, sbx.sandbox_id)] == ["sandbox.exec"]


def test_a_sandbox_paused_by_its_timeout_resumes_with_its_timeout_again(e2b_env: E2BServer,
                                                                        cleanup: Cleanup) -> None:
    sbx = cleanup.add(Sandbox.create("base", timeout=600, lifecycle=_AUTO))
    sbx.files.write("/home/user/marker", "kept")
    sbx.set_timeout(0)  # the TTL ends now: paused, as `on_timeout` says
    deadline = time.monotonic() + 60
    while _state(sbx) is not SandboxState.PAUSED and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _state(sbx) is SandboxState.PAUSED
    assert sbx.commands.run("cat /home/user/marker").stdout == "kept"
    info = sbx.get_info()
    assert info.state is SandboxState.RUNNING
    assert info.end_at.timestamp() > time.time() + 200  # at least five minutes from the resume, not expired


def test_without_auto_resume_a_paused_sandbox_answers_as_before(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(Sandbox.create("base", timeout=600, lifecycle={"on_timeout": "pause"}))
    assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
    sbx.pause()
    with pytest.raises(SandboxException) as refused:
        sbx.commands.run("true")
    assert "paused" in str(refused.value)
    with pytest.raises(SandboxException, match="paused"):
        sbx.files.read("/etc/hostname")
    assert _state(sbx) is SandboxState.PAUSED
    assert _resumes(e2b_env, sbx.sandbox_id) == []


@pytest.mark.anyio
async def test_concurrent_requests_resume_it_once(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = await AsyncSandbox.create("base", timeout=600, lifecycle=_AUTO)
    cleanup.ids.append(sbx.sandbox_id)
    await sbx.files.write("/home/user/n", "7")
    await sbx.pause()
    results = await asyncio.gather(*(sbx.commands.run("cat /home/user/n") for _ in range(6)),
                                   *(sbx.files.read("/home/user/n") for _ in range(2)))
    assert [getattr(r, "stdout", r) for r in results] == ["7"] * 8
    assert (await sbx.get_info()).state is SandboxState.RUNNING
    assert len(_resumes(e2b_env, sbx.sandbox_id)) == 1


def test_an_anonymous_request_to_a_public_port_resumes_it(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(Sandbox.create("base", timeout=600, lifecycle=_AUTO, network={"allow_public_traffic": True}))
    server = sbx.commands.run("cd /home/user && python3 -m http.server 8001", background=True)
    for _ in range(100):
        if httpx.get(f"{e2b_env.url}/", headers={"Host": sbx.get_host(8001)}, timeout=60).status_code == 200:
            break
        time.sleep(0.1)
    sbx.pause()
    assert _state(sbx) is SandboxState.PAUSED
    r = httpx.get(f"{e2b_env.url}/", headers={"Host": sbx.get_host(8001)}, timeout=60)  # no credential at all
    assert r.status_code == 200 and "Directory listing" in r.text
    server.kill()
    r = httpx.get(f"{e2b_env.url}/v1/audit", params={"sandbox": sbx.sandbox_id, "action": "sandbox.resume"},
                  headers={"Authorization": f"Bearer {e2b_env.server.admin_key}"}, timeout=30)
    (record,) = [rec for rec in r.json()["records"] if rec["params"].get("auto_resume")]
    assert record["params"]["reason"] == "sandbox.port" and record["key_id"] is None and record["tenant_id"]
