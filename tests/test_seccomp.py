"""The seccomp profile: its shape, the algebra of its argument filters, and what it does under runc.

The unit tests need nothing (one asks `scmp_sys_resolver` when it is installed). The `runc` tests run real
containers as root: a read-only bundle over the default template's rootfs (for the probes and Python
workloads) and one over the host's own /usr (for gcc, git, curl, tar, Node.js and pip), hardened the way
Corral hardens sandboxes. Each denial is also checked in a container whose process *does* hold capabilities
inside its user namespace, and once more in that container without the filter, so a passing test shows the
filter is what stops the call.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

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

def test_rootfs() -> Path:
    """CORRAL_TEST_ROOTFS for quick iteration, else the template the rest of the suite uses (never skipped)."""
    from .conftest import DEV_ROOTFS, TEMPLATE, template_store

    if DEV_ROOTFS:
        return Path(DEV_ROOTFS)
    return Path(template_store().get(TEMPLATE).rootfs)


test_rootfs.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test
HOST_UID_BASE = 1_000_000


# --- Unit tests: the profile as data ---------------------------------------------------------------------


def _all_rules() -> list[dict[str, Any]]:
    return cast(list[dict[str, Any]], seccomp_profile()["syscalls"])


@functools.cache
def _rules(name: str) -> list[dict[str, Any]]:
    return [rule for rule in _all_rules() if name in rule["names"]]


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
    native = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}[platform.machine()]
    assert profile["architectures"] == [native]  # other ABIs are killed, see EXPECTED_FILTERED_X86
    for rule in _all_rules():
        assert set(rule) <= {"names", "action", "args", "errnoRet"}
        assert rule["names"] and rule["action"] in {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}
        assert (rule["action"] == "SCMP_ACT_ERRNO") == ("errnoRet" in rule)
    assert seccomp_profile() is not profile and seccomp_profile() == profile


def test_groups_are_disjoint() -> None:
    # The private tuples of names: the allowlist groups and the _DENY_ groups.
    groups = {
        name: value
        for name, value in vars(_seccomp).items()
        if name.startswith("_") and isinstance(value, tuple) and value and isinstance(value[0], str)
    }
    assert {"_FILE_IO", "_MISC", "_DENY_PTRACE", "_DENY_HOST"} <= set(groups)
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
    assert len(_rules(name)) == 1 and "args" not in _rules(name)[0]
    assert _decide(name, 1, 2, 3) == DENY_EPERM


def test_names_in_an_unconditional_rule_have_no_other_rule() -> None:
    # libseccomp lets an unconditional rule absorb every other rule for the same syscall.
    for rule in _all_rules():
        if "args" not in rule:
            for name in rule["names"]:
                assert _rules(name) == [rule], name


def test_no_rule_has_two_conditions_on_one_argument() -> None:
    # runc would split such a rule into one rule per condition: OR instead of AND.
    for rule in _all_rules():
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
    neighbours = [persona ^ (1 << bit) for persona in allowed for bit in range(32)]
    near = [persona + delta for persona in allowed for delta in range(-64, 65) if 0 <= persona + delta < 1 << 32]
    personas = [*range(1 << 14), *neighbours, *near, *(rng.getrandbits(32) for _ in range(10_000))]
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


# --- runc: a real bundle ---------------------------------------------------------------------------------

# In-container helper: a small Python program run as the container's process. It is self-contained (the
# template has only the standard library) and prints one JSON object.
PROBE = r'''
import ctypes, errno, fcntl, json, mmap, os, platform, resource, signal, socket, struct, sys, termios, time

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # probes killed by SIGSYS must not spend seconds dumping core

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
    # Wait for the child, not for EOF: a probe killed mid-way may leave a grandchild holding the pipe open.
    _, status = os.waitpid(pid, 0)
    os.set_blocking(r, False)
    try:
        data = os.read(r, 4096)
    except BlockingIOError:
        data = b""
    os.close(r)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
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

# Seccomp-filtered expectations, the same for the hardened process (uid 1000, no capabilities) and for a
# process holding capabilities inside its user namespace: the filter, not the missing capability, decides.
EXPECTED_FILTERED = {
    **dict.fromkeys(
        [
            "socket AF_PACKET", "socket AF_PACKET dgram", "socket INET raw", "socket INET raw nonblock",
            "socket INET SOCK_PACKET", "socket INET6 raw", "socketpair INET", "ptrace attach 1",
            "ptrace attach child", "process_vm_readv", "kcmp", "pidfd_getfd", "mount", "umount2", "pivot_root",
            "fsopen", "unshare user", "unshare files", "setns", "clone newns", "clone newuser", "clone newpid",
            "clone newnet", "clone newuts", "clone newipc", "clone newcgroup", "bpf", "keyctl", "add_key",
            "io_uring_setup", "userfaultfd", "perf_event_open", "open_by_handle_at", "init_module", "syslog",
            "settimeofday", "acct", "personality ADDR_NO_RANDOMIZE", "personality READ_IMPLIES_EXEC",
            "ioctl TIOCSTI", "ioctl TIOCSTI, high bits", "ioctl TIOCLINUX",
        ],
        "EPERM",
    ),
    **dict.fromkeys(
        [
            # not on the list, so the default answers: the same as a kernel without the feature
            "socket AF_PACKET, high bits in family", "socket NETLINK audit", "socket AF_ALG", "socket SCTP",
            "clone3", "unknown syscall",
        ],
        "ENOSYS",
    ),
    **dict.fromkeys(
        [
            "socket TCP", "socket TCP proto 6", "socket UDP", "socket TCP6", "socket UDP6", "socket UNIX stream",
            "socket UNIX dgram", "socket UNIX seqpacket", "socketpair UNIX", "socket NETLINK route",
            "clone plain", "fork", "personality query", "personality PER_LINUX32", "prctl subreaper",
            "prctl pdeathsig", "setsid", "pty ioctls", "getrandom",
        ],
        "ok",
    ),
}  # fmt: skip
# The 32-bit and x32 system call tables of an x86_64 kernel, through the same filter.
# Those ABIs are not in the filter: libseccomp's bad-architecture action kills the caller, whatever the call.
EXPECTED_FILTERED_X86 = {
    "i386 getpid": "SIGSYS",
    "i386 socket UNIX": "SIGSYS",
    "i386 socket AF_PACKET": "SIGSYS",
    "i386 socketcall": "SIGSYS",
    "i386 ptrace": "SIGSYS",
    "i386 unshare": "SIGSYS",
    "i386 mount": "SIGSYS",
    "x32 ptrace": "SIGSYS",
}
# Without the filter, a process with capabilities in its user namespace gets all of these: each denial
# above is the filter's doing.
SUCCEEDS_UNFILTERED = [
    "socket AF_PACKET", "socket AF_PACKET dgram", "socket AF_PACKET, high bits in family", "socket INET raw",
    "socket INET SOCK_PACKET", "socket INET6 raw", "ptrace attach child", "process_vm_readv", "kcmp",
    "pidfd_getfd", "mount", "fsopen", "unshare user", "unshare files", "setns", "clone newns", "clone newuser",
    "clone newpid", "clone newnet", "clone newuts", "clone newipc", "clone newcgroup", "clone3", "keyctl",
    "add_key", "personality ADDR_NO_RANDOMIZE", "personality READ_IMPLIES_EXEC",
]  # fmt: skip

# createRuntime hook: bring up loopback in the container's fresh network namespace, so TCP to 127.0.0.1
# works inside (a sandbox gets the same from Corral's own setup).
LOOPBACK_UP = r"""
import ctypes, fcntl, json, os, socket, struct, sys
pid = json.load(sys.stdin)["pid"]
libc = ctypes.CDLL(None, use_errno=True)
if libc.setns(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY), 0x40000000) != 0:
    raise OSError(ctypes.get_errno(), "setns")
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))
"""

ALL_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_CHROOT",
    "CAP_MKNOD", "CAP_SYS_RESOURCE",
]  # fmt: skip


def _oci_config(
    args: list[str], *, rootfs: Path, mounts: list[dict[str, Any]], seccomp: bool, capable: bool
) -> dict[str, Any]:
    caps = ALL_CAPS if capable else []
    linux: dict[str, Any] = {
        "uidMappings": [{"containerID": 0, "hostID": HOST_UID_BASE, "size": 65536}],
        "gidMappings": [{"containerID": 0, "hostID": HOST_UID_BASE, "size": 65536}],
        "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network", "cgroup", "user")],
        "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
        "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"],
    }
    if seccomp:
        linux["seccomp"] = seccomp_profile()
    tmpfs = ["nosuid", "nodev", "mode=1777", "size=262144k"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0} if capable else {"uid": 1000, "gid": 1000},
            "args": args,
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "LANG=C.UTF-8", "TMPDIR=/tmp"],
            "cwd": "/tmp",
            "capabilities": {kind: caps for kind in ("bounding", "effective", "inheritable", "permitted")},
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": tmpfs},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "nodev"]},
            {"destination": "/sys", "type": "none", "source": "/sys", "options": ["rbind", "nosuid", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmpfs},
            *mounts,
        ],
        "hooks": {"createRuntime": [{"path": sys.executable, "args": ["python", "-c", LOOPBACK_UP]}]},
        "linux": linux,
    }


class Runc:
    """One command per throwaway container; each container is force-deleted however the run ends."""

    def __init__(self, workdir: Path, rootfs: Path) -> None:
        self.workdir = workdir
        self.rootfs = rootfs
        self.state = workdir / "runc"

    def run(
        self,
        args: list[str],
        *,
        rootfs: Path | None = None,
        mounts: list[dict[str, Any]] | None = None,
        seccomp: bool = True,
        capable: bool = False,
        timeout: float = 240,
    ) -> subprocess.CompletedProcess[str]:
        container = f"corral-seccomp-{uuid.uuid4().hex[:12]}"
        bundle = self.workdir / container
        bundle.mkdir()
        config = _oci_config(args, rootfs=rootfs or self.rootfs, mounts=mounts or [], seccomp=seccomp,
                             capable=capable)
        (bundle / "config.json").write_text(json.dumps(config))
        runc = ["runc", "--root", str(self.state)]
        try:
            return subprocess.run(
                [*runc, "run", "--bundle", str(bundle), container],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            subprocess.run([*runc, "delete", "--force", container], capture_output=True, timeout=60)


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def _python(source: str, *argv: str) -> list[str]:
    """A command that saves `source` as /tmp/main.py and runs it (spawned multiprocessing needs a file)."""
    return ["sh", "-c", 'printf %s "$1" > /tmp/main.py && shift && exec python3 /tmp/main.py "$@"', "sh", source, *argv]


@pytest.fixture(scope="module")
def runc(tmp_path_factory: pytest.TempPathFactory) -> Runc:
    if os.geteuid() != 0 or shutil.which("runc") is None:
        pytest.fail("the seccomp tests need root and runc (scripts/install installs it)", pytrace=False)
    rootfs = test_rootfs()
    if not (rootfs / "usr/bin/python3").exists():
        pytest.fail(f"no rootfs with python3 at {rootfs}", pytrace=False)
    return Runc(tmp_path_factory.mktemp("seccomp"), rootfs)


@pytest.fixture(scope="module")
def host_rootfs() -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """A rootfs of the host's own /usr and /etc, read-only, for the toolchain the template lacks."""
    # Not under pytest's tmp: the container's root (an unprivileged host uid) must be able to reach it.
    root = Path(tempfile.mkdtemp(prefix="corral-seccomp-", dir="/var/tmp"))
    try:
        root.chmod(0o755)
        for name in ("usr", "etc", "proc", "dev", "sys", "tmp"):
            (root / name).mkdir()
        (root / "tmp").chmod(0o1777)  # runc gives a tmpfs the mode of the directory it covers
        for name in ("bin", "lib", "lib64", "sbin"):
            if (Path("/") / name).is_symlink():
                (root / name).symlink_to(f"usr/{name}")
        options = ["bind", "ro", "nosuid", "nodev"]
        mounts = [
            {"destination": f"/{name}", "type": "bind", "source": f"/{name}", "options": options}
            for name in ("usr", "etc")
        ]
        yield root, mounts
    finally:
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def probe_results(runc: Runc) -> Callable[[str], dict[str, Any]]:
    cache: dict[str, dict[str, Any]] = {}

    def results(mode: str) -> dict[str, Any]:
        if mode not in cache:
            if mode == "hardened":
                result = runc.run(["python3", "-c", PROBE])
            elif mode == "capable":
                result = runc.run(["python3", "-c", PROBE], capable=True)
            else:
                result = runc.run(["python3", "-c", PROBE, "--unfiltered"], capable=True, seccomp=False)
            cache[mode] = json.loads(_ok(result))
        return cache[mode]

    return results


