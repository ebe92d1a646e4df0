"""The sandbox checklist (docs: CHECKLIST.md), item by item, against real runc sandboxes.

Each test probes the property from inside a fresh sandbox (or from the engine API) and asserts what was really
observed: an errno, a size, a uid, bytes. Probes use python3, bash and coreutils only, so they run on the
`default` template and on the quick dev rootfs alike. Every command has an explicit timeout and every loop a
bound. Items served by other layers (HTTP API, tenants, egress proxy, audit) are tested there.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from corral import (
    AgentError,
    CorralError,
    DiskFullError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RuntimeUnavailableError,
    ServerError,
)
from corral.backends.local import _cgroups
from corral.check import _limits as check_limits
from corral.engine import AgentClient, SandboxSpec

from .conftest import CGROUP_PARENT, TEMPLATE, make_engine, spec

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

MiB = 1024 * 1024
GiB = 1024 * MiB


# -- helpers ---------------------------------------------------------------------------------------


async def sh(sb: Any, cmd: str | list[str], *, timeout: float = 30, **kwargs: Any) -> Any:
    """Run a command that must succeed; say what went wrong if it does not."""
    r = await sb.exec(cmd, timeout=timeout, **kwargs)
    assert r.exit_code == 0, f"{cmd!r} failed: exit {r.exit_code} signal {r.signal}\n{r.stdout}\n{r.stderr}"
    return r


async def probe(sb: Any, code: str, *, timeout: float = 30, **kwargs: Any) -> Any:
    """Run a Python probe inside the sandbox; its last stdout line is JSON."""
    r = await sh(sb, ["python3", "-c", code], timeout=timeout, **kwargs)
    lines = r.stdout.strip().splitlines()
    assert lines, f"probe printed nothing; stderr:\n{r.stderr}"
    return json.loads(lines[-1])


def record(engine: Any, sb: Any) -> dict[str, Any]:
    rec: dict[str, Any] = engine.runtime.sandboxes[sb.id].record.to_json()
    return rec


def cgroup_dir(engine: Any, sb: Any, controller: str) -> Path:
    rel = str(record(engine, sb)["cgroups_path"]).lstrip("/")
    if _cgroups.is_v2():
        return Path("/sys/fs/cgroup") / rel
    return Path("/sys/fs/cgroup") / controller / rel


def host_free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def errname(code: int | None) -> str:
    return errno.errorcode.get(code or 0, str(code))


# -- 1, 2: no host sockets; the agent channel ------------------------------------------------------

HOST_SOCKETS = ["/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock",
                "/run/crio/crio.sock", "/run/podman/podman.sock", "/run/dbus/system_bus_socket",
                "/run/systemd/private", "/run/corral"]


async def test_01_no_container_engine_or_host_sockets(sandbox):
    out = await probe(sandbox, r"""
import glob, json, os, socket
paths = PATHS + glob.glob("/run/*.sock") + glob.glob("/var/run/*.sock") + glob.glob("/run/*/*.sock")
seen = {p: os.path.exists(p) for p in paths}
connected = []
for p in paths:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    try:
        s.connect(p)
        connected.append(p)
    except OSError:
        pass
    finally:
        s.close()
# every Unix socket this network namespace knows about, bound to a path
with open("/proc/net/unix") as f:
    bound = [line.split()[-1] for line in f.read().splitlines()[1:] if len(line.split()) >= 8]
print(json.dumps({"seen": [p for p, e in seen.items() if e], "connected": connected, "bound": bound}))
""".replace("PATHS", repr(HOST_SOCKETS)))
    assert out["seen"] == [] and out["connected"] == [], out
    assert out["bound"] == [], f"Unix sockets bound to paths inside the sandbox: {out['bound']}"


async def test_02_agent_needs_its_own_token(engine, sandbox):
    other = await engine.create(spec())
    try:
        sock = engine.agent(sandbox.id).endpoint
        assert (await AgentClient(sock, record(engine, sandbox)["token"]).ping())  # the right token works
        for token in ("", "x" * 43, record(engine, other)["token"]):  # none, a guess, another sandbox's
            with pytest.raises(CorralError) as info:
                await AgentClient(sock, token).ping()
            assert "token" in info.value.message, info.value.message
    finally:
        await other.destroy()
    # the socket file on the host is for its owner only
    assert os.stat(sock.path).st_mode & 0o077 == 0


async def test_02_nothing_listens_inside_but_loopback(sandbox):
    # Start a loopback listener so the probe is known to see listeners at all.
    await sh(sandbox, "nohup python3 -m http.server --bind 127.0.0.1 8123 >/dev/null 2>&1 & sleep 1")
    out = await probe(sandbox, r"""
import json
listening = []
for name in ("/proc/net/tcp", "/proc/net/tcp6", "/proc/net/udp", "/proc/net/udp6"):
    with open(name) as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            if name.startswith("/proc/net/tcp") and state != "0A":  # LISTEN
                continue
            listening.append((name, local))
print(json.dumps(listening))
""")
    loopback = {"0100007F", "00000000000000000000000001000000"}
    assert any(addr.split(":")[0] in loopback for _, addr in out), f"the probe saw no listener: {out}"
    exposed = [(n, a) for n, a in out if a.split(":")[0] not in loopback]
    assert exposed == [], f"listening on non-loopback addresses: {exposed}"


# -- 3, 4, 5, 6: user, capabilities, setuid, read-only template -------------------------------------


async def test_03_runs_as_uid_1000(sandbox):
    r = await sh(sandbox, "id -u; id -g; id -un")
    assert r.stdout.split() == ["1000", "1000", "user"]
    status = await probe(sandbox, "import json, os; print(json.dumps(os.getresuid() + os.getresgid()))")
    assert status == [1000] * 6, f"real/effective/saved uids and gids must all be 1000, got {status}"


async def test_04_no_capabilities_no_new_privs_seccomp(sandbox):
    r = await sh(sandbox, "cat /proc/self/status")
    status = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    status = {k: v.strip() for k, v in status.items()}
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[cap], 16) == 0, f"{cap} is {status[cap]}: capabilities must all be dropped"
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2", f"Seccomp is {status['Seccomp']}: no seccomp filter is active"
    # The agent itself (PID 1) holds nothing either.
    r = await sh(sandbox, "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/1/status")
    pid1 = {k: v.strip() for k, v in (line.split(":", 1) for line in r.stdout.splitlines())}
    assert int(pid1["CapEff"], 16) == 0 and int(pid1["CapBnd"], 16) == 0
    assert pid1["NoNewPrivs"] == "1" and pid1["Seccomp"] == "2"


SETUID_PROBE = r"""
import fcntl, json, os, subprocess, termios, time
paths = subprocess.run(["find", "/", "-xdev", "-perm", "-4000", "-type", "f"], capture_output=True,
                       text=True, timeout=20).stdout.split()
