"""MCP's undo tools through the official `mcp` client (docs/mcp.md, "Undo"): `checkpoint`, `list_checkpoints`,
`list_changes`, `restore`, `delete_checkpoint`, and `create_sandbox(checkpoints="auto")`, over both transports.

The tools' own behaviour (results, roles, tenancy, bad arguments) runs on the fake engine (the fast tier; its
backend's checkpoints copy the fake sandbox's files); an agent undoing its own `rm -rf` runs on real runc
(`test_an_agent_undoes_its_own_rm_rf`)."""

from __future__ import annotations

import pytest

from .conftest import DEV_ROOTFS
from .test_mcp import (
    TRANSPORTS,
    MCPServer,
    assert_tool_error,
    call,
    call_ok,
    connect,
    create,
    text,
)
from .test_mcp import mcp_server as mcp_server  # the fixtures: the whole server over the fake engine, and
from .test_mcp import real_mcp_server as real_mcp_server  # a real `corral serve`


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_checkpoint_change_list_and_restore(mcp_server: MCPServer, transport: str) -> None:
    async with connect(mcp_server, transport) as client:
        sandbox_id = await create(mcp_server, client)
        await call_ok(client, "write_file", sandbox_id=sandbox_id, path="keep.txt", content="original\n")
        made = await call_ok(client, "checkpoint", sandbox_id=sandbox_id, name="before-edit")
        assert made["checkpoint_id"].startswith("ckpt-") and made["name"] == "before-edit"
        assert made["sandbox_id"] == sandbox_id and made["automatic"] is False

        await call_ok(client, "write_file", sandbox_id=sandbox_id, path="keep.txt", content="broken\n")
        await call_ok(client, "write_file", sandbox_id=sandbox_id, path="junk.txt", content="junk\n")
        changed = await call(client, "list_changes", sandbox_id=sandbox_id, since="before-edit", diff=True)
        assert not changed.is_error, text(changed)
        found = changed.structured_content
        assert found is not None and found["until"] is None and not found["truncated"]
        kinds = {c["path"]: c["kind"] for c in found["changes"]}
        assert kinds["/workspace/keep.txt"] == "modified" and kinds["/workspace/junk.txt"] == "added", kinds
        diffs = {c["path"]: c.get("diff") or "" for c in found["changes"]}
        assert "-original" in diffs["/workspace/keep.txt"] and "+broken" in diffs["/workspace/keep.txt"]
        assert "/workspace/junk.txt" in text(changed) and "-original" in text(changed)

        listed = await call_ok(client, "list_checkpoints", sandbox_id=sandbox_id)
        assert [c["checkpoint_id"] for c in listed["checkpoints"]] == [made["checkpoint_id"]]

        restored = await call(client, "restore", sandbox_id=sandbox_id, checkpoint=made["checkpoint_id"])
        assert not restored.is_error, text(restored)
        assert restored.structured_content is not None
        assert restored.structured_content["checkpoint_id"] == made["checkpoint_id"]
        assert set(restored.structured_content["stopped"]) == {"processes", "code_contexts", "terminals"}
        assert text(restored).startswith(f"Restored sandbox {sandbox_id} to checkpoint {made['checkpoint_id']}")
        back = await call_ok(client, "read_file", sandbox_id=sandbox_id, path="keep.txt")
        assert back["content"] == "original\n"
        assert_tool_error(await call(client, "read_file", sandbox_id=sandbox_id, path="junk.txt"), "not_found")

        await call_ok(client, "delete_checkpoint", sandbox_id=sandbox_id, checkpoint="before-edit")
        assert (await call_ok(client, "list_checkpoints", sandbox_id=sandbox_id))["checkpoints"] == []
        assert_tool_error(await call(client, "restore", sandbox_id=sandbox_id, checkpoint="before-edit"),
                          "not_found", "list_checkpoints")
        await call_ok(client, "kill_sandbox", sandbox_id=sandbox_id)


