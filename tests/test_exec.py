"""Commands in real sandboxes: bytes exact, structured outcomes, streaming, stdin, env, cwd."""

from __future__ import annotations

import time

import pytest

from corral import InvalidRequestError

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


async def test_shell_and_argv(sandbox):
    r = await sandbox.exec("echo hi; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "err\n")
    r = await sandbox.exec(["printf", "%s|", "a b", "c"])
    assert r.stdout == "a b|c|" and r.ok


async def test_output_bytes_exact(sandbox):
    r = await sandbox.exec(r"printf 'a\x00b\xff\xfe\n'; printf '\x00' >&2")
    assert r.stdout_bytes == b"a\x00b\xff\xfe\n"
    assert r.stderr_bytes == b"\x00"
    assert r.stdout == "a\x00b\ufffd\ufffd\n"  # text is a view; invalid UTF-8 replaced, never an exception


async def test_stdin_bytes(sandbox):
    payload = bytes(range(256)) * 4096 + b"\x00" * 10
    r = await sandbox.exec("sha256sum | cut -d' ' -f1", stdin=payload)
    import hashlib

    assert r.stdout.strip() == hashlib.sha256(payload).hexdigest()
    r = await sandbox.exec(["cat"], stdin=b"")
    assert r.stdout_bytes == b"" and r.exit_code == 0


async def test_cwd_env_and_user(sandbox):
    r = await sandbox.exec("pwd; id -u; echo $FOO", env={"FOO": "bar baz"})
    assert r.stdout.split("\n")[:3] == ["/workspace", "1000", "bar baz"]
    r = await sandbox.exec("pwd", cwd="/tmp")
    assert r.stdout == "/tmp\n"
    with pytest.raises(InvalidRequestError, match="does not exist"):
        await sandbox.exec("pwd", cwd="/nope")


async def test_bad_command_input(sandbox):
    with pytest.raises(InvalidRequestError, match="NUL"):
        await sandbox.exec("echo a\x00b")
    with pytest.raises(InvalidRequestError, match="not found"):
        await sandbox.exec(["/no/such/binary"])
    with pytest.raises(InvalidRequestError):
        await sandbox.exec([])


async def test_streaming_arrives_before_exit(sandbox):
    seen: list[tuple[float, bytes]] = []
    start = time.monotonic()

    def on_out(data: bytes) -> None:
        seen.append((time.monotonic() - start, data))

    r = await sandbox.exec("echo first; sleep 1; echo second", on_stdout=on_out)
    assert r.stdout == "first\nsecond\n"
    assert seen[0][1] == b"first\n" and seen[0][0] < 0.9  # streamed live, not at the end


async def test_timeout_is_structured(sandbox):
    t = time.monotonic()
    r = await sandbox.exec("echo started; sleep 30", timeout=0.5)
    assert r.timed_out and not r.ok and r.stdout == "started\n"
    assert time.monotonic() - t < 5


async def test_output_cap_keeps_head_and_tail(sandbox):
    r = await sandbox.exec("seq 1 200000", max_output=4000)
    full = "".join(f"{i}\n" for i in range(1, 200001)).encode()
    assert r.truncated and r.stdout_size == len(full)
    assert r.stdout_cut is not None
    head, tail = r.stdout_bytes[: r.stdout_cut], r.stdout_bytes[r.stdout_cut :]
    assert full.startswith(head) and full.endswith(tail)
    assert len(r.stdout_bytes) <= 4000 and len(tail) > 0


async def test_exit_by_signal(sandbox):
    r = await sandbox.exec("kill -TERM $$")
    assert r.signal == 15 and r.exit_code == 143 and not r.timed_out and not r.oom_killed


async def test_open_files_limit(engine):
    from .conftest import spec

    async with await engine.create(spec(open_files=256)) as sb:
        r = await sb.exec("ulimit -n; ulimit -Hn")
        assert r.stdout.split() == ["256", "256"]
        probe = ("import os\nfds=[]\ntry:\n  while True: fds.append(os.open('/dev/null', 0))\n"
                 "except OSError as e: print(e.errno, len(fds) < 256)")
        r = await sb.exec(["python3", "-c", probe])
        assert r.stdout.strip() == "24 True"  # EMFILE