seen = {}
def ctty():
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
for path in paths:
    # A terminal on stdin makes password prompts (su, passwd, chsh...) block, so the process can be observed
    # after exec: its Uid line says whether the setuid bit took effect.
    master, slave = os.openpty()
    try:
        p = subprocess.Popen([path], stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                             preexec_fn=ctty)
    except OSError:
        os.close(master); os.close(slave); continue
    os.close(slave)
    name = os.path.basename(path)[:15]
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                st = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
        except OSError:
            break
        if st["Name"].strip() == name:
            seen.setdefault(path, set()).update(int(x) for x in st["Uid"].split())
            seen[path].update(-int(x) - 1 for x in st["Gid"].split())
        if p.poll() is not None:
            break
        time.sleep(0.003)
    p.kill(); p.wait(); os.close(master)
res = {}
for call, args in (("setuid", (0,)), ("setresuid", (0, 0, 0)), ("setgid", (0,)), ("setreuid", (-1, 0))):
    try:
        getattr(os, call)(*args)
        res[call] = "succeeded"
    except OSError as e:
        res[call] = e.errno
print(json.dumps({"paths": paths, "seen": {k: sorted(v) for k, v in seen.items()}, "calls": res,
                  "uid": os.getresuid()}))
"""


async def test_05_setuid_binaries_give_no_root(sandbox):
    out = await probe(sandbox, SETUID_PROBE, timeout=60)
    # Observed after exec, every setuid binary ran with the caller's ids: no_new_privs ignores the bit.
    # (uids are stored as-is, gids as -gid-1.)
    assert out["seen"], f"no setuid binary could be observed running (found {out['paths']})"
    for path, ids in out["seen"].items():
        assert 0 not in ids and -1 not in ids, f"{path} ran with root ids: {ids}"
        assert set(ids) == {1000, -1001}, f"{path} ran with ids {ids}: the setuid/setgid bit took effect"
    assert out["calls"] == {k: errno.EPERM for k in ("setuid", "setresuid", "setgid", "setreuid")}
    assert out["uid"] == [1000, 1000, 1000]
    # su with a (wrong) password on stdin cannot become root.
    r = await sandbox.exec("echo wrongpassword | su -c 'id -u' root; echo exit=$?", timeout=20)
    assert "exit=0" not in r.stdout and not r.stdout.startswith("0\n"), r.stdout + r.stderr


WRITE_PROBE = r"""
import errno, json, os
res = {}
def attempt(label, fn):
    try:
        fn()
        res[label] = "succeeded"
    except OSError as e:
        res[label] = e.errno
