"""Corral's own seccomp profile: the `linux.seccomp` object of every runc bundle.

Written from the Linux syscall table, one purpose-group at a time, for what sandboxed code actually runs:
bash and coreutils, Python 3.11 (threads, subprocess, multiprocessing, asyncio), pip, Node.js, gcc/g++/ld,
git, curl, tar and Corral's in-sandbox agent.

```
syscall                          what the sandbox gets
 anything not listed below       ENOSYS: looks like an older kernel, so glibc, Python and Node fall back
 clone3                          ENOSYS on purpose: its flags sit in memory and cannot be filtered, and
                                 glibc falls back to clone, which is filtered
 the allowlist groups            allowed
 DENIED_SYSCALLS                 EPERM: ptrace, mount, namespaces, bpf, keyrings, io_uring, perf, ...
 clone                           allowed without namespace flags, EPERM with any of them
 socket                          Unix, TCP/UDP/ping over IPv4 and IPv6, netlink route only;
                                 EPERM for packet sockets and raw or SOCK_PACKET IP sockets
 ioctl                           allowed, except EPERM for TIOCSTI (typing into a terminal) and TIOCLINUX
 personality                     the harmless personas and the query allowed, EPERM for anything else
```

How runc 1.1 and libseccomp 2.5 read this, measured with runc and pinned down by `tests/test_seccomp.py`:

- A name libseccomp does not know is skipped without an error, so newer syscalls can be listed today and
  take effect once libseccomp learns them; until then they get the default ENOSYS.
- Several rules for one syscall are not resolved by "most restrictive wins". A rule with fewer conditions
  that overlaps a longer one silently absorbs it (an unconditional `ioctl` allow would swallow the TIOCSTI
  denial), and the reverse order fails with EEXIST. So for every filtered syscall the rules here are
  *disjoint*: each argument vector matches at most one rule, and the complements are spelled out as
  masked-equality patterns (`_all_but`).
- runc turns a rule with two conditions on the same argument into separate rules (OR, not AND), so no rule
  here has more than one condition per argument.
- On 32-bit x86, libseccomp copies every socket rule onto the socketcall multiplexer with its first
  condition replaced by the call number, so `socket(AF_UNIX)` allowed would mean `socketcall(SYS_SOCKET)`
  of any family allowed. socketcall is therefore denied outright (`_DENY_SOCKETCALL`).
- Argument comparisons are 64-bit, but the kernel reads `int`/`unsigned int` arguments from the low 32 bits.
  Exact matches that allow use the full value (stray high bits fall through to a denial); patterns that deny
  look at the low 32 bits only, as the kernel does.
"""

from __future__ import annotations

import errno
import platform
from collections.abc import Iterable, Sequence

__all__ = [
    "ALLOWED_SYSCALLS",
    "ARCHITECTURES",
    "DENIED_SYSCALLS",
    "ENOSYS_SYSCALLS",
    "FILTERED_SYSCALLS",
    "seccomp_profile",
]

# Only the host's native ABI. x86_64 hosts could also run 32-bit (int 0x80) and x32 code, arm64 hosts 32-bit
# arm code; those ABIs are not in the filter, so libseccomp's bad-architecture action kills any process that
# tries them (the tests prove it). Listing them would let 32-bit programs run, and made runc compile a filter
# five times larger: ~110 ms more per sandbox start.
_NATIVE = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64", "arm64": "SCMP_ARCH_AARCH64"}
ARCHITECTURES = (_NATIVE.get(platform.machine(), "SCMP_ARCH_NATIVE"),)

# --- The allowlist, by purpose -------------------------------------------------------------------------
# Names that exist only on some architectures (the 32-bit *64 and *_time64 variants, arm's private calls)
# sit next to their 64-bit twins; libseccomp resolves each name per architecture.

# Reading and writing open files, and opening and closing them. The *64 names are the 32-bit ABI forms.
_FILE_IO = (
    "read", "readv", "pread64", "preadv", "preadv2",
    "write", "writev", "pwrite64", "pwritev", "pwritev2",
    "open", "openat", "openat2", "creat", "close", "close_range",
    "dup", "dup2", "dup3", "fcntl", "fcntl64", "flock",
    "lseek", "_llseek",
    "sendfile", "sendfile64", "copy_file_range", "splice", "tee", "vmsplice",
    "truncate", "truncate64", "ftruncate", "ftruncate64", "fallocate",
    "fsync", "fdatasync", "sync", "syncfs",
    "sync_file_range", "arm_sync_file_range",
    "fadvise64", "fadvise64_64", "arm_fadvise64_64", "readahead", "cachestat",
    # Linux native AIO (databases, some build tools); bounded by fs.aio-max-nr.
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents",
    "io_pgetevents", "io_pgetevents_time64",
)  # fmt: skip

