"""Resource abuse: fork bombs, memory hogs, disk and tmpfs fills, CPU burners, output floods, descriptor and stack
exhaustion, and commands that must be stopped by their timeout.

Each task provokes one limit and checks the outcome says so (EAGAIN, an OOM kill, ENOSPC, a CPU-time ratio, a
truncation flag with the true size, a timeout), then proves the sandbox still answers (`host_disrupted` if it
does not). Everything is small and bounded: limits are lowered for the task (`pids=64`, `memory=128M`,
`disk=64M`, `cpus=0.5`) so a limit is reached in a second or two, and every command has a timeout.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterable, Iterator
from typing import Any

from .._checks import CodeError, CodeText, Duration, ExitCode, Fails, Ok, Oom, Stderr, Stdout, TimedOut, Truncated
from .._task import Blob, Code, Exec, Setup, Severity, Step, Task, Write

__all__ = ["tasks"]


def said(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text`, a short verdict: a mismatch shows what was printed (an `equals` check would show
    hashes, and call a wrong answer binary corruption)."""
    return Stdout(matches=r"\A" + re.escape(text).replace("\\\n", r"\n") + r"\Z", mode=mode)


CATEGORY = "resource_abuse"
MiB = 1024 * 1024


def alive(within: float = 5.0) -> Exec:
    """The sandbox still answers, promptly: abuse in it must not have taken it (or its agent) down."""
    return Exec("echo alive", timeout=15, checks=(Ok(mode="host_disrupted"), said("alive\n",
                                                                                     mode="host_disrupted"),
                                                  Duration(max=within, mode="host_disrupted")))


def _task(family: str, variant: str, title: str, steps: tuple[Step, ...], *, limits: dict[str, Any] | None = None,
          checklist: tuple[int, ...] = (), severity: Severity = "high", budget: float = 45,
          requires: frozenset[str] = frozenset(), files: tuple[tuple[str, Blob], ...] = ()) -> Task:
    return Task(id=f"abuse.{family}/{variant}", family=f"abuse.{family}", category=CATEGORY, title=title,
                steps=(*steps, alive()), setup=Setup(limits=limits or {}, files=files), severity=severity,
                budget=budget, checklist=checklist, requires=requires)


def _bomb() -> bytes:
    """256 MiB of zeros as a 270 KB gzip file: one compressed MiB, as 256 concatenated gzip members (cheap to make,
    and gunzip and Python's gzip both read every member)."""
    return gzip.compress(bytes(MiB), 9, mtime=0) * 256


BOMB = (("/workspace/bomb.gz", Blob.literal(_bomb())),)


def py(code: str, *args: str) -> tuple[str, ...]:
    return ("python3", "-c", code, *args)


LEFTOVERS = r"""
import os, sys, time
# Processes whose command line holds the marker (other than this probe), and zombies; wait up to 2 s for reaping.
marker = sys.argv[1]
for _ in range(20):
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd or state == "Z":
            left.append(f"{pid} {state} {cmd.strip()[:60]}")
    if not left:
        break
    time.sleep(0.1)
print(f"{len(left)} left: " + "; ".join(left[:5]) if left else "clean")
"""


def no_leftovers(marker: str) -> Exec:
    return Exec(py(LEFTOVERS, marker), timeout=15, checks=(said("clean\n", mode="zombie_processes"),))


# -- fork bombs (pids limit) --------------------------------------------------------------------------------

FORK_LINEAR = r"""
import errno, os, sys, time
cap = int(sys.argv[1])
kids, err = [], None
for _ in range(2 * cap):
    try:
        pid = os.fork()
    except OSError as e:
        err = errno.errorcode.get(e.errno, e.errno)
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.kill(k, 9)
for k in kids:
    os.waitpid(k, 0)
print(err, len(kids) < cap)
"""
THREADS = r"""
import sys, threading, time
cap = int(sys.argv[1])
stop = threading.Event()
started, err = 0, None
for _ in range(2 * cap):
    try:
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
    except RuntimeError as e:
        err = "RuntimeError"
        break
stop.set()
print(err, started < cap)
"""
SPAWN = r"""
import errno, subprocess, sys
cap = int(sys.argv[1])
procs, err = [], None
for _ in range(2 * cap):
    try:
        procs.append(subprocess.Popen(["sleep", "30"]))
    except OSError as e:
        err = errno.errorcode.get(e.errno, e.errno)
        break
for p in procs:
    p.kill()
    p.wait()
print(err, len(procs) < cap)
"""
NODE_SPAWN = r"""
const {spawn} = require('child_process');
const kids = []; let err = null;
for (let i = 0; i < 128; i++) {
  try {
    const k = spawn('sleep', ['30']);
    k.on('error', (e) => { err = err || e.code; });
    kids.push(k);
  } catch (e) { err = e.code; break; }
}
setTimeout(() => { kids.forEach((k) => k.kill('SIGKILL')); console.log(err); process.exit(0); }, 500);
"""