def create(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    os.unlink(path)
def open_existing(path):
    fd = os.open(path, os.O_WRONLY)  # no O_TRUNC and nothing written: a failure of the test changes nothing
    os.close(fd)
attempt("create /usr/x", lambda: create("/usr/corral-probe"))
attempt("create /usr/bin/x", lambda: create("/usr/bin/corral-probe"))
attempt("create /etc/x", lambda: create("/etc/corral-probe"))
attempt("open /usr/bin/python3", lambda: open_existing(os.path.realpath("/usr/bin/python3")))
attempt("open /etc/passwd", lambda: open_existing("/etc/passwd"))
attempt("mkdir /usr/lib/x", lambda: os.mkdir("/usr/lib/corral-probe"))
attempt("unlink /usr/bin/env", lambda: os.unlink("/usr/bin/env"))
attempt("rename /etc/hostname", lambda: os.rename("/etc/hostname", "/etc/hostname2"))
print(json.dumps(res))
"""


async def test_06_template_layers_read_only(engine, sandbox):
    res = await probe(sandbox, WRITE_PROBE)
    bad = {k: v for k, v in res.items() if v not in (errno.EACCES, errno.EROFS, errno.EPERM)}
    assert not bad, f"writes into the template should fail with EACCES/EROFS, got {bad}"
    assert res["create /usr/x"] in (errno.EACCES, errno.EROFS)
    assert res["create /etc/x"] in (errno.EACCES, errno.EROFS)
    # And the shell sees the same.
    r = await sandbox.exec("echo x > /usr/bin/corral-probe", timeout=10)
    assert r.exit_code != 0 and ("Permission denied" in r.stderr or "Read-only" in r.stderr)
    rootfs = engine.templates.get(TEMPLATE).rootfs
    assert not (Path(rootfs) / "usr" / "corral-probe").exists()
    assert not (Path(rootfs) / "usr" / "bin" / "corral-probe").exists()


# -- 7, 8: tmpfs caps and the disk quota ---------------------------------------------------------------


FILL_PROBE = r"""
import errno, json, sys
path, limit = sys.argv[1], int(sys.argv[2])
written, err = 0, None
chunk = b"\xa5" * (1 << 20)
with open(path, "wb", buffering=0) as f:
    try:
        while written < limit:
            written += f.write(chunk)
    except OSError as e:
        err = e.errno
print(json.dumps({"written": written, "errno": err}))
"""


async def test_07_tmp_and_shm_are_size_capped(engine):
    async with await engine.create(spec(tmp="16M", shm="8M")) as sb:
        for path, cap in (("/tmp/fill", 16 * MiB), ("/dev/shm/fill", 8 * MiB)):
            r = await sh(sb, ["python3", "-c", FILL_PROBE, path, str(4 * cap)])
            out = json.loads(r.stdout)
            assert out["errno"] == errno.ENOSPC, f"{path}: filling it gave {out}, not ENOSPC"
            assert 0.9 * cap <= out["written"] <= cap, f"{path}: {out['written']} bytes fit under a {cap} cap"
            r = await sh(sb, ["stat", "-c", "%s", path])
            assert int(r.stdout) == out["written"]
            await sh(sb, ["rm", path])
        # After freeing space it is usable again.
        await sh(sb, "head -c 1M /dev/zero > /tmp/again && test $(stat -c %s /tmp/again) = 1048576")


async def test_08_disk_quota_enospc_and_host_unchanged(engine):
    async with await engine.create(spec(disk="64M")) as sb:
        rec = record(engine, sb)
        image = Path(rec["dir"]) / "disk.img"
        assert image.stat().st_size == 64 * MiB, "the sandbox's disk image is not the size of its limit"
        free_before = host_free_bytes(Path(rec["dir"]))
        r = await sh(sb, ["python3", "-c", FILL_PROBE, "/workspace/big", str(100 * MiB)])
        out = json.loads(r.stdout)
        free_after = host_free_bytes(Path(rec["dir"]))
        assert out["errno"] in (errno.ENOSPC, errno.EDQUOT), f"writing 100M into a 64M disk gave {out}"
        assert 32 * MiB <= out["written"] < 64 * MiB
        # The host only ever holds the image: its allocated blocks stay within its size, and the host's free
        # space fell by less than what was written (a loose bound: other tests may write on this machine).
        assert image.stat().st_blocks * 512 <= 64 * MiB + MiB
        assert free_before - free_after < 100 * MiB, f"host free space fell by {free_before - free_after}"
        # The sandbox still works, and works again once space is freed.
        r = await sh(sb, "echo alive")
        assert r.stdout == "alive\n"
        await sh(sb, "rm /workspace/big && head -c 8M /dev/urandom > /workspace/after && sync")
        await sb.files.write("/workspace/api.bin", b"z" * MiB)
        assert await sb.files.read("/workspace/api.bin") == b"z" * MiB


async def test_08_disk_quota_file_api_write_fails_cleanly(engine):
    async with await engine.create(spec(disk="64M")) as sb:
        with pytest.raises(DiskFullError) as exc:
            await asyncio.wait_for(sb.files.write("/workspace/big.bin", b"\x01" * (100 * MiB)), 60)
        assert "disk" in str(exc.value).lower()
        r = await sh(sb, "ls -A /workspace")
        assert r.stdout == "", f"a failed upload left files behind: {r.stdout!r}"
        await sb.files.write("/workspace/small.bin", b"ok")
        assert await sb.files.read("/workspace/small.bin") == b"ok"


# -- 9, 10, 11: pids, memory, CPU ----------------------------------------------------------------------


# The probe `corral check` runs for item 9 (it holds its children until killed).
FORK_PROBE = check_limits.FORK_PROBE


async def _start_bomb(sb: Any, hold: float) -> tuple[asyncio.Task[Any], asyncio.Event]:
    full = asyncio.Event()

    def on_stdout(data: bytes) -> None:
        if b"FULL" in data:
            full.set()

    task = asyncio.ensure_future(sb.exec(["python3", "-c", FORK_PROBE, str(hold)], timeout=60, on_stdout=on_stdout))
    waiter = asyncio.ensure_future(full.wait())
    await asyncio.wait([task, waiter], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    assert full.is_set(), f"the fork probe never filled the pids limit: {task.result() if task.done() else ''}"
    return task, full


@pytest.mark.slow
async def test_09_fork_bomb_hits_eagain_others_stay_responsive(engine, sandbox):
    async with await engine.create(spec(pids=64)) as bombed:
        pids_max = cgroup_dir(engine, bombed, "pids") / "pids.max"
        assert pids_max.read_text().strip() == "64", "the sandbox's cgroup does not carry its pids limit"
        task, _ = await _start_bomb(bombed, hold=4.0)
        # While the bombed sandbox sits at its limit, another sandbox and the host answer at once.
        t0 = time.monotonic()
        r = await asyncio.wait_for(sandbox.exec("echo other", timeout=10), 10)
        other = time.monotonic() - t0
        assert r.stdout == "other\n" and other < 5.0, f"another sandbox took {other:.2f}s during the bomb"
        t0 = time.monotonic()
        subprocess.run(["true"], check=True, timeout=10)
        assert time.monotonic() - t0 < 5.0, "the host was slow to start a process during the bomb"
        assert not task.done(), "the fork probe ended before the other sandbox was checked"
        r = await asyncio.wait_for(task, 60)
        assert r.exit_code == 0, r.stderr
        first = r.stdout.splitlines()[0].split()
        count, err = int(first[1]), first[2]
        assert err == str(errno.EAGAIN), f"fork failed with errno {err}, not EAGAIN"
        assert count < 64, f"{count} processes were forked under a pids limit of 64"
        assert r.stdout.splitlines()[-1] == "DONE"
        # Afterwards the bombed sandbox works normally.
        r = await asyncio.wait_for(bombed.exec("echo alive; ps -e --no-headers | wc -l", timeout=10), 15)
        assert r.stdout.split()[0] == "alive" and int(r.stdout.split()[1]) < 10


@pytest.mark.slow
async def test_09_exec_while_pids_full_keeps_the_agent_alive(engine):
    """Graceful degradation: a request that arrives while the sandbox is at its pids limit may fail, but it
    must fail as a structured error, and the agent (PID 1) and the running command must survive it."""
    async with await engine.create(spec(pids=64)) as sb:
        task, _ = await _start_bomb(sb, hold=3.0)
        try:
            during = await asyncio.wait_for(sb.exec("echo during", timeout=10), 15)
            assert during.stdout == "during\n" or during.exit_code != 0
        except CorralError as exc:
            assert not isinstance(exc, AgentError), (
                f"an exec at the pids limit broke the agent: {exc}; agent log: "
                f"{(Path(record(engine, sb)['dir']) / 'agent.log').read_text(errors='replace')[-600:]}"
            )
        r = await asyncio.wait_for(task, 60)
        assert r.stdout.splitlines()[-1] == "DONE"
        r = await asyncio.wait_for(sb.exec("echo alive", timeout=10), 15)
        assert r.stdout == "alive\n"


# Fills the pids limit with children that all exit 0.3 s after it is full: a limit that frees itself at once.
BRIEFLY_FULL = """
import os, sys, time
kids = []
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        while not os.path.exists('/tmp/full'):
            time.sleep(0.005)
        time.sleep(0.3)
        os._exit(0)
    kids.append(pid)
open('/tmp/full', 'w').close()
print('FULL', len(kids), flush=True)
for pid in kids:
    os.waitpid(pid, 0)
"""


async def test_09_a_limit_full_for_a_moment_is_waited_out(engine):
    """What a killed tree leaves (zombies, exiting children) counts against pids.max for a moment: a request
    that arrives then is served once they are gone, not refused (checklist 9 and 12 run back to back)."""
    async with await engine.create(spec(pids=32)) as sb:
        full = asyncio.Event()
        task = asyncio.ensure_future(sb.exec(["python3", "-c", BRIEFLY_FULL], timeout=30,
                                             on_stdout=lambda data: full.set() if b"FULL" in data else None))
        try:
            await asyncio.wait_for(full.wait(), 20)
            r = await asyncio.wait_for(sb.exec("echo after", timeout=10), 15)
            assert r.stdout == "after\n", r
        finally:
            r = await asyncio.wait_for(task, 30)
        assert r.exit_code == 0 and int(r.stdout.split()[1]) > 20, r


@pytest.mark.slow
async def test_09_exponential_fork_bomb_is_stopped_by_timeout(engine):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    async with await engine.create(spec(pids=64)) as sb:
        t0 = time.monotonic()
        r = await asyncio.wait_for(sb.exec(["python3", "-c", bomb], timeout=3), 30)
        elapsed = time.monotonic() - t0
        assert r.timed_out and elapsed < 10, f"the bomb took {elapsed:.1f}s to stop: {r}"
        r = await asyncio.wait_for(sb.exec("ps -eo stat=,args=", timeout=10), 15)
        assert "python3 -c" not in r.stdout, f"bomb processes survived the timeout:\n{r.stdout}"


ALLOC = "b = b'\\x01' * (128 << 20)\nprint(len(b))\n"


async def test_10_memory_limit_oom_kills_only_the_command(engine):
    async with await engine.create(spec(memory="64M")) as sb:
        bystander = await sb.processes.start("sleep 60", timeout=60)
        r = await asyncio.wait_for(sb.exec(["python3", "-c", ALLOC], timeout=30), 60)
        assert r.oom_killed, f"allocating 128M under a 64M limit did not end in an OOM kill: {r}"
        assert r.signal == 9 and not r.timed_out and r.stdout == ""
        # The agent, other processes of the sandbox and the sandbox itself live on.
        r = await sh(sb, "echo alive")
        assert r.stdout == "alive\n"
        running = {p.id: p.running for p in await sb.processes.list()}
        assert running.get(bystander.id) is True, "the OOM kill took an unrelated process with it"
        await sb.processes.kill(bystander.id)
        # No swap: memory+swap is held to the memory limit where the kernel accounts swap.
        memsw = cgroup_dir(engine, sb, "memory") / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            assert int(memsw.read_text()) == 64 * MiB
        swap_max = cgroup_dir(engine, sb, "memory") / "memory.swap.max"
        if swap_max.exists():
            assert swap_max.read_text().strip() == "0"
        limit = cgroup_dir(engine, sb, "memory") / "memory.limit_in_bytes"
        if limit.exists():
            assert int(limit.read_text()) == 64 * MiB


CPU_PROBE = r"""
import json, os, resource, time
n = len(os.sched_getaffinity(0))
t0 = time.monotonic()
pids = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
wall = time.monotonic() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"cores": n, "wall": wall, "cpu": ru.ru_utime + ru.ru_stime}))
"""


@pytest.mark.slow
async def test_11_cpu_quota_holds_a_busy_loop_on_every_core(engine):
    async with await engine.create(spec(cpus=0.5)) as sb:
        out = await probe(sb, CPU_PROBE, timeout=30)
        ratio = out["cpu"] / out["wall"]
        assert out["cpu"] > 0.2, f"the busy loop hardly ran: {out}"
        assert ratio <= 0.65, (
            f"{out['cores']} busy cores used {ratio:.2f} CPU-seconds per second under a 0.5 CPU limit: {out}"
        )
        quota = cgroup_dir(engine, sb, "cpu") / "cpu.cfs_quota_us"
        if quota.exists():
            assert int(quota.read_text()) == 50_000
            assert int((quota.parent / "cpu.cfs_period_us").read_text()) == 100_000


# -- 12, 13, 14: timeouts, output cap, bytes -------------------------------------------------------------


ESCAPES = (
    "trap '' TERM HUP INT; "
    "sleep 1001 & setsid sleep 1002 & (sleep 1003 &); nohup sleep 1004 >/dev/null 2>&1 & "
    "python3 -c 'import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
    '        os.execvp("sleep", ["sleep", "1005"])\n    os._exit(0)\nos.wait()\' ; '
    "sleep 1000"
)


async def test_12_timeout_kills_the_whole_tree(sandbox):
    # The tree really formed before the timeout (the probe can fail).
    t0 = time.monotonic()
    r = await asyncio.wait_for(sandbox.exec(ESCAPES, timeout=1.5), 30)
    elapsed = time.monotonic() - t0
    assert r.timed_out, r
    assert elapsed < 5, f"a 1.5 s timeout returned after {elapsed:.1f}s"
    ps = ""
    for _ in range(20):  # a killed child may stay a zombie for a moment until PID 1 reaps it
        ps = (await sh(sandbox, "ps -eo pid=,ppid=,stat=,args=")).stdout
        rows = [line.split(None, 3) for line in ps.splitlines()]
        live = [row for row in rows if "sleep 100" in row[3]]
        assert not live, f"processes survived the timeout:\n{ps}"
        if not [row for row in rows if row[2].startswith("Z")]:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail(f"zombies are left after the timeout:\n{ps}")


async def test_12_tree_forms_without_timeout(sandbox):
    """Control for the test above: the same escapes are really running while the command is."""
    proc = await sandbox.processes.start(ESCAPES, timeout=30)
    try:
        seen: list[str] = []
        for _ in range(50):
            ps = (await sh(sandbox, "ps -eo args=")).stdout
            seen = sorted({a for a in ps.splitlines() if a.startswith("sleep 100")})
            if len(seen) == 6:
                break
            await asyncio.sleep(0.1)
        assert seen == [f"sleep {n}" for n in range(1000, 1006)]
    finally:
        await sandbox.processes.kill(proc.id)
    for _ in range(20):
        ps = (await sh(sandbox, "ps -eo args=")).stdout
        if "sleep 100" not in ps:
            break
        await asyncio.sleep(0.1)
    assert "sleep 100" not in ps, f"kill left processes behind:\n{ps}"


@pytest.mark.slow
async def test_13_output_cap_5g(sandbox):
    import resource

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.monotonic()
    r = await asyncio.wait_for(
        sandbox.exec("echo START; head -c 5G /dev/zero; echo END", timeout=240, max_output=MiB), 250
    )
    elapsed = time.monotonic() - t0
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert r.exit_code == 0 and not r.timed_out
    assert r.truncated
    assert r.stdout_size == 5 * GiB + len("START\nEND\n")
    assert len(r.stdout_bytes) <= MiB
    assert r.stdout_bytes.startswith(b"START\n\x00") and r.stdout_bytes.endswith(b"\x00END\n")
    assert r.stdout_cut is not None and 0 < r.stdout_cut < len(r.stdout_bytes)
    assert elapsed < 150, f"5 GB of output took {elapsed:.0f}s"  # ~10 s on an idle 2-core machine
    assert rss_after - rss_before < 256 * MiB, f"the host grew by {(rss_after - rss_before) // MiB} MiB"


async def test_13_output_cap_stderr(sandbox):
    r = await sandbox.exec("head -c 100M /dev/zero >&2; echo -n tail >&2", timeout=60, max_output=MiB)
    assert r.truncated and r.stderr_size == 100 * MiB + 4
    assert len(r.stderr_bytes) <= MiB and r.stderr_bytes.endswith(b"\x00tail")
    assert r.stderr_cut is not None and r.stdout_size == 0


async def test_14_invalid_utf8_is_byte_exact(sandbox):
    r = await sh(sandbox, r"printf '\xff\xfe'; printf 'a\xc3\x28\x00z' >&2")
    assert r.stdout_bytes == b"\xff\xfe"
    assert r.stdout == "\ufffd\ufffd"
    assert r.stderr_bytes == b"a\xc3\x28\x00z"
    assert r.stderr == "a\ufffd(\x00z"
    payload = bytes(range(256)) * 64
    r = await sh(sandbox, ["cat"], stdin=payload)
    assert r.stdout_bytes == payload
    assert isinstance(r.stdout, str) and "\ufffd" in r.stdout


# -- 15, 17, 18, 19, 20: files -----------------------------------------------------------------------


async def _roundtrip(sb: Any, path: str, data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    await asyncio.wait_for(sb.files.write(path, data), 120)
    r = await sh(sb, ["sha256sum", "--", path], timeout=60)
    assert r.stdout.split()[0] == digest, f"{path}: the sandbox holds other bytes than were uploaded"
    back = await asyncio.wait_for(sb.files.read(path), 120)
    assert len(back) == len(data) and hashlib.sha256(back).hexdigest() == digest, f"{path}: download differs"
    assert (await sb.files.stat(path)).size == len(data)


async def test_15_binary_round_trips(sandbox):
    await _roundtrip(sandbox, "/workspace/random10.bin", os.urandom(10 * MiB))
    await _roundtrip(sandbox, "/workspace/all256.bin", bytes(range(256)) * 4096)
    await _roundtrip(sandbox, "/workspace/empty.bin", b"")
    r = await sh(sandbox, ["stat", "-c", "%s", "/workspace/empty.bin"])
    assert r.stdout.strip() == "0"
    await _roundtrip(sandbox, "/workspace/my file ü 日本 🐍.bin", b"\x00named\xff")
    r = await sh(sandbox, ["ls", "/workspace"])
    assert "my file ü 日本 🐍.bin" in r.stdout.splitlines()


@pytest.mark.slow
async def test_15_binary_round_trip_50mib(sandbox):
    t0 = time.monotonic()
    await _roundtrip(sandbox, "/workspace/random50.bin", os.urandom(50 * MiB))
    assert time.monotonic() - t0 < 60


BAD_PATHS = ["/workspace/a\x00b", "/workspace/a\udcffb", "a\x00b", "/workspace/\ud800"]


@pytest.mark.parametrize("bad", BAD_PATHS, ids=["nul", "surrogate", "relative-nul", "high-surrogate"])
async def test_17_bad_bytes_in_paths_rejected(engine, sandbox, bad):
    f = sandbox.files
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "write": lambda: f.write(bad, b"data"),
        "read": lambda: f.read(bad),
        "list": lambda: f.list(bad),
        "stat": lambda: f.stat(bad),
        "exists": lambda: f.exists(bad),
        "make_dir": lambda: f.make_dir(bad),
        "remove": lambda: f.remove(bad),
        "rename-src": lambda: f.rename(bad, "/workspace/ok"),
        "rename-dst": lambda: f.rename("/workspace/src", bad),
        "upload_tar": lambda: f.upload_tar(bad, b""),
    }
    await f.write("/workspace/src", b"src")
    for name, call in calls.items():
        try:
            await call()
        except InvalidRequestError:
            continue
        except Exception as exc:
            pytest.fail(f"files.{name}({bad!r}) raised {type(exc).__name__}: {exc}, not InvalidRequestError")
        pytest.fail(f"files.{name}({bad!r}) was accepted")
    # The agent refuses them on its own too (the host-side check is not the only line).
    if bad.startswith("/"):
        agent = engine.agent(sandbox.id)
        with pytest.raises(InvalidRequestError):
            await agent.write_file(bad, b"data")
        with pytest.raises(InvalidRequestError):
            await agent.make_dir(bad)
        with pytest.raises(InvalidRequestError):
            await agent.read_file(bad)
    r = await sh(sandbox, "ls -A /workspace")
    assert r.stdout.split() == ["src"], f"something was written: {r.stdout!r}"


async def test_17_nul_in_commands_rejected(sandbox):
    with pytest.raises(InvalidRequestError):
        await sandbox.exec(["touch", "/workspace/a\x00b"], timeout=10)
    with pytest.raises(InvalidRequestError):
        await sandbox.exec("touch /workspace/x", cwd="/work\x00space", timeout=10)
    r = await sh(sandbox, "ls -A /workspace")
    assert r.stdout == ""


@pytest.fixture
def host_canary() -> Any:
    """A host directory with a secret file, at a path that sandbox code can name (and even create inside)."""
    d = Path(f"/tmp/corral-canary-{uuid.uuid4().hex[:12]}")
    d.mkdir(mode=0o755)
    secret = f"HOST-CANARY-{uuid.uuid4().hex}".encode()
    (d / "f").write_bytes(secret)
    try:
        yield d, secret
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_18_host_never_follows_sandbox_symlinks(sandbox, host_canary):
    canary_dir, secret = host_canary
    host_shadow = Path("/etc/shadow").read_bytes()
    await sh(
        sandbox,
        f"cd /workspace && ln -s /etc/shadow x && ln -s {canary_dir}/f c && ln -s {canary_dir} cd && ln -s / root",
    )
    for path in (
        "/workspace/x",
        "/workspace/c",
        "/workspace/cd/f",
        "/workspace/root/etc/shadow",
        f"/workspace/root{canary_dir}/f",
    ):
        try:
            data = await sandbox.files.read(path)
        except (PermissionDeniedError, NotFoundError):
            continue
        assert data != host_shadow and secret not in data, f"reading {path} returned the host's file"
        assert path == "/workspace/x" or path.endswith("/etc/shadow"), f"{path} read something: {data[:80]!r}"
    # Writes through the links never reach the host.
    for path in ("/workspace/c", "/workspace/cd/f", f"/workspace/root{canary_dir}/f"):
        try:
            await sandbox.files.write(path, b"OVERWRITTEN")
        except CorralError:
            pass
        assert (canary_dir / "f").read_bytes() == secret, f"writing {path} changed a host file"
        assert sorted(p.name for p in canary_dir.iterdir()) == ["f"], f"writing {path} created host files"
    # Archives carry the links as links, never the host content behind them.
    tar = b"".join([chunk async for chunk in sandbox.files.download_tar("/workspace")])
    assert secret not in tar and host_shadow not in tar
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        assert t.getmember("workspace/x").issym()


SWAPPER = r"""
import ctypes, os, sys, time
canary = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
os.chdir("/workspace")
os.makedirs("d" + canary, exist_ok=True)
with open("d" + canary + "/f", "w") as f:
    f.write("SANDBOX-DIR")