@pytest.mark.anyio
async def test_restore_of_some_paths_keeps_the_rest(mcp_server: MCPServer) -> None:
    async with connect(mcp_server, "http") as client:
        sandbox_id = await create(mcp_server, client)
        for name in ("a.txt", "b.txt"):
            await call_ok(client, "write_file", sandbox_id=sandbox_id, path=name, content="old\n")
        made = await call_ok(client, "checkpoint", sandbox_id=sandbox_id)
        for name in ("a.txt", "b.txt"):
            await call_ok(client, "write_file", sandbox_id=sandbox_id, path=name, content="new\n")
        done = await call_ok(client, "restore", sandbox_id=sandbox_id, checkpoint=made["checkpoint_id"],
                             paths=["a.txt"])
        assert done["paths"] == ["/workspace/a.txt"]  # relative paths are under /workspace, as everywhere
        assert (await call_ok(client, "read_file", sandbox_id=sandbox_id, path="a.txt"))["content"] == "old\n"
        assert (await call_ok(client, "read_file", sandbox_id=sandbox_id, path="b.txt"))["content"] == "new\n"
        await call_ok(client, "kill_sandbox", sandbox_id=sandbox_id)


@pytest.mark.anyio
async def test_automatic_checkpoints_name_the_step_they_preceded(mcp_server: MCPServer) -> None:
    async with connect(mcp_server, "http") as client:
        sandbox_id = await create(mcp_server, client, checkpoints="auto")
        wrote = await call(client, "write_file", sandbox_id=sandbox_id, path="data.csv", content="x,y\n1,2\n")
        assert wrote.structured_content is not None and not wrote.is_error
        assert "restore it to undo this step" in text(wrote)
        listed = (await call_ok(client, "list_checkpoints", sandbox_id=sandbox_id))["checkpoints"]
        assert len(listed) == 1 and listed[0]["automatic"] is True
        assert wrote.structured_content["checkpoint"] == listed[0]["checkpoint_id"]
        assert "/workspace/data.csv" in listed[0]["command"], listed
        changed = await call_ok(client, "list_changes", sandbox_id=sandbox_id, since=listed[0]["checkpoint_id"])
        assert [(c["path"], c["kind"]) for c in changed["changes"]] == [("/workspace/data.csv", "added")]
        await call_ok(client, "kill_sandbox", sandbox_id=sandbox_id)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_auditor_reads_checkpoints_but_cannot_restore(mcp_server: MCPServer, transport: str) -> None:
    async with connect(mcp_server, "http") as owner:
        sandbox_id = await create(mcp_server, owner)
        made = await call_ok(owner, "checkpoint", sandbox_id=sandbox_id)
        async with connect(mcp_server, transport, "a_aud") as auditor:
            listed = await call_ok(auditor, "list_checkpoints", sandbox_id=sandbox_id)
            assert [c["checkpoint_id"] for c in listed["checkpoints"]] == [made["checkpoint_id"]]
            await call_ok(auditor, "list_changes", sandbox_id=sandbox_id, since=made["checkpoint_id"])
            for tool in ("restore", "delete_checkpoint"):
                assert_tool_error(await call(auditor, tool, sandbox_id=sandbox_id, checkpoint=made["checkpoint_id"]),
                                  "permission_denied", "configure a developer's key")
            assert_tool_error(await call(auditor, "checkpoint", sandbox_id=sandbox_id), "permission_denied")
        async with connect(mcp_server, transport, "b_dev") as other:
            for tool, arguments in (("checkpoint", {}), ("list_checkpoints", {}),
                                    ("restore", {"checkpoint": made["checkpoint_id"]}),
                                    ("list_changes", {"since": made["checkpoint_id"]})):
                result = await call(other, tool, sandbox_id=sandbox_id, **arguments)
                assert_tool_error(result, "not_found")
        assert len((await call_ok(owner, "list_checkpoints", sandbox_id=sandbox_id))["checkpoints"]) == 1
        await call_ok(owner, "kill_sandbox", sandbox_id=sandbox_id)


