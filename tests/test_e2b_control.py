"""E2B's control plane on Corral, driven by E2B's own SDK (`e2b` from PyPI) with the three environment variables
alone: create, info, list with filters and pages, timeouts, pause and connect, snapshots and fork, tenancy, roles
and refusals, each checked against what Corral's own API says of the same sandbox. The front's own behaviour runs
on the fake engine; what a real sandbox keeps across pause, snapshot and fork, on runc."""

from __future__ import annotations

import time
import urllib.request
import uuid

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState, Template
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

from .e2b_support import Cleanup, E2BServer
from .e2b_support import cleanup as cleanup  # fixtures
from .e2b_support import e2b_env as e2b_env
from .e2b_support import e2b_fake_server as e2b_fake_server
from .e2b_support import e2b_front as e2b_front
from .e2b_support import e2b_server as e2b_server

# What is the E2B front's own runs on the fake engine (the fast tier, e2b_support's `e2b_fake_server`); what needs
# a real sandbox's memory or disk across pause, snapshot and fork runs on a real `corral serve` (marked runc).


def _v1(server: E2BServer, sandbox_id: str, who: str = "a_dev") -> httpx.Response:
    return httpx.get(f"{server.url}/v1/sandboxes/{sandbox_id}",
                     headers={"Authorization": f"Bearer {server.keys[who]}"}, timeout=30)


def test_create_with_the_environment_alone(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    tag = uuid.uuid4().hex
    sbx = cleanup.add(Sandbox.create("base", timeout=120, metadata={"case": tag}, envs={"FOO": "bar"}))
    assert sbx.is_running()
    assert str(sbx._envd_version) == "0.6.4" and sbx._envd_access_token
    info = sbx.get_info()
    assert info.state is SandboxState.RUNNING and info.metadata == {"case": tag}
    assert info.template_id == "default"  # `base` is the deployment's alias of `default`
    assert 100 < (info.end_at - info.started_at).total_seconds() <= 120
    record = _v1(e2b_env, sbx.sandbox_id).json()  # the same sandbox, seen through /v1
    assert record["metadata"] == {"case": tag} and record["network"] == "internet"
    assert record["file_roots"] == ["/"]  # E2B's envd reaches every path the user can
    assert sbx.get_host(8000) == f"8000-{sbx.sandbox_id}.localhost:{e2b_env.server.port}"
    sbx.kill()
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id) is False  # killing it again: E2B's 404, which the SDK answers False