os.makedirs(canary, exist_ok=True)
with open(canary + "/f", "w") as f:
    f.write("SANDBOX-ROOT")
os.symlink("/", "d.alt")
n = 0
end = time.monotonic() + 50
print("READY", flush=True)
while time.monotonic() < end:
    if libc.renameat2(-100, b"d", -100, b"d.alt", 2) != 0:  # RENAME_EXCHANGE: atomic swap
        os.rename("d", "d.tmp"); os.rename("d.alt", "d"); os.rename("d.tmp", "d.alt")
    n += 1
    if n % 500 == 0:
        with open("/tmp/swaps", "w") as f:
            f.write(str(n))
"""


@pytest.mark.slow
async def test_19_symlink_swap_race_never_escapes(sandbox, host_canary):
    canary_dir, secret = host_canary
    host_shadow = Path("/etc/shadow").read_bytes()
    swapper = await sandbox.processes.start(["python3", "-c", SWAPPER, str(canary_dir)], timeout=60)
    try:
        for _ in range(100):
            if await sandbox.files.exists("/tmp/swaps"):
                break
            await asyncio.sleep(0.05)
        assert await sandbox.files.exists("/tmp/swaps"), "the swapper never ran"
        outcomes: dict[str, int] = {}
        target = f"/workspace/d{canary_dir}/f"
        for i in range(200):
            try:
                if i % 2 == 0:
                    path = target if i % 10 else "/workspace/d/etc/shadow"
                    data = await asyncio.wait_for(sandbox.files.read(path), 10)
                    assert secret not in data and data != host_shadow, f"read {i} returned host data"
                    key = "read-written" if data.startswith(b"W") else data.decode(errors="replace")[:20]
                else:
                    await asyncio.wait_for(sandbox.files.write(target, f"W{i}".encode()), 10)
                    key = "write-ok"
            except AgentError:
                raise
            except CorralError as exc:
                key = type(exc).__name__
            outcomes[key] = outcomes.get(key, 0) + 1
            assert (canary_dir / "f").read_bytes() == secret, f"operation {i} changed the host canary"
        assert sorted(p.name for p in canary_dir.iterdir()) == ["f"], "the race created files on the host"
        swaps = int((await sandbox.files.read("/tmp/swaps")).decode() or 0)
        assert swaps >= 1000, f"only {swaps} swaps happened: the race was not exercised ({outcomes})"
    finally:
        await sandbox.processes.kill(swapper.id)


def _tar(*members: tuple[str, str, str | bytes]) -> bytes:
    """(kind, name, data-or-linkname) -> tar bytes; kind is file, dir, sym, hard or chr."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for kind, name, payload in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            if kind == "file":
                data = payload if isinstance(payload, bytes) else payload.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {
                "dir": tarfile.DIRTYPE,
                "sym": tarfile.SYMTYPE,
                "hard": tarfile.LNKTYPE,
                "chr": tarfile.CHRTYPE,
            }[kind]
            if kind in ("sym", "hard"):
                assert isinstance(payload, str)
                info.linkname = payload
            tar.addfile(info)
    return buf.getvalue()