def _fork_bombs() -> Iterator[Task]:
    pids = {"pids": 64}
    yield _task("fork_bomb", "python-linear", "fork until the pids limit (64): fork fails with EAGAIN below the cap",
                (Exec(py(FORK_LINEAR, "64", "FORK_MARK"), timeout=30,
                      checks=(said("EAGAIN True\n", mode="limit_not_enforced"),)),
                 no_leftovers("FORK_MARK")), limits=pids, checklist=(9,))
    yield _task("fork_bomb", "python-linear-default-limit", "fork until the default pids limit (256): EAGAIN",
                (Exec(py(FORK_LINEAR, "256"), timeout=30,
                      checks=(said("EAGAIN True\n", mode="limit_not_enforced"),)),), checklist=(9,))
    yield _task("fork_bomb", "threads", "start threads until the pids limit: thread creation fails below the cap",
                (Exec(py(THREADS, "64"), timeout=30,
                      checks=(said("RuntimeError True\n", mode="limit_not_enforced"),)),), limits=pids,
                checklist=(9,))
    yield _task("fork_bomb", "subprocess-spawn", "spawn `sleep` processes until the pids limit: EAGAIN",
                (Exec(py(SPAWN, "64"), timeout=30,
                      checks=(said("EAGAIN True\n", mode="limit_not_enforced"),)),),
                limits=pids, checklist=(9,))
    yield _task("fork_bomb", "node-spawn", "node spawning children until the pids limit gets EAGAIN errors",
                (Exec(("node", "-e", NODE_SPAWN), timeout=30,
                      checks=(said("EAGAIN\n", mode="limit_not_enforced"),)),), limits=pids, checklist=(9,))
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    yield _task("fork_bomb", "code-cell", "a code cell forking until the pids limit gets EAGAIN by name; the "
                "session lives on",
                (Code(FORK_LINEAR.replace("cap = int(sys.argv[1])", "cap = 64") + "'done'", timeout=30,
                      checks=(said("EAGAIN True\n", mode="limit_not_enforced"),)),
                 Code("6 * 7", checks=(CodeText(equals="42", mode="host_disrupted"),))), limits=pids, checklist=(9,),
                requires=frozenset({"code"}))
    yield _task("fork_bomb", "python-exponential", "an exponential fork bomb is stopped by a 3 s timeout and no "
                "process of it survives",
                (Exec(py(bomb, "BOMB_MARK"), timeout=3, checks=(TimedOut(within=10),)), no_leftovers("BOMB_MARK")),
                limits=pids, checklist=(9, 12), budget=60)
    yield _task("fork_bomb", "bash-classic", "the classic bash fork bomb is stopped by a 3 s timeout, nothing left",
                (Exec(":(){ :|:& };:; sleep 10", timeout=3, checks=(TimedOut(within=10),)),
                 Exec("ps -e --no-headers | wc -l", checks=(Stdout(matches=r"^[1-5]\n$", mode="zombie_processes"),))),
                limits=pids, checklist=(9, 12), budget=60)


# -- memory hogs (memory limit, OOM reported) -------------------------------------------------------------------

C_HOG = r"""
cat > /tmp/hog.c <<'EOF'
#include <stdlib.h>
#include <string.h>
int main(void) {
    for (int i = 0; i < 64; i++) {
        char *p = malloc(16 << 20);
        if (!p) return 3;
        memset(p, 1, 16 << 20);
    }
    return 0;
}
EOF
gcc -O0 -o /tmp/hog /tmp/hog.c && /tmp/hog
"""


def _oom(cmd: str | tuple[str, ...], timeout: float = 30) -> Exec:
    return Exec(cmd, timeout=timeout, checks=(Oom(), Stdout(absent="survived", mode="limit_not_enforced")))