def _expected(results: dict[str, Any]) -> dict[str, str]:
    expected = dict(EXPECTED_FILTERED)
    if "i386 getpid" in results:
        expected.update(EXPECTED_FILTERED_X86)
    return expected


@pytest.mark.runc
@pytest.mark.parametrize("mode", ["hardened", "capable"])
def test_probes_under_the_filter(probe_results: Callable[[str], dict[str, Any]], mode: str) -> None:
    results = probe_results(mode)
    expected = _expected(results)
    assert {name: results[name] for name in expected} == expected


@pytest.mark.runc
def test_probes_need_the_filter(probe_results: Callable[[str], dict[str, Any]]) -> None:
    results = probe_results("unfiltered")
    assert results["status"]["Seccomp"] == "0"
    succeeds = list(SUCCEEDS_UNFILTERED)
    if Path("/proc/sys/dev/tty/legacy_tiocsti").read_text().strip() == "1":
        succeeds += ["ioctl TIOCSTI", "ioctl TIOCSTI, high bits"]
    if results.get("i386 getpid") == "ok":
        succeeds += ["i386 socket AF_PACKET", "i386 socketcall", "i386 ptrace", "i386 unshare"]
    assert {name: results[name] for name in succeeds} == dict.fromkeys(succeeds, "ok")