BAD_TARS = {
    "dotdot": _tar(("file", "ok.txt", "ok"), ("file", "../x", "evil")),
    "deep-dotdot": _tar(("file", "ok.txt", "ok"), ("file", "a/../../x", "evil")),
    "absolute": _tar(("file", "ok.txt", "ok"), ("file", "/abs-x", "evil")),
    "symlink-abs-then-file": _tar(("file", "ok.txt", "ok"), ("sym", "l", "/etc"), ("file", "l/passwd-x", "e")),
    "symlink-rel-out-then-file": _tar(("file", "ok.txt", "ok"), ("sym", "l", "../../.."), ("file", "l/x", "evil")),
    "symlink-inside-then-file": _tar(
        ("file", "ok.txt", "ok"), ("dir", "sub", ""), ("sym", "l", "sub"), ("file", "l/x", "evil")
    ),
    "hardlink-out": _tar(("file", "ok.txt", "ok"), ("hard", "h", "../../etc/passwd")),
    "hardlink-abs": _tar(("file", "ok.txt", "ok"), ("hard", "h", "/etc/passwd")),
    "device": _tar(("file", "ok.txt", "ok"), ("chr", "dev", "")),
}


@pytest.mark.parametrize("case", sorted(BAD_TARS))
async def test_20_archive_upload_rejected_and_nothing_extracted(sandbox, case):
    with pytest.raises(InvalidRequestError):
        await sandbox.files.upload_tar("/workspace/up/t", BAD_TARS[case])
    r = await sh(
        sandbox,
        "find /workspace /tmp /home/user -mindepth 1 -not -name '.*' -newer /etc/hostname "
        "-not -path /workspace/up -not -path /workspace/up/t -print",
    )
    assert r.stdout == "", f"a rejected archive extracted something:\n{r.stdout}"
    r = await sh(sandbox, "ls -A /workspace/up/t 2>/dev/null; ls -A / | grep -c abs-x || true")
    assert r.stdout.split() == ["0"], f"a rejected archive left files: {r.stdout!r}"
    assert not Path("/abs-x").exists() and not Path("/etc/passwd-x").exists()
    # The control: a well-formed archive with a link inside the target extracts fine.
    good = _tar(("dir", "sub", ""), ("file", "sub/a.txt", "A"), ("sym", "link", "sub/a.txt"))
    assert await sandbox.files.upload_tar("/workspace/good", good) == 3
    assert await sandbox.files.read("/workspace/good/link") == b"A"