def _memory() -> Iterator[Task]:
    small = {"memory": "128M"}
    hogs: dict[str, tuple[str | tuple[str, ...], str]] = {
        "python-bytes": (py("b = b'\\x01' * (256 << 20)\nprint('survived')"), "one 256 MiB bytes object"),
        "python-growth": (py("chunks = []\nwhile len(chunks) < 64:\n    chunks.append(bytearray(8 << 20))\n"
                             "print('survived')"), "a list growing by 8 MiB bytearrays"),
        "numpy": (py("import numpy as np\na = np.ones(40_000_000)\nprint('survived', a.sum())"),
                  "a 320 MB numpy array"),
        "node-buffer": (("node", "-e", "const b = []; for (let i = 0; i < 32; i++) b.push(Buffer.alloc(16 << 20, 1));"
                         " console.log('survived')"), "node Buffers, 512 MiB in all"),
        "c-malloc": (C_HOG, "a C program touching 1 GiB of malloc'd memory"),
        "bash-string": ("x=aaaaaaaa; for i in $(seq 40); do x=$x$x; done; echo survived", "a bash string doubling"),
    }
    for label, (cmd, what) in hogs.items():
        yield _task("memory", label, f"{what} under a 128M limit is OOM-killed and the result says so",
                    (_oom(cmd, timeout=60 if label == "c-malloc" else 30),), limits=small, checklist=(10,))
    yield _task("memory", "child-only", "a child of the command is OOM-killed; the parent lives on and sees "
                "SIGKILL (exit 137)",
                (Exec("python3 -c 'b = bytearray(300 << 20)'; echo child=$?", timeout=30,
                      checks=(said("child=137\n", mode="limit_not_enforced"),)),), limits=small,
                checklist=(10,))
    yield _task("memory", "shm-counts", "/dev/shm pages count against memory: 60 MiB in /dev/shm plus a 100 MiB "
                "allocation under 128M OOM-kills the allocator; freeing /dev/shm makes room again",
                (Exec("head -c 60M /dev/zero > /dev/shm/f && echo filled", timeout=30,
                      checks=(said("filled\n"),)),
                 _oom(py("b = b'\\x01' * (100 << 20)\nprint('survived')")),
                 Exec("rm /dev/shm/f && python3 -c \"b = b'x' * (80 << 20); print('ok')\"", timeout=30,
                      checks=(said("ok\n", mode="limit_not_enforced"),))), limits={**small, "shm": "64M"},
                checklist=(7, 10))
    yield _task("memory", "decompression-bomb", "gzip.decompress of a 256 MiB bomb (a 270 KB upload) under 128M is "
                "OOM-killed",
                (_oom(py("import gzip\nd = gzip.decompress(open('/workspace/bomb.gz', 'rb').read())\n"
                         "print('survived', len(d))")),), limits=small, checklist=(10,), files=BOMB)
    yield _task("memory", "within-limit", "control: 64 MiB under a 128M limit is fine",
                (Exec(py("b = bytearray(64 << 20)\nprint(len(b) >> 20)"), timeout=30,
                      checks=(ExitCode(0, mode="limit_not_enforced"), said("64\n"))),), limits=small,
                severity="medium", checklist=(10,))
    yield _task("memory", "default-limit", "1 GiB under the default 512M limit is OOM-killed",
                (_oom(py("b = bytearray(1 << 30)\nprint('survived')")),), checklist=(10,))
    yield _task("memory", "code-cell", "a code cell allocating past the limit comes back OOM-killed; a new cell works",
                (Code("b = bytearray(256 << 20)", timeout=30, checks=(Oom(),)),
                 Code("1 + 1", timeout=30, checks=(CodeText(equals="2", mode="host_disrupted"),))),
                limits=small, checklist=(10,), requires=frozenset({"code"}))
    yield _task("memory", "background-holder", "one process holds 40 MiB while another allocates: the allocator is "
                "OOM-killed, the sandbox answers",
                (Exec("setsid -f python3 -c 'import time; b = bytearray(40 << 20); time.sleep(8)' >/dev/null 2>&1; "
                      "sleep 0.5; echo started", checks=(said("started\n"),)),
                 _oom(py("b = b'\\x01' * (150 << 20)\nprint('survived')"))), limits=small, checklist=(10,))
    # tmpfs pages count against the memory limit: filling /tmp past it must not wedge the sandbox.
    yield _task("memory", "tmp-fill-past-memory", "200 MiB written to /tmp (tmpfs 256M by default) under a 128M "
                "memory limit ends in ENOSPC or an OOM kill, and the sandbox keeps working",
                (Exec("head -c 200M /dev/zero > /tmp/fill; echo rc=$?", timeout=30, checks=(Duration(max=20),)),
                 Exec("rm -f /tmp/fill; echo cleaned", timeout=15,
                      checks=(said("cleaned\n", mode="host_disrupted"),))),
                limits=small, checklist=(7, 10), severity="critical")
    yield _task("memory", "file-api-tmp-past-memory", "uploading 200 MiB to /tmp under a 128M memory limit fails "
                "clearly, and the sandbox keeps working",
                (Write("/tmp/big.bin", Blob.repeat(b"\x01", 200 * MiB),
                       checks=(Fails(code=("disk_full", "invalid_request", "resource_exhausted"),
                                     mode="limit_not_enforced"),)),),
                limits=small, checklist=(7, 10), severity="critical", budget=90)