def test_list_filters_and_pages(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    tag = uuid.uuid4().hex
    made = [cleanup.add(Sandbox.create("base", metadata={"list": tag, "n": str(i)})) for i in range(3)]
    made[0].pause()
    query = SandboxQuery(metadata={"list": tag})
    everything = Sandbox.list(query=query).next_items()
    assert [s.sandbox_id for s in everything] == [s.sandbox_id for s in reversed(made)]  # newest first
    running = Sandbox.list(query=SandboxQuery(metadata={"list": tag}, state=[SandboxState.RUNNING])).next_items()
    assert {s.sandbox_id for s in running} == {made[1].sandbox_id, made[2].sandbox_id}
    paused = Sandbox.list(query=SandboxQuery(metadata={"list": tag}, state=[SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [made[0].sandbox_id] and paused[0].state is SandboxState.PAUSED
    pages = Sandbox.list(query=query, limit=1)
    seen = []
    while pages.has_next:
        seen += [s.sandbox_id for s in pages.next_items()]
    assert seen == [s.sandbox_id for s in reversed(made)]
    assert Sandbox.list(query=SandboxQuery(metadata={"list": "no-such-tag"})).next_items() == []


def test_timeouts_connect_and_pause(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(Sandbox.create("base", timeout=300))
    before = sbx.get_info().end_at
    Sandbox.connect(sbx.sandbox_id, timeout=10)  # never shortens
    assert sbx.get_info().end_at == before
    Sandbox.connect(sbx.sandbox_id, timeout=900)
    assert sbx.get_info().end_at > before
    sbx.pause()
    assert not sbx.is_running() and sbx.get_info().state is SandboxState.PAUSED
    assert Sandbox.pause(sbx.sandbox_id) is False  # already paused: E2B's 409
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.is_running() and resumed.get_info().state is SandboxState.RUNNING
    sbx.set_timeout(2)
    # The sweep stops the agent first and removes the record when the destroy ends (seconds under CI's load):
    # wait for the record to go, bounded.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            sbx.get_info()
        except NotFoundException:
            break
        time.sleep(0.5)
    assert not sbx.is_running()
    with pytest.raises(NotFoundException):
        sbx.get_info()


@pytest.mark.runc  # a real sandbox's state kept across pause, snapshot and fork
def test_auto_pause_in_memory_and_on_disk(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    frozen = cleanup.add(Sandbox.create("base", timeout=60, lifecycle={"on_timeout": "pause"}))
    frozen.files.write("/home/user/marker", "kept")
    on_disk = cleanup.add(Sandbox.create("base", timeout=60,
                                         lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}}))
    frozen.commands.run("sleep 600", background=True)
    for sbx in (frozen, on_disk):
        sbx.set_timeout(0)  # the TTL ends now
    deadline = time.monotonic() + 30
    while (frozen.is_running() or on_disk.is_running()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert frozen.get_info().state is SandboxState.PAUSED and on_disk.get_info().state is SandboxState.PAUSED
    assert _v1(e2b_env, on_disk.sandbox_id).json()["paused_to_disk"] is True
    assert _v1(e2b_env, frozen.sandbox_id).json()["paused_to_disk"] is False
    resumed = frozen.connect()
    assert resumed.files.read("/home/user/marker") == "kept"
    assert any("sleep 600" in " ".join([p.cmd, *p.args]) for p in resumed.commands.list())  # processes kept
    assert resumed.get_info().end_at.timestamp() > time.time() + 30  # its whole timeout again, not expired


@pytest.mark.runc  # a real sandbox's state kept across pause, snapshot and fork
def test_snapshots_and_fork(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(Sandbox.create("base"))
    sbx.files.write("/home/user/state.txt", "before")
    name = f"snap-{uuid.uuid4().hex[:8]}"
    snapshot = sbx.create_snapshot(name=name)
    assert snapshot.snapshot_id.startswith("snap-") and snapshot.names == [name]
    assert [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()] == [snapshot.snapshot_id]
    assert snapshot.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(
        sandbox_id=sbx.sandbox_id).next_items()]
    child = cleanup.add(Sandbox.create(snapshot.snapshot_id))
    assert child.files.read("/home/user/state.txt") == "before"
    forks = sbx.fork(count=2)
    for fork in forks:
        cleanup.add(fork)
    assert len({f.sandbox_id for f in forks}) == 2 and all(f.files.read("/home/user/state.txt") == "before"
                                                            for f in forks)
    forks[0].files.write("/home/user/state.txt", "changed")
    assert sbx.files.read("/home/user/state.txt") == "before"
    assert Sandbox.delete_snapshot(snapshot.snapshot_id) is True
    assert Sandbox.delete_snapshot(snapshot.snapshot_id) is False


def test_template_aliases(e2b_env: E2BServer) -> None:
    assert Template.exists("base") is True
    assert Template.exists("code-interpreter-v1") is True
    assert Template.exists(f"no-such-{uuid.uuid4().hex[:6]}") is False


def test_tenancy_roles_and_credentials(e2b_front: E2BServer, e2b_env: E2BServer, cleanup: Cleanup,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    sbx = cleanup.add(Sandbox.create("base"))
    sbx.files.write("/home/user/secret.txt", "a's")
    monkeypatch.setenv("E2B_API_KEY", e2b_front.keys["b_dev"])
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    # Tenant b's key on tenant a's data plane: the sandbox does not exist for it.
    r = httpx.get(f"{e2b_front.url}/files", params={"path": "/home/user/secret.txt"},
                  headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-API-KEY": e2b_front.keys["b_dev"]})
    assert r.status_code == 404 and r.json()["code"] == 404
    # No credentials, or a token of another sandbox: 401.
    r = httpx.get(f"{e2b_front.url}/files", params={"path": "/home/user/secret.txt"},
                  headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert r.status_code == 401
    other = cleanup.add(Sandbox.create("base", api_key=e2b_front.keys["a_dev"]))
    r = httpx.get(f"{e2b_front.url}/files", params={"path": "/home/user/secret.txt"},
                  headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": other._envd_access_token})
    assert r.status_code == 401
    monkeypatch.setenv("E2B_API_KEY", e2b_front.keys["a_aud"])  # an auditor reads the audit trail, nothing else
    with pytest.raises(SandboxException, match="403"):
        Sandbox.create("base")
    with pytest.raises(SandboxException, match="403"):
        Sandbox.get_info(sbx.sandbox_id)
    monkeypatch.setenv("E2B_API_KEY", "corral_nope_" + "x" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.list().next_items()


def test_bad_input_is_refused_with_reasons(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    with pytest.raises(SandboxException, match="no-such-template"):
        Sandbox.create("no-such-template")
    with pytest.raises(SandboxException, match="address range"):
        Sandbox.create("base", network={"allow_out": ["10.0.0.0/8"], "deny_out": ["0.0.0.0/0"]})
    with pytest.raises(SandboxException, match="denyOut"):
        Sandbox.create("base", network={"deny_out": ["8.8.8.8"]})
    url = e2b_env.url
    headers = {"X-API-KEY": e2b_env.keys["a_dev"]}
    for body in ({}, {"templateID": ""}, {"templateID": "base", "timeout": -1}, {"templateID": "base", "timeout": "x"}):
        r = httpx.post(f"{url}/sandboxes", json=body, headers=headers)
        assert r.status_code == 400 and r.json()["code"] == 400 and r.json()["message"], body
    r = httpx.post(f"{url}/sandboxes", content=b"{not json", headers=headers)
    assert r.status_code == 400
    r = httpx.get(f"{url}/v2/sandboxes", params={"limit": "1000"}, headers=headers)
    assert r.status_code == 400 and "limit" in r.json()["message"]
    r = httpx.get(f"{url}/v2/sandboxes", params={"nextToken": "garbage!"}, headers=headers)
    assert r.status_code == 400
    r = httpx.get(f"{url}/v2/sandboxes", params={"state": "sleeping"}, headers=headers)
    assert r.status_code == 400
    assert Sandbox.list(query=SandboxQuery(metadata={"case": "x"})).next_items() == []  # nothing was made


@pytest.mark.runc  # the policy applied by a real egress proxy to a real command
def test_network_settings_become_egress_policies(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    closed = cleanup.add(Sandbox.create("base", allow_internet_access=False))
    assert _v1(e2b_env, closed.sandbox_id).json()["network"] == "none"
    listed = cleanup.add(Sandbox.create("base", network={"allow_out": ["pypi.org"], "deny_out": ["0.0.0.0/0"]}))
    assert _v1(e2b_env, listed.sandbox_id).json()["network"] == ["pypi.org"]
    r = closed.commands.run("curl -sS -m 5 https://pypi.org/ || true")
    assert "403" in r.stderr  # all that curl says of a refused CONNECT
    assert r.error is not None and "pypi.org" in r.error and "policy: none" in r.error, r.error  # Corral says why
    refused = listed.commands.run("curl -sS -m 5 https://example.com/ || true")
    assert refused.error is not None and "example.com" in refused.error, refused.error


def test_signed_file_urls(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(Sandbox.create("base"))
    sbx.files.write("signed.bin", b"\x00\xffsigned")
    with urllib.request.urlopen(sbx.download_url("signed.bin", use_signature_expiration=60)) as resp:
        assert resp.read() == b"\x00\xffsigned"
    expired = sbx.download_url("signed.bin", use_signature_expiration=-60)
    r = httpx.get(expired)
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "signature is already expired"}
    forged = sbx.download_url("signed.bin").replace("signature=v1_", "signature=v1_A")
    assert httpx.get(forged).status_code == 401
    r = httpx.post(sbx.upload_url("up.bin"), files={"file": ("up.bin", b"\x01\x02")})
    assert r.status_code == 200, r.text
    assert sbx.files.read("up.bin", format="bytes") == b"\x01\x02"
    r = httpx.post(sbx.upload_url("field.txt"), files={"file": (None, "a form field")})  # FormData of text
    assert r.status_code == 200 and r.json() == [{"path": "/home/user/field.txt", "name": "field.txt", "type": "file"}]
    assert sbx.files.read("field.txt") == "a form field"
    r = httpx.post(sbx.upload_url("form.txt"), data={"file": "urlencoded"})
    assert r.status_code == 400 and "urlencoded" in r.json()["message"]


@pytest.mark.anyio
async def test_async_client_lifecycle(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(await AsyncSandbox.create("base", metadata={"async": "1"}))
    assert await sbx.is_running()
    info = await sbx.get_info()
    assert info.metadata == {"async": "1"}
    await sbx.pause()
    assert not await sbx.is_running()
    resumed = await AsyncSandbox.connect(sbx.sandbox_id)
    assert await resumed.is_running()
    await resumed.kill()
    assert not await resumed.is_running()
