"""The seccomp profile: its shape, the algebra of its argument filters, and what it does under runc.

The unit tests need nothing. The `runc` tests run real containers as root: a read-only bundle over the
default template's rootfs (for the probes and Python workloads) and one over the host's own /usr (for gcc,
git, curl, tar, Node.js and pip), hardened the way Corral hardens sandboxes. Each denial is also checked
in a container whose process *does* hold capabilities inside its user namespace, and once more in that
container without the filter, so a passing test shows the filter is what stops the call.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.backends.local import _seccomp
from corral.backends.local._seccomp import (
    ALLOWED_SYSCALLS,
    DENIED_SYSCALLS,
    ENOSYS_SYSCALLS,
    FILTERED_SYSCALLS,
    seccomp_profile,
)

EPERM, ENOSYS = 1, 38
ALLOW = ("SCMP_ACT_ALLOW", None)
DENY_EPERM = ("SCMP_ACT_ERRNO", EPERM)
DEFAULT = ("SCMP_ACT_ERRNO", ENOSYS)

ROOTFS = Path(os.environ.get("CORRAL_TEST_ROOTFS", "/var/tmp/devroot"))
HOST_UID_BASE = 1_000_000


# --- Unit tests: the profile as data ---------------------------------------------------------------------


def _rules(name: str) -> list[dict[str, Any]]:
    return [rule for rule in seccomp_profile()["syscalls"] if name in rule["names"]]  # type: ignore[attr-defined]


def _matches(rule: dict[str, Any], args: tuple[int, ...]) -> bool:
    for cond in rule.get("args", []):
        value, op = args[cond["index"]], cond["op"]
        if op == "SCMP_CMP_EQ":
            ok = value == cond["value"]
        elif op == "SCMP_CMP_NE":
            ok = value != cond["value"]
        elif op == "SCMP_CMP_MASKED_EQ":
            ok = value & cond["value"] == cond["valueTwo"]
        else:  # pragma: no cover - the profile uses no other operator
            raise AssertionError(f"unexpected operator {op}")
        if not ok:
            return False
    return True


def _decide(name: str, *args: int) -> tuple[str, int | None]:
    """What the filter does with `name(*args)`, refusing to answer if two rules match (see the module doc)."""
    padded = (*args, *(0,) * (6 - len(args)))
    matching = [rule for rule in _rules(name) if _matches(rule, padded)]
    assert len(matching) <= 1, f"{name}{args} matches {len(matching)} rules: {matching}"
    if not matching:
        return DEFAULT
    return matching[0]["action"], matching[0].get("errnoRet")


def test_profile_is_the_oci_seccomp_object() -> None:
    profile = seccomp_profile()
    assert json.loads(json.dumps(profile)) == profile
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["defaultErrnoRet"] == ENOSYS
    assert profile["architectures"] == [
        "SCMP_ARCH_X86_64",
        "SCMP_ARCH_X86",
        "SCMP_ARCH_X32",
        "SCMP_ARCH_AARCH64",
        "SCMP_ARCH_ARM",
    ]
    for rule in profile["syscalls"]:  # type: ignore[attr-defined]
        assert set(rule) <= {"names", "action", "args", "errnoRet"}
        assert rule["names"] and rule["action"] in {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}
        assert (rule["action"] == "SCMP_ACT_ERRNO") == ("errnoRet" in rule)
    assert seccomp_profile() is not profile and seccomp_profile() == profile


def test_groups_are_disjoint() -> None:
    groups = {
        name: value
        for name, value in vars(_seccomp).items()
        if (name.startswith(("_DENY_", "_")) and isinstance(value, tuple) and value and isinstance(value[0], str))
        and name not in {"_GROUPS"}
    }
    seen: dict[str, str] = {}
    for group_name, members in groups.items():
        assert len(set(members)) == len(members), f"{group_name} lists a name twice"
        for member in members:
            assert member not in seen, f"{member} is in both {seen[member]} and {group_name}"
            seen[member] = group_name
    allowed, denied = set(ALLOWED_SYSCALLS), set(DENIED_SYSCALLS)
    assert not allowed & denied
    assert not (allowed | denied) & set(FILTERED_SYSCALLS)
    assert not (allowed | denied | set(FILTERED_SYSCALLS)) & set(ENOSYS_SYSCALLS)
    assert "clone3" not in allowed


@pytest.mark.parametrize(
    "name",
    [
        "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "unshare",
        "setns", "bpf", "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup",
        "io_uring_enter", "io_uring_register", "perf_event_open", "kexec_load", "kexec_file_load",
        "init_module", "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at", "swapon",
        "swapoff", "reboot", "acct", "quotactl", "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree",
        "fspick", "mount_setattr", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
        "lookup_dcookie", "kcmp", "syslog", "vhangup", "iopl", "ioperm", "create_module", "socketcall",
    ],
)  # fmt: skip
def test_denied_with_eperm(name: str) -> None:
    assert name in DENIED_SYSCALLS
    assert _rules(name) == [r for r in seccomp_profile()["syscalls"] if r["action"] == "SCMP_ACT_ERRNO"][:1]  # type: ignore[attr-defined]
    assert _decide(name, 1, 2, 3) == DENY_EPERM


def test_names_in_an_unconditional_rule_have_no_other_rule() -> None:
    # libseccomp lets an unconditional rule absorb every other rule for the same syscall.
    for rule in seccomp_profile()["syscalls"]:  # type: ignore[attr-defined]
        if "args" not in rule:
            for name in rule["names"]:
                assert _rules(name) == [rule], name


def test_no_rule_has_two_conditions_on_one_argument() -> None:
    # runc would split such a rule into one rule per condition: OR instead of AND.
    for rule in seccomp_profile()["syscalls"]:  # type: ignore[attr-defined]
        indexes = [cond["index"] for cond in rule.get("args", [])]
        assert len(indexes) == len(set(indexes)), rule
        for cond in rule.get("args", []):
            if cond["op"] == "SCMP_CMP_MASKED_EQ":
                assert cond["valueTwo"] & ~cond["value"] == 0, rule


@pytest.mark.parametrize("bits", [4, 8])
def test_all_but_covers_exactly_the_complement(bits: int) -> None:
    rng = random.Random(bits)
    for _ in range(50):
        excluded = set(rng.sample(range(1 << bits), rng.randint(1, 5)))
        patterns = _seccomp._all_but(excluded, bits)
        assert len(patterns) <= bits * len(excluded)
        for value in range(1 << bits):
            hits = sum(value & mask == want for mask, want in patterns)
            assert hits == (0 if value in excluded else 1), (excluded, value)


def test_clone_is_denied_with_any_namespace_flag() -> None:
    namespace_flags = [0x0002_0000, 0x0200_0000, 0x0400_0000, 0x0800_0000, 0x1000_0000, 0x2000_0000, 0x4000_0000]
    harmless = [0x11, 0x3D0F00, 0x0100_0000 | 0x0020_0000, 0x8000_0000, 1 << 40]
    for flags in harmless:
        assert _decide("clone", flags) == ALLOW
    for r in range(1, len(namespace_flags) + 1):
        for combo in itertools.combinations(namespace_flags, r):
            for extra in harmless:
                assert _decide("clone", sum(combo) | extra) == DENY_EPERM


def test_ioctl_denies_only_terminal_injection() -> None:
    rng = random.Random(0)
    requests = [*range(1 << 16), *(rng.getrandbits(64) for _ in range(20_000))]
    for request in requests:
        expected = DENY_EPERM if request & 0xFFFF_FFFF in (0x5412, 0x541C) else ALLOW
        assert _decide("ioctl", 3, request) == expected, hex(request)
    for high in (1 << 32, 0xDEAD << 40, 0xFFFF_FFFF << 32):  # the kernel ignores the high half
        assert _decide("ioctl", 3, high | 0x5412) == DENY_EPERM
        assert _decide("ioctl", 3, high | 0x541C) == DENY_EPERM
        assert _decide("ioctl", 3, high | 0x5414) == ALLOW


def test_personality_allows_only_harmless_personas() -> None:
    allowed = {0x0, 0x8, 0x20000, 0x20008, 0xFFFF_FFFF}
    rng = random.Random(1)
    personas = [*range(1 << 18), *(rng.getrandbits(32) for _ in range(20_000)), *allowed, 0x0040000, 0x0400000]
    for persona in personas:
        assert _decide("personality", persona) == (ALLOW if persona in allowed else DENY_EPERM), hex(persona)
    assert _decide("personality", (1 << 32) | 0x0040000) == DENY_EPERM


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, 1, 0), ALLOW), ((1, 2, 0), ALLOW), ((1, 5, 0), ALLOW), ((1, 0x80801, 0), ALLOW),
        ((2, 1, 0), ALLOW), ((2, 1, 6), ALLOW), ((2, 2, 0), ALLOW), ((2, 2, 17), ALLOW), ((2, 2, 1), ALLOW),
        ((2, 0x80801, 6), ALLOW),  # SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC
        ((10, 1, 0), ALLOW), ((10, 2, 17), ALLOW), ((10, 2, 58), ALLOW),
        ((16, 3, 0), ALLOW), ((16, 0x80002, 0), ALLOW),
        ((17, 3, 0x300), DENY_EPERM), ((17, 2, 0), DENY_EPERM),
        ((2, 3, 1), DENY_EPERM), ((2, 0x80003, 255), DENY_EPERM), ((2, 10, 0), DENY_EPERM),
        ((10, 3, 58), DENY_EPERM),
        ((2, 1, 132), DEFAULT), ((2, 5, 132), DEFAULT), ((2, 6, 33), DEFAULT),  # SCTP, DCCP
        ((16, 3, 9), DEFAULT), ((38, 5, 0), DEFAULT), ((40, 1, 0), DEFAULT), ((44, 3, 0), DEFAULT),
        (((1 << 32) | 17, 3, 0), DEFAULT), ((2, 1, (1 << 32) | 6), DEFAULT),
    ],
)  # fmt: skip
def test_socket(args: tuple[int, int, int], expected: tuple[str, int | None]) -> None:
    assert _decide("socket", *args) == expected


def test_socketpair_only_unix() -> None:
    assert _decide("socketpair", 1, 1, 0) == ALLOW
    for family in (2, 10, 16, 17, 30, (1 << 32) | 1):
        assert _decide("socketpair", family, 1, 0) == DENY_EPERM


def test_names_are_known_to_libseccomp() -> None:
    resolver = shutil.which("scmp_sys_resolver")
    if resolver is None:
        pytest.skip("scmp_sys_resolver (Debian package `seccomp`) is not installed")
    # Newer than libseccomp 2.5.4: runc skips them until libseccomp learns them.
    newer = {"getxattrat", "setxattrat", "listxattrat", "removexattrat", "mseal", "open_tree_attr"}
    names = {*ALLOWED_SYSCALLS, *DENIED_SYSCALLS, *FILTERED_SYSCALLS, *ENOSYS_SYSCALLS}
    arches = ["x86_64", "x86", "aarch64", "arm"]
    unknown = set()
    for name in sorted(names):
        for arch in arches:
            answer = subprocess.run([resolver, "-a", arch, name], capture_output=True, text=True).stdout
            if answer.strip().lstrip("-").isdigit() and int(answer) >= 0:
                break
        else:
            unknown.add(name)
    assert unknown <= newer
    if not unknown:
        pytest.fail(f"libseccomp now knows {sorted(newer)}: shrink the list")


# --- runc: a real bundle ---------------------------------------------------------------------------------

# In-container helper: a small Python program run as the container's process. It is self-contained (the
# template has only the standard library) and prints one JSON object.
PROBE = r'''
import ctypes, errno, fcntl, json, mmap, os, platform, socket, struct, sys, termios, time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
X86_64 = platform.machine() == "x86_64"
NR = {  # x86_64, aarch64
    "ioctl": (16, 29), "ptrace": (101, 117), "syslog": (103, 116), "personality": (135, 92),
    "pivot_root": (155, 41), "acct": (163, 89), "settimeofday": (164, 170), "mount": (165, 40),
    "umount2": (166, 39), "init_module": (175, 105), "clone": (56, 220), "socket": (41, 198),
    "socketpair": (53, 199), "add_key": (248, 217), "keyctl": (250, 219), "unshare": (272, 97),
    "perf_event_open": (298, 241), "open_by_handle_at": (304, 265), "setns": (308, 268),
    "process_vm_readv": (310, 270), "kcmp": (312, 272), "bpf": (321, 280), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "fsopen": (430, 430), "clone3": (435, 435), "pidfd_getfd": (438, 438),
    "unknown": (1000, 1000),
}

def call(name, *args):
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    res = libc.syscall(ctypes.c_long(NR[name][0 if X86_64 else 1]), *conv)
    if res == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res

def isolated(fn):
    """Run fn in a child process; 'ok' or the errno's name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            fn()
            out = "ok"
        except OSError as e:
            out = errno.errorcode.get(e.errno, str(e.errno))
        except BaseException as e:
            out = "error: " + repr(e)
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data.decode()