@pytest.mark.runc
def test_checklist_4_no_capabilities_no_new_privs_seccomp(probe_results: Callable[[str], dict[str, Any]]) -> None:
    status = probe_results("hardened")["status"]
    assert status == {"Seccomp": "2", "NoNewPrivs": "1", "CapEff": "0000000000000000", "Uid": "1000\t1000\t1000\t1000"}


@pytest.mark.runc
def test_checklist_28_raw_sockets_and_ptrace(probe_results: Callable[[str], dict[str, Any]]) -> None:
    results = probe_results("hardened")
    assert results["socket AF_PACKET"] == results["ptrace attach 1"] == "EPERM"


@pytest.mark.runc
def test_checklist_29_mount_unshare_io_uring_bpf_keyctl(probe_results: Callable[[str], dict[str, Any]]) -> None:
    results = probe_results("hardened")
    for probe in ("mount", "unshare user", "io_uring_setup", "bpf", "keyctl"):
        assert results[probe] in {"EPERM", "ENOSYS"}, probe


@pytest.mark.runc
def test_checklist_30_tiocsti(probe_results: Callable[[str], dict[str, Any]]) -> None:
    assert probe_results("hardened")["ioctl TIOCSTI"] == "EPERM"


BASH_WORKLOAD = r"""
set -euo pipefail
cd /tmp
seq 1 2000 | sort -rn | sed -n 1,3p | paste -sd, -
printf 'b\na\nc\na\n' > f.txt
sort f.txt | uniq -c | sort -rn | sed -n 1p | tr -s ' '
mkdir -p d/e && touch d/e/x && ln -s x d/e/y && ln d/e/x d/e/z && chmod 640 d/e/x && stat -c %a d/e/x
cp -a d d2 && mv d2 d3 && rm -r d3 && du -s d > /dev/null && df /tmp > /dev/null
mkfifo p && { echo through-fifo > p & } && cat p && wait
echo hello | sha256sum | cut -c1-8
timeout 5 sleep 0.1 && date +%Y > /dev/null && nproc > /dev/null && id -un
split -l 1 f.txt part. && ls part.* | wc -l
{ echo a; echo b; } | xargs -n1 echo | tr a-z A-Z | paste -sd' ' -
head -c 100000 /dev/zero | gzip -c | gunzip -c | wc -c
tar -cf t.tar d && tar -tf t.tar | wc -l
coproc { read -r line; echo "co:$line"; }; echo ping >&"${COPROC[1]}"; read -r reply <&"${COPROC[0]}"; echo "$reply"
( sleep 0.1; echo sub ) & wait
trap 'echo trapped' USR1; kill -USR1 $$
echo done
"""


