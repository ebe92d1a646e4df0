"""MCP: Corral's tools through the official `mcp` client, over both transports (`/mcp` of the whole server on a real
socket, streamable HTTP with the key as a bearer token; and `corral mcp`, the stdio relay, as a subprocess): the
key's tenant and role apply to every tool, and every failure is a tool error, never a protocol error (docs/mcp.md).

What is MCP's own (the listing, tenancy, roles, bad arguments, keys) runs on the fake engine (the fast tier); a
sandbox's whole session through both transports runs on real runc (`test_a_sandbox_from_create_to_kill`)."""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp_types as types
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from corral import Admin, NotFoundError, Sandbox
from corral.engine import Engine
from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME, TEST_HOME
from .live_front import live_front

TRANSPORTS = ["http", "stdio"]
CORRAL_MCP = [sys.executable, "-c", "from corral.cli import main; main()", "mcp"]
WRONG_KEY = "corral_wrongkey_" + "A" * 43  # well-formed, and no key of the server's
TOOL_NAMES = {"create_sandbox", "list_sandboxes", "kill_sandbox", "run_command", "run_code", "write_file",
              "read_file", "list_files", "checkpoint", "list_checkpoints", "restore", "list_changes",
              "delete_checkpoint"}


@dataclass
class MCPServer:
    url: str
    keys: dict[str, str]  # "a_dev", "a_aud", "b_dev" -> key
    created: list[str] = field(default_factory=list)  # every sandbox a test made (the engine destroys them all)

    @property
    def endpoint(self) -> str:
        return f"{self.url}/mcp"


@pytest.fixture
async def mcp_server(fake_engine: Engine, tmp_path: Path) -> AsyncIterator[MCPServer]:
    """The whole server over the fake engine, in this event loop."""
    async with live_front(fake_engine, tmp_path) as front:
        yield MCPServer(front.url, front.keys)


@pytest.fixture(scope="module")
def real_mcp_server() -> Iterator[MCPServer]:
    """A real `corral serve` (runc sandboxes, its egress proxy), as a user runs it."""
    home = TEST_HOME / f"mcp-{uuid.uuid4().hex[:8]}"
    with ServerProcess(home, template_home=TEMPLATE_HOME) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            for tenant in ("a", "b"):
                admin.tenants.create(tenant)
            keys = {who: admin.keys.create(tenant, role).key
                    for who, tenant, role in (("a_dev", "a", "developer"), ("a_aud", "a", "auditor"),
                                              ("b_dev", "b", "developer"))}
        found = MCPServer(server.url, keys)
        try:
            yield found
        finally:  # the server destroys its leftovers when it stops; this says which ones a test forgot
            for sandbox_id in found.created:
                with contextlib.suppress(NotFoundError):
                    Sandbox.connect(sandbox_id, api_key=keys["a_dev"], base_url=server.url).kill()


@contextlib.asynccontextmanager
async def connect(srv: MCPServer, transport: str, who: str = "a_dev", *, key: str | None = None,
                  mode: str = "auto") -> AsyncIterator[Client]:
    """An MCP client of `srv` as `who` (or with `key`): over HTTP directly, or through `corral mcp` on stdio."""
    key = key if key is not None else srv.keys[who]
    if transport == "stdio":
        env = {**os.environ, "CORRAL_URL": srv.url, "CORRAL_API_KEY": key}
        params = StdioServerParameters(command=CORRAL_MCP[0], args=CORRAL_MCP[1:], env=env)
        async with Client(params, mode=mode) as client:
            yield client
        return
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(30, read=300))
    async with http, Client(streamable_http_client(srv.endpoint, http_client=http), mode=mode) as client:
        yield client


def text(result: types.CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, types.TextContent)
    return first.text


async def call(client: Client, tool: str, **arguments: Any) -> types.CallToolResult:
    return await client.call_tool(tool, arguments)


