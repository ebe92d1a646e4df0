"""One check of each input (docs/architecture.md, "Checked inputs"), and a command's options as one typed value.

The path check (`corral._paths.sandbox_path`, the agent's own rule) and the user check (`corral._users.check_user`)
are the same function at every edge: each bad form gets the same error type and message wherever it arrives.
`ExecOptions` is serialized once, by `ExecOptions.request`: every option reaches the agent's request, a plain
command's request keeps the fields it always had, and the agent client sends exactly that request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral import AuthenticationError, InvalidRequestError
from corral._paths import SandboxPath, sandbox_path
from corral._users import check_user, user_home
from corral.agent import file_access, protocol
from corral.backends import UnixEndpoint
from corral.backends import check_user as backends_check_user
from corral.e2b._user import absolute_path, envd_user
from corral.engine import AgentClient, ExecOptions, Liveness, PtySize
from corral.engine._session import sandbox_path as engine_sandbox_path
from corral.mcp._tools import _path as mcp_path
from corral.server._context import sandbox_path as rest_sandbox_path
from corral.service import Command

# Every form of a bad path, and the reason each edge gives for it.
BAD_PATHS = {
    "": "must be a non-empty string",
    "a\x00b": "contains a NUL byte",
    "/workspace/a\x00b": "contains a NUL byte",
    "/workspace/\udcff.txt": "is not valid UTF-8",
    "/workspace/\ud800": "is not valid UTF-8",
    "rel/\udcff": "is not valid UTF-8",
}


@pytest.mark.parametrize("bad", list(BAD_PATHS), ids=["empty", "nul", "abs-nul", "surrogate", "high", "rel-sur"])
def test_every_edge_refuses_a_bad_path_with_the_same_error(bad: str) -> None:
    reason = f"path {BAD_PATHS[bad]}"
    edges = {"paths": lambda: sandbox_path(bad), "rest": lambda: rest_sandbox_path(bad),
             "engine": lambda: engine_sandbox_path(bad), "mcp": lambda: mcp_path(bad)}
    if bad:  # E2B's empty path is protobuf's unset: its default, or required (below)
        edges["e2b"] = lambda: absolute_path(bad)
    for edge, check in edges.items():
        with pytest.raises(InvalidRequestError) as refused:
            check()
        assert str(refused.value) == reason, edge
    # The agent applies the same rule to what it is sent, with the same reason.
    with pytest.raises(file_access.FileError) as agent_refused:
        file_access.check_path(bad)
    assert agent_refused.value.code == "invalid_request" and agent_refused.value.message == reason


@pytest.mark.parametrize("bad", [None, 5, b"/workspace/x", ["/workspace"]])
def test_what_is_no_string_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"^cwd "):
        sandbox_path(bad, "cwd")
    with pytest.raises(InvalidRequestError):
        engine_sandbox_path(bad)  # type: ignore[arg-type]
    if bad is not None:
        with pytest.raises(file_access.FileError):
            file_access.check_path(bad)
    with pytest.raises(InvalidRequestError, match=r"^path is required$"):
        absolute_path(None)


def test_a_checked_path_is_resolved_once_and_not_checked_again() -> None:
    checked = sandbox_path("a/b.txt")
    assert isinstance(checked, SandboxPath) and checked == "/workspace/a/b.txt"
    assert sandbox_path(checked) is checked and engine_sandbox_path(checked) is checked
    assert sandbox_path("/tmp/x") == "/tmp/x" and sandbox_path("~/x") == "/workspace/~/x"  # REST expands no ~
    # E2B: relative to the user's home, `~` expanded, an unset path its default.
    assert absolute_path("x", home="/root") == "/root/x" and absolute_path("~/x") == "/home/user/x"
    assert absolute_path("~") == "/home/user" and absolute_path("", default="/home/user") == "/home/user"


@pytest.mark.parametrize("bad", ["admin", "", "ROOT", "root ", 0, "u" * 200])
def test_every_edge_refuses_an_unknown_user_as_before(bad: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"^unknown user ") as refused:
        check_user(bad)
    assert refused.value.details == {"user": str(bad)[:64]}
    assert backends_check_user is check_user  # one function, re-exported by the layer that owns specs
    if isinstance(bad, str) and bad:  # E2B: an empty name is the default user; another is unknown to envd (401)
        with pytest.raises(AuthenticationError, match=r"^invalid username "):
            envd_user(bad)


def test_known_users_and_their_homes() -> None:
    assert [check_user(u) for u in (None, "user", "root")] == [None, "user", "root"]
    assert [envd_user(u) for u in (None, "", "user", "root")] == ["user", "user", "user", "root"]
    assert (user_home(None), user_home("root")) == ("/home/user", "/root")
    with pytest.raises(InvalidRequestError):
        user_home("nobody")


# -- ExecOptions: written once, serialized once ---------------------------------------------------------------

# A value other than the default for each option, and the request field it must show in.
SET = {"cwd": ("/tmp", "cwd"), "env": ({"A": "1"}, "cmd_env"), "timeout": (5.0, "timeout"),
       "max_output": (100, "max_output"), "stdin": (b"in", "stdin"), "detached": (True, "background"),
       "tag": ("t", "tag"), "pty": (PtySize(rows=30, cols=90), "pty"), "keep_stdin": (True, "stdin")}
PLAIN_FIELDS = {"cmd", "cwd", "env", "timeout", "max_output", "stdin"}  # what a plain exec always sent


def test_every_option_reaches_the_agents_request() -> None:
    plain = ExecOptions("true").request({"PATH": "/bin"})
    assert set(plain) == PLAIN_FIELDS and plain["env"] == {"PATH": "/bin"} and plain["stdin"] is False
    names = {f.name for f in dataclasses.fields(ExecOptions)}
    # `cmd` is always sent; `user` is who the client acts as (`AgentClient.as_user`), a field of every request.
    assert names - {"cmd", "user"} == set(SET), "a new option needs its wire field here and in request()"
    for name, (value, wire) in SET.items():
        request = ExecOptions("true", **{name: value}).request({"PATH": "/bin"})
        assert request[wire] != plain.get(wire), name


def test_the_request_round_trips_through_the_wire_encoding() -> None:
    options = ExecOptions(["python3", "-c", "print(1)"], cwd="/workspace/é", env={"SECRET": "x\u00e9"},
                          timeout=2.5, max_output=4096, stdin=b"\x00\xff", detached=True, tag="job",
                          pty=PtySize(rows=24, cols=80), keep_stdin=True, user="root")
    request = {"op": "exec", "token": "t", **options.request({"HOME": "/root"})}
    frame = protocol.encode_json(protocol.REQUEST, request)
    kind, length = protocol.parse_header(frame[: protocol.HEADER.size])
    assert kind == protocol.REQUEST and length == len(frame) - protocol.HEADER.size
    assert protocol.decode_json(frame[protocol.HEADER.size:]) == request == {
        "op": "exec", "token": "t", "cmd": ["python3", "-c", "print(1)"], "cwd": "/workspace/é",
        "env": {"HOME": "/root"}, "cmd_env": {"SECRET": "x\u00e9"}, "timeout": 2.5, "max_output": 4096,
        "stdin": True, "background": True, "stream": True, "tag": "job", "pty": {"rows": 24, "cols": 80}}
    launched = options.request(None, follow=False)
    assert launched["background"] is True and "stream" not in launched


def test_the_service_command_is_the_engines_options() -> None:
    command = Command("id", user="root", env={"A": "1"})
    assert isinstance(command, ExecOptions) and dataclasses.replace(command, tag="x").audit_params()["tag"] == "x"
    assert command.request(None) == ExecOptions("id", user="root", env={"A": "1"}).request(None)


# -- the agent client sends exactly that request --------------------------------------------------------------


class RecordingAgent:
    """An agent socket that records each request (and a connection's stdin) and ends every command at once."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.stdin: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _kind, payload = await _frame(reader)
            request = protocol.decode_json(payload)
            self.requests.append(request)
            if request["op"] == "stdin":
                await self._event(writer, event="ready")
                await self._take_stdin(reader)
                await self._event(writer, event="stdin", written=len(b"".join(self.stdin)))
                return
            await self._event(writer, event="started", id="p-1", pid=7, max_output=100)
            if request.get("stdin") and not request.get("background"):
                await self._take_stdin(reader)
            if not request.get("background") or request.get("stream"):
                await self._event(writer, event="exit", exit_code=0, id="p-1", pid=7)
        finally:
            writer.close()

    async def _take_stdin(self, reader: asyncio.StreamReader) -> None:
        for _ in range(100):
            kind, payload = await _frame(reader)
            if kind in (protocol.STDIN_EOF, protocol.DATA_END):
                return
            self.stdin.append(payload)

    @staticmethod
    async def _event(writer: asyncio.StreamWriter, **event: Any) -> None:
        writer.write(protocol.encode_json(protocol.EVENT, event))
        await writer.drain()


async def _frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    kind, length = protocol.parse_header(await reader.readexactly(protocol.HEADER.size))
    return kind, await reader.readexactly(length)


@pytest.fixture
async def recorded() -> AsyncIterator[tuple[RecordingAgent, AgentClient]]:
    agent = RecordingAgent()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "agent.sock")
        server = await asyncio.start_unix_server(agent.handle, path)
        try:
            yield agent, AgentClient(UnixEndpoint(path), "tok", liveness=Liveness(idle_timeout=None))
        finally:
            server.close()
            await server.wait_closed()