@pytest.mark.runc
def test_bash_and_coreutils(runc: Runc) -> None:
    lines = _ok(runc.run(["bash", "-c", BASH_WORKLOAD])).splitlines()
    assert lines == [
        "2000,1999,1998", " 2 a", "640", "through-fifo", "5891b5b5", "user", "4", "A B", "100000", "5",
        "co:ping", "sub", "trapped", "done",
    ]  # fmt: skip


PYTHON_WORKLOAD = r"""
import asyncio, concurrent.futures, json, multiprocessing, os, resource, shutil, signal, subprocess
import tempfile, threading, time
from multiprocessing import shared_memory


def square(x):
    return x * x


async def echo(reader, writer):
    writer.write(await reader.readline())
    await writer.drain()
    writer.close()


async def roundtrip(reader, writer, line):
    writer.write(line)
    answer = await reader.readline()
    writer.close()
    return answer == line


async def asyncio_checks():
    out = {}
    proc = await asyncio.create_subprocess_exec("sh", "-c", "echo async", stdout=asyncio.subprocess.PIPE)
    out["asyncio subprocess"] = (await proc.communicate())[0] == b"async\n"
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    out["asyncio tcp"] = await roundtrip(*await asyncio.open_connection("127.0.0.1", port), b"tcp\n")
    server.close()
    server = await asyncio.start_unix_server(echo, "/tmp/echo.sock")
    out["asyncio unix"] = await roundtrip(*await asyncio.open_unix_connection("/tmp/echo.sock"), b"unix\n")
    server.close()
    out["asyncio to_thread"] = await asyncio.to_thread(square, 7) == 49
    loop = asyncio.get_running_loop()
    got = loop.create_future()
    loop.add_signal_handler(signal.SIGUSR1, got.set_result, "signal")
    os.kill(os.getpid(), signal.SIGUSR1)
    out["asyncio signal"] = await asyncio.wait_for(got, 10) == "signal"
    return out


def main():
    out = {}
    seen, lock = [], threading.Lock()

    def work(i):
        with lock:
            seen.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["threads"] = sorted(seen) == list(range(16))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out["thread pool"] = sum(pool.map(square, range(10))) == 285
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        out["process pool"] = list(pool.map(square, range(4))) == [0, 1, 4, 9]
    run = subprocess.run(["sh", "-c", "echo $((6 * 7))"], capture_output=True, text=True, check=True)
    out["subprocess"] = run.stdout == "42\n"
    seq = subprocess.Popen(["seq", "100"], stdout=subprocess.PIPE)
    wc = subprocess.run(["wc", "-l"], stdin=seq.stdout, capture_output=True, text=True)
    out["subprocess pipeline"] = seq.wait() == 0 and wc.stdout.strip() == "100"
    pid = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 3"], dict(os.environ))
    out["posix_spawn"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3
    for method in ("fork", "spawn", "forkserver"):
        ctx = multiprocessing.get_context(method)
        with ctx.Pool(2) as pool:
            out[f"pool {method}"] = pool.map(square, range(5)) == [0, 1, 4, 9, 16]
        queue = ctx.Queue()
        process = ctx.Process(target=queue.put, args=(method,))
        process.start()
        out[f"queue {method}"] = queue.get(timeout=60) == method
        process.join()
    shm = shared_memory.SharedMemory(create=True, size=4096)
    shm.buf[0] = 7
    other = shared_memory.SharedMemory(shm.name)
    out["shared memory"] = other.buf[0] == 7
    other.close()
    shm.close()
    shm.unlink()
    out.update(asyncio.run(asyncio_checks()))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "a")
        with open(src, "wb") as f:
            f.write(os.urandom(1 << 20))
        shutil.copy2(src, src + ".copy")
        os.replace(src + ".copy", src + ".moved")
        with open(src, "rb") as a, open(src + ".moved", "rb") as b:
            out["files"] = a.read() == b.read()
    fired = []
    signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    time.sleep(0.3)
    out["itimer"] = fired == [1]
    out["limits"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 0 and len(os.sched_getaffinity(0)) > 0
    print(json.dumps(out))


if __name__ == "__main__":
    main()
"""


