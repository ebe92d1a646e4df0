"""Checkpoints through REST and the SDK (sync and async), end to end over the whole server on the fake engine
(tests/live_front.py's `threaded_front`; the fake backend's `Checkpointing` copies the fake agent's files): the
routes' answers and errors, the `checkpoint` field on results of automatic ones, roles and tenancy at the HTTP
edge. tests/test_checkpoints_service.py covers the service's rules; tests/test_checkpoints_live.py real runc."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from corral import (
    AsyncSandbox,
    Change,
    Changes,
    Checkpoint,
    NotFoundError,
    RestoreResult,
    Sandbox,
)

from .live_front import LiveFront, threaded_front


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFront]:
    with threaded_front(tmp_path_factory.mktemp("checkpoints-api")) as front:
        yield front


def _http(server: LiveFront, who: str = "a_dev") -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys[who]}"}, timeout=30)


def _sandbox(server: LiveFront, **options: object) -> Sandbox:
    return Sandbox.create(api_key=server.keys["a_dev"], base_url=server.url, **options)  # type: ignore[arg-type]


def test_sdk_undoes_a_destructive_command_with_auto_checkpoints(server: LiveFront) -> None:
    with _sandbox(server, checkpoints="auto", checkpoint_keep=5) as sb:
        assert sb.info.checkpoints == "auto"
        written = sb.files.write("/workspace/project/main.py", b"print('hi')\n")
        assert written.checkpoint is not None and written.checkpoint.startswith("ckpt-")
        before = sb.checkpoint(name="good")
        result = sb.commands.run("rm -rf /workspace/project")
        assert result.checkpoint is not None and result.checkpoint != written.checkpoint
        assert not sb.files.exists("/workspace/project")
        changes = sb.changes(since=result.checkpoint, diff=True)
        assert isinstance(changes, Changes) and not changes.truncated
        by_path = {c.path: c for c in changes}
        assert isinstance(by_path["/workspace/project/main.py"], Change)
        assert by_path["/workspace/project/main.py"].kind == "deleted"
        assert "-print('hi')" in (by_path["/workspace/project/main.py"].diff or "")
        restored = sb.restore(result.checkpoint)
        assert isinstance(restored, RestoreResult) and restored.checkpoint.id == result.checkpoint
        assert restored.paths is None
        assert sb.files.read("/workspace/project/main.py") == b"print('hi')\n"
        listed = sb.checkpoints()
        assert all(isinstance(c, Checkpoint) for c in listed)
        assert [c.id for c in listed][:2] == [result.checkpoint, before.id]  # newest first
        auto = sb.get_checkpoint(result.checkpoint)
        assert auto.automatic and auto.command == "rm -rf /workspace/project" and auto.sandbox_id == sb.id
        assert sb.get_checkpoint("good").id == before.id and not before.automatic
        sb.delete_checkpoint(before)
        with pytest.raises(NotFoundError):
            sb.get_checkpoint("good")
        execution = sb.code.run("x = 1")
        assert execution.checkpoint is not None


def test_sdk_restore_of_some_paths_and_manual_sandboxes_take_none(server: LiveFront) -> None:
    with _sandbox(server) as sb:
        sb.files.write("/workspace/db/rows", b"1\n2\n")
        sb.files.write("/workspace/notes", b"old")
        cp = sb.checkpoint()
        assert cp.name is None and cp.size >= 7
        result = sb.commands.run("rm -rf /workspace/db; echo new > /workspace/notes")
        assert result.checkpoint is None  # manual: no automatic checkpoint
        restored = sb.restore(cp.id, paths=["/workspace/db"])
        assert restored.paths == ["/workspace/db"]
        assert sb.files.read("/workspace/db/rows") == b"1\n2\n"
        assert sb.files.read("/workspace/notes") == b"new\n"
        assert [c.path for c in sb.changes(since=cp)] == ["/workspace/notes"]


@pytest.mark.anyio
async def test_async_sdk(server: LiveFront) -> None:
    async with await AsyncSandbox.create(api_key=server.keys["a_dev"], base_url=server.url,
                                         checkpoints="auto") as sb:
        await sb.files.write("/workspace/a.txt", b"a")
        cp = await sb.checkpoint("v1")
        result = await sb.commands.run("rm /workspace/a.txt")
        assert result.checkpoint is not None
        assert [c.kind for c in await sb.changes(cp)] == ["deleted"]
        restored = await sb.restore("v1")
        assert restored.checkpoint.id == cp.id
        assert await sb.files.read("/workspace/a.txt") == b"a"
        assert {c.id for c in await sb.checkpoints()} >= {cp.id, result.checkpoint}
        assert (await sb.get_checkpoint(cp)).name == "v1"
        await sb.delete_checkpoint("v1")
        assert cp.id not in {c.id for c in await sb.checkpoints()}


def test_rest_answers_and_errors(server: LiveFront) -> None:
    with _sandbox(server, checkpoints="auto") as sb, _http(server) as c:
        base = f"/v1/sandboxes/{sb.id}"
        r = c.post(f"{base}/checkpoints", json={"name": "v1"})
        assert r.status_code == 201, r.text
        body = r.json()
        assert set(body) == {"id", "name", "sandbox_id", "created_at", "size", "command", "automatic"}
        assert (body["name"], body["sandbox_id"], body["automatic"], body["command"]) == ("v1", sb.id, False, None)
        assert c.post(f"{base}/checkpoints").status_code == 201  # no body: unnamed
        # Bad input: 400 naming the field, nothing taken.
        count = len(c.get(f"{base}/checkpoints").json()["checkpoints"])
        bad = c.post(f"{base}/checkpoints", json={"name": "no spaces"})
        assert bad.status_code == 400 and bad.json()["error"]["details"] == {"name": "no spaces"}
        assert c.post(f"{base}/checkpoints", json={"nme": "x"}).status_code == 400
        assert c.post(f"{base}/checkpoints", json={"name": "v1"}).status_code == 409
        assert len(c.get(f"{base}/checkpoints").json()["checkpoints"]) == count
        bad = c.post(f"{base}/restore", json={"checkpoint": "v1", "paths": ["relative/path"]})
        assert bad.status_code == 400 and "paths" in bad.text
        assert c.post(f"{base}/restore", json={"paths": None}).status_code == 400  # checkpoint is required
        assert c.get(f"{base}/changes").status_code == 400  # since is required
        # Unknown checkpoints: 404 naming it.
        for method, path in (("GET", f"{base}/checkpoints/nope"), ("DELETE", f"{base}/checkpoints/nope")):
            missing = c.request(method, path)
            assert missing.status_code == 404 and missing.json()["error"]["details"] == {"checkpoint": "nope"}
        assert c.post(f"{base}/restore", json={"checkpoint": "nope"}).status_code == 404
        assert c.get(f"{base}/changes", params={"since": "v1", "until": "nope"}).json()["error"]["details"] == \
            {"until": "nope"}
        # Results of automatic ones: JSON fields, a streamed exec's exit event, the header of a 204.
        put = c.put(f"{base}/files", params={"path": "f.txt"}, content=b"x").json()
        assert put["checkpoint"].startswith("ckpt-")
        assert c.post(f"{base}/files/mkdir", json={"path": "d"}).json()["checkpoint"].startswith("ckpt-")
        removed = c.delete(f"{base}/files", params={"path": "f.txt"})
        assert removed.status_code == 204 and removed.headers["Corral-Checkpoint"].startswith("ckpt-")
        with c.stream("POST", f"{base}/exec", json={"cmd": "echo hi", "stream": True}) as streamed:
            events = [json.loads(line) for line in streamed.iter_lines() if line]
        assert events[-1]["event"] == "exit" and events[-1]["checkpoint"].startswith("ckpt-")
        started = c.post(f"{base}/processes", json={"cmd": "sleep 1"}).json()
        assert started["checkpoint"].startswith("ckpt-")
        restored = c.post(f"{base}/restore", json={"checkpoint": "v1"}).json()
        assert set(restored) == {"checkpoint", "paths", "stopped"} and restored["checkpoint"]["name"] == "v1"
        assert set(restored["stopped"]) == {"processes", "code_contexts", "terminals"}
        changed = c.get(f"{base}/changes", params={"since": "v1"}).json()
        assert set(changed) == {"since", "until", "changes", "truncated"} and changed["changes"] == []


def test_roles_and_tenancy_at_the_edge(server: LiveFront) -> None:
    with _sandbox(server) as sb, _http(server, "a_aud") as auditor, _http(server, "b_dev") as other:
        cp = sb.checkpoint("v1")
        base = f"/v1/sandboxes/{sb.id}"
        assert [x["id"] for x in auditor.get(f"{base}/checkpoints").json()["checkpoints"]] == [cp.id]
        assert auditor.get(f"{base}/changes", params={"since": "v1"}).status_code == 200
        assert auditor.post(f"{base}/restore", json={"checkpoint": "v1"}).status_code == 403
        assert auditor.post(f"{base}/checkpoints", json={}).status_code == 403
        assert auditor.delete(f"{base}/checkpoints/v1").status_code == 403
        for method, path in (("GET", f"{base}/checkpoints"), ("POST", f"{base}/checkpoints"),
                             ("GET", f"{base}/checkpoints/v1"), ("DELETE", f"{base}/checkpoints/v1")):
            assert other.request(method, path).status_code == 404
        assert other.post(f"{base}/restore", json={"checkpoint": "v1"}).status_code == 404
        assert [c.id for c in sb.checkpoints()] == [cp.id]


def test_the_tenant_default_through_the_admin_route(server: LiveFront) -> None:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.admin_key}"}) as admin:
        bad = admin.patch("/v1/tenants/b", json={"default_checkpoints": "sometimes"})
        assert bad.status_code == 400 and bad.json()["error"]["details"] == {"default_checkpoints": "sometimes"}
        assert admin.patch("/v1/tenants/b", json={"default_checkpoints": "auto"}).json()["default_checkpoints"] == \
            "auto"
    with Sandbox.create(api_key=server.keys["b_dev"], base_url=server.url) as sb:
        assert sb.info.checkpoints == "auto" and sb.commands.run("true").checkpoint is not None