# -- disk and tmpfs fills -------------------------------------------------------------------------------------------

ENOSPC = "No space left on device"


def _disk() -> Iterator[Task]:
    disk = {"disk": "64M"}
    yield _task("disk_fill", "dd-zero", "dd 200 MiB of zeros into a 64M disk fails with ENOSPC",
                (Exec("dd if=/dev/zero of=/workspace/f bs=1M count=200 status=none", timeout=60,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),
                 Exec("rm /workspace/f && head -c 1M /dev/zero > /workspace/g && echo reusable",
                      checks=(said("reusable\n", mode="limit_not_enforced"),))), limits=disk, checklist=(8,))
    yield _task("disk_fill", "urandom", "incompressible data past the 64M disk fails with ENOSPC",
                (Exec("head -c 100M /dev/urandom > /workspace/f", timeout=60,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),), limits=disk,
                checklist=(8,))
    yield _task("disk_fill", "fallocate", "fallocate of 1 GiB on a 64M disk fails",
                (Exec("fallocate -l 1G /workspace/f", timeout=30,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),), limits=disk,
                checklist=(8,))
    yield _task("disk_fill", "many-files", "creating empty files until the disk's inodes run out gives ENOSPC",
                (Exec(py("import errno, os\nos.makedirs('/workspace/many')\nn = 0\ntry:\n    while n < 200000:\n"
                         "        open(f'/workspace/many/{n}', 'w').close()\n        n += 1\n"
                         "except OSError as e:\n    print(errno.errorcode[e.errno], n < 200000)"), timeout=60,
                      checks=(said("ENOSPC True\n", mode="limit_not_enforced"),)),), limits=disk,
                checklist=(8,), budget=90)
    yield _task("disk_fill", "sparse-then-fill", "a 10 GiB sparse file is fine; filling it stops at the disk limit",
                (Exec("truncate -s 10G /workspace/sparse && dd if=/dev/zero of=/workspace/sparse bs=1M count=200 "
                      "conv=notrunc status=none", timeout=60,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),), limits=disk,
                checklist=(8,))
    yield _task("disk_fill", "file-api-when-full", "with the disk full a file API upload fails with disk_full; after "
                "freeing space it works",
                (Exec("dd if=/dev/zero of=/workspace/f bs=1M count=200 status=none; true", timeout=60),
                 Write("/workspace/up.bin", Blob.random(8 * MiB, 7),
                       checks=(Fails(code="disk_full", matches="disk", mode="limit_not_enforced"),)),
                 Exec("rm /workspace/f", checks=(ExitCode(0),)),
                 Write("/workspace/up.bin", Blob.random(MiB, 8))), limits=disk, checklist=(8,), budget=90)
    yield _task("disk_fill", "home", "filling /home/user hits the same 64M disk limit",
                (Exec("dd if=/dev/zero of=/home/user/f bs=1M count=200 status=none", timeout=60,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),), limits=disk,
                checklist=(8,))
    yield _task("disk_fill", "background-filler", "a background process fills the disk; a later write fails with "
                "ENOSPC",
                (Exec("setsid -f sh -c 'dd if=/dev/zero of=/workspace/f bs=1M count=200 status=none; "
                      "touch /tmp/dd-done'; for i in $(seq 250); do [ -e /tmp/dd-done ] && break; sleep 0.1; done; "
                      "python3 -c \"open('/workspace/g', 'w').write('x' * (1 << 20))\"", timeout=40,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains="No space left"))),),
                limits=disk, checklist=(8,))
    yield _task("disk_fill", "decompression-bomb", "gunzip of a 256 MiB bomb into a 64M disk stops with ENOSPC",
                (Exec("gunzip -c /workspace/bomb.gz > /workspace/out", timeout=60,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),), limits=disk,
                checklist=(8,), files=BOMB)
    yield _task("disk_fill", "code-cell", "a code cell writing past the 64M disk gets OSError (ENOSPC) by name",
                (Code("with open('/workspace/f', 'wb') as f:\n    for _ in range(200):\n"
                      "        f.write(bytes(1 << 20))",
                      timeout=60, checks=(CodeError("OSError", matches="No space left"),)),), limits=disk,
                checklist=(8,), requires=frozenset({"code"}))
    tmp = {"tmp": "32M", "shm": "16M"}
    yield _task("tmpfs_fill", "tmp", "dd past /tmp's 32M cap fails with ENOSPC",
                (Exec("dd if=/dev/zero of=/tmp/f bs=1M count=100 status=none", timeout=30,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),
                 Exec("stat -c %s /tmp/f", checks=(Stdout(matches=r"^(3[0-3]|2[4-9])\d{6}\n$",
                                                          mode="limit_not_enforced"),))),
                limits=tmp, checklist=(7,))
    yield _task("tmpfs_fill", "shm", "dd past /dev/shm's 16M cap fails with ENOSPC",
                (Exec("dd if=/dev/zero of=/dev/shm/f bs=1M count=100 status=none", timeout=30,
                      checks=(ExitCode(1, mode="limit_not_enforced"), Stderr(contains=ENOSPC))),), limits=tmp,
                checklist=(7,))
    yield _task("tmpfs_fill", "python-shm-segment", "a POSIX shared memory segment larger than /dev/shm fails "
                "cleanly (no SIGBUS kills the sandbox)",
                (Exec(py("import os\nfd = os.open('/dev/shm/seg', os.O_CREAT | os.O_RDWR)\ntry:\n"
                         "    os.posix_fallocate(fd, 0, 64 << 20)\n    print('allocated')\nexcept OSError as e:\n"
                         "    print(e.strerror)"), timeout=30,
                      checks=(said(f"{ENOSPC}\n", mode="limit_not_enforced"),)),), limits=tmp, checklist=(7,))
    yield _task("tmpfs_fill", "default-tmp", "filling /tmp at its default size (256M) stops with ENOSPC within the "
                "default memory limit",
                (Exec("dd if=/dev/zero of=/tmp/f bs=1M count=300 status=none; echo rc=$?; rm /tmp/f", timeout=60,
                      checks=(said("rc=1\n", mode="limit_not_enforced"),)),), checklist=(7,), budget=90)