# Walking and changing the directory tree: names, links, special files, file-change notification.
_DIRECTORIES = (
    "getcwd", "chdir", "fchdir",
    "getdents", "getdents64",
    "mkdir", "mkdirat", "rmdir",
    "rename", "renameat", "renameat2",
    "link", "linkat", "unlink", "unlinkat",
    "symlink", "symlinkat", "readlink", "readlinkat",
    # FIFOs and socket files; device nodes need CAP_MKNOD, which nobody in the sandbox has.
    "mknod", "mknodat",
    "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
)  # fmt: skip

# File metadata: stat, permissions, ownership, times, extended attributes.
_METADATA = (
    "stat", "stat64", "lstat", "lstat64", "fstat", "fstat64",
    "newfstatat", "fstatat64", "statx",
    "statfs", "statfs64", "fstatfs", "fstatfs64",
    "access", "faccessat", "faccessat2",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "umask",
    "chown", "chown32", "fchown", "fchown32", "lchown", "lchown32", "fchownat",
    "utime", "utimes", "futimesat", "utimensat", "utimensat_time64",
    "getxattr", "lgetxattr", "fgetxattr", "getxattrat",
    "setxattr", "lsetxattr", "fsetxattr", "setxattrat",
    "listxattr", "llistxattr", "flistxattr", "listxattrat",
    "removexattr", "lremovexattr", "fremovexattr", "removexattrat",
)  # fmt: skip

# The process's own memory: mappings, protection, locking (capped by RLIMIT_MEMLOCK), NUMA policy.
_MEMORY = (
    "brk", "mmap", "mmap2", "munmap", "mremap", "mprotect", "madvise", "mincore", "msync",
    "mlock", "mlock2", "munlock", "mlockall", "munlockall",
    "pkey_alloc", "pkey_free", "pkey_mprotect", "mseal", "map_shadow_stack",
    "memfd_create", "membarrier",
    "get_mempolicy", "set_mempolicy", "mbind",
    # arm: JIT compilers (V8) flush the instruction cache after writing code.
    "cacheflush",
)  # fmt: skip

# Processes and threads: creation (clone is filtered separately), exec, exit, waiting, ids, sessions,
# scheduling, limits, credentials. setuid and friends only move between ids the process already holds,
# capset only drops: without capabilities neither can gain anything.
_PROCESSES = (
    "fork", "vfork", "execve", "execveat", "exit", "exit_group",
    "wait4", "waitid", "waitpid",
    "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "restart_syscall",
    "futex", "futex_time64", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue",
    "arch_prctl", "set_thread_area", "get_thread_area", "set_tls",
    "prctl", "seccomp",
    "getpid", "getppid", "gettid", "getpgid", "setpgid", "getpgrp", "getsid", "setsid",
    "pidfd_open", "pidfd_send_signal",
    "sched_yield", "sched_getaffinity", "sched_setaffinity",
    "sched_getparam", "sched_setparam", "sched_getscheduler", "sched_setscheduler",
    "sched_getattr", "sched_setattr", "sched_get_priority_min", "sched_get_priority_max",
    "sched_rr_get_interval", "sched_rr_get_interval_time64",
    "getpriority", "setpriority", "nice", "ioprio_get", "ioprio_set", "getcpu",
    "getrlimit", "ugetrlimit", "setrlimit", "prlimit64", "getrusage", "times",
    "getuid", "getuid32", "geteuid", "geteuid32", "getgid", "getgid32", "getegid", "getegid32",
    "getresuid", "getresuid32", "getresgid", "getresgid32", "getgroups", "getgroups32",
    "setuid", "setuid32", "setgid", "setgid32", "setreuid", "setreuid32", "setregid", "setregid32",
    "setresuid", "setresuid32", "setresgid", "setresgid32", "setgroups", "setgroups32",
    "setfsuid", "setfsuid32", "setfsgid", "setfsgid32",
    "capget", "capset",
)  # fmt: skip

# Signals: handlers, masks, waiting, sending (only to processes in the sandbox's own pid namespace).
_SIGNALS = (
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend",
    "rt_sigtimedwait", "rt_sigtimedwait_time64", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "sigaction", "sigprocmask", "sigreturn", "sigpending", "sigsuspend",
    "sigaltstack", "signalfd", "signalfd4",
    "kill", "tkill", "tgkill", "pause", "alarm",
)  # fmt: skip

