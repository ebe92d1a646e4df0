"""envd's data plane on Corral, driven by E2B's own SDK (`e2b` from PyPI): commands (streamed, background, stdin,
kill, exit codes, timeouts, env that does not leak), terminals, files (bytes, text, streams, gzip, metadata, many
at once), listing, moving, removing, and directory watches, sync and async, with exact bytes throughout and E2B's
error classes reached on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import socket
import time

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    TimeoutException,
)
from e2b.exceptions import InvalidArgumentException, SandboxException
from e2b.sandbox.filesystem.filesystem import WriteEntry

from .e2b_support import Cleanup, E2BServer
from .e2b_support import cleanup as cleanup  # fixtures
from .e2b_support import e2b_env as e2b_env
from .e2b_support import e2b_fake_server as e2b_fake_server
from .e2b_support import e2b_front as e2b_front
from .e2b_support import e2b_server as e2b_server

pytestmark = [pytest.mark.runc]


@pytest.fixture
def sbx(e2b_env: E2BServer, cleanup: Cleanup) -> Sandbox:
    return cleanup.add(Sandbox.create("base", envs={"SANDBOX_WIDE": "yes"}))


# -- commands ----------------------------------------------------------------------------------------------------


def test_commands_output_exit_codes_and_env(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2; pwd; echo $SANDBOX_WIDE")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n/home/user\nyes\n", "err\n", 0)
    assert sbx.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout == "bar\n"
    assert sbx.commands.run("echo ${FOO:-unset}").stdout == "unset\n"  # a command's env never leaks
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    assert failed.value.error == "exit status 3"
    sbx.files.make_dir("sub")
    assert sbx.commands.run("pwd", cwd="sub").stdout == "/home/user/sub\n"  # relative to the home
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("true", cwd="/no/such/dir")


def test_streamed_output_arrives_while_the_command_runs(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    started = time.monotonic()
    sbx.commands.run("echo a; sleep 1; echo b", on_stdout=lambda line: seen.append((time.monotonic() - started, line)))
    assert [line for _, line in seen] == ["a\n", "b\n"]
    assert seen[1][0] - seen[0][0] > 0.5  # the first line came before the command ended


def test_output_bytes_stay_exact(sbx: Sandbox) -> None:
    sbx.commands.run("printf 'x\\xff\\xfey\\000z' > /home/user/raw.bin")
    assert sbx.files.read("raw.bin", format="bytes") == b"x\xff\xfey\x00z"
    r = sbx.commands.run("cat raw.bin")
    assert r.stdout == "x\ufffd\ufffdy\x00z"  # invalid UTF-8 as replacement characters, the NUL kept
    big = os.urandom(3 * 2**20)
    sbx.files.write("big.bin", big)
    assert sbx.commands.run("sha256sum big.bin").stdout.split()[0] == __import__("hashlib").sha256(big).hexdigest()


def test_background_stdin_kill_and_list(sbx: Sandbox) -> None:
    sleeper = sbx.commands.run("sleep 300", background=True)
    cat = sbx.commands.run("cat", background=True, stdin=True)
    assert {sleeper.pid, cat.pid} <= {p.pid for p in sbx.commands.list()}
    listed = next(p for p in sbx.commands.list() if p.pid == sleeper.pid)
    assert listed.cmd == "/bin/bash" and listed.args[-1] == "sleep 300" and listed.cwd == "/home/user"
    sbx.commands.send_stdin(cat.pid, "one\n")
    sbx.commands.send_stdin(cat.pid, b"\x00two\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "one\n\x00two\n"
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sbx.commands.run(f"kill -0 {sleeper.pid}")  # reaped before kill answered
    assert sleeper.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(999999) is False
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999999)


def test_reconnect_follows_new_output_only(sbx: Sandbox) -> None:
    handle = sbx.commands.run("echo first; sleep 2; echo second", background=True)
    time.sleep(0.5)
    handle.disconnect()
    again = sbx.commands.connect(handle.pid)
    assert again.wait().stdout == "second\n"  # envd's Connect: no old output


def test_a_command_killed_for_memory_says_so(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as killed:
        sbx.commands.run("python3 -c 'x = bytearray(3 * 2**30)'")  # past the default 512M limit
    assert killed.value.exit_code == -1 and killed.value.error.startswith("signal: killed")
    assert "corral: out of memory" in killed.value.error  # E2B's end event has no flag for it


def test_timeouts_end_commands(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - started < 15
    time.sleep(0.5)
    assert "sleep 30" not in sbx.commands.run("ps -eo args").stdout  # killed at the deadline, not left behind


def test_terminal_input_resize_and_reconnect(sbx: Sandbox) -> None:
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=123))
    sbx.pty.send_stdin(term.pid, b"tput cols; echo $TERM; exit\n")
    for _, _, pty in term:
        if pty:
            out += pty
    text = out.decode(errors="replace")
    assert "123" in text and "xterm-256color" in text
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    term.disconnect()  # the terminal outlives its client
    again = sbx.pty.connect(term.pid)
    sbx.pty.send_stdin(term.pid, b"echo back-$((40+2)); exit\n")
    seen = bytearray()
    for _, _, pty in again:
        if pty:
            seen += pty
    assert b"back-42" in seen


# -- files -------------------------------------------------------------------------------------------------------


def test_files_bytes_text_streams_gzip_and_metadata(e2b_server: E2BServer, sbx: Sandbox) -> None:
    data = bytes(range(256)) * 4096 + b"\x00"
    info = sbx.files.write("/home/user/all.bin", data)
    assert info.path == "/home/user/all.bin" and info.type is FileType.FILE
    assert sbx.files.read("all.bin", format="bytes") == data
    assert b"".join(sbx.files.read("all.bin", format="stream")) == data
    assert sbx.files.read("all.bin", format="bytes", gzip=True) == data
    sbx.files.write("streamed.bin", io.BytesIO(data))  # a file object: octet-stream upload
    sbx.files.write("gz.bin", data, gzip=True)
    assert sbx.files.read("streamed.bin", format="bytes") == data == sbx.files.read("gz.bin", format="bytes")
    sbx.files.write("text.txt", "héllo ✓")
    assert sbx.files.read("text.txt") == "héllo ✓"
    tagged = sbx.files.write("tagged.txt", "x", metadata={"author": "corral", "purpose": "test"})
    assert tagged.metadata == {"author": "corral", "purpose": "test"}
    assert sbx.files.get_info("tagged.txt").metadata == {"author": "corral", "purpose": "test"}
    assert sbx.files.get_info("text.txt").metadata is None
    with pytest.raises(InvalidArgumentException):
        sbx.files.write("bad-meta.txt", "x", metadata={"k": "\x01"})
    assert not sbx.files.exists("bad-meta.txt")  # refused: nothing written
    r = httpx.post(f"{e2b_server.url}/files", files={"file": ("", b"x")}, headers={
        "E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token})
    assert r.status_code == 400 and "filename" in r.json()["message"]  # no path, no name: said so
    written = sbx.files.write_files([WriteEntry(path="many/a.txt", data="A"), WriteEntry(path="many/b.bin",
                                                                                          data=b"\xff")])
    assert [w.path for w in written] == ["/home/user/many/a.txt", "/home/user/many/b.bin"]
    assert sbx.files.read("many/b.bin", format="bytes") == b"\xff"


def test_entries_list_move_and_remove(sbx: Sandbox) -> None:
    sbx.files.make_dir("tree/inner")
    assert sbx.files.make_dir("tree") is False  # there already
    sbx.files.write("tree/inner/f.txt", "abc")
    sbx.commands.run("ln -s f.txt link", cwd="tree/inner")
    info = sbx.files.get_info("tree/inner/f.txt")
    assert (info.size, info.mode, info.permissions, info.owner, info.group) == (3, 0o644, "-rw-r--r--", "user",
                                                                                 "user")
    assert info.modified_time.tzinfo is not None
    link = sbx.files.get_info("tree/inner/link")
    assert link.type is FileType.FILE and link.symlink_target == "/home/user/tree/inner/f.txt"
    shallow = [e.path for e in sbx.files.list("tree")]
    deep = [e.path for e in sbx.files.list("tree", depth=3)]
    assert shallow == ["/home/user/tree/inner"] and "/home/user/tree/inner/f.txt" in deep
    moved = sbx.files.rename("tree/inner/f.txt", "elsewhere/new/f.txt")  # parents made, as envd does
    assert moved.path == "/home/user/elsewhere/new/f.txt" and sbx.files.read(moved.path) == "abc"
    sbx.files.remove("tree")
    sbx.files.remove("tree")  # removing what is not there is no error
    assert not sbx.files.exists("tree") and sbx.files.exists("/etc/passwd")
    with pytest.raises(NotFoundException):
        sbx.files.read("nope.txt")
    with pytest.raises(NotFoundException):
        sbx.files.get_info("nope.txt")
    with pytest.raises(SandboxException):
        sbx.files.read("/proc/self/environ")  # the agent's own: never through the file API


def test_polled_watch_sees_writes_in_order(sbx: Sandbox) -> None:
    sbx.files.make_dir("watched")
    handle = sbx.files.watch_dir("watched", recursive=True)
    sbx.files.write("watched/new.txt", "1")
    events = handle.get_new_events()
    assert [(e.type, e.name) for e in events] == [(FilesystemEventType.CREATE, "new.txt"),
                                                   (FilesystemEventType.CHMOD, "new.txt"),
                                                   (FilesystemEventType.WRITE, "new.txt")]
    sbx.files.make_dir("watched/sub")
    sbx.files.write("watched/sub/deep.txt", "2")
    sbx.files.remove("watched/new.txt")
    names = [(e.type, e.name) for e in handle.get_new_events()]
    assert (FilesystemEventType.CREATE, "sub/deep.txt") in names and \
        (FilesystemEventType.REMOVE, "new.txt") in names
    handle.stop()
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir("no-such-dir")


# -- async twins and the data plane's credentials ----------------------------------------------------------------


@pytest.mark.anyio
async def test_async_commands_files_and_streaming_watch(e2b_env: E2BServer, cleanup: Cleanup) -> None:
    sbx = cleanup.add(await AsyncSandbox.create("base"))
    r = await sbx.commands.run("echo hi")
    assert r.stdout == "hi\n"
    seen: list[str] = []
    await sbx.files.make_dir("w")
    watch = await sbx.files.watch_dir("w", on_event=lambda e: seen.append(f"{e.type.name}:{e.name}"))
    await sbx.files.write("w/a.txt", b"\x00\x01")
    for _ in range(50):
        if "WRITE:a.txt" in seen:
            break
        await asyncio.sleep(0.1)
    await watch.stop()
    assert seen[:1] == ["CREATE:a.txt"] and "WRITE:a.txt" in seen
    assert await sbx.files.read("w/a.txt", format="bytes") == b"\x00\x01"
    handle = await sbx.commands.run("sleep 60", background=True)
    assert await sbx.commands.kill(handle.pid)


def test_an_env_value_execve_cannot_take_is_invalid_not_a_502(sbx: Sandbox) -> None:
    """Issue 29 item 6: a 200 KB variable (the kernel takes 128 KiB a string) is refused naming env."""
    with pytest.raises(InvalidArgumentException, match="env"):
        sbx.commands.run("true", envs={"BIG": "x" * 200_000})
    assert sbx.commands.run("echo ok", envs={"SMALL": "x" * 1000}).stdout == "ok\n"


def test_an_rpc_message_past_the_limit_is_refused_before_it_ends(e2b_server: E2BServer, sbx: Sandbox) -> None:
    """Issue 29 item 5: a unary RPC's body is refused at the first chunk past 16 MiB, not read whole first: the
    client here never finishes its chunked body, and still gets the answer."""
    url = httpx.URL(e2b_server.url)
    head = (f"POST /filesystem.Filesystem/Stat HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
            f"E2b-Sandbox-Id: {sbx.sandbox_id}\r\nX-Access-Token: {sbx._envd_access_token}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    piece = b"x" * 2**20
    with socket.create_connection((url.host, url.port), timeout=60) as conn:
        start = b'{"path": "'
        conn.sendall(head + b"%x\r\n%s\r\n" % (len(start), start))
        answer = b""
        with contextlib.suppress(OSError):  # the server may close while the rest is still being sent
            for _ in range(17):
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.settimeout(30)
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in answer and (data := conn.recv(65536)):
                answer += data
    assert answer.startswith(b"HTTP/1.1 429"), answer[:300]
    assert b"larger than" in answer or b"resource_exhausted" in answer


def test_rpcs_need_the_sandboxs_own_credentials(e2b_server: E2BServer, sbx: Sandbox, cleanup: Cleanup) -> None:
    url = f"{e2b_server.url}/process.Process/List"
    base = {"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/json"}
    assert httpx.post(url, json={}, headers={**base, "X-Access-Token": sbx._envd_access_token}).status_code == 200
    r = httpx.post(url, json={}, headers=base)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.post(url, json={}, headers={**base, "X-API-KEY": e2b_server.keys["b_dev"]})
    assert r.status_code == 404 and r.json()["code"] == "not_found"  # another tenant: no such sandbox
    r = httpx.post(url, json={}, headers={**base, "X-API-KEY": e2b_server.keys["a_aud"]})
    assert r.status_code == 403  # an auditor never runs or lists processes
    sbx.files.write("/home/user/kept.txt", "kept")
    for path in ("/home/user/kept.txt", "/home/user/never-there"):  # removing what is not there is no error...
        r = httpx.post(f"{e2b_server.url}/filesystem.Filesystem/Remove", json={"path": path},
                       headers={**base, "X-API-KEY": e2b_server.keys["b_dev"]})
        assert r.status_code == 404 and r.json()["code"] == "not_found", r.text  # ...but another tenant's sandbox is
    assert sbx.files.read("/home/user/kept.txt") == "kept"
    r = httpx.post(f"{e2b_server.url}/process.Process/Nope", json={},
                   headers={**base, "X-Access-Token": sbx._envd_access_token})
    assert r.status_code == 501
    r = httpx.post(url, content=b"{bad", headers={**base, "X-Access-Token": sbx._envd_access_token})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    assert httpx.get(f"{e2b_server.url}/health", headers={**base, "X-Access-Token": sbx._envd_access_token}
                     ).status_code == 204
    assert httpx.get(f"{e2b_server.url}/health", headers=base).status_code == 401


def test_hosts_name_the_sandbox_and_port_as_well_as_headers(e2b_server: E2BServer, sbx: Sandbox) -> None:
    """`<port>-<id>.<domain>` hosts reach envd and the code interpreter too (what the SDKs use without
    E2B_SANDBOX_URL), and any other port goes to the sandbox's own server, with the traffic token."""
    port = e2b_server.server.port
    token = {"X-Access-Token": sbx._envd_access_token}
    r = httpx.get(f"{e2b_server.url}/health", headers={"Host": f"49983-{sbx.sandbox_id}.localhost:{port}", **token})
    assert r.status_code == 204
    r = httpx.get(f"{e2b_server.url}/contexts", headers={"Host": f"49999-{sbx.sandbox_id}.localhost:{port}",
                                                          "E2B-Traffic-Access-Token": sbx.traffic_access_token})
    assert r.status_code == 200 and {"python", "javascript"} <= {c["language"] for c in r.json()}
    server = sbx.commands.run("python3 -m http.server 8000", background=True)
    try:
        for _ in range(50):
            r = httpx.get(f"{e2b_server.url}/", headers={"Host": sbx.get_host(8000),
                                                                     "E2B-Traffic-Access-Token":
                                                                         sbx.traffic_access_token})
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200 and "Directory listing" in r.text
        r = httpx.get(f"{e2b_server.url}/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000",
                                                     "E2B-Traffic-Access-Token": sbx.traffic_access_token})
        assert r.status_code == 200 and "Directory listing" in r.text
        assert httpx.get(f"{e2b_server.url}/", headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                         "E2b-Sandbox-Port": "8000"}).status_code == 401
    finally:
        server.kill()


def test_root_and_sudo_as_in_e2bs_sandboxes(sbx: Sandbox) -> None:
    """E2B's sandboxes give their user passwordless sudo and take `user="root"`: Corral's E2B API makes root
    sandboxes (docs/security.md) where the backend can, the user's commands still unprivileged."""
    assert sbx.commands.run("id -u").stdout == "1000\n"
    assert sbx.commands.run("id -u", user="root").stdout == "0\n"
    assert sbx.commands.run("pwd", user="root").stdout == "/root\n"
    assert sbx.commands.run("sudo id -u").stdout == "0\n"
    sbx.files.write("mine.txt", "root's", user="root")  # relative: in root's home
    assert sbx.files.get_info("/root/mine.txt", user="root").owner == "root"
    with pytest.raises(SandboxException):
        sbx.files.read("/root/mine.txt")  # the user may not read root's home
    sbx.commands.run("mkdir -p /opt/tool && touch /opt/tool/bin", user="root")  # the template is root's
    with pytest.raises(CommandExitException):
        sbx.commands.run("touch /usr/local/bin/nope")