# -- CPU ------------------------------------------------------------------------------------------------------------

CPU_PROBE = r"""
import os, resource, sys, time
workers, seconds, quota = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
t0 = time.monotonic()
pids = []
for _ in range(workers):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
wall = time.monotonic() - t0
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
ratio = (ru.ru_utime + ru.ru_stime) / wall
# The busy loops must have run at all (on a busy host they may get far less than the quota), and never more than
# the quota (with 30% of slack for accounting granularity).
print("OK" if 0.01 <= ratio <= 1.3 * quota else f"FAIL ratio {ratio:.2f} for quota {quota}")
"""
NODE_BURN = r"""
const t0 = process.hrtime.bigint(), c0 = process.cpuUsage();
while (process.hrtime.bigint() - t0 < 2000000000n) {}
const wall = Number(process.hrtime.bigint() - t0) / 1e9, u = process.cpuUsage(c0);
const ratio = (u.user + u.system) / 1e6 / wall;
console.log(ratio <= 0.65 && ratio > 0.05 ? 'OK' : 'FAIL ratio ' + ratio.toFixed(2));
"""


def _cpu() -> Iterator[Task]:
    for label, cpus, workers, seconds in (("half-two-workers", 0.5, 2, 2.0), ("quarter-two-workers", 0.25, 2, 2.0),
                                          ("one-four-workers", 1.0, 4, 1.5), ("half-one-worker", 0.5, 1, 2.0)):
        yield _task("cpu", label, f"{workers} busy loops for {seconds:g} s under cpus={cpus} get at most their quota "
                    "of CPU time",
                    (Exec(py(CPU_PROBE, str(workers), str(seconds), str(cpus)), timeout=30,
                          checks=(said("OK\n", mode="limit_not_enforced"),)),),
                    limits={"cpus": cpus}, checklist=(11,))
    yield _task("cpu", "node-busy-loop", "a node busy loop under cpus=0.5 gets at most half a CPU",
                (Exec(("node", "-e", NODE_BURN), timeout=30,
                      checks=(said("OK\n", mode="limit_not_enforced"),)),),
                limits={"cpus": 0.5}, checklist=(11,))
    yield _task("cpu", "burner-timed-out", "an endless busy loop is stopped by a 2 s timeout",
                (Exec("while :; do :; done", timeout=2, checks=(TimedOut(within=6),)), no_leftovers("while :")),
                limits={"cpus": 0.5}, checklist=(11, 12))
    yield _task("cpu", "answers-while-burning", "with two background burners at its quota, the sandbox still runs a "
                "command within seconds",
                (Exec("for i in 1 2; do setsid -f timeout 8 python3 -c 'while True: pass'; done; sleep 1; echo burning",
                      checks=(said("burning\n"),)),
                 Exec("python3 -c 'print(6 * 7)'", timeout=15, checks=(said("42\n", mode="host_disrupted"),
                                                                      Duration(max=20, mode="host_disrupted")))),
                limits={"cpus": 0.5}, checklist=(11,))