def with_child(fn):
    def run():
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        try:
            fn(pid)
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    return run

def clone(flags):
    def run():
        pid = call("clone", flags | 17, 0, 0, 0, 0)  # | SIGCHLD
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return run

def clone3():
    args = struct.pack("<11Q", 0, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)
    pid = call("clone3", args, len(args))
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def sock(family, type_, proto=0):
    return lambda: socket.socket(family, type_, proto).close()

def raw_sock(family, type_, proto=0):
    return lambda: os.close(call("socket", family, type_, proto))

def controlling_pty(request, arg=b"x"):
    def run():
        master, slave = os.openpty()
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        call("ioctl", slave, request, ctypes.c_char_p(arg))
    return run

def pty_ioctls():
    master, slave = os.openpty()
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    rows, cols = struct.unpack("HHHH", fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8))[:2]
    assert (rows, cols) == (24, 80)
    fcntl.ioctl(slave, termios.FIONREAD, b"\0" * 4)

def mount_tmpfs():
    os.makedirs("/tmp/mnt", exist_ok=True)
    call("mount", b"none", b"/tmp/mnt", b"tmpfs", 0, None)
    call("umount2", b"/tmp/mnt", 0)

def setns():
    call("setns", os.open("/proc/self/ns/uts", os.O_RDONLY), 0)