@pytest.mark.runc
@pytest.mark.slow
def test_python_threads_subprocess_multiprocessing_asyncio(runc: Runc) -> None:
    out = json.loads(_ok(runc.run(_python(PYTHON_WORKLOAD))))
    assert len(out) == 21
    assert [name for name, ok in out.items() if not ok] == []


@pytest.mark.runc
def test_python_venv(runc: Runc) -> None:
    script = (
        "python3 -m venv --without-pip /tmp/venv && "
        "/tmp/venv/bin/python -c 'import sys; print(sys.prefix != sys.base_prefix)'"
    )
    assert _ok(runc.run(["sh", "-c", script])) == "True\n"


AGENT_WORKLOAD = r"""
import ctypes, fcntl, json, os, signal, socket, struct, termios, time

libc = ctypes.CDLL(None, use_errno=True)
out = {"subreaper": libc.prctl(36, 1, 0, 0, 0) == 0}  # PR_SET_CHILD_SUBREAPER

# A double fork: the orphaned grandchild comes back to us.
child = os.fork()
if child == 0:
    if os.fork() == 0:
        time.sleep(0.2)
        os._exit(7)
    os._exit(0)
os.waitpid(child, 0)
out["reaps orphans"] = os.waitstatus_to_exitcode(os.waitpid(-1, 0)[1]) == 7

# A terminal session: setsid, TIOCSCTTY, TIOCSWINSZ; the shell sees the size and typed input.
master, slave = os.openpty()
fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
pid = os.fork()
if pid == 0:
    os.close(master)
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    for fd in (0, 1, 2):
        os.dup2(slave, fd)
    os.execvp("bash", ["bash", "-c", "stty size; tty; read -r line; echo got:$line"])
os.close(slave)
os.write(master, b"hello\n")
data = b""
while True:
    try:
        chunk = os.read(master, 4096)
    except OSError:  # EIO once the shell is gone
        break
    if not chunk:
        break
    data += chunk
out["pty exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
text = data.decode()
out["pty size"] = "33 101" in text
out["pty tty"] = "/dev/pts/" in text
out["pty input"] = "got:hello" in text
fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))

# The agent's Unix socket, with descriptor passing and peer credentials.
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("/tmp/agent.sock")
server.listen()
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect("/tmp/agent.sock")
conn, _ = server.accept()
r, w = os.pipe()
socket.send_fds(client, [b"fd"], [r])
msg, fds, _, _ = socket.recv_fds(conn, 16, 1)
os.write(w, b"x")
out["fd passing"] = msg == b"fd" and os.read(fds[0], 1) == b"x"
peer_pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
out["peer credentials"] = peer_pid == os.getpid()

# A process group in its own session, killed as a whole; its orphans are reaped here.
leader = os.fork()
if leader == 0:
    os.setsid()
    os.execvp("sh", ["sh", "-c", "sleep 60 & sleep 60 & wait"])
time.sleep(0.3)
os.killpg(leader, signal.SIGKILL)
out["killpg"] = os.WIFSIGNALED(os.waitpid(leader, 0)[1])
deadline = time.monotonic() + 10
reaped = 0
while reaped < 2 and time.monotonic() < deadline:
    try:
        if os.waitpid(-1, os.WNOHANG)[0]:
            reaped += 1
        else:
            time.sleep(0.05)
    except ChildProcessError:
        break
out["group gone"] = reaped == 2

# Parent-death signal.
child = os.fork()
if child == 0:
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os._exit(0)
out["pdeathsig"] = os.waitpid(child, 0)[1] == 0
print(json.dumps(out))
"""