# -- output floods ------------------------------------------------------------------------------------------------


def _floods() -> Iterator[Task]:
    size = 20 * MiB
    yield _task("output_flood", "stdout-zeros", "20 MiB of NUL bytes on stdout come back truncated, true size kept",
                (Exec(f"head -c {size} /dev/zero", timeout=60, checks=(ExitCode(0), Truncated(size=size))),),
                checklist=(13,), budget=90)
    yield _task("output_flood", "stdout-lines", "20 MiB of short lines come back truncated, true size kept",
                (Exec(f"yes | head -c {size}", timeout=60, checks=(ExitCode(0), Truncated(size=size))),),
                checklist=(13,), budget=90)
    yield _task("output_flood", "stdout-random", "17 MiB of random bytes come back truncated, true size kept",
                (Exec(f"head -c {17 * MiB} /dev/urandom", timeout=60,
                      checks=(ExitCode(0), Truncated(size=17 * MiB))),),
                checklist=(13,), budget=90)
    yield _task("output_flood", "stdout-head-and-tail", "a truncated flood keeps its first and last bytes",
                (Exec(f"echo START; head -c {size} /dev/zero; echo END", timeout=60,
                      checks=(Truncated(size=size + 10), Stdout(matches=r"\ASTART\n\x00"),
                              Stdout(matches=r"\x00END\n\Z"))),), checklist=(13,), budget=90)
    yield _task("output_flood", "stderr", "20 MiB on stderr come back truncated and flagged",
                (Exec(f"head -c {size} /dev/zero >&2; echo -n tail >&2", timeout=60,
                      checks=(Truncated(), Stderr(matches=r"\x00tail\Z", mode="silent_output_truncation"))),),
                checklist=(13,), budget=90)
    # 40 MiB then a hang, rather than an endless `yes`: how much `yes` writes before a timeout depends on the
    # machine's load, and the point is the cap and the timeout together, not the speed.
    yield _task("output_flood", "endless-with-timeout", "40 MiB of output then a hang: stopped by the timeout, "
                "output truncated with its true size",
                (Exec("yes | head -c 40M; sleep 600", timeout=8,
                      checks=(TimedOut(within=20), Truncated(size=40 * MiB))),),
                checklist=(12, 13), budget=90)
    yield _task("output_flood", "code-cell", "a code cell printing 20 MiB returns promptly and the session lives on",
                (Code("import sys\nfor _ in range(20):\n    sys.stdout.write('x' * (1 << 20))\n'done'", timeout=60,
                      checks=(CodeText(equals="'done'"), Duration(max=45, mode="hang"))),
                 Code("6 * 7", checks=(CodeText(equals="42", mode="host_disrupted"),))),
                checklist=(13,), requires=frozenset({"code"}), budget=90)
    yield _task("output_flood", "tiny-writes", "200,000 one-byte writes, each flushed, arrive complete and in order",
                (Exec(py("import os\nfor i in range(200000):\n    os.write(1, b'0123456789'[i % 10:i % 10 + 1])"),
                      timeout=60, checks=(Stdout(equals=Blob.repeat(b"0123456789", 200_000),
                                                 mode="silent_output_truncation"),)),), checklist=(13,),
                severity="medium", budget=90)
    yield _task("output_flood", "under-the-cap", "control: 15 MiB of output (under the 16 MiB cap) comes back whole",
                (Exec(f"yes | head -c {15 * MiB}", timeout=60,
                      checks=(Stdout(equals=Blob.repeat(b"y\n", 15 * MiB), mode="silent_output_truncation"),)),),
                checklist=(13,), severity="medium", budget=90)