async def call_ok(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await call(client, tool, **arguments)
    assert not result.is_error, text(result)
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def create(srv: MCPServer, client: Client, **arguments: Any) -> str:
    created = await call_ok(client, "create_sandbox", template=TEMPLATE, timeout=300, **arguments)
    srv.created.append(created["sandbox_id"])
    return str(created["sandbox_id"])


def assert_tool_error(result: types.CallToolResult, *fragments: str) -> None:
    assert result.is_error, result
    for fragment in fragments:
        assert fragment in text(result), text(result)


# -- the listing -----------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_tools_are_listed_with_schemas_and_descriptions(mcp_server: MCPServer, transport: str) -> None:
    async with connect(mcp_server, transport) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(listed) == TOOL_NAMES
    for tool in listed.values():
        assert tool.description and len(tool.description) > 40, tool.name
        assert tool.input_schema["type"] == "object" and tool.input_schema.get("additionalProperties") is False
    run = listed["run_command"].input_schema
    assert set(run["required"]) == {"sandbox_id", "command"} and "timeout" in run["properties"]
    assert set(listed["create_sandbox"].input_schema["properties"]) == {"template", "network", "timeout",
                                                                        "checkpoints"}
    assert listed["read_file"].input_schema["properties"]["encoding"]["enum"] == ["text", "base64"]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_client_of_the_handshake_era_gets_the_same_tools(mcp_server: MCPServer, transport: str) -> None:
    """Clients that still speak the initialize handshake (most desktop clients today) are served too."""
    async with connect(mcp_server, transport, mode="legacy") as client:
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOL_NAMES
        sandbox_id = await create(mcp_server, client)
        messages: list[str] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            messages.append(message or "")

        ran = await client.call_tool("run_command", {"sandbox_id": sandbox_id, "command": "echo streamed"},
                                     progress_callback=on_progress)
        assert ran.structured_content is not None and ran.structured_content["stdout"] == "streamed\n"
        assert messages == ["streamed\n"]
        await call_ok(client, "kill_sandbox", sandbox_id=sandbox_id)


# -- a session with a real sandbox -------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.runc  # the end-to-end session through MCP: real sandboxes behind a real server
@pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs")
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_sandbox_from_create_to_kill(real_mcp_server: MCPServer, transport: str) -> None:
    async with connect(real_mcp_server, transport) as client:
        sandbox_id = await create(real_mcp_server, client)
        assert sandbox_id.startswith("sb-")
        listed = await call_ok(client, "list_sandboxes")
        assert sandbox_id in [s["sandbox_id"] for s in listed["sandboxes"]]

        await _commands(client, sandbox_id)
        await _files(client, sandbox_id)
        await _code(client, sandbox_id)

        killed = await call_ok(client, "kill_sandbox", sandbox_id=sandbox_id)
        assert killed == {"sandbox_id": sandbox_id, "killed": True}
        assert sandbox_id not in [s["sandbox_id"] for s in (await call_ok(client, "list_sandboxes"))["sandboxes"]]
        gone = await call(client, "run_command", sandbox_id=sandbox_id, command="true")
        assert_tool_error(gone, "not_found", "list_sandboxes")


async def _commands(client: Client, sandbox_id: str) -> None:
    messages: list[str] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    ran = await client.call_tool("run_command", {"sandbox_id": sandbox_id,
                                                 "command": "echo one; sleep 0.5; echo two >&2"},
                                 progress_callback=on_progress)
    assert not ran.is_error and ran.structured_content is not None
    assert ran.structured_content["exit_code"] == 0
    assert (ran.structured_content["stdout"], ran.structured_content["stderr"]) == ("one\n", "two\n")
    assert messages == ["one\n", "[stderr] two\n"]  # streamed while it ran, stderr marked as such

    failed = await call(client, "run_command", sandbox_id=sandbox_id, command="echo no >&2; exit 3")
    assert not failed.is_error  # a command that fails is a result, not a failing call
    assert failed.structured_content is not None and failed.structured_content["exit_code"] == 3
    assert text(failed).startswith("exit code 3") and "no" in text(failed)

    big = await call(client, "run_command", sandbox_id=sandbox_id, command="head -c 300000 /dev/zero | tr '\\0' a")
    assert big.structured_content is not None and big.structured_content["truncated"]
    assert big.structured_content["stdout_size"] == 300_000 and len(big.structured_content["stdout"]) <= 128 * 1024
    assert "[output truncated: 300000 bytes of stdout" in text(big)

    slow = await call_ok(client, "run_command", sandbox_id=sandbox_id, command="sleep 30", timeout=1)
    assert slow["timed_out"] and slow["duration"] < 15 and not slow["oom_killed"]

    denied = await call(client, "run_command", sandbox_id=sandbox_id,
                        command="curl -sS --max-time 20 https://pypi.org/simple/six/")
    assert denied.structured_content is not None and denied.structured_content["exit_code"] != 0
    assert [(d["host"], d["port"]) for d in denied.structured_content["egress_denials"]] == [("pypi.org", 443)]
    assert "egress policy" in text(denied) and "pypi.org" in text(denied)


async def _files(client: Client, sandbox_id: str) -> None:
    blob = bytes(range(256)) * 64 + b"\x00\xff\xfe" + b"\r\n\x00"  # NUL, invalid UTF-8, CRLF: all must survive
    wrote = await call_ok(client, "write_file", sandbox_id=sandbox_id, path="data/blob.bin",
                          content=base64.b64encode(blob).decode(), encoding="base64")
    assert wrote == {"path": "/workspace/data/blob.bin", "size": len(blob)}
    back = await call_ok(client, "read_file", sandbox_id=sandbox_id, path="/workspace/data/blob.bin",
                         encoding="base64")
    assert base64.b64decode(back["content"]) == blob and back["size"] == len(blob)
    as_text = await call(client, "read_file", sandbox_id=sandbox_id, path="data/blob.bin")
    assert_tool_error(as_text, "not UTF-8", "base64")

    note = "héllo wörld ✓\n\ttabs and\r\nCRLF\n"
    await call_ok(client, "write_file", sandbox_id=sandbox_id, path="/workspace/note.txt", content=note)
    assert (await call_ok(client, "read_file", sandbox_id=sandbox_id, path="note.txt"))["content"] == note

    listed = await call_ok(client, "list_files", sandbox_id=sandbox_id)
    entries = {e["path"]: e for e in listed["entries"]}
    assert entries["/workspace/data"]["type"] == "dir"
    assert entries["/workspace/note.txt"]["size"] == len(note.encode())
    deep = await call_ok(client, "list_files", sandbox_id=sandbox_id, path="/workspace", depth=2)
    assert {"/workspace/data/blob.bin": len(blob)}.items() <= {e["path"]: e["size"] for e in deep["entries"]}.items()
    missing = await call(client, "read_file", sandbox_id=sandbox_id, path="nope.txt")
    assert_tool_error(missing, "not_found")
    outside = await call(client, "write_file", sandbox_id=sandbox_id, path="/etc/passwd", content="x")
    assert_tool_error(outside, "permission_denied", "/etc/passwd is outside", "under /workspace")


async def _code(client: Client, sandbox_id: str) -> None:
    await call_ok(client, "run_code", sandbox_id=sandbox_id, code="x = 21")
    value = await call_ok(client, "run_code", sandbox_id=sandbox_id, code="print('doubling')\nx * 2")
    assert value["text"] == "42" and value["stdout"] == "doubling\n"  # stateful: x survived

    plot = await call(client, "run_code", sandbox_id=sandbox_id,
                      code="import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert not plot.is_error, text(plot)
    images = [block for block in plot.content if isinstance(block, types.ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert base64.b64decode(images[0].data).startswith(b"\x89PNG\r\n\x1a\n")

    raised = await call_ok(client, "run_code", sandbox_id=sandbox_id, code="1 / 0")
    assert raised["error"]["name"] == "ZeroDivisionError" and "division by zero" in raised["error"]["value"]
    node = await call_ok(client, "run_code", sandbox_id=sandbox_id, code="console.log(6 * 7)",
                         language="javascript")
    assert node["stdout"] == "42\n"

    big = await call(client, "run_code", sandbox_id=sandbox_id, code="print('a' * 300_000)")
    assert big.structured_content is not None and big.structured_content["truncated"]
    assert len(big.structured_content["stdout"]) == 128 * 1024  # what a model can still read, as for commands
    assert "[output truncated: 300001 bytes of stdout" in text(big)


# -- tenancy and roles -------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_another_tenants_sandbox_is_not_found(mcp_server: MCPServer, transport: str) -> None:
    async with connect(mcp_server, "http") as owner:
        sandbox_id = await create(mcp_server, owner)
        async with connect(mcp_server, transport, "b_dev") as other:
            assert sandbox_id not in str(await call_ok(other, "list_sandboxes"))
            for tool, arguments in (("run_command", {"command": "id"}), ("run_code", {"code": "1"}),
                                    ("read_file", {"path": "x"}), ("write_file", {"path": "x", "content": "x"}),
                                    ("list_files", {}), ("kill_sandbox", {})):
                result = await call(other, tool, sandbox_id=sandbox_id, **arguments)
                assert_tool_error(result, "not_found")
                assert "permission" not in text(result)  # nothing says that it exists
        still = await call_ok(owner, "run_command", sandbox_id=sandbox_id, command="echo alive")
        assert still["stdout"] == "alive\n"
        await call_ok(owner, "kill_sandbox", sandbox_id=sandbox_id)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_auditor_may_not_create_or_run(mcp_server: MCPServer, transport: str) -> None:
    async with connect(mcp_server, "http") as owner:
        sandbox_id = await create(mcp_server, owner)
        async with connect(mcp_server, transport, "a_aud") as auditor:
            assert_tool_error(await call(auditor, "create_sandbox"), "permission_denied")
            assert_tool_error(await call(auditor, "run_command", sandbox_id=sandbox_id, command="id"),
                              "permission_denied", "role 'auditor'", "configure a developer's key")
            assert_tool_error(await call(auditor, "kill_sandbox", sandbox_id=sandbox_id), "permission_denied")
        await call_ok(owner, "kill_sandbox", sandbox_id=sandbox_id)


# -- bad calls -------------------------------------------------------------------------------------------------

BAD_CALLS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("run_command", {"sandbox_id": "sb-0"}, ["command: Field required"]),
    ("run_command", {"sandbox_id": "sb-0", "command": "true", "timeout": "soon"}, ["timeout"]),
    ("run_command", {"sandbox_id": "sb-0", "command": "true", "timeout": 0}, ["greater than 0"]),
    ("run_command", {"sandbox_id": "sb-0", "command": "true", "tiemout": 5}, ["tiemout", "not permitted"]),
    ("create_sandbox", {"network": "everywhere"}, ["network"]),
    ("create_sandbox", {"template": "no-such-template"}, ["no-such-template"]),
    ("write_file", {"sandbox_id": "sb-0", "path": "a", "content": "%%%", "encoding": "base64"}, ["base64"]),
    ("read_file", {"sandbox_id": "sb-0", "path": "a", "encoding": "hex"}, ["encoding"]),
    ("list_files", {"sandbox_id": "sb-0", "depth": 99}, ["depth"]),
    ("no_such_tool", {}, ["no tool 'no_such_tool'", "run_command"]),
]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_bad_arguments_are_tool_errors_that_say_what_to_fix(mcp_server: MCPServer, transport: str) -> None:
    async with connect(mcp_server, transport) as client:
        before = await call_ok(client, "list_sandboxes")
        for tool, arguments, fragments in BAD_CALLS:
            result = await client.call_tool(tool, arguments)
            assert_tool_error(result, "invalid_request", *fragments)
        assert await call_ok(client, "list_sandboxes") == before  # nothing was created


# -- keys --------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_no_key_or_a_wrong_one_is_a_401(mcp_server: MCPServer) -> None:
    ping = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    for authorization in (None, "Bearer corral_nosuchkey_" + "A" * 43, "Basic dXNlcjpwYXNz", "Bearer"):
        sent = {**headers, **({"Authorization": authorization} if authorization else {})}
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(mcp_server.endpoint, json=ping, headers=sent)
        assert response.status_code == 401, (authorization, response.text)
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert "unauthenticated" in response.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_wrong_key_fails_the_http_client_with_the_reason(mcp_server: MCPServer) -> None:
    with pytest.raises(BaseException) as info:  # the client's task groups may wrap it
        async with connect(mcp_server, "http", key=WRONG_KEY) as client:
            await client.list_tools()
    error = info.value
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    assert isinstance(error, MCPError), repr(error)
    assert "unauthenticated: invalid API key" in error.error.message and "Bearer" in error.error.message


@pytest.mark.anyio
@pytest.mark.slow  # two relay processes, one retrying an unreachable server
async def test_the_relay_answers_a_wrong_key_and_an_unreachable_server_with_tool_errors(
        mcp_server: MCPServer) -> None:
    async with connect(mcp_server, "stdio", key=WRONG_KEY) as client:
        assert_tool_error(await call(client, "list_sandboxes"), "refused", "unauthenticated")
        with pytest.raises(MCPError, match="unauthenticated"):
            await client.list_tools()
    gone = MCPServer("http://127.0.0.1:1", mcp_server.keys)  # nothing listens on port 1
    async with connect(gone, "stdio") as client:
        assert_tool_error(await call(client, "list_sandboxes"), "cannot reach Corral", "CORRAL_URL")


def test_the_relay_without_a_key_says_so_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_API_KEY"}
    proc = subprocess.run(CORRAL_MCP, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("error: unauthenticated: no API key: set CORRAL_API_KEY (in the MCP client's env "
                                   "for this server)")
