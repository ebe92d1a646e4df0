"""The OpenAI Agents SDK's E2B sandbox client (`agents.extensions.sandbox.e2b`) against Corral with the client's
defaults, which ask for E2B's auto-resume (`on_timeout="pause"`, `auto_resume=True`): the sandbox is created,
and each time it is paused (as E2B's pause route does it, or by its timeout) the client's next command, read or
write resumes it and is served. Runs in `.venv-openai-agents` (scripts/test), against a real `corral serve` and
real runc sandboxes; the client is driven directly, with no model and no OpenAI key."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions

from .conftest import Corral

pytestmark = [pytest.mark.anyio]


def _e2b(corral: Corral, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """E2B's control plane as its SDKs call it (the `X-API-Key` header)."""
    return httpx.request(method, f"{corral.url}{path}", headers={"X-API-Key": corral.key}, timeout=60, **kwargs)


def _detail(corral: Corral, sandbox_id: str) -> dict[str, Any]:
    r = _e2b(corral, "GET", f"/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _pause(corral: Corral, sandbox_id: str) -> None:
    assert _e2b(corral, "POST", f"/sandboxes/{sandbox_id}/pause").status_code == 204
    assert _detail(corral, sandbox_id)["state"] == "paused"


def _auto_resumes(corral: Corral, sandbox_id: str) -> list[str]:
    with corral.admin() as admin:
        r = admin.get("/v1/audit", params={"sandbox": sandbox_id, "action": "sandbox.resume"})
    assert r.status_code == 200, r.text
    return [rec["params"]["reason"] for rec in r.json()["records"] if rec["params"].get("auto_resume")]


@pytest.fixture
async def session(e2b_env: Corral) -> AsyncIterator[Any]:
    options = E2BSandboxClientOptions(sandbox_type="e2b", timeout=600)
    assert options.on_timeout == "pause" and options.auto_resume is True  # the defaults this tier is about
    made = await E2BSandboxClient().create(options=options)
    try:
        await made.start()
        yield made
    finally:
        sandbox_id = made.state.sandbox_id
        try:
            await made.shutdown()
        finally:
            with e2b_env.admin() as admin:
                admin.delete(f"/v1/sandboxes/{sandbox_id}")


async def test_created_with_the_clients_defaults(e2b_env: Corral, session: Any) -> None:
    lifecycle = _detail(e2b_env, session.state.sandbox_id)["lifecycle"]
    assert lifecycle == {"autoResume": True, "onTimeout": "pause"}
    r = await session.exec("echo hello from $(id -un)")
    assert r.exit_code == 0 and r.stdout == b"hello from user\n"


async def test_a_paused_sandbox_resumes_for_commands_reads_and_writes(e2b_env: Corral, session: Any) -> None:
    sandbox_id = session.state.sandbox_id
    await session.write(Path("notes.txt"), io.BytesIO(b"kept\x00across pauses"))

    _pause(e2b_env, sandbox_id)
    r = await session.exec("cat notes.txt | wc -c")
    assert r.exit_code == 0 and r.stdout.strip() == b"18"
    assert _detail(e2b_env, sandbox_id)["state"] == "running"

    _pause(e2b_env, sandbox_id)
    assert (await session.read(Path("notes.txt"))).read() == b"kept\x00across pauses"

    _pause(e2b_env, sandbox_id)
    await session.write(Path("after.txt"), io.BytesIO(b"written after a pause"))
    assert _detail(e2b_env, sandbox_id)["state"] == "running"
    assert (await session.read(Path("after.txt"))).read() == b"written after a pause"
    assert len(_auto_resumes(e2b_env, sandbox_id)) == 3


async def test_paused_by_its_timeout_it_resumes_for_the_next_command(e2b_env: Corral, session: Any) -> None:
    sandbox_id = session.state.sandbox_id
    assert _e2b(e2b_env, "POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": 0}).status_code == 204
    deadline = time.monotonic() + 60
    while _detail(e2b_env, sandbox_id)["state"] != "paused" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _detail(e2b_env, sandbox_id)["state"] == "paused"
    r = await session.exec("echo awake")
    assert r.exit_code == 0 and r.stdout == b"awake\n"
    assert _auto_resumes(e2b_env, sandbox_id) == ["sandbox.exec"]