@pytest.mark.anyio
async def test_the_agent_client_sends_the_options_request(recorded: tuple[RecordingAgent, AgentClient]) -> None:
    agent, client = recorded
    env = {"PATH": "/bin"}
    foreground = ExecOptions("cat", cwd="/tmp", env={"A": "1"}, timeout=3.0, stdin=b"hello", tag="t")
    result = await client.as_user("root").run(foreground, env)
    assert result.exit_code == 0
    assert agent.requests == [{"op": "exec", "token": "tok", "user": "root", **foreground.request(env)}]
    assert agent.stdin == [b"hello"]
    # The keyword form for Python callers builds the same options: the same request.
    agent.requests.clear()
    await client.exec("cat", cwd="/tmp", env=env, cmd_env={"A": "1"}, timeout=3.0, stdin=b"hello", tag="t")
    assert agent.requests == [{"op": "exec", "token": "tok", **foreground.request(env)}]


@pytest.mark.anyio
async def test_a_launch_is_the_same_request_unfollowed(recorded: tuple[RecordingAgent, AgentClient]) -> None:
    agent, client = recorded
    options = ExecOptions(["sleep", "9"], env={"A": "1"}, stdin=b"data", tag="bg")
    info = await client.launch(options, None)
    assert (info.id, info.pid, info.argv, info.tag, info.env) == ("p-1", 7, ["sleep", "9"], "bg", {"A": "1"})
    launched = dataclasses.replace(options, detached=True).request(None, follow=False)
    assert agent.requests == [{"op": "exec", "token": "tok", **launched},
                              {"op": "stdin", "token": "tok", "id": "p-1", "eof": True}]  # then its stdin, closed
    assert agent.stdin == [b"data"]