# -- descriptors, stacks --------------------------------------------------------------------------------------------

OPEN_FILES = r"""
import errno, os, resource, sys
cap = int(sys.argv[1])
fds, err = [], None
try:
    while len(fds) < 2 * cap:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    err = errno.errorcode[e.errno]
print(err, len(fds) < cap, resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= cap)
"""


def _descriptors() -> Iterator[Task]:
    yield _task("open_files", "default-limit", "opening files until the default limit (4096) gives EMFILE",
                (Exec(py(OPEN_FILES, "4096"), timeout=30, checks=(said("EMFILE True True\n",
                                                                         mode="limit_not_enforced"),)),))
    yield _task("open_files", "lowered-limit", "with open_files=256 the 257th descriptor fails with EMFILE",
                (Exec(py(OPEN_FILES, "256"), timeout=30, checks=(said("EMFILE True True\n",
                                                                        mode="limit_not_enforced"),)),),
                limits={"open_files": 256})
    yield _task("open_files", "raise-hard-limit", "raising the descriptor hard limit is refused",
                (Exec(py("import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\ntry:\n"
                         "    resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))\n    print('raised')\n"
                         "except (ValueError, OSError):\n    print('refused')"), timeout=30,
                      checks=(said("refused\n", mode="limit_not_enforced"),)),))
    yield _task("open_files", "pipes", "pipes until the limit give EMFILE",
                (Exec(py("import errno, os\npipes = []\ntry:\n    while len(pipes) < 5000:\n"
                         "        pipes.append(os.pipe())\nexcept OSError as e:\n    print(errno.errorcode[e.errno])"),
                      timeout=30, checks=(said("EMFILE\n", mode="limit_not_enforced"),)),))
    yield _task("open_files", "sockets", "socketpairs until the limit give EMFILE and the sandbox answers",
                (Exec(py("import errno, socket\npairs = []\ntry:\n    while len(pairs) < 5000:\n"
                         "        pairs.append(socket.socketpair())\nexcept OSError as e:\n"
                         "    print(errno.errorcode[e.errno])"), timeout=30,
                      checks=(said("EMFILE\n", mode="limit_not_enforced"),)),))
    yield _task("recursion", "python-default", "unbounded Python recursion ends in RecursionError",
                (Exec(py("def f(n):\n    return f(n + 1)\nf(0)"), timeout=30,
                      checks=(ExitCode(1), Stderr(contains="RecursionError"))),), severity="medium")
    yield _task("recursion", "python-unlimited", "Python recursion with the limit lifted grows its frames until the "
                "memory limit: OOM-killed and reported, the sandbox answers",
                (_oom(py("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)")),),
                limits={"memory": "128M"}, checklist=(10,), severity="medium")
    yield _task("recursion", "regex-backtracking", "a catastrophically backtracking regex is stopped by its timeout",
                (Exec(py("import re\nre.match(r'(a+)+$', 'a' * 40 + 'b')"), timeout=2,
                      checks=(TimedOut(within=7),)),), limits={"cpus": 0.5}, checklist=(12,), severity="medium")
    yield _task("recursion", "c-stack-overflow", "a C stack overflow dies of SIGSEGV",
                (Exec("printf 'int f(int n){volatile char b[4096]; b[0]=n; return f(n+1)+b[0];}\\n"
                      "int main(void){return f(0);}\\n' > /tmp/r.c && gcc -O0 -o /tmp/r /tmp/r.c && /tmp/r",
                      timeout=60, checks=(ExitCode(139, mode="wrong_exit_code"),)),), severity="medium")
    yield _task("recursion", "node", "unbounded node recursion ends in RangeError",
                (Exec(("node", "-e", "function f(n) { return f(n + 1) + 1; } f(0)"), timeout=30,
                      checks=(ExitCode(1), Stderr(contains="Maximum call stack size exceeded"))),), severity="medium")
    yield _task("recursion", "bash-function", "unbounded bash function recursion is stopped (a crash or "
                "FUNCNEST), and the sandbox answers",
                (Exec("FUNCNEST=2000; f() { f; }; f; echo after=$?", timeout=30,
                      checks=(Stderr(contains="maximum function nesting level exceeded"),)),), severity="medium")