@pytest.mark.runc
def test_agent_primitives(runc: Runc) -> None:
    out = json.loads(_ok(runc.run(_python(AGENT_WORKLOAD))))
    assert out == dict.fromkeys(out, True)
    assert len(out) == 11


TOOLCHAIN = {
    "gcc": (
        r"""
set -eu
cat > hello.c <<'EOF'
#include <pthread.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
static void *run(void *arg) { return arg; }
int main(void) {
    pthread_t t; void *r; int status;
    pthread_create(&t, NULL, run, "thread"); pthread_join(t, &r);
    pid_t pid = fork();
    if (pid == 0) { execlp("true", "true", (char *)NULL); _exit(127); }
    waitpid(pid, &status, 0);
    printf("%s %d\n", (char *)r, WEXITSTATUS(status));
    return 0;
}
EOF
gcc -O2 -Wall -pthread hello.c -o hello && ./hello
gcc -c hello.c -o hello.o && gcc -fuse-ld=bfd -pthread hello.o -o hello2 && ./hello2
ld --version | head -n 1 | cut -d' ' -f1-2
""",
        "thread 0\nthread 0\nGNU ld\n",
    ),
    "g++": (
        r"""
set -eu
cat > hello.cpp <<'EOF'
#include <future>
#include <iostream>
#include <thread>
int main() {
    auto answer = std::async(std::launch::async, [] { return 6 * 7; });
    std::thread t([] {}); t.join();
    std::cout << "cpp " << answer.get() << std::endl;
}
EOF
g++ -O2 -pthread hello.cpp -o hello && ./hello
""",
        "cpp 42\n",
    ),
    "git": (
        r"""
set -eu
git config --global user.name Corral && git config --global user.email corral@example.invalid
git config --global init.defaultBranch main
git init -q repo && cd repo && echo one > a && git add a && git commit -qm one
git checkout -qb feature && echo two >> a && git commit -qam two && git checkout -q main && git merge -q feature
git log --oneline | wc -l && git gc -q && git fsck --no-progress --no-dangling
git clone -q /tmp/repo /tmp/clone && tail -n 1 /tmp/clone/a && git -C /tmp/clone status --short | wc -l
""",
        "2\ntwo\n0\n",
    ),
    "tar": (
        r"""
set -eu
mkdir -p src/d && echo data > src/d/f && ln -s f src/d/link && chmod 640 src/d/f
tar -czf a.tgz -C src . && mkdir gz && tar -xzf a.tgz -C gz
stat -c %a gz/d/f && readlink gz/d/link && cat gz/d/link
tar -cJf a.txz -C src . && mkdir xz && tar -xJf a.txz -C xz && cmp gz/d/f xz/d/f && echo same
""",
        "640\nf\ndata\nsame\n",
    ),
    "curl": (
        r"""
set -eu
mkdir www && echo from-server > www/index.html
python3 -m http.server --bind 127.0.0.1 8765 --directory www > /dev/null 2>&1 &
for i in $(seq 100); do curl -sf http://127.0.0.1:8765/index.html && break; sleep 0.1; done
curl -s -o /dev/null -w '%{http_code}\n' http://localhost:8765/missing
kill %1
""",
        "from-server\n404\n",
    ),
    "node": (
        r"""
node -e '
const http = require("http"), cp = require("child_process"), fs = require("fs");
const { Worker } = require("worker_threads"), zlib = require("zlib"), crypto = require("crypto");
const server = http.createServer((req, res) => res.end("node-ok")).listen(0, "127.0.0.1", async () => {
  const body = await (await fetch(`http://127.0.0.1:${server.address().port}/`)).text();
  const child = cp.execSync("echo child").toString().trim();
  const worker = await new Promise((resolve, reject) => {
    const w = new Worker("require(\"worker_threads\").parentPort.postMessage(6 * 7)", { eval: true });
    w.on("message", resolve); w.on("error", reject);
  });
  await fs.promises.writeFile("/tmp/n.gz", zlib.gzipSync(crypto.randomBytes(1000)));
  const unzipped = zlib.gunzipSync(fs.readFileSync("/tmp/n.gz")).length;
  console.log(JSON.stringify({ body, child, worker, unzipped }));
  server.close();
});'
""",
        '{"body":"node-ok","child":"child","worker":42,"unzipped":1000}\n',
    ),
    "pip": (
        r"""
set -eu
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
python3 -m venv --system-site-packages /tmp/venv  # the host's setuptools and wheel build the package
mkdir -p pkg/corral_probe && echo 'VALUE = 42' > pkg/corral_probe/__init__.py
printf '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n' > pkg/pyproject.toml
printf '[project]\nname = "corral-probe"\nversion = "1.0"\n' >> pkg/pyproject.toml
/tmp/venv/bin/pip install -q --no-build-isolation ./pkg
/tmp/venv/bin/python -c 'import corral_probe; print(corral_probe.VALUE)'
/tmp/venv/bin/pip list --format=freeze | grep -c '^corral-probe=='
""",
        "42\n1\n",
    ),
}
# The binary each toolchain test needs from the host's /usr.
TOOL_BINARIES = {
    "gcc": "gcc",
    "g++": "g++",
    "git": "git",
    "tar": "xz",
    "curl": "curl",
    "node": "node",
    "pip": "python3",
}


@pytest.mark.runc
@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(TOOLCHAIN))
def test_toolchain(runc: Runc, host_rootfs: tuple[Path, list[dict[str, Any]]], tool: str) -> None:
    if shutil.which(TOOL_BINARIES[tool]) is None or not Path("/usr/bin", TOOL_BINARIES[tool]).exists():
        pytest.skip(f"{TOOL_BINARIES[tool]} is not installed in the host's /usr")
    if tool == "pip" and subprocess.run(["/usr/bin/python3", "-c", "import ensurepip"]).returncode != 0:
        pytest.skip("the host's python3 has no ensurepip")
    script, expected = TOOLCHAIN[tool]
    rootfs, mounts = host_rootfs
    assert _ok(runc.run(["bash", "-c", script], rootfs=rootfs, mounts=mounts)) == expected