def pidfd_getfd(child):
    call("pidfd_getfd", os.pidfd_open(child), 0, 0)

def prctl(option, arg):
    def run():
        if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    return run

I386 = []

def int80(nr, a=0, b=0, c=0):
    """A 32-bit (i386) system call from this 64-bit process; returns the raw result (-errno on failure)."""
    if not I386:
        page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40, prot=7)  # MAP_32BIT, rwx
        # push rbx; eax, ebx, ecx, edx = edi, esi, edx, ecx; int 0x80; pop rbx; ret
        code = bytes.fromhex("53 89f8 89f3 4189d0 89ca 4489c1 cd80 5b c3")
        page[:len(code)] = code
        base = ctypes.addressof(ctypes.c_char.from_buffer(page))
        I386[:] = [page, base, ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_uint] * 4)(base)]
    return I386[2](nr, a, b, c)

def i386(nr, *args):
    def run():
        res = int80(nr, *args)
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        if nr in (102, 359):  # socketcall, socket
            os.close(res)
    return run

def i386_socketcall():
    int80(20)
    page, base = I386[0], I386[1]
    page[512:524] = struct.pack("<3I", 1, 1, 0)  # AF_UNIX, SOCK_STREAM, 0
    i386(102, 1, base + 512)()  # socketcall(SYS_SOCKET, args)