# Reading clocks, sleeping, timers. Setting the clock is denied (DENIED_SYSCALLS).
_TIME = (
    "clock_gettime", "clock_gettime64", "clock_getres", "clock_getres_time64",
    "clock_nanosleep", "clock_nanosleep_time64", "nanosleep", "gettimeofday", "time",
    "getitimer", "setitimer",
    "timer_create", "timer_delete", "timer_getoverrun",
    "timer_settime", "timer_settime64", "timer_gettime", "timer_gettime64",
    "timerfd_create", "timerfd_settime", "timerfd_settime64", "timerfd_gettime", "timerfd_gettime64",
)  # fmt: skip

# Everything on sockets once they exist. Creating them is filtered (`_socket_rules`); socketpair only
# makes Unix sockets in practice and is held to AF_UNIX there too. On 32-bit x86, libseccomp turns each
# of these into a rule on the socketcall multiplexer, which is itself never allowed wholesale.
_SOCKETS = (
    "bind", "listen", "accept", "accept4", "connect", "shutdown",
    "getsockname", "getpeername", "getsockopt", "setsockopt",
    "sendto", "send", "sendmsg", "sendmmsg",
    "recvfrom", "recv", "recvmsg", "recvmmsg", "recvmmsg_time64",
)  # fmt: skip

# Waiting on many file descriptors.
_POLLING = (
    "poll", "ppoll", "ppoll_time64", "select", "_newselect", "pselect6", "pselect6_time64",
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2",
)  # fmt: skip

# Talking to other processes in the sandbox: pipes, eventfds, System V and POSIX IPC (the IPC namespace
# is the sandbox's own).
_IPC = (
    "pipe", "pipe2", "eventfd", "eventfd2",
    "shmget", "shmat", "shmdt", "shmctl",
    "semget", "semop", "semtimedop", "semtimedop_time64", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "mq_open", "mq_unlink", "mq_notify", "mq_getsetattr",
    "mq_timedsend", "mq_timedsend_time64", "mq_timedreceive", "mq_timedreceive_time64",
)  # fmt: skip

# Small things everybody calls. Landlock only ever narrows what a process may do.
_MISC = (
    "uname", "sysinfo", "getrandom",
    "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
)  # fmt: skip

_GROUPS = (_FILE_IO, _DIRECTORIES, _METADATA, _MEMORY, _PROCESSES, _SIGNALS, _TIME, _SOCKETS, _POLLING, _IPC, _MISC)
ALLOWED_SYSCALLS: tuple[str, ...] = tuple(sorted({name for group in _GROUPS for name in group}))

# --- Denied with EPERM ---------------------------------------------------------------------------------
# Each of these is either a way out of the sandbox, a large slice of kernel attack surface, or a host-wide
# setting. EPERM (not ENOSYS) so that programs report "Operation not permitted" instead of probing for
# fallbacks that would not help them.

# Looking into or controlling other processes.
_DENY_PTRACE = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp")
# 32-bit x86's socket multiplexer: its arguments sit in memory, out of the filter's sight (see the module
# doc). 32-bit programs still have the direct socket syscalls (Linux 4.3+), filtered like everyone else's.
_DENY_SOCKETCALL = ("socketcall",)
# New or other namespaces (clone with namespace flags is denied in `_clone_rules`).
_DENY_NAMESPACES = ("unshare", "setns")
# Mounting, old and new API.
_DENY_MOUNTS = (
    "mount", "umount", "umount2", "pivot_root", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "open_tree_attr",
)  # fmt: skip
# Kernel subsystems with a long record of privilege-escalation bugs.
_DENY_ATTACK_SURFACE = (
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "lookup_dcookie", "open_by_handle_at", "name_to_handle_at",
)  # fmt: skip
# The host's kernel, devices, clock and log.
_DENY_HOST = (
    "init_module", "finit_module", "delete_module", "create_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct",
    "quotactl", "quotactl_fd", "iopl", "ioperm", "vhangup", "syslog",
    "settimeofday", "stime", "clock_settime", "clock_settime64",
    "adjtimex", "clock_adjtime", "clock_adjtime64",
)  # fmt: skip

