"""Background processes and the PTY."""

from __future__ import annotations

import anyio
import pytest

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


async def test_background_lifecycle(sandbox):
    p = await sandbox.processes.start("for i in 1 2 3; do echo line$i; sleep 0.2; done")
    listed = await sandbox.processes.list()
    assert any(x.id == p.id and x.running for x in listed)
    r = await sandbox.processes.wait(p.id, timeout=10)
    assert r is not None and r.exit_code == 0 and r.stdout == "line1\nline2\nline3\n"
    again = await sandbox.processes.wait(p.id)  # output can be fetched later
    assert again is not None and again.stdout == r.stdout


async def test_background_stdin_and_kill(sandbox):
    p = await sandbox.processes.start(["cat"], stdin=True)
    await sandbox.processes.send_stdin(p.id, b"hello\x00")
    await sandbox.processes.send_stdin(p.id, b"", eof=True)
    r = await sandbox.processes.wait(p.id, timeout=10)
    assert r is not None and r.stdout_bytes == b"hello\x00"

    p = await sandbox.processes.start("sleep 1000 & sleep 1000")
    assert await sandbox.processes.wait(p.id, timeout=0.2) is None  # still running
    await sandbox.processes.kill(p.id)
    r = await sandbox.processes.wait(p.id, timeout=10)
    assert r is not None and r.killed and r.signal == 9
    ps = await sandbox.exec("ps -eo comm | grep -c '^sleep$' || true")
    assert ps.stdout.strip() == "0"


async def test_background_survives_its_caller_and_attach_streams(sandbox):
    p = await sandbox.processes.start("echo a; sleep 0.5; echo b")
    chunks: list[bytes] = []
    r = await sandbox.processes.attach(p.id, on_stdout=chunks.append)
    assert b"".join(chunks) == b"a\nb\n" and r.exit_code == 0


async def test_background_timeout(sandbox):
    p = await sandbox.processes.start("sleep 100", timeout=0.3)
    r = await sandbox.processes.wait(p.id, timeout=10)
    assert r is not None and r.timed_out


async def test_pty_interactive(sandbox):
    term = await sandbox.pty("bash --norc --noprofile", rows=30, cols=100)
    out = bytearray()
    resized = False
    try:
        await term.write(b"stty size; tty; echo $TERM\n")
        with anyio.fail_after(10):
            async for chunk in term:
                out += chunk
                if not resized and b"xterm-256color\r\n" in out:
                    resized = True
                    await term.resize(40, 120)
                    await term.write(b"stty size; exit 7\n")
    finally:
        await term.close()
    text = out.decode(errors="replace")
    assert "30 100" in text and "40 120" in text and "/dev/pts/" in text and "xterm-256color" in text
    assert term.result is not None and term.result.exit_code == 7