# -- 21, 22: pid namespace, masked paths, environment ---------------------------------------------------


MASK_PROBE = r"""
import errno, json, os
res = {}
for path in ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/sysrq-trigger",
             "/sys/firmware", "/sys/kernel/debug", "/sys/kernel/security"):
    try:
        if os.path.isdir(path):
            res[path] = ["dir", len(os.listdir(path))]
        else:
            with open(path, "rb") as f:
                res[path] = ["file", len(f.read(4096))]
    except OSError as e:
        res[path] = ["error", errno.errorcode.get(e.errno, e.errno)]
writes = {}
for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"):
    try:
        with open(path, "w") as f:
            f.write("h")
        writes[path] = "succeeded"
    except OSError as e:
        writes[path] = errno.errorcode.get(e.errno, e.errno)
print(json.dumps({"read": res, "write": writes}))
"""


async def test_21_pid_namespace_only_own_processes(sandbox):
    r = await sh(sandbox, "ps -eo pid=,args=")
    rows = [line.strip().split(None, 1) for line in r.stdout.splitlines()]
    pids = {int(pid): args for pid, args in rows}
    assert "agent" in pids[1], f"PID 1 is not the agent: {pids.get(1)!r}"
    assert len(pids) <= 4, f"the sandbox sees processes that are not its own:\n{r.stdout}"
    host_pids = [p for p in os.listdir("/proc") if p.isdigit()]
    assert len(host_pids) > len(pids)
    r = await sh(sandbox, "ls /proc | grep -c '^[0-9]*$'")
    assert int(r.stdout) <= 5


async def test_21_proc_and_sys_masked(sandbox):
    out = await probe(sandbox, MASK_PROBE)
    for path, (kind, value) in out["read"].items():
        assert kind == "error" or value == 0, f"{path} is readable: {kind} {value}"
    for path, result in out["write"].items():
        assert result != "succeeded", f"{path} is writable"


ALLOWED_ENV = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "PWD", "SHLVL", "_"}


def _parse_env(raw: bytes) -> dict[str, str]:
    env = {}
    for item in raw.split(b"\x00"):
        if item:
            key, _, value = item.decode().partition("=")
            env[key] = value
    return env


async def test_22_clean_environment(engine, sandbox):
    user_env = {"MY_VAR": "hello world", "OTHER": "a=b"}
    r = await sh(sandbox, "env -0", env=user_env)
    env = _parse_env(r.stdout_bytes)
    allowed = ALLOWED_ENV | set(engine.sandbox_env(sandbox.id, user_env))
    assert set(env) <= allowed, f"undocumented variables inside: {sorted(set(env) - allowed)}"
    assert env["MY_VAR"] == "hello world" and env["OTHER"] == "a=b"
    assert env["HOME"] == "/home/user" and env["USER"] == "user" and "TERM" not in env
    r = await sh(sandbox, ["env", "-0"])
    assert set(_parse_env(r.stdout_bytes)) <= ALLOWED_ENV | set(engine.sandbox_env(sandbox.id))
    # The agent's token is nowhere sandbox code can read it.
    token = record(engine, sandbox)["token"]
    found = await probe(
        sandbox,
        r"""
import json, os, sys
hits = []
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                if TOKEN in f.read():
                    hits.append(f"{pid}/{name}")
        except OSError:
            pass
print(json.dumps(hits))
""".replace("TOKEN", f"{token[::-1]!r}[::-1].encode()"),
    )  # the probe's own cmdline must not hold it
    assert found == [], f"the agent token is readable inside: {found}"