def x32(nr, *args):
    def run():
        if libc.syscall(ctypes.c_long(0x4000_0000 | nr), *[ctypes.c_long(a) for a in args]) == -1:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    return run

probes = {
    # checklist 28: raw sockets and ptrace
    "socket AF_PACKET": sock(17, socket.SOCK_RAW, 0x0300),
    "socket AF_PACKET dgram": sock(17, socket.SOCK_DGRAM, 0x0300),
    "socket AF_PACKET, high bits in family": raw_sock((1 << 32) | 17, 3, 0x0300),
    "socket INET raw": sock(2, socket.SOCK_RAW, 1),
    "socket INET raw nonblock": sock(2, socket.SOCK_RAW | socket.SOCK_NONBLOCK, 255),
    "socket INET SOCK_PACKET": sock(2, 10, 0x0300),
    "socket INET6 raw": sock(10, socket.SOCK_RAW, 58),
    "socket NETLINK audit": sock(16, socket.SOCK_RAW, 9),
    "socket AF_ALG": sock(38, socket.SOCK_SEQPACKET, 0),
    "socket SCTP": sock(2, socket.SOCK_STREAM, 132),
    "socketpair INET": lambda: call("socketpair", 2, 1, 0, ctypes.create_string_buffer(8)),
    "ptrace attach 1": lambda: call("ptrace", 16, 1, 0, 0),
    "ptrace attach child": with_child(lambda pid: call("ptrace", 16, pid, 0, 0)),
    "process_vm_readv": with_child(lambda pid: call("process_vm_readv", pid, 0, 0, 0, 0, 0)),
    "kcmp": with_child(lambda pid: call("kcmp", os.getpid(), pid, 0, 0, 0)),
    "pidfd_getfd": with_child(pidfd_getfd),
    # checklist 29: mount, namespaces, io_uring, bpf, keyctl and friends
    "mount": mount_tmpfs,
    "umount2": lambda: call("umount2", b"/nonexistent", 0),
    "pivot_root": lambda: call("pivot_root", b"/nonexistent", b"/nonexistent"),
    "fsopen": lambda: os.close(call("fsopen", b"tmpfs", 0)),
    "unshare user": lambda: call("unshare", 0x1000_0000),
    "unshare files": lambda: call("unshare", 0x400),
    "setns": setns,
    "clone newns": clone(0x0002_0000),
    "clone newuser": clone(0x1000_0000),
    "clone newpid": clone(0x2000_0000),
    "clone newnet": clone(0x4000_0000),
    "clone newuts": clone(0x0400_0000),
    "clone newipc": clone(0x0800_0000),
    "clone newcgroup": clone(0x0200_0000),
    "clone3": clone3,
    "bpf": lambda: call("bpf", 0, ctypes.create_string_buffer(128), 128),
    "keyctl": lambda: call("keyctl", 0, -3, 0),
    "add_key": lambda: call("add_key", b"user", b"corral", b"x", 1, -2),
    "io_uring_setup": lambda: os.close(call("io_uring_setup", 1, ctypes.create_string_buffer(120))),
    "userfaultfd": lambda: os.close(call("userfaultfd", 0)),
    "perf_event_open": lambda: call("perf_event_open", ctypes.create_string_buffer(128), 0, -1, -1, 0),
    "open_by_handle_at": lambda: call("open_by_handle_at", -100, ctypes.create_string_buffer(64), 0),
    "init_module": lambda: call("init_module", ctypes.create_string_buffer(64), 64, b""),
    "syslog": lambda: call("syslog", 10, 0, 0),
    "settimeofday": lambda: call("settimeofday", 0, 0),
    "acct": lambda: call("acct", 0),
    "personality ADDR_NO_RANDOMIZE": lambda: call("personality", 0x0040000),
    "personality READ_IMPLIES_EXEC": lambda: call("personality", 0x0400000),
    "unknown syscall": lambda: call("unknown"),
    # checklist 30: terminal injection
    "ioctl TIOCSTI": controlling_pty(termios.TIOCSTI),
    "ioctl TIOCSTI, high bits": controlling_pty((1 << 32) | termios.TIOCSTI),
    "ioctl TIOCLINUX": controlling_pty(0x541C, b"\x06"),
    # what must keep working
    "socket TCP": sock(2, socket.SOCK_STREAM),
    "socket TCP proto 6": sock(2, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, 6),
    "socket UDP": sock(2, socket.SOCK_DGRAM, 17),
    "socket TCP6": sock(10, socket.SOCK_STREAM),
    "socket UDP6": sock(10, socket.SOCK_DGRAM),
    "socket UNIX stream": sock(1, socket.SOCK_STREAM),
    "socket UNIX dgram": sock(1, socket.SOCK_DGRAM),
    "socket UNIX seqpacket": sock(1, socket.SOCK_SEQPACKET),
    "socketpair UNIX": lambda: [s.close() for s in socket.socketpair()],
    "socket NETLINK route": sock(16, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0),
    "clone plain": clone(0),
    "fork": with_child(lambda pid: None),
    "personality query": lambda: call("personality", 0xFFFF_FFFF),
    "personality PER_LINUX32": lambda: call("personality", 0x0008),
    "prctl subreaper": prctl(36, 1),
    "prctl pdeathsig": prctl(1, 9),
    "setsid": os.setsid,
    "pty ioctls": pty_ioctls,
    "getrandom": lambda: os.urandom(16),
}
if X86_64:
    probes.update({
        # 32-bit (int 0x80) and x32 system calls go through the same filter
        "i386 getpid": i386(20),
        "i386 socket UNIX": i386(359, 1, 1, 0),
        "i386 socket AF_PACKET": i386(359, 17, 3, 0),
        "i386 socketcall": i386_socketcall,
        "i386 ptrace": with_child(lambda pid: i386(26, 16, pid, 0)()),
        "i386 unshare": i386(310, 0x1000_0000),
        "i386 mount": i386(21, 0, 0, 0),
        "x32 getpid": x32(39),
        "x32 ptrace": with_child(lambda pid: x32(521, 16, pid, 0, 0)()),
    })

if "--unfiltered" in sys.argv:
    del probes["ptrace attach 1"]  # would succeed and stop this process for good
results = {name: isolated(fn) for name, fn in probes.items()}
with open("/proc/self/status") as f:
    status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
results["status"] = {k: status[k].strip() for k in ("Seccomp", "NoNewPrivs", "CapEff", "Uid")}
print(json.dumps(results))
'''
