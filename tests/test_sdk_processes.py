"""The SDK's background commands and terminals against a real server: uvicorn serving the API app in the test's
event loop over real runc sandboxes. The sync SDK runs in a worker thread (it blocks), the async one in the loop.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from websockets.exceptions import ConnectionClosedError
from websockets.frames import Close

from corral import (
    AsyncCommandHandle,
    AsyncPtySession,
    AsyncSandbox,
    AuthenticationError,
    CommandHandle,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ProcessInfo,
    PtySession,
    Sandbox,
    ServerError,
)
from corral._sdk import AsyncCommands, AsyncPty, Pty
from corral._sdk._config import ConnectionConfig
from corral._sdk._processes import _Delivered
from corral._sdk._pty import _closed_error, _ws_url
from corral._sdk._transport import AsyncClient, SyncClient

from .conftest import TEMPLATE
from .test_server_processes import NASTY, Api, api, live  # noqa: F401  # the fixtures

SCRIPT = "printf 'a\\000'; sleep 0.5; printf '\\377b' >&2; printf 'c\\n'; exit 3"


def until(check: Callable[[], bool], seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- sync ---------------------------------------------------------------------------------------------------------


def sync_background(sb: Sandbox) -> None:
    out: list[bytes] = []
    err: list[bytes] = []
    handle = sb.commands.run(SCRIPT, background=True, on_stdout=out.append, on_stderr=err.append)
    assert isinstance(handle, CommandHandle) and handle.id and handle.pid > 0
    result = handle.wait(timeout=20)
    assert result is not None and result.exit_code == 3 and result.stdout_bytes == b"a\x00c\n"
    assert result.stderr_bytes == b"\xffb" and b"".join(out) == b"a\x00c\n" and b"".join(err) == b"\xffb"
    assert handle.wait() is result  # kept once it ended

    sleeper = sb.commands.run("sleep 100 & sleep 100", background=True, timeout=None)
    assert sleeper.wait(timeout=0.2) is None  # still running: it goes on
    listed = sb.commands.list()
    assert all(isinstance(p, ProcessInfo) for p in listed)
    assert [(p.id, p.cmd) for p in listed if p.running] == [(sleeper.id, "sleep 100 & sleep 100")]
    sleeper.kill()
    killed = sleeper.wait(timeout=20)
    assert killed is not None and killed.killed and killed.signal == 9 and killed.exit_code == 137

    term = sb.commands.run(["sleep", "100"], background=True)
    sb.commands.kill(term.id, signal="SIGTERM")
    ended = term.wait(timeout=20)
    assert ended is not None and ended.signal == 15


def sync_stdin_and_connect(sb: Sandbox) -> None:
    cat = sb.commands.run(["cat"], background=True, stdin=True)
    cat.send_stdin(NASTY)
    sb.commands.send_stdin(cat.id, "é", eof=True)
    result = cat.wait(timeout=20)
    assert result is not None and result.stdout_bytes == NASTY + "é".encode()

    started = sb.commands.run("echo one; sleep 1; echo two", background=True)
    got: list[bytes] = []
    again = sb.commands.connect(started.id, on_stdout=got.append)
    assert again.id == started.id and again.pid == started.pid
    assert again.wait(timeout=0.5) is None and b"".join(got) == b"one\n"
    final = again.wait(timeout=20)
    assert final is not None and final.stdout_bytes == b"one\ntwo\n"
    assert b"".join(got) == b"one\ntwo\n"  # a second wait replays nothing twice

    with pytest.raises(NotFoundError):
        sb.commands.connect("999")
    sleeper = sb.commands.run(["sleep", "5"], background=True)
    with pytest.raises(ConflictError):
        sleeper.send_stdin(b"x")  # started without stdin=True
    with pytest.raises(ValueError, match="background=True"):
        sb.commands.run(["cat"], stdin=True)


def sync_pty(sb: Sandbox, url: str) -> None:
    data = bytearray()
    with sb.pty.create(["bash", "--norc", "--noprofile"], rows=30, cols=100, on_data=data.extend) as term:
        assert isinstance(term, PtySession) and term.id and term.pid > 0
        term.send("tty; stty size; echo M$((1+1))\n")
        until(lambda: term.wait(timeout=0.1) is None and b"M2\r\n" in data)
        term.resize(40, 120)
        term.send(b"stty size; printf 'A\\000B\\377C'; exit 7\n")
        result = term.wait(timeout=20)
    assert result.exit_code == 7 and term.result is result
    text = data.decode(errors="replace")
    assert "/dev/pts/" in text and "30 100" in text and "40 120" in text and b"A\x00B\xffC" in data

    with sb.pty.create("sleep 1000") as term:
        term.kill()
        killed = term.wait(timeout=20)
        assert killed.killed and killed.signal == 9

    with sb.pty.create("printf 'x\\000y'; exit 2") as term:
        chunks = b"".join(term)  # iterating instead of a callback
        assert chunks == b"x\x00y" and term.result is not None and term.result.exit_code == 2

    with pytest.raises(InvalidRequestError):
        sb.pty.create(["no-such-program"])
    with pytest.raises(NotFoundError):
        Pty(sb._client, "sb-doesnotexist").create()
    with pytest.raises(ValueError):
        sb.pty.create(rows=0)


def sync_scenario(url: str, key: str) -> None:
    with Sandbox.create(template=TEMPLATE, api_key=key, base_url=url) as sb:
        sync_background(sb)
        sync_stdin_and_connect(sb)
        sync_pty(sb, url)
        with pytest.raises(AuthenticationError):
            Pty(SyncClient(ConnectionConfig(base_url=url, api_key="corral_nope")), sb.id).create()


@pytest.mark.anyio
@pytest.mark.runc
async def test_sync_sdk_against_a_real_server(live: Api) -> None:  # noqa: F811
    with anyio.fail_after(240):
        await anyio.to_thread.run_sync(sync_scenario, live.url, live.keys["a_dev"])


# -- async --------------------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.runc
async def test_async_sdk_against_a_real_server(live: Api) -> None:  # noqa: F811
    out: list[bytes] = []

    async def on_stdout(data: bytes) -> None:  # coroutine callbacks are awaited
        out.append(data)

    with anyio.fail_after(240):
        async with await AsyncSandbox.create(template=TEMPLATE, api_key=live.keys["a_dev"], base_url=live.url) as sb:
            handle = await sb.commands.run(SCRIPT, background=True, on_stdout=on_stdout)
            assert isinstance(handle, AsyncCommandHandle)
            result = await handle.wait(timeout=20)
            assert result is not None and result.exit_code == 3 and result.stderr_bytes == b"\xffb"
            assert b"".join(out) == b"a\x00c\n"

            cat = await sb.commands.run(["cat"], background=True, stdin=True, timeout=None)
            assert await cat.wait(timeout=0.2) is None
            await cat.send_stdin(NASTY, eof=True)
            done = await cat.wait(timeout=20)
            assert done is not None and done.stdout_bytes == NASTY
            assert cat.id in [p.id for p in await sb.commands.list()]

            sleeper = await sb.commands.run("sleep 100", background=True)
            again = await sb.commands.connect(sleeper.id)
            await again.kill()
            killed = await sleeper.wait(timeout=20)
            assert killed is not None and killed.killed

            data = bytearray()
            async with await sb.pty.create(["bash", "--norc", "--noprofile"], rows=25, cols=90,
                                           on_data=data.extend) as term:
                assert isinstance(term, AsyncPtySession)
                await term.send(b"tty; stty size; echo M$((1+1))\n")
                while b"M2\r\n" not in data:
                    assert await term.wait(timeout=0.1) is None
                await term.resize(50, 132)
                await term.send(b"stty size; exit 5\n")
                exited = await term.wait(timeout=20)
            assert exited.exit_code == 5
            assert b"25 90" in data and b"50 132" in data and b"/dev/pts/" in data

            async with await sb.pty.create("printf 'x\\000y'") as term:
                assert b"".join([chunk async for chunk in term]) == b"x\x00y"
            with pytest.raises(NotFoundError):
                await AsyncPty(sb._client, "sb-doesnotexist").create()
            auditor = AsyncClient(ConnectionConfig(base_url=live.url, api_key=live.keys["a_aud"]))
            try:
                with pytest.raises(PermissionDeniedError):
                    await AsyncPty(auditor, sb.id).create()
                with pytest.raises(PermissionDeniedError):
                    await AsyncCommands(auditor, sb.id).run("id", background=True)
            finally:
                await auditor.close()


@pytest.mark.anyio
async def test_async_pty_connection_refused_is_a_server_error() -> None:
    client = AsyncClient(ConnectionConfig(base_url="http://127.0.0.1:9", api_key="k", request_timeout=5))
    with pytest.raises(ServerError, match="cannot connect") as info:
        await AsyncPty(client, "sb-x").create()
    assert isinstance(info.value.__cause__, OSError)
    await client.close()


# -- I/O-free pieces ----------------------------------------------------------------------------------------------


def test_sync_pty_connection_refused_is_a_server_error() -> None:
    client = SyncClient(ConnectionConfig(base_url="http://127.0.0.1:9", api_key="k", request_timeout=5))
    with pytest.raises(ServerError, match="cannot connect") as info:
        Pty(client, "sb-x").create()
    assert isinstance(info.value.__cause__, OSError)
    client.close()


@pytest.mark.parametrize(("code", "error"), [(4401, AuthenticationError), (4404, NotFoundError),
                                             (4400, InvalidRequestError), (4403, PermissionDeniedError),
                                             (4409, ConflictError), (4999, ServerError), (1011, ServerError),
                                             (1000, ServerError)])
def test_close_codes_map_to_errors(code: int, error: type[Exception]) -> None:
    exc = _closed_error(ConnectionClosedError(Close(code, "why"), None))
    assert type(exc) is error and exc.details["close_code"] == code


def test_ws_url() -> None:
    assert _ws_url("http://h:1", "sb-1") == "ws://h:1/v1/sandboxes/sb-1/pty"
    assert _ws_url("https://h/base", "sb-1") == "wss://h/base/v1/sandboxes/sb-1/pty"


def test_replayed_output_is_delivered_once() -> None:
    delivered = _Delivered()
    assert delivered.fresh("stdout", b"abc") == b"abc"
    delivered.restart()  # a second attach replays from the start
    assert delivered.fresh("stdout", b"ab") == b""
    assert delivered.fresh("stdout", b"cde") == b"de"
    assert delivered.fresh("stderr", b"x") == b"x"


@pytest.mark.parametrize(("sync_cls", "async_cls"), [(CommandHandle, AsyncCommandHandle), (Pty, AsyncPty),
                                                     (PtySession, AsyncPtySession)])
def test_sync_and_async_twins_have_the_same_signatures(sync_cls: Any, async_cls: Any) -> None:
    sync = {n: m for n, m in vars(sync_cls).items() if not n.startswith("_")}
    asyn = {n: m for n, m in vars(async_cls).items() if not n.startswith("_")}
    assert set(sync) == set(asyn) and sync
    for name, member in sync.items():
        other = asyn[name]
        assert inspect.iscoroutinefunction(other) and not inspect.iscoroutinefunction(member), name
        ps, pa = inspect.signature(member).parameters, inspect.signature(other).parameters
        assert [(p.name, p.kind, p.default) for p in ps.values()] == \
            [(p.name, p.kind, p.default) for p in pa.values()], name