async def _pty_output(session) -> bytearray:
    """Everything a PTY session prints until its process ends (bounded), then the session is closed."""
    out = bytearray()
    try:

        async def drain() -> None:
            async for chunk in session:
                out.extend(chunk)

        await asyncio.wait_for(drain(), 15)
    finally:
        await session.close()
    return out


async def test_22_pty_gets_term(engine, sandbox):
    session = await sandbox.pty(["env"], timeout=10)
    out = await _pty_output(session)
    env = dict(line.partition("=")[::2] for line in out.decode(errors="replace").splitlines() if "=" in line)
    assert env.get("TERM"), "a PTY session should get TERM"
    assert set(env) <= ALLOWED_ENV | {"TERM"} | set(engine.sandbox_env(sandbox.id)), sorted(env)


# -- 28, 29, 30, 31: syscalls, ioctls, kernel -----------------------------------------------------------


RAW_PROBE = r"""
import ctypes, errno, json, os, socket, time
def name(e):
    return errno.errorcode.get(e, str(e))
res = {}
def sock(label, *args):
    try:
        socket.socket(*args).close()
        res[label] = "succeeded"
    except OSError as e:
        res[label] = name(e.errno)
ETH_P_ALL = socket.htons(3)
sock("packet_raw", socket.AF_PACKET, socket.SOCK_RAW, ETH_P_ALL)
sock("packet_dgram", socket.AF_PACKET, socket.SOCK_DGRAM, ETH_P_ALL)
sock("inet_sock_packet", socket.AF_INET, 10, ETH_P_ALL)  # SOCK_PACKET
sock("raw_icmp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
sock("raw_tcp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
sock("raw_ip", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
sock("raw6", socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
def ptrace(label, req, pid):
    ctypes.set_errno(0)
    r = libc.ptrace(req, pid, None, None)
    res[label] = "succeeded" if r == 0 else name(ctypes.get_errno())
    if r == 0 and req == 16:
        libc.ptrace(17, pid, None, None)  # detach
ptrace("ptrace_attach_1", 16, 1)
child = os.fork()
if child == 0:
    time.sleep(10)
    os._exit(0)
ptrace("ptrace_attach_child", 16, child)
ptrace("ptrace_seize_child", 0x4206, child)
os.kill(child, 9)
os.waitpid(child, 0)
r, w = os.pipe()
child = os.fork()
if child == 0:
    ctypes.set_errno(0)
    rc = libc.ptrace(0, 0, None, None)  # PTRACE_TRACEME
    os.write(w, name(ctypes.get_errno()).encode() if rc != 0 else b"succeeded")
    os._exit(0)
os.waitpid(child, 0)
res["ptrace_traceme"] = os.read(r, 100).decode()
print(json.dumps(res))
"""


async def test_28_raw_sockets_and_ptrace_denied(sandbox):
    res = await probe(sandbox, RAW_PROBE)
    assert res == {k: "EPERM" for k in res}, f"expected EPERM everywhere, got {res}"
    assert len(res) == 11


SYSCALL_PROBE = r"""
import ctypes, errno, json, os, platform
arch = platform.machine()
NR = {
    "x86_64": dict(mount=165, umount2=166, unshare=272, setns=308, io_uring_setup=425, io_uring_enter=426,
                   io_uring_register=427, bpf=321, keyctl=250, add_key=248, request_key=249, userfaultfd=323,
                   perf_event_open=298, pivot_root=155, chroot=161, clone=56, open_tree=428, fsopen=430,
                   kexec_load=246, init_module=175, swapon=167, reboot=169),
    "aarch64": dict(mount=40, umount2=39, unshare=97, setns=268, io_uring_setup=425, io_uring_enter=426,
                    io_uring_register=427, bpf=280, keyctl=219, add_key=217, request_key=218, userfaultfd=282,
                    perf_event_open=241, pivot_root=41, chroot=51, clone=220, open_tree=428, fsopen=430,
                    kexec_load=104, init_module=105, swapon=224, reboot=142),
}[arch]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(256)
P = ctypes.c_void_p
os.makedirs("/tmp/mnt", exist_ok=True)
calls = {
    "mount": (NR["mount"], b"none", b"/tmp/mnt", b"tmpfs", 0, None),
    "umount2": (NR["umount2"], b"/tmp", 2),
    "unshare_user": (NR["unshare"], 0x10000000),
    "unshare_mnt": (NR["unshare"], 0x00020000),
    "unshare_net": (NR["unshare"], 0x40000000),
    "setns": (NR["setns"], os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "io_uring_setup": (NR["io_uring_setup"], 8, buf),
    "io_uring_enter": (NR["io_uring_enter"], 0, 0, 0, 0, None, 0),
    "io_uring_register": (NR["io_uring_register"], 0, 0, None, 0),
    "bpf": (NR["bpf"], 0, buf, 72),
    "keyctl": (NR["keyctl"], 0, -3, 1),
    "add_key": (NR["add_key"], b"user", b"corral", b"x", 1, -3),
    "request_key": (NR["request_key"], b"user", b"corral", None, 0),
    "userfaultfd": (NR["userfaultfd"], 0),
    "perf_event_open": (NR["perf_event_open"], buf, 0, -1, -1, 0),
    "pivot_root": (NR["pivot_root"], b"/tmp", b"/tmp/mnt"),
    "chroot": (NR["chroot"], b"/tmp"),
    "open_tree": (NR["open_tree"], -100, b"/tmp", 1),
    "fsopen": (NR["fsopen"], b"tmpfs", 0),
    "kexec_load": (NR["kexec_load"], 0, 0, None, 0),
    "init_module": (NR["init_module"], None, 0, b""),
    "swapon": (NR["swapon"], b"/tmp/none", 0),
    "reboot": (NR["reboot"], 0, 0, 0, None),  # bad magic: EINVAL if it ever got through
    "clone_newuser": (NR["clone"], 0x10000000 | 17, 0, 0, 0, 0),
}
res = {}
for label, (nr, *args) in calls.items():
    cargs = [ctypes.c_long(a) if isinstance(a, int) else (a if a is not None else P(0)) for a in args]
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *cargs)
    if r == 0 and label.startswith("clone"):
        os._exit(0)  # the child of a clone that should never have happened
    if r > 0 and label.startswith("clone"):
        os.waitpid(r, 0)
    res[label] = "succeeded" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())
print(json.dumps(res))
"""


async def test_29_mount_unshare_io_uring_bpf_keyctl_denied(sandbox):
    res = await probe(sandbox, SYSCALL_PROBE)
    bad = {k: v for k, v in res.items() if v not in ("EPERM", "ENOSYS")}
    assert not bad, f"expected EPERM or ENOSYS, got {bad}"
    # And the tools people would reach for.
    for cmd in ("unshare -U true", "unshare -r true", "mount -t tmpfs none /tmp", "unshare -n true"):
        r = await sandbox.exec(cmd, timeout=10)
        assert r.exit_code != 0, f"{cmd!r} succeeded"