@pytest.mark.anyio
async def test_bad_undo_arguments_are_tool_errors(mcp_server: MCPServer) -> None:
    async with connect(mcp_server, "http") as client:
        for tool, arguments, fragment in (
                ("create_sandbox", {"checkpoints": "always"}, "checkpoints"),
                ("restore", {"sandbox_id": "sb-0"}, "checkpoint: Field required"),
                ("restore", {"sandbox_id": "sb-0", "checkpoint": "x", "paths": []}, "paths"),
                ("list_changes", {"sandbox_id": "sb-0"}, "since: Field required"),
                ("checkpoint", {"sandbox_id": "sb-0", "name": ""}, "name")):
            assert_tool_error(await client.call_tool(tool, arguments), "invalid_request", fragment)
        sandbox_id = await create(mcp_server, client)
        assert_tool_error(await call(client, "checkpoint", sandbox_id=sandbox_id, name="ckpt-0123456789abcdef"),
                          "invalid_request")
        assert_tool_error(await call(client, "restore", sandbox_id=sandbox_id, checkpoint="ckpt-0000000000000000",
                                     paths=["a\x00b"]), "invalid_request", "NUL")
        assert_tool_error(await call(client, "restore", sandbox_id=sandbox_id, checkpoint="ckpt-0000000000000000"),
                          "not_found", "list_checkpoints")
        assert (await call_ok(client, "list_checkpoints", sandbox_id=sandbox_id))["checkpoints"] == []
        await call_ok(client, "kill_sandbox", sandbox_id=sandbox_id)


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.runc  # what the tools are for, on a real sandbox: an agent's destructive command, undone
@pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs")
async def test_an_agent_undoes_its_own_rm_rf(real_mcp_server: MCPServer) -> None:
    async with connect(real_mcp_server, "http") as client:
        sandbox_id = await create(real_mcp_server, client, checkpoints="auto")
        made = await call_ok(client, "run_command", sandbox_id=sandbox_id,
                             command="mkdir -p project/src && seq 1 5000 > project/src/data.txt && chmod 640 "
                                     "project/src/data.txt && ln -s src/data.txt project/link")
        assert made["exit_code"] == 0
        before = (await call_ok(client, "run_command", sandbox_id=sandbox_id,
                                command="cd project && sha256sum src/data.txt && stat -c %a src/data.txt && "
                                        "readlink link"))["stdout"]
        wiped = await call_ok(client, "run_command", sandbox_id=sandbox_id, command="rm -rf project")
        assert wiped["exit_code"] == 0
        listed = (await call_ok(client, "list_checkpoints", sandbox_id=sandbox_id))["checkpoints"]
        (before_rm,) = [c for c in listed if c["command"] and "rm -rf project" in c["command"]]
        assert wiped["checkpoint"] == before_rm["checkpoint_id"]  # the step's result names it
        changed = await call_ok(client, "list_changes", sandbox_id=sandbox_id, since=before_rm["checkpoint_id"])
        assert {("/workspace/project", "deleted")} <= {(c["path"], c["kind"]) for c in changed["changes"]}

        restored = await call_ok(client, "restore", sandbox_id=sandbox_id, checkpoint=before_rm["checkpoint_id"])
        assert set(restored["stopped"]) == {"processes", "code_contexts", "terminals"}
        assert restored["checkpoint_id"] == before_rm["checkpoint_id"]
        after = await call_ok(client, "run_command", sandbox_id=sandbox_id,
                              command="cd project && sha256sum src/data.txt && stat -c %a src/data.txt && "
                                      "readlink link")
        assert after["stdout"] == before  # bytes, mode and the symlink, back in the same sandbox
        await call_ok(client, "kill_sandbox", sandbox_id=sandbox_id)
