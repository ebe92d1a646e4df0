"""gVisor's agent socket (backends/local/_backend.py): runsc cannot hand the agent a listening socket, so the agent
binds its own in `run/`, a host directory mounted at /.corral/run. `create` then moves the socket out of the
sandbox's reach (root's, 0600; it stays bound) and leaves `run/` root's, empty and 0555: the sandbox can neither
write to the host's disk there (outside its quota) nor plant a socket where the engine would connect."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral.backends.local import LocalRecord
from corral.egress import EgressProxy
from corral.engine import Adoption, Engine, SandboxSpec

from .conftest import TEMPLATE, TEST_HOME, engine_behind, leaks, make_engine

pytestmark = [pytest.mark.anyio, pytest.mark.runsc]

SANDBOX_UID = 1000

# What the sandbox user tries in /.corral/run: each line prints "<what> <errno name or ok>".
PROBE = r"""
import errno, os, socket
def attempt(what, fn):
    try:
        fn()
        print(what, "ok")
    except OSError as exc:
        print(what, errno.errorcode.get(exc.errno, exc.errno))
attempt("list", lambda: print("entries", os.listdir("/.corral/run")))
attempt("write", lambda: open("/.corral/run/fill", "wb").write(b"x" * 4096))
attempt("mkdir", lambda: os.mkdir("/.corral/run/d"))
attempt("bind", lambda: socket.socket(socket.AF_UNIX).bind("/.corral/run/agent.sock"))
attempt("connect", lambda: socket.socket(socket.AF_UNIX).connect("/.corral/run/agent.sock"))
attempt("egress-write", lambda: open("/.corral/egress/fill", "wb"))
"""


@pytest.fixture
async def engine_with_egress(test_home: Path) -> AsyncIterator[Engine]:
    async with engine_behind(test_home, EgressProxy()) as engine:
        yield engine


def _record(engine: Engine, sandbox_id: str) -> LocalRecord:
    record = engine.runtime.sandboxes[sandbox_id].record
    assert isinstance(record, LocalRecord)
    return record


def _assert_locked(record: LocalRecord, address: str) -> None:
    sock = record.dir / "agent.sock"
    assert address == str(sock)
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and (st.st_uid, st.st_gid) == (0, 0)
    run = record.dir / "run"
    st = run.stat()
    assert stat.S_IMODE(st.st_mode) == 0o555 and (st.st_uid, st.st_gid) == (0, 0)
    assert list(run.iterdir()) == []


def _probe(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.splitlines() if not line.startswith("entries"))


async def test_agent_socket_is_out_of_the_sandboxes_reach(engine_with_egress: Engine) -> None:
    engine = engine_with_egress
    async with await engine.create(SandboxSpec(template=TEMPLATE, runtime="runsc")) as sb:
        record = _record(engine, sb.id)
        _assert_locked(record, engine.backend.agent_address(record).endpoint.path)  # type: ignore[union-attr]

        r = await sb.exec(["python3", "-c", PROBE], timeout=60)
        assert r.exit_code == 0, r.stderr
        assert "entries []" in r.stdout, r.stdout
        assert _probe(r.stdout) == {"list": "ok", "write": "EACCES", "mkdir": "EACCES", "bind": "EACCES",
                                    "connect": "ENOENT", "egress-write": "EROFS"}, r.stdout
        assert list((record.dir / "run").iterdir()) == []

        # The agent still answers, and the egress proxy's socket (in its tmpfs) is reachable from gVisor.
        r = await sb.exec("id -u; curl -fsS --max-time 20 http://example.org/", timeout=60)
        assert r.stdout.splitlines()[0] == str(SANDBOX_UID)
        assert r.exit_code != 0 and [d.host for d in r.egress_denials] == ["example.org"], (r.stdout, r.stderr)

        info = (await sb.exec(["cat", "/proc/self/mountinfo"])).stdout
        assert str(TEST_HOME) not in info and "/sandboxes/" not in info, info


async def test_a_sandbox_of_the_old_layout_is_locked_on_restart(test_home: Path) -> None:
    """A runsc sandbox made before the socket was moved (agent in run/, run/ the sandbox user's) is locked down
    when an engine takes it back, and stays usable."""
    first = make_engine(test_home)
    await first.start()
    try:
        sb = await first.create(SandboxSpec(template=TEMPLATE, runtime="runsc"))
        record = _record(first, sb.id)
        user = record.uid_base + SANDBOX_UID
        run = record.dir / "run"
        os.chown(run, user, user)
        os.chmod(run, 0o700)
        os.rename(record.dir / "agent.sock", run / "agent.sock")
        os.chown(run / "agent.sock", user, user)
    finally:
        await first.close()  # the engine goes, the sandbox stays

    second = make_engine(test_home)
    await second.start(adopt={sb.id: Adoption(spec=SandboxSpec(template=TEMPLATE, runtime="runsc"))})  # the store's
    try:
        again = second.get(sb.id)
        rec = _record(second, sb.id)
        _assert_locked(rec, second.backend.agent_address(rec).endpoint.path)  # type: ignore[union-attr]
        r: Any = await again.exec("echo still here", timeout=60)
        assert r.stdout == "still here\n"
    finally:
        await second.close(destroy_all=True)
    assert not [x for x in leaks(test_home) if sb.id in x]