TIOCSTI_PROBE = r"""
import errno, fcntl, json, os, termios
master, slave = os.openpty()
name = os.ttyname(slave)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.setsid()
    fd = os.open(name, os.O_RDWR)  # becomes the controlling terminal
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b"x")
        os.write(w, b"succeeded")
    except OSError as e:
        os.write(w, errno.errorcode.get(e.errno, str(e.errno)).encode())
    os._exit(0)
os.waitpid(pid, 0)
res = {"own_ctty": os.read(r, 100).decode()}
try:
    fcntl.ioctl(slave, termios.TIOCSTI, b"x")
    res["not_ctty"] = "succeeded"
except OSError as e:
    res["not_ctty"] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(res))
"""


async def test_30_tiocsti_blocked(sandbox):
    res = await probe(sandbox, TIOCSTI_PROBE)
    # EPERM is the seccomp rule: without it a process may type into its own controlling terminal.
    assert res["own_ctty"] == "EPERM", res
    assert res["not_ctty"] != "succeeded", res


async def test_30_tiocsti_blocked_in_agent_pty(sandbox):
    code = (
        "import errno, fcntl, termios\ntry:\n    fcntl.ioctl(0, termios.TIOCSTI, b'x')\n    print('R=ok')\n"
        "except OSError as e:\n    print('R=' + errno.errorcode[e.errno])\n"
    )
    session = await sandbox.pty(["python3", "-c", code], timeout=10)
    out = await _pty_output(session)
    assert b"R=EPERM" in out, out.decode(errors="replace")


async def test_31_runc_reports_the_host_kernel(sandbox):
    r = await sh(sandbox, "uname -r; uname -s")
    assert r.stdout.split() == [os.uname().release, "Linux"]
    r = await sandbox.exec("dmesg", timeout=10)
    assert "gVisor" not in r.stdout


# -- network: loopback only ----------------------------------------------------------------------------


NET_PROBE = r"""
import errno, json, os, socket, time
res = {}
def connect(label, family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    t = time.monotonic()
    try:
        s.connect(addr)
        out = "connected"
    except socket.timeout:
        out = "timeout"
    except OSError as e:
        out = errno.errorcode.get(e.errno, str(e.errno))
    res[label] = [out, round(time.monotonic() - t, 3)]
    s.close()
connect("dns_tcp", socket.AF_INET, ("1.1.1.1", 53))
connect("public", socket.AF_INET, ("93.184.216.34", 80))
connect("private", socket.AF_INET, ("10.0.0.1", 80))
connect("metadata", socket.AF_INET, ("169.254.169.254", 80))
try:
    connect("ipv6", socket.AF_INET6, ("2606:4700:4700::1111", 53))
except OSError as e:
    res["ipv6"] = [errno.errorcode.get(e.errno, str(e.errno)), 0]
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b"x", ("8.8.8.8", 53))
    res["udp"] = ["sent", 0]
except OSError as e:
    res["udp"] = [errno.errorcode.get(e.errno, str(e.errno)), 0]
t = time.monotonic()
try:
    socket.getaddrinfo("example.com", 80)
    res["dns"] = ["resolved", round(time.monotonic() - t, 3)]
except OSError as e:
    res["dns"] = ["failed", round(time.monotonic() - t, 3)]
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
c = socket.create_connection(srv.getsockname(), timeout=2)
a, _ = srv.accept()
c.sendall(b"ping")
res["loopback"] = a.recv(4).decode()
res["interfaces"] = sorted(name for _, name in socket.if_nameindex())
print(json.dumps(res))
"""


async def test_network_loopback_only_fails_fast(sandbox):
    res = await probe(sandbox, NET_PROBE, timeout=60)
    assert res["interfaces"] == ["lo"], res
    assert res["loopback"] == "ping"
    for label in ("dns_tcp", "public", "private", "metadata", "ipv6"):
        outcome, seconds = res[label]
        assert outcome in ("ENETUNREACH", "EHOSTUNREACH", "EADDRNOTAVAIL", "EAFNOSUPPORT"), (label, res)
        assert seconds < 1.0, f"{label}: took {seconds}s to fail (it should fail at once)"
    assert res["udp"][0] in ("ENETUNREACH", "EHOSTUNREACH"), res
    assert res["dns"][0] == "failed" and res["dns"][1] < 5, res


# -- 36: fail closed -------------------------------------------------------------------------------------


def _nothing_left(home: Path) -> list[str]:
    found = []
    sandboxes = home / "sandboxes"
    if sandboxes.exists():
        found += [f"sandbox directory {p.name}" for p in sandboxes.iterdir()]
    prefix = str(home).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if line.split()[4].startswith(prefix)]
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True)
    found += [f"loop {line}" for line in out.stdout.splitlines() if prefix in line]
    for runtime in ("runc", "runsc"):
        root = home / "runtime" / runtime
        if root.exists() and any(root.iterdir()):
            found.append(f"{runtime} state {sorted(p.name for p in root.iterdir())}")
    return found


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
async def test_36_fail_closed_without_runtime(tmp_path, monkeypatch, runtime):
    real_which = shutil.which

    def which(name: str, *args: Any, **kwargs: Any) -> str | None:
        return None if os.path.basename(str(name)) == runtime else real_which(name, *args, **kwargs)

    monkeypatch.setattr(shutil, "which", which)
    home = tmp_path / "home"
    eng = make_engine(home)
    await eng.start()
    cgroups_before = set(_cgroup_children())
    try:
        with pytest.raises(RuntimeUnavailableError) as exc:
            await eng.create(SandboxSpec(template=TEMPLATE, runtime=runtime))
        assert eng.list() == []
    finally:
        await eng.close(destroy_all=True)
    msg = str(exc.value)
    assert runtime in msg and f"apt-get install {runtime}" in msg, msg
    assert _nothing_left(home) == []
    assert set(_cgroup_children()) <= cgroups_before


async def test_36_fail_closed_empty_path(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    home = tmp_path / "home"
    eng = make_engine(home)
    await eng.start()
    monkeypatch.setenv("PATH", str(empty))
    try:
        with pytest.raises(RuntimeUnavailableError) as exc:
            await eng.create(spec())
    finally:
        monkeypatch.undo()
        await eng.close(destroy_all=True)
    assert "runc" in str(exc.value) and "apt-get install runc" in str(exc.value)
    assert isinstance(exc.value, ServerError)
    assert _nothing_left(home) == []


async def test_36_fail_closed_without_cgroup_controller(tmp_path, monkeypatch):
    monkeypatch.setattr(_cgroups, "missing_controllers", lambda: ["pids"])
    home = tmp_path / "home"
    eng = make_engine(home)
    await eng.start()
    try:
        with pytest.raises(RuntimeUnavailableError, match="pids"):
            await eng.create(spec())
    finally:
        await eng.close(destroy_all=True)
    assert _nothing_left(home) == []


def _cgroup_children() -> list[str]:
    root = Path("/sys/fs/cgroup")
    dirs = [root / CGROUP_PARENT, *root.glob(f"*/{CGROUP_PARENT}")]
    return [str(c) for d in dirs if d.is_dir() for c in d.iterdir() if c.is_dir()]