# -- timeouts and leftovers -------------------------------------------------------------------------------------------


def _timeouts() -> Iterator[Task]:
    # label: (command, timeout, what it is, a string in the command line of every process it starts)
    cases: dict[str, tuple[str | tuple[str, ...], float, str, str]] = {
        "python-busy": (py("while True:\n    pass", "TO_MARK"), 2, "a Python busy loop", "TO_MARK"),
        "sleep": ("sleep 3601", 1, "a long sleep", "sleep 3601"),
        "ignores-sigterm": (py("import signal, time\nfor s in (1, 2, 15):\n    signal.signal(s, signal.SIG_IGN)\n"
                               "while True:\n    time.sleep(0.1)", "TO_MARK"), 1.5, "a process that ignores "
                                                                                  "SIGTERM, SIGINT and SIGHUP",
                            "TO_MARK"),
        "tail-follow": ("tail -f /dev/null", 1, "tail -f", "tail -f"),
        "busy-children": ("for i in 1 2 3 4; do python3 -c 'while True: pass' TO_MARK & done; wait", 2,
                          "four busy children", "TO_MARK"),
        "stopped-child": ("sleep 3602 & kill -STOP $!; wait", 1, "a stopped (SIGSTOP) child", "sleep 3602"),
    }
    for label, (cmd, timeout, what, marker) in cases.items():
        yield _task("timeout", label, f"{what} is stopped by a {timeout:g} s timeout, promptly, and nothing survives",
                    (Exec(cmd, timeout=timeout, checks=(TimedOut(within=timeout + 5),)), no_leftovers(marker)),
                    limits={"cpus": 0.5}, checklist=(12,))
    yield _task("timeout", "code-cell-loop", "an endless loop in a code cell is stopped by its timeout; the next cell "
                "runs", (Code("while True:\n    pass", timeout=3, checks=(TimedOut(within=10),)),
                         Code("6 * 7", timeout=30, checks=(CodeText(equals="42", mode="host_disrupted"),))),
                checklist=(12,), requires=frozenset({"code"}), budget=60)
    yield _task("timeout", "code-cell-error-after-timeout", "after a timed-out cell, an exception in the next cell "
                "still comes back by name",
                (Code("import time\ntime.sleep(60)", timeout=2, checks=(TimedOut(within=10),)),
                 Code("1 / 0", timeout=30, checks=(CodeError("ZeroDivisionError"),))), checklist=(12,),
                requires=frozenset({"code"}), budget=60, severity="medium")
    yield _task("zombies", "orphans-reaped", "children that exit after their parent are reaped: no zombies remain",
                (Exec(py("import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n        time.sleep(0.2)\n"
                         "        os._exit(0)\nos._exit(0)"), timeout=10, checks=(ExitCode(0),)),
                 Exec("sleep 0.5"), no_leftovers("ZOMBIE_MARK")), checklist=(12,), severity="medium")
    yield _task("zombies", "parent-timed-out", "a parent holding zombies is timed out: parent and zombies are gone",
                (Exec(py("import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n        os._exit(0)\n"
                         "time.sleep(60)", "ZOMBIE_MARK"), timeout=1.5, checks=(TimedOut(within=6),)),
                 no_leftovers("ZOMBIE_MARK")), checklist=(12,), severity="medium")


def tasks() -> Iterable[Task]:
    yield from _fork_bombs()
    yield from _memory()
    yield from _disk()
    yield from _cpu()
    yield from _floods()
    yield from _descriptors()
    yield from _timeouts()