DENIED_SYSCALLS: tuple[str, ...] = tuple(
    sorted({*_DENY_PTRACE, *_DENY_SOCKETCALL, *_DENY_NAMESPACES, *_DENY_MOUNTS, *_DENY_ATTACK_SURFACE, *_DENY_HOST})
)

# Listed only to say so: the default action already answers ENOSYS.
ENOSYS_SYSCALLS: tuple[str, ...] = ("clone3",)

# Allowed or denied depending on their arguments, by the rules below.
FILTERED_SYSCALLS: tuple[str, ...] = ("clone", "ioctl", "personality", "socket", "socketpair")

# --- Argument filters ----------------------------------------------------------------------------------

_ALLOW = "SCMP_ACT_ALLOW"
_ERRNO = "SCMP_ACT_ERRNO"
_LOW32 = 0xFFFF_FFFF

# clone(2) flags that make new namespaces: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_CLONE_NAMESPACES = (0x0002_0000, 0x0200_0000, 0x0400_0000, 0x0800_0000, 0x1000_0000, 0x2000_0000, 0x4000_0000)
_CLONE_NAMESPACE_MASK = sum(_CLONE_NAMESPACES)  # 0x7E020000

_AF_UNIX, _AF_INET, _AF_INET6, _AF_NETLINK, _AF_PACKET = 1, 2, 10, 16, 17
_SOCK_STREAM, _SOCK_DGRAM, _SOCK_RAW, _SOCK_PACKET = 1, 2, 3, 10
_SOCK_TYPE_MASK = 0xF  # the rest of the type argument is SOCK_NONBLOCK / SOCK_CLOEXEC
_IPPROTO_IP, _IPPROTO_ICMP, _IPPROTO_TCP, _IPPROTO_UDP, _IPPROTO_ICMPV6 = 0, 1, 6, 17, 58
_NETLINK_ROUTE = 0

# (family, type, protocol) a sandbox may create; None means any. Protocols are pinned so that an
# unprivileged socket() cannot make the kernel load SCTP, DCCP or other rarely used protocol modules.
_SOCKETS_ALLOWED: tuple[tuple[int, int | None, int | None], ...] = (
    (_AF_UNIX, None, None),
    (_AF_INET, _SOCK_STREAM, _IPPROTO_IP), (_AF_INET, _SOCK_STREAM, _IPPROTO_TCP),
    (_AF_INET, _SOCK_DGRAM, _IPPROTO_IP), (_AF_INET, _SOCK_DGRAM, _IPPROTO_UDP),
    (_AF_INET, _SOCK_DGRAM, _IPPROTO_ICMP),  # unprivileged ping, if net.ipv4.ping_group_range allows
    (_AF_INET6, _SOCK_STREAM, _IPPROTO_IP), (_AF_INET6, _SOCK_STREAM, _IPPROTO_TCP),
    (_AF_INET6, _SOCK_DGRAM, _IPPROTO_IP), (_AF_INET6, _SOCK_DGRAM, _IPPROTO_UDP),
    (_AF_INET6, _SOCK_DGRAM, _IPPROTO_ICMPV6),
    (_AF_NETLINK, None, _NETLINK_ROUTE),  # glibc's getaddrinfo reads interface addresses this way
)  # fmt: skip
# Sockets that see or forge raw traffic: EPERM. (SOCK_PACKET on AF_INET is the old spelling of a packet
# socket.) Every other combination gets the default ENOSYS.
_SOCKETS_DENIED: tuple[tuple[int, int | None], ...] = (
    (_AF_PACKET, None),
    (_AF_INET, _SOCK_RAW), (_AF_INET, _SOCK_PACKET),
    (_AF_INET6, _SOCK_RAW),
)  # fmt: skip

# TIOCSTI pushes bytes into a terminal's input (commands typed "by" whoever reads it next);
# TIOCLINUX does the same on virtual consoles and can read the screen.
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C

# Personas that only change uname's answer or nothing: PER_LINUX, PER_LINUX32, UNAME26, both, and the
# 0xffffffff query. Everything else (READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, ...) is EPERM.
_PERSONALITIES_ALLOWED = (0x0000_0000, 0x0000_0008, 0x0002_0000, 0x0002_0008, 0xFFFF_FFFF)


def _arg(index: int, op: str, value: int, value_two: int = 0) -> dict[str, object]:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


def _eq(index: int, value: int) -> dict[str, object]:
    return _arg(index, "SCMP_CMP_EQ", value)


def _masked(index: int, mask: int, value: int) -> dict[str, object]:
    return _arg(index, "SCMP_CMP_MASKED_EQ", mask, value)


def _rule(
    names: Sequence[str], action: str, args: Sequence[dict[str, object]] = (), errno_ret: int | None = None
) -> dict[str, object]:
    rule: dict[str, object] = {"names": list(names), "action": action}
    if args:
        rule["args"] = list(args)
    if errno_ret is not None:
        rule["errnoRet"] = errno_ret
    return rule


def _all_but(excluded: Iterable[int], bits: int = 32) -> list[tuple[int, int]]:
    """(mask, value) patterns matching exactly the `bits`-wide values not in `excluded`.

    seccomp has no masked "not equal", and runc ORs two conditions on one argument, so "anything but these"
    is spelled as a prefix tree: walking from the top bit down, every branch that no excluded value takes
    becomes one pattern. The patterns are disjoint, and there are at most `bits` per excluded value.
    """
    patterns: list[tuple[int, int]] = []

    def walk(bit: int, mask: int, value: int, candidates: list[int]) -> None:
        if not candidates:
            patterns.append((mask, value))
        elif bit >= 0:
            b = 1 << bit
            for branch in (0, b):
                walk(bit - 1, mask | b, value | branch, [c for c in candidates if c & b == branch])

    walk(bits - 1, 0, 0, sorted(set(excluded)))
    return patterns


def _clone_rules() -> list[dict[str, object]]:
    # The flags are the first argument on x86_64, x86, arm and aarch64 alike.
    # One denial per flag, each also requiring the flags before it clear, so that no two rules overlap.
    rules = [_rule(["clone"], _ALLOW, [_masked(0, _CLONE_NAMESPACE_MASK, 0)])]
    earlier = 0
    for flag in _CLONE_NAMESPACES:
        rules.append(_rule(["clone"], _ERRNO, [_masked(0, earlier | flag, flag)], errno.EPERM))
        earlier |= flag
    return rules


def _socket_rules() -> list[dict[str, object]]:
    rules = []
    for family, sock_type, protocol in _SOCKETS_ALLOWED:
        args = [_eq(0, family)]
        if sock_type is not None:
            args.append(_masked(1, _SOCK_TYPE_MASK, sock_type))
        if protocol is not None:
            args.append(_eq(2, protocol))
        rules.append(_rule(["socket"], _ALLOW, args))
    for family, sock_type in _SOCKETS_DENIED:
        args = [_eq(0, family)]
        if sock_type is not None:
            args.append(_masked(1, _SOCK_TYPE_MASK, sock_type))
        rules.append(_rule(["socket"], _ERRNO, args, errno.EPERM))
    rules.append(_rule(["socketpair"], _ALLOW, [_eq(0, _AF_UNIX)]))
    rules.append(_rule(["socketpair"], _ERRNO, [_arg(0, "SCMP_CMP_NE", _AF_UNIX)], errno.EPERM))
    return rules


def _ioctl_rules() -> list[dict[str, object]]:
    # The request number is an unsigned int to the kernel: only its low 32 bits count.
    denied = (_TIOCSTI, _TIOCLINUX)
    rules = [_rule(["ioctl"], _ALLOW, [_masked(1, mask, value)]) for mask, value in _all_but(denied)]
    rules += [_rule(["ioctl"], _ERRNO, [_masked(1, _LOW32, request)], errno.EPERM) for request in denied]
    return rules


def _personality_rules() -> list[dict[str, object]]:
    allowed = _PERSONALITIES_ALLOWED
    rules = [_rule(["personality"], _ALLOW, [_masked(0, _LOW32, persona)]) for persona in allowed]
    rules += [
        _rule(["personality"], _ERRNO, [_masked(0, mask, value)], errno.EPERM) for mask, value in _all_but(allowed)
    ]
    return rules


def seccomp_profile() -> dict[str, object]:
    """The OCI runtime-spec `linux.seccomp` object for a sandbox.

    A fresh dict on every call, ready for `json.dumps`.
    """
    return {
        "defaultAction": _ERRNO,
        "defaultErrnoRet": errno.ENOSYS,
        "architectures": list(ARCHITECTURES),
        "syscalls": [
            _rule(ALLOWED_SYSCALLS, _ALLOW),
            _rule(DENIED_SYSCALLS, _ERRNO, errno_ret=errno.EPERM),
            _rule(ENOSYS_SYSCALLS, _ERRNO, errno_ret=errno.ENOSYS),
            *_clone_rules(),
            *_socket_rules(),
            *_ioctl_rules(),
            *_personality_rules(),
        ],
    }
