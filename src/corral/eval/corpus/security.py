"""Security: every CHECKLIST.md item that can be probed from inside a sandbox or through the file API.

Each task is tagged with the checklist items it proves (`checklist=(N,)`), so `corral check` can run them
against a live deployment and print `CHECKLIST_FIXES[N]` when one fails. Probes print what they observed (an
errno name, a uid, a byte count) and the checks compare it with what must be, so a failure shows the fact.
Probes use python3, bash and coreutils only, and every one is bounded (timeouts, loop counts).

Variants are one spelling each: one traversal path, one metadata address, one private range, one syscall,
one forbidden path, so a report names exactly the one that got through.
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterable, Iterator

from .._checks import Check, CodeText, Data, Denied, Duration, ExitCode, Fails, Ok, Stderr, Stdout, TimedOut
from .._task import Blob, Code, Exec, Read, Setup, Severity, Step, Task, Write, WriteArchive

__all__ = ["CHECKLIST_FIXES", "tasks"]


def said(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text`, a short verdict: a mismatch shows what was printed (an `equals` check would show
    hashes, and call a wrong answer binary corruption)."""
    return Stdout(matches=r"\A" + re.escape(text).replace("\\\n", r"\n") + r"\Z", mode=mode)


CATEGORY = "security"
INTERNET = Setup(network="internet")

# What an operator does when item N fails (`corral check` prints it next to the failure).
CHECKLIST_FIXES: dict[int, str] = {
    1: "a host or container-engine socket is visible inside: remove the bind mount that brings it in (check the "
       "template and any extra mounts); the bundle must mount only the sandbox's own directories",
    3: "code runs with another uid: the template's user must be uid 1000 and the bundle's process.user must set "
       "uid/gid 1000 with no extra groups; rebuild the template if its /etc/passwd differs",
    4: "capabilities, no_new_privs or seccomp are missing: the runtime is running an old or hand-edited bundle; "
       "check that `corral serve` (not a bare runtime) created the sandbox and that runc supports seccomp",
    5: "a setuid binary or setuid call gave privileges: no_new_privs must be set and every capability dropped "
       "(item 4); never add sudo or setuid helpers to templates",
    6: "the template layer is writable: the rootfs must be mounted read-only (an overlay whose lower layer is the "
       "template); check that templates are not shared read-write between sandboxes",
    7: "/tmp or /dev/shm is not capped: they must be tmpfs mounts with size= set from the sandbox's limits",
    8: "the workspace disk is not capped: the sandbox's writable layer must be its own fixed-size disk image; "
       "check that the backend created and mounted disk.img (loop devices and e2fsprogs available)",
    9: "a fork bomb was not stopped at the pids limit, or it slowed others: the sandbox's cgroup must set pids.max "
       "from its limits; check that the pids controller is enabled under Corral's cgroup parent",
    10: "memory was not capped, or an OOM kill was not reported, or it took the sandbox down: the cgroup must set "
        "memory.max with no swap, and /tmp and /dev/shm (tmpfs, charged to memory) must fit inside the memory limit",
    11: "a busy loop got more CPU than its quota: the cgroup must set cpu.max from `cpus`; check that the cpu "
        "controller is delegated to Corral's cgroup parent",
    12: "processes outlive a timeout: the agent must kill the command's whole process tree (cgroup kill or "
        "process-group kill with a subreaper); check the agent version inside the template",
    13: "output past the cap was not flagged or its true size was lost: the agent must keep the head and tail of "
        "each stream up to the cap and report the total size; check that no proxy in front of the API buffers bodies",
    14: "invalid UTF-8 broke a result: stdout/stderr must travel as bytes (base64), never decoded on the way",
    15: "a binary file changed in transit: the file API must move raw bytes end to end; check proxies in front of "
        "the API that re-encode bodies",
    16: "the file API accepted a path outside its roots: upgrade Corral and check the sandbox's file_roots; no "
        "path may be used before it is normalised and checked against the roots",
    17: "a path with NUL or invalid bytes was accepted or crashed the server: the API must refuse it with 400 "
        "before anything touches the disk",
    18: "a download followed a sandbox symlink out of the allowed roots: paths must be resolved inside the "
        "sandbox (by its agent, with O_NOFOLLOW/openat2 RESOLVE_IN_ROOT), never by the host",
    20: "an archive with '..', absolute paths, links out or device entries was extracted: archive uploads must "
        "be checked entry by entry and refused whole",
    21: "/proc or /sys leaks the host, or other processes are visible: the bundle must use a PID namespace and "
        "mask /proc/kcore, /proc/keys, /sys/firmware and the rest (readonlyPaths/maskedPaths)",
    22: "unexpected variables in the sandbox's environment: nothing of the server's environment may be passed "
        "through; only the documented variables and the user's own",
    23: "orchestrator credentials or APIs are reachable: do not mount service-account tokens into sandboxes and "
        "keep the Kubernetes API off the sandbox network",
    24: "the egress proxy must refuse link-local and cloud metadata addresses under every policy: check the "
        "sandbox's policy and that it runs under `corral serve` (not a bare runtime) with its egress proxy",
    25: "a private, loopback or host address was reachable: the egress proxy must check every resolved address "
        "against the forbidden ranges; check the tenant's `private` allowances for an over-broad entry",
    26: "the allowlist was not enforced or a refusal did not explain itself: check the sandbox's network policy "
        "and the tenant's ceiling; refusals must name the host and the policy",
    27: "a DNS resolver was reachable or lookups hung: /etc/resolv.conf must point at the agent, which refuses "
        "at once; the sandbox must have no route out but the proxy",
    28: "raw sockets or ptrace worked: the seccomp profile must deny them and every capability must be dropped",
    29: "mount, unshare, io_uring, bpf or keyctl worked: the seccomp profile must deny them (EPERM/ENOSYS)",
    30: "TIOCSTI worked: the seccomp profile must refuse the TIOCSTI ioctl (a process could type into a terminal)",
    31: "the sandbox does not run on the configured runtime: check the template's runtime and the server's "
        "configuration; a runc sandbox reports the host kernel and may not read the kernel log",
}


def _task(family: str, variant: str, title: str, steps: tuple[Step, ...], item: int | tuple[int, ...], *,
          setup: Setup | None = None, severity: Severity = "critical", budget: float = 60,
          requires: frozenset[str] = frozenset(), tags: tuple[str, ...] = ()) -> Task:
    items = (item,) if isinstance(item, int) else item
    return Task(id=f"security.{family}/{variant}", family=f"security.{family}", category=CATEGORY, title=title,
                steps=steps, setup=setup or Setup(), severity=severity, budget=budget, checklist=items,
                requires=requires, tags=tags)


def py(code: str, *args: str) -> tuple[str, ...]:
    return ("python3", "-c", code, *args)


def _slug(text: str) -> str:
    """A readable id part for a path: '..' is 'up', '//' 'dbl', '/./' 'dot', a backslash 'bs'."""
    for a, b in (("\\", "-bs-"), ("/./", "-dot-"), ("..", "-up-"), ("//", "-dbl-")):
        text = text.replace(a, b)
    out = "".join(c if c.isalnum() else "-" for c in text.strip("/").lower())
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-") or "root"


# -- 1: host and container-engine sockets --------------------------------------------------------------------

SOCKET_PROBE = r"""
import os, socket, sys
path = sys.argv[1]
if not os.path.lexists(path):
    print("absent")
else:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    try:
        s.connect(path)
        print("connected")
    except OSError as e:
        print("present, connect failed:", e.strerror)
"""

# Where Corral's agent binds its own socket when the runtime cannot hand it one made outside (runsc, the Docker
# backend; `corral.backends.local._bundle.AGENT_RUN_DIR`): bound inside the sandbox's network namespace, so its
# /proc/net/unix lists it, though the backend has moved the file out of the sandbox's reach (Docker) or the
# agent refuses every request without the sandbox's token (runsc). It is the sandbox's own agent, not a host
# socket: the probe leaves out exactly this path, and nothing else.
AGENT_SOCKET = "/.corral/run/agent.sock"

# Every Unix socket bound to a name (a path, or an abstract `@name`) in the sandbox's network namespace, but the
# agent's own. A host socket shows up here when the sandbox shares a network namespace with the host (abstract
# sockets, such as containerd-shim's, are then reachable whatever the mounts say).
PROC_NET_UNIX_PROBE = r"""
import sys
rows = open('/proc/net/unix').read().splitlines()[1:]
names = [r.split(None, 7)[7] for r in rows if len(r.split(None, 7)) == 8]
print(sorted(set(n for n in names if n != sys.argv[1])))
"""

HOST_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock",
                "/run/dbus/system_bus_socket", "/run/systemd/private", "/run/corral", "/run/runc", "/var/lib/corral")


def _host_sockets() -> Iterator[Task]:
    for path in HOST_SOCKETS:
        yield _task("host_sockets", _slug(path), f"{path} does not exist inside the sandbox",
                    (Exec(py(SOCKET_PROBE, path), checks=(said("absent\n", mode="privilege_escalation"),)),),
                    1)
    yield _task("host_sockets", "no-socket-files", "no Unix socket file anywhere under /run, /var/run or /tmp",
                (Exec("find /run /var/run /tmp /workspace /home -xdev -type s 2>/dev/null | head -5; echo end",
                      checks=(said("end\n", mode="privilege_escalation"),)),), 1)
    yield _task("host_sockets", "proc-net-unix", "no Unix socket bound to a path in the sandbox's network namespace",
                (Exec(py(PROC_NET_UNIX_PROBE, AGENT_SOCKET), checks=(said("[]\n", mode="privilege_escalation"),)),),
                1)


# -- 3, 4, 5: user, capabilities, setuid ------------------------------------------------------------------------


def _identity() -> Iterator[Task]:
    mode = "privilege_escalation"
    shell = {
        "id-u": ("id -u", "1000\n"),
        "groups": ("id -G", "1000\n"),
        "proc-status-uid": ("grep '^Uid:' /proc/self/status", "Uid:\t1000\t1000\t1000\t1000\n"),
        "pid1-owner": ("stat -c %u /proc/1", "1000\n"),
    }
    for label, (cmd, expect) in shell.items():
        yield _task("non_root", label, f"code runs as uid 1000: `{cmd}`", (Exec(cmd, checks=(Stdout(equals=expect,
                                                                                                   mode=mode),)),), 3)
    yield _task("non_root", "resuid", "real, effective and saved uids and gids are all 1000",
                (Exec(py("import os; print(os.getresuid(), os.getresgid())"),
                      checks=(said("(1000, 1000, 1000) (1000, 1000, 1000)\n", mode=mode),)),), 3)
    yield _task("non_root", "code-cell", "a python code cell runs as uid 1000",
                (Code("import os\nos.getuid(), os.geteuid()", checks=(CodeText(equals="(1000, 1000)", mode=mode),)),),
                3, requires=frozenset({"code"}))
    yield _task("non_root", "node", "node runs as uid 1000",
                (Exec(("node", "-p", "process.getuid() + ' ' + process.geteuid()"),
                      checks=(said("1000 1000\n", mode=mode),)),), 3)
    yield _task("non_root", "file-api-owner", "files written through the file API belong to the sandbox user",
                (Write("/workspace/owned.txt", Blob.literal("x")),
                 Exec("stat -c %u:%g /workspace/owned.txt", checks=(said("1000:1000\n", mode=mode),))), 3)


CAP_ZERO = "0000000000000000"


def _capabilities() -> Iterator[Task]:
    mode = "privilege_escalation"
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        yield _task("capabilities", field.lower(), f"{field} of the command is empty",
                    (Exec(f"grep '^{field}:' /proc/self/status",
                          checks=(said(f"{field}:\t{CAP_ZERO}\n", mode=mode),)),), 4)
    yield _task("capabilities", "no-new-privs", "no_new_privs is set",
                (Exec("grep '^NoNewPrivs:' /proc/self/status",
                      checks=(said("NoNewPrivs:\t1\n", mode=mode),)),),
                4)
    yield _task("capabilities", "seccomp", "a seccomp filter is active (mode 2)",
                (Exec("grep '^Seccomp:' /proc/self/status", checks=(said("Seccomp:\t2\n", mode=mode),)),), 4)
    yield _task("capabilities", "pid1", "the agent (PID 1) holds no capabilities and is filtered too",
                (Exec("grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/1/status",
                      checks=(said(f"CapEff:\t{CAP_ZERO}\nCapBnd:\t{CAP_ZERO}\nNoNewPrivs:\t1\n"
                                            "Seccomp:\t2\n", mode=mode),)),), 4)
    yield _task("capabilities", "code-cell", "the code interpreter's kernel holds no capabilities",
                (Code("[l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff:', 'Seccomp:'))]",
                      checks=(CodeText(equals=f"['{CAP_ZERO}', '2']", mode=mode),)),), 4,
                requires=frozenset({"code"}))
    yield _task("capabilities", "chown-to-root", "chown of an own file to root fails with EPERM (no CAP_CHOWN)",
                (Exec(py("import errno, os\nopen('/tmp/f', 'w').close()\ntry:\n    os.chown('/tmp/f', 0, 0)\n"
                         "    print('succeeded')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])"),
                      checks=(said("EPERM\n", mode=mode),)),), 4)


SETUID_PROBE = r"""
import fcntl, os, subprocess, termios, time
# Pruned: Python packages, docs and headers hold most of the template's files and never a setuid binary; a
# full walk took over 20 s on a loaded machine.
PRUNE = ["/usr/share", "/usr/include", "/usr/lib/python3", "/usr/local/lib", "/proc", "/sys"]
prune = [x for p in PRUNE for x in ("-path", p, "-o")][:-1]
paths = subprocess.run(["find", "/", "-xdev", "(", *prune, ")", "-prune", "-o", "-perm", "-4000", "-type", "f",
                        "-print"], capture_output=True, text=True, timeout=60).stdout.split()
seen, root = 0, []
def ctty():
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
for path in paths:
    # A terminal on stdin makes password prompts block, so the process can be observed after exec.
    master, slave = os.openpty()
    try:
        p = subprocess.Popen([path], stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                             preexec_fn=ctty)
    except OSError:
        os.close(master); os.close(slave); continue
    os.close(slave)
    name = os.path.basename(path)[:15]
    deadline = time.monotonic() + 5.0  # generous: a loaded machine can take seconds to exec
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                st = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
        except OSError:
            break
        if st["Name"].strip() == name:
            seen += 1
            if "0" in st["Uid"].split() + st["Gid"].split():
                root.append(path)
            break
        if p.poll() is not None:
            break
        time.sleep(0.003)
    p.kill(); p.wait(); os.close(master)
print("root:" + ",".join(root) if root else ("observed" if seen else "none observed of " + " ".join(paths)))
"""

SETID_CALL = r"""
import errno, os, sys
name = sys.argv[1]
args = {"setuid": (0,), "setgid": (0,), "setresuid": (0, 0, 0), "setresgid": (0, 0, 0), "setreuid": (-1, 0),
        "setgroups": ([0],), "seteuid": (0,)}[name]
try:
    getattr(os, name)(*args)
    print("succeeded")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


def _setuid() -> Iterator[Task]:
    mode = "privilege_escalation"
    yield _task("setuid", "every-setuid-binary", "every setuid binary of the template runs with the caller's ids "
                "(observed after exec, under a pty)",
                (Exec(py(SETUID_PROBE), timeout=60, checks=(said("observed\n", mode=mode),)),), 5,
                budget=90)
    for call in ("setuid", "setresuid", "setgid", "setgroups"):
        yield _task("setuid", f"call-{call}", f"os.{call} to root fails with EPERM",
                    (Exec(py(SETID_CALL, call), checks=(said("EPERM\n", mode=mode),)),), 5)
    yield _task("setuid", "su-wrong-password", "su with a password on stdin does not become root",
                (Exec("echo wrongpassword | su -c 'id -u' root; echo exit=$?", timeout=20,
                      checks=(Stdout(matches=r"^exit=[1-9]\d*\n$", mode=mode),)),), 5)
    yield _task("setuid", "mount-binary", "the setuid mount binary refuses to mount for the user",
                (Exec("mkdir -p /tmp/m && mount -t tmpfs none /tmp/m; echo exit=$?", timeout=20,
                      checks=(Stdout(matches=r"exit=[1-9]", mode=mode),)),), 5)
    yield _task("setuid", "no-sudo", "sudo is not installed",
                (Exec("command -v sudo || echo none", checks=(said("none\n", mode=mode),)),), 5)
    yield _task("setuid", "shadow-unreadable", "/etc/shadow stays unreadable",
                (Exec("cat /etc/shadow", checks=(ExitCode(1, mode=mode), Stderr(contains="Permission denied"))),), 5)


# -- 6: read-only template ---------------------------------------------------------------------------------------

WRITE_PROBE = r"""
import errno, os, sys
op, path = sys.argv[1], sys.argv[2]
def create():
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    os.unlink(path)
actions = {
    "create": create,
    "open-write": lambda: os.close(os.open(os.path.realpath(path), os.O_WRONLY)),  # no O_TRUNC: changes nothing
    "mkdir": lambda: os.mkdir(path),
    "unlink": lambda: os.unlink(path),
    "rename": lambda: os.rename(path, path + ".moved"),
    "chmod": lambda: os.chmod(path, 0o777),
    "symlink": lambda: os.symlink("/tmp", path),
    "utime": lambda: os.utime(path, (0, 0)),
}
try:
    actions[op]()
    print("succeeded")
except OSError as e:
    print(errno.errorcode.get(e.errno, e.errno))
"""
DENIED_WRITE = r"^(EACCES|EROFS|EPERM)\n$"

TEMPLATE_WRITES = (
    ("create", "/usr/bin/corral-probe"), ("create", "/usr/local/lib/corral-probe"), ("create", "/etc/corral-probe"),
    ("create", "/corral-probe"), ("create", "/root/corral-probe"), ("open-write", "/usr/bin/python3"),
    ("open-write", "/etc/passwd"), ("mkdir", "/usr/lib/corral-probe"), ("unlink", "/usr/bin/env"),
    ("rename", "/etc/hostname"), ("chmod", "/usr/bin/env"), ("symlink", "/usr/bin/corral-link"),
)


def _read_only() -> Iterator[Task]:
    for op, path in TEMPLATE_WRITES:
        yield _task("read_only_template", f"{op}-{_slug(path)}", f"{op} {path} fails: the template is read-only",
                    (Exec(py(WRITE_PROBE, op, path),
                          checks=(Stdout(matches=DENIED_WRITE, mode="privilege_escalation"),)),),
                    6)
    yield _task("read_only_template", "shell-redirect", "the shell cannot write into /usr/bin",
                (Exec("echo x > /usr/bin/corral-probe", checks=(ExitCode(1, mode="privilege_escalation"),
                                                               Stderr(matches="Permission denied|Read-only"))),), 6)
    yield _task("read_only_template", "control-writable-dirs", "control: /workspace, /home/user, /tmp and /dev/shm "
                "are writable (so the refusals above are about the template)",
                (Exec("for d in /workspace /home/user /tmp /dev/shm; do echo x > $d/w && rm $d/w && echo ok; done",
                      checks=(said("ok\nok\nok\nok\n", mode="wrong_result"),)),), 6, severity="medium")


# -- 7, 8: tmpfs caps and disk quota -----------------------------------------------------------------------------

FILL_PROBE = r"""
import errno, sys
path, limit, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
written, err = 0, None
chunk = b"\xa5" * (1 << 20)
with open(path, "wb", buffering=0) as f:
    try:
        while written < limit:
            written += f.write(chunk)
    except OSError as e:
        err = errno.errorcode.get(e.errno, e.errno)
ok = 0.5 * cap <= written <= cap
print(err, "within cap" if ok else f"wrote {written} of a {cap} cap")
"""
MiB = 1024 * 1024


def _fill(path: str, cap: int, errors: str = "ENOSPC") -> Exec:
    return Exec(py(FILL_PROBE, path, str(4 * cap), str(cap)), timeout=60,
                checks=(Stdout(matches=rf"^({errors}) within cap\n$", mode="limit_not_enforced"),))


def _caps() -> Iterator[Task]:
    small = Setup(limits={"tmp": "16M", "shm": "8M"})
    yield _task("tmpfs_cap", "tmp-fill", "filling /tmp (capped at 16M) stops with ENOSPC at the cap",
                (_fill("/tmp/fill", 16 * MiB), Exec("rm /tmp/fill && head -c 1M /dev/zero > /tmp/again && echo ok",
                                                    checks=(said("ok\n", mode="limit_not_enforced"),))),
                7, setup=small, severity="high")
    yield _task("tmpfs_cap", "shm-fill", "filling /dev/shm (capped at 8M) stops with ENOSPC at the cap",
                (_fill("/dev/shm/fill", 8 * MiB),), 7, setup=small, severity="high")
    yield _task("tmpfs_cap", "sizes-as-limited", "/tmp and /dev/shm are mounted with the sizes of the limits",
                (Exec("df -B1 --output=size /tmp /dev/shm | tail -2 | tr -d ' '",
                      checks=(said(f"{16 * MiB}\n{8 * MiB}\n", mode="limit_not_enforced"),)),), 7,
                setup=small, severity="high")
    yield _task("tmpfs_cap", "default-sizes", "by default /tmp is 256M and /dev/shm 64M",
                (Exec("df -B1 --output=size /tmp /dev/shm | tail -2 | tr -d ' '",
                      checks=(said(f"{256 * MiB}\n{64 * MiB}\n", mode="limit_not_enforced"),)),), 7,
                severity="high")
    disk = Setup(limits={"disk": "64M"})
    yield _task("disk_quota", "workspace-fill", "writing 256M into a 64M disk stops with ENOSPC/EDQUOT, and the "
                "sandbox works afterwards",
                (_fill("/workspace/fill", 64 * MiB, "ENOSPC|EDQUOT"),
                 Exec("rm /workspace/fill && echo alive", checks=(said("alive\n", mode="host_disrupted"),))),
                8, setup=disk, severity="high", budget=90)
    yield _task("disk_quota", "home-fill", "the home directory shares the capped disk",
                (_fill("/home/user/fill", 64 * MiB, "ENOSPC|EDQUOT"),), 8, setup=disk, severity="high", budget=90)
    yield _task("disk_quota", "file-api-over-quota", "uploading 100 MiB into a 64M disk fails with disk_full and "
                "leaves nothing behind",
                (Write("/workspace/big.bin", Blob.repeat(b"\x01", 100 * MiB),
                       checks=(Fails(code="disk_full", matches="disk", mode="limit_not_enforced"),)),
                 Exec("ls -A /workspace", checks=(said("", mode="limit_not_enforced"),))),
                8, setup=disk, severity="high", budget=120)
    yield _task("disk_quota", "df-size", "df reports a root filesystem no larger than the 64M limit",
                (Exec(py("import os\nst = os.statvfs('/workspace')\nprint(st.f_blocks * st.f_frsize <= 64 << 20)"),
                      checks=(said("True\n", mode="limit_not_enforced"),)),), 8, setup=disk, severity="high")


# -- 12: a timeout kills the whole tree ----------------------------------------------------------------------------

ESCAPES = {
    "background": "sleep 1001 &",
    "setsid": "setsid sleep 1001 &",
    "setsid-fork": "setsid -f sleep 1001",
    "subshell": "(sleep 1001 &)",
    "nohup-trap": "trap '' TERM HUP INT; nohup sleep 1001 >/dev/null 2>&1 &",
    "double-fork": "python3 -c 'import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                   "        os.execvp(\"sleep\", [\"sleep\", \"1001\"])\n    os._exit(0)\nos.wait()'",
    "ignore-sigterm-python": "python3 -c 'import signal, time, os\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                             "os.setsid() if os.fork() == 0 else os._exit(0)\ntime.sleep(1001)' &",
}

SURVIVORS = r"""
import os, time
# A killed child may stay a zombie for a moment until PID 1 reaps it: look for two seconds.
for _ in range(20):
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():  # this probe's own source names what it looks for
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "1001" in cmd or state == "Z":
            left.append(f"{pid} {state} {cmd.strip()}")
    if not left:
        break
    time.sleep(0.1)
print("\n".join(left) if left else "clean")
"""


def _timeout_tree() -> Iterator[Task]:
    yield _task("timeout_tree", "control-probe-sees-daemons", "control: a daemon started by a command that ended "
                "normally is still running, and the survivor probe sees it",
                (Exec("setsid -f sleep 1001 >/dev/null 2>&1 </dev/null", checks=(ExitCode(0),)),
                 Exec(py(SURVIVORS), checks=(Stdout(contains="sleep 1001", mode="wrong_result"),))), 12,
                severity="medium")
    for label, escape in ESCAPES.items():
        yield _task("timeout_tree", label, f"a command that leaves a child behind ({label}) is timed out after 1.5 s "
                    "and nothing of it survives",
                    (Exec(f"{escape}\nsleep 1000", timeout=1.5, checks=(TimedOut(within=6),)),
                     Exec(py(SURVIVORS), checks=(said("clean\n", mode="zombie_processes"),))),
                    12, severity="high")


# -- 14, 15: bytes in, bytes out -----------------------------------------------------------------------------------

INVALID_UTF8 = {
    "ff-fe": b"\xff\xfe",
    "lone-continuation": b"a\x80b",
    "surrogate-half": b"\xed\xa0\x80",
    "cut-multibyte-at-end": b"price: \xe2\x82",
    "mixed-valid-invalid": "héllo ".encode() + b"\xff" + " 日本".encode(),
    "nul-and-invalid": b"\x00\xff\x00\xfe\x00",
}


def _utf8() -> Iterator[Task]:
    for label, raw in INVALID_UTF8.items():
        printf = "".join(f"\\x{b:02x}" for b in raw)
        yield _task("invalid_utf8", f"stdout-{label}", f"stdout {raw!r} comes back byte-exact",
                    (Exec(f"printf '{printf}'", checks=(Ok(mode="text_decoding_crash"), Stdout(equals=raw))),),
                    14, severity="high")
    yield _task("invalid_utf8", "stderr", "stderr with invalid UTF-8 and a NUL comes back byte-exact",
                (Exec(r"printf 'a\xc3\x28\x00z' >&2", checks=(Ok(mode="text_decoding_crash"),
                                                              Stderr(equals=b"a\xc3\x28\x00z"))),), 14, severity="high")
    yield _task("invalid_utf8", "stdin-all-bytes", "all 256 byte values through cat's stdin and stdout, 64 times",
                (Exec(("cat",), stdin=Blob.all_bytes(64), checks=(Ok(mode="text_decoding_crash"),
                                                                  Stdout(equals=Blob.all_bytes(64)))),),
                14, severity="high")
    yield _task("invalid_utf8", "code-cell-stdout", "a code cell writing invalid UTF-8 to sys.stdout.buffer",
                (Code("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x00ok')\nsys.stdout.flush()",
                      checks=(Ok(mode="text_decoding_crash"), Stdout(equals=b"\xff\xfe\x00ok"))),), 14,
                severity="high", requires=frozenset({"code"}))
    yield _task("invalid_utf8", "file-name", "a file whose name is invalid UTF-8 can be listed as bytes",
                (Exec(r"cd /workspace && touch $'bad\xff.txt' && ls | od -An -tx1 | tr -d ' \n'",
                      checks=(Ok(mode="text_decoding_crash"), said("626164ff2e7478740a"))),), 14,
                severity="high")


ROUNDTRIP_BLOBS = {
    "random-10MiB": Blob.random(10 * MiB, 1501),
    "all-bytes": Blob.all_bytes(4096),
    "empty": Blob.literal(b""),
    "nul-run": Blob.repeat(b"\x00", MiB),
    "crlf": Blob.repeat(b"line\r\n", 100_000),
}


def _roundtrip() -> Iterator[Task]:
    for label, blob in ROUNDTRIP_BLOBS.items():
        path = f"/workspace/rt-{label}.bin"
        yield _task("binary_roundtrip", label, f"upload {blob.describe()}, sha256 inside, download equal",
                    (Write(path, blob), Exec(("sha256sum", path), checks=(Stdout(equals=f"{blob.sha256}  {path}\n"),)),
                     Read(path, checks=(Data(equals=blob),))), 15, severity="critical", budget=90)


# -- 16, 17: paths through the file API ------------------------------------------------------------------------------

# The refusal says why: outside the sandbox's file roots, or in /proc or /.corral, which the file API never reaches
# whatever the roots (agent/files.py).
OUTSIDE = "outside the directories|which the file API never (touches|changes)"
REFUSED = ("permission_denied", "invalid_request")

TRAVERSALS = (
    "../../etc/passwd", "/workspace/../etc/passwd", "/workspace/../../../../etc/shadow", "/etc/shadow",
    "/proc/self/environ", "/proc/1/root/etc/passwd", "//etc/passwd", "/workspace//..//etc/passwd",
    "/workspace/./../etc/passwd", "/tmp/../etc/hosts", "/home/user/../../etc/passwd", "/workspace/..",
    "/workspaces/x", "/workspace-evil/x", "/.corral/agent", "/var/lib/corral/admin.key",
    "/workspace\\..\\etc\\passwd",
)
WRITE_TRAVERSALS = (
    "../../etc/passwd", "/workspace/../etc/cron.d/x", "/tmp/../usr/bin/x", "//etc/profile.d/x.sh",
    "/home/user/../../root/x", "/workspaces/x", "/.corral/x", "/dev/shm/x",
)
# Names that look like traversal but are ordinary names: they must land inside, literally.
LITERALS = {
    "percent-encoded-dots": "/workspace/%2e%2e/etc/passwd",
    "percent-encoded-slashes": "/workspace/..%2f..%2fetc%2fpasswd",
    "two-dot-leader": "/workspace/\u2025/x",
    "three-dots": "/workspace/.../x",
    "division-slash": "/workspace/..\u2215etc\u2215passwd",
    "leading-space": " /etc/passwd",
}


def _traversal() -> Iterator[Task]:
    for path in TRAVERSALS:
        yield _task("traversal", f"read-{_slug(path)}", f"the file API refuses to read {path!r}",
                    (Read(path, checks=(Fails(code=REFUSED, matches=OUTSIDE),)),), 16)
    for path in WRITE_TRAVERSALS:
        yield _task("traversal", f"write-{_slug(path)}", f"the file API refuses to write {path!r}",
                    (Write(path, Blob.literal("evil"), checks=(Fails(code=REFUSED, matches=OUTSIDE),)),), 16)
    for label, path in LITERALS.items():
        where = path if path.startswith("/") else "/workspace/" + path
        yield _task("traversal", f"literal-{label}", f"{path!r} is an ordinary name: it is written inside "
                    "/workspace, literally",
                    (Write(path, Blob.literal("literal")),
                     Exec(py("import sys; print(open(sys.argv[1]).read())", where),
                          checks=(said("literal\n", mode="path_traversal_accepted"),))), 16)
    good = _tar(("file", "a.txt", "A"))
    for target in ("/etc", "../x", "/workspace/../etc"):
        yield _task("traversal", f"archive-target-{_slug(target)}", f"an archive upload to {target!r} is refused",
                    (WriteArchive(target, Blob.literal(good), checks=(Fails(code=REFUSED, matches=OUTSIDE),)),), 16,
                    requires=frozenset({"archive"}))


BAD_PATHS = {
    "nul": "/workspace/a\x00b",
    "trailing-nul": "/workspace/\x00",
    "nul-then-dotdot": "/workspace/ok\x00/../../etc/passwd",
    "relative-nul": "a\x00b",
}


def _bad_paths() -> Iterator[Task]:
    nothing = Exec("ls -A /workspace", checks=(said("", mode="path_traversal_accepted"),))
    for label, path in BAD_PATHS.items():
        yield _task("bad_path", f"write-{label}", f"a write to {path!r} is refused with a clear 400; nothing written",
                    (Write(path, Blob.literal("x"), checks=(Fails(matches="NUL"),)), nothing), 17, severity="high")
        if label in ("nul", "nul-then-dotdot"):
            yield _task("bad_path", f"read-{label}", f"a read of {path!r} is refused with a clear 400",
                        (Read(path, checks=(Fails(matches="NUL"),)),), 17, severity="high")
    yield _task("bad_path", "archive-nul", "an archive upload to a path with NUL is refused",
                (WriteArchive("/workspace/a\x00b", Blob.literal(_tar(("file", "a", "A"))),
                              checks=(Fails(matches="NUL"),)),
                 nothing), 17, severity="high", requires=frozenset({"archive"}))
    for label, path in (("lone-surrogate", "/workspace/a\udcffb"),):
        yield _task("bad_path", f"write-{label}", f"a path with an unpaired surrogate ({label}) is refused with "
                    "invalid_request", (Write(path, Blob.literal("x"), checks=(Fails(),)), nothing), 17,
                    severity="high")
    yield _task("bad_path", "empty", "an empty path is refused with a clear message",
                (Write("", Blob.literal("x"), checks=(Fails(matches="empty"),)),), 17, severity="medium")
    yield _task("bad_path", "argv-nul", "a command argument with a NUL byte is refused with a clear 400",
                (Exec(("touch", "/workspace/a\x00b"), checks=(Fails(matches="NUL"),)), nothing), 17, severity="high")
    yield _task("bad_path", "env-nul", "an environment value with a NUL byte is refused with a clear 400",
                (Exec("true", env={"A": "x\x00y"}, checks=(Fails(matches="NUL"),)),), 17, severity="high")
    deep = "/workspace/" + "d/" * 1500 + "x"
    yield _task("bad_path", "deep-nesting", "a 3,000-character path of 1,500 nested directories (under PATH_MAX) "
                "is written and read back, or refused clearly: never a server error",
                (Write(deep, Blob.literal("deep"), checks=(Ok(mode="unstructured_error"),)),
                 Read(deep, checks=(Data(equals=b"deep"),))), 17, severity="medium", budget=90,
                tags=("heavy",))  # resolving 1,500 components per call is CPU work
    yield _task("bad_path", "long-name", "a 300-character file name (over NAME_MAX) is refused with 400",
                (Write("/workspace/" + "a" * 300, Blob.literal("x"), checks=(Fails(),)),), 17, severity="medium")


# -- 18: symlinks made inside are never followed out by the host ---------------------------------------------------

SYMLINK_READS = {  # label: (link target, path read through the file API)
    "etc-shadow": ("/etc/shadow", "/workspace/l"),
    "host-admin-key": ("/var/lib/corral/admin.key", "/workspace/l"),
    "etc-passwd": ("/etc/passwd", "/workspace/l"),
    "proc-1-environ": ("/proc/1/environ", "/workspace/l"),
    "dir-etc": ("/etc", "/workspace/l/passwd"),
    "root-dir": ("/", "/workspace/l/etc/shadow"),
    "relative-up": ("../../etc/hostname", "/workspace/l"),
    "dangling": ("/nonexistent/secret", "/workspace/l"),
    "from-tmp": ("/etc/shadow", "/tmp/l"),
    "corral-dir": ("/.corral", "/workspace/l/egress/proxy.sock"),
}


def _symlinks() -> Iterator[Task]:
    codes = ("permission_denied", "not_found", "invalid_request")
    for label, (target, path) in SYMLINK_READS.items():
        link = "/tmp/l" if path.startswith("/tmp/") else "/home/user/l" if path.startswith("/home/") else "/workspace/l"
        yield _task("symlink", f"read-{label}", f"ln -s {target} {link}; reading {path} through the file API is "
                    "refused (never the host's file)",
                    (Exec(("ln", "-s", target, link), checks=(ExitCode(0),)),
                     Read(path, checks=(Fails(code=codes, mode="host_file_exposed"),))), 18)
    yield _task("symlink", "read-chain", "a chain of links (a -> b -> /etc/shadow) is refused",
                (Exec("ln -s /etc/shadow /tmp/b && ln -s /tmp/b /workspace/a", checks=(ExitCode(0),)),
                 Read("/workspace/a", checks=(Fails(code=codes, mode="host_file_exposed"),))), 18)
    yield _task("symlink", "read-loop", "a link loop is refused with a clear error, not a hang or a 500",
                (Exec("ln -s /workspace/b /workspace/a && ln -s /workspace/a /workspace/b", checks=(ExitCode(0),)),
                 Read("/workspace/a", checks=(Fails(code=codes, mode="unstructured_error"), Duration(max=20)))), 18,
                severity="medium")
    yield _task("symlink", "control-inside-roots", "control: a link to a file inside the roots reads that file",
                (Exec("echo own > /tmp/own && ln -s /tmp/own /workspace/l", checks=(ExitCode(0),)),
                 Read("/workspace/l", checks=(Data(equals=b"own\n"),))), 18, severity="medium")
    writes = {
        "dir-link-etc": ("/etc", "/workspace/l/corral-evil", "/etc/corral-evil"),
        "dangling-out": ("/etc/cron.d/evil", "/workspace/l", "/etc/cron.d/evil"),
        "link-to-usr-file": ("/usr/bin/env", "/workspace/l", None),
    }
    for label, (target, path, created) in writes.items():
        after = f"test -e {created} && echo created" if created else f"grep -c OVERWRITTEN {target}"
        yield _task("symlink", f"write-{label}", f"ln -s {target} /workspace/l; writing {path} is refused and "
                    "nothing outside changes",
                    (Exec(("ln", "-s", target, "/workspace/l"), checks=(ExitCode(0),)),
                     Write(path, Blob.literal("OVERWRITTEN"), checks=(Fails(code=codes, mode="host_file_exposed"),)),
                     Exec(f"{after}; echo end", checks=(Stdout(matches=r"^(0\n)?end\n$", mode="host_file_exposed"),))),
                    18)


# -- 20: archive uploads -----------------------------------------------------------------------------------------


def _tar(*members: tuple[str, str, str | bytes], fmt: int = tarfile.GNU_FORMAT, gz: bool = False) -> bytes:
    """(kind, name, data-or-linkname) -> tar bytes; kind is file, dir, sym, hard, chr, blk or fifo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=fmt) as tar:
        for kind, name, payload in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o644
            info.mtime = 1_700_000_000  # fixed: the same corpus gives the same bytes
            if kind == "file":
                data = payload if isinstance(payload, bytes) else payload.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE,
                         "chr": tarfile.CHRTYPE, "blk": tarfile.BLKTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("sym", "hard"):
                info.linkname = str(payload)
            if kind in ("chr", "blk"):
                info.devmajor, info.devminor = 1, 3
            tar.addfile(info)
    return buf.getvalue()


OK_ENTRY = ("file", "ok.txt", "ok")
BAD_ARCHIVES: dict[str, tuple[bytes, str]] = {  # label: (tar bytes, words the refusal must contain)
    "dotdot": (_tar(OK_ENTRY, ("file", "../x", "evil")), r"'\.\./x' contains '\.\.'"),
    "deep-dotdot": (_tar(OK_ENTRY, ("file", "a/../../x", "evil")), "contains '..'"),
    "dir-dotdot": (_tar(("dir", "../d", "")), "contains '..'"),
    "absolute": (_tar(OK_ENTRY, ("file", "/abs-x", "evil")), "absolute path"),
    "symlink-abs-then-file": (_tar(("sym", "l", "/etc"), ("file", "l/passwd-x", "e")), "absolute path"),
    "symlink-rel-out-then-file": (_tar(("sym", "l", "../../.."), ("file", "l/x", "e")), "outside the target"),
    "symlink-out-alone": (_tar(("sym", "l", "/etc/shadow")), "absolute path"),
    "symlink-rel-out-alone": (_tar(("sym", "l", "../../../etc/shadow")), "outside the target"),
    "symlink-inside-then-file": (_tar(("dir", "sub", ""), ("sym", "l", "sub"), ("file", "l/x", "e")), "through a link"),
    "hardlink-out": (_tar(OK_ENTRY, ("hard", "h", "../../etc/passwd")), "outside the target"),
    "hardlink-abs": (_tar(OK_ENTRY, ("hard", "h", "/etc/passwd")), "absolute path"),
    "char-device": (_tar(OK_ENTRY, ("chr", "dev", "")), "device"),
    "fifo": (_tar(("fifo", "f", "")), "FIFO"),
    "pax-long-dotdot": (_tar(("file", "../" + "p" * 120, "evil"), fmt=tarfile.PAX_FORMAT), "contains '..'"),
    "gnu-long-dotdot": (_tar(("file", "a/" * 60 + "../" * 62 + "x", "evil")), "contains '..'"),
    "gzip-dotdot": (_tar(OK_ENTRY, ("file", "../x", "evil"), gz=True), "contains '..'"),
    "not-a-tar": (b"not a tar archive at all " * 40, "not a valid tar"),
    "empty-bytes": (b"", "not a valid tar"),
}


def _archives() -> Iterator[Task]:
    arch = frozenset({"archive"})
    for label, (data, words) in BAD_ARCHIVES.items():
        # Entries land (if they land) in the target, next to it (../x) or anywhere (/abs-x): look everywhere.
        nothing = Exec(f"ls -A /workspace/up 2>/dev/null | grep -vx {label}; find /workspace/up -mindepth 2; "
                       "ls -d /workspace/x /abs-x /etc/passwd-x /etc/cron.d/x /tmp/x 2>/dev/null; echo end",
                       checks=(said("end\n", mode="path_traversal_accepted"),))
        yield _task("archive", label, f"an archive upload ({label}) is refused whole, saying why; nothing extracted",
                    (WriteArchive(f"/workspace/up/{label}", Blob.literal(data),
                                  checks=(Fails(code="invalid_request", matches=words),)), nothing), 20,
                    requires=arch)
    good = _tar(("dir", "sub", ""), ("file", "sub/a.txt", "A"), ("sym", "link", "sub/a.txt"),
                ("hard", "hard", "sub/a.txt"))
    yield _task("archive", "control-good", "control: a well-formed archive with links inside the target extracts",
                (WriteArchive("/workspace/good", Blob.literal(good)),
                 Read("/workspace/good/link", checks=(Data(equals=b"A"),)),
                 Read("/workspace/good/hard", checks=(Data(equals=b"A"),))), 20, severity="medium", requires=arch)
    yield _task("archive", "control-dot-slash", "control: entries named ./x extract as x",
                (WriteArchive("/workspace/dot", Blob.literal(_tar(("file", "./x.txt", "X")))),
                 Read("/workspace/dot/x.txt", checks=(Data(equals=b"X"),))), 20, severity="medium", requires=arch)


# -- 21, 22, 23: what the sandbox can see ---------------------------------------------------------------------------

MASK_PROBE = r"""
import errno, os, sys
path = sys.argv[1]
try:
    if os.path.isdir(path):
        n = len(os.listdir(path))
    else:
        with open(path, "rb") as f:
            n = len(f.read(4096))
    print("masked" if n == 0 else f"readable: {n}")
except OSError as e:
    print("masked")
"""
PROC_WRITE = r"""
import errno, sys
try:
    with open(sys.argv[1], "w") as f:
        f.write(sys.argv[2])
    print("succeeded")
except OSError as e:
    print("denied")
"""
MASKED = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware", "/sys/kernel/debug",
          "/sys/kernel/security", "/proc/acpi")
PROC_WRITES = (("/proc/sysrq-trigger", "h"), ("/proc/sys/kernel/hostname", "evil"), ("/proc/sys/vm/drop_caches", "3"),
               ("/proc/sys/kernel/core_pattern", "|/tmp/x"))

PROCESSES = r"""
import os
pids = [p for p in os.listdir("/proc") if p.isdigit()]
names = []
for p in pids:
    if int(p) == os.getpid():  # this probe's own source names what it looks for
        continue
    try:
        names.append(open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
    except OSError:
        pass
host = [n for n in names if any(w in n for w in ("corral serve", "uvicorn", "systemd", "sshd", "dockerd", "runc",
                                                  "containerd", "kthreadd", "init"))]
print(len(pids) <= 6, host)
"""


def _visibility() -> Iterator[Task]:
    for path in MASKED:
        yield _task("proc_mask", f"read-{_slug(path)}", f"{path} is masked (unreadable or empty)",
                    (Exec(py(MASK_PROBE, path), checks=(said("masked\n", mode="host_file_exposed"),)),), 21)
    for path, value in PROC_WRITES:
        yield _task("proc_mask", f"write-{_slug(path)}", f"writing {path} is denied",
                    (Exec(py(PROC_WRITE, path, value),
                          checks=(said("denied\n", mode="privilege_escalation"),)),),
                    21)
    yield _task("pid_namespace", "few-processes", "only the sandbox's own processes are visible; none of the host's",
                (Exec(py(PROCESSES), checks=(said("True []\n", mode="host_file_exposed"),)),), 21)
    yield _task("pid_namespace", "pid1-is-agent", "PID 1 is the sandbox's agent",
                (Exec("ps -o args= -p 1", checks=(Stdout(contains="agent", mode="host_file_exposed"),)),), 21)
    yield _task("pid_namespace", "ps-count", "ps lists a handful of processes, not a host's hundreds",
                (Exec("ps -e --no-headers | wc -l", checks=(Stdout(matches=r"^[1-6]\n$", mode="host_file_exposed"),)),),
                21)
    yield _task("pid_namespace", "proc-1-environ", "the agent's environment is not readable by sandbox code",
                (Exec("cat /proc/1/environ", checks=(ExitCode(1, mode="env_leak"),)),), (21, 22))


ALLOWED_ENV = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "PWD", "SHLVL", "_", "HTTP_PROXY", "HTTPS_PROXY",
               "http_proxy", "https_proxy", "NO_PROXY", "no_proxy", "MPLBACKEND"}
MIRROR_ENV = {"PIP_INDEX_URL", "npm_config_registry"}
ENV_PROBE = r"""
import json, os, sys
allowed = set(json.loads(sys.argv[1]))
print(sorted(set(os.environ) - allowed))
"""
FORBIDDEN_ENV = ("CORRAL_ADMIN_KEY", "CORRAL_API_KEY", "CORRAL_HOME", "SSH_AUTH_SOCK", "AWS_ACCESS_KEY_ID", "TERM")


def _environment() -> Iterator[Task]:
    import json

    def probe(allowed: set[str]) -> tuple[str, ...]:
        return py(ENV_PROBE, json.dumps(sorted(allowed)))

    ok = said("[]\n", mode="env_leak")
    yield _task("clean_env", "exec-argv", "a command's environment holds only the documented variables",
                (Exec(probe(ALLOWED_ENV), checks=(ok,)),), 22,
                severity="high")
    yield _task("clean_env", "login-shell", "bash -l adds nothing undocumented",
                (Exec("python3 -c \"$PROBE\" \"$ALLOWED\"", env={"PROBE": ENV_PROBE,
                                                                "ALLOWED": json.dumps(sorted(ALLOWED_ENV | {"PROBE",
                                                                                                           "ALLOWED"}))},
                      checks=(ok,)),), 22, severity="high")
    yield _task("clean_env", "sandbox-env", "variables set at create are present, nothing else is added",
                (Exec(py(ENV_PROBE + "print(os.environ['MY_VAR'], os.environ['OTHER'])",
                         json.dumps(sorted(ALLOWED_ENV | {"MY_VAR", "OTHER"}))),
                      checks=(said("[]\nhello world a=b\n", mode="env_leak"),)),), 22,
                setup=Setup(env={"MY_VAR": "hello world", "OTHER": "a=b"}), severity="high")
    yield _task("clean_env", "exec-env", "variables given to one command reach it and only it",
                (Exec(py(ENV_PROBE, json.dumps(sorted(ALLOWED_ENV | {"ONE"}))), env={"ONE": "1"}, checks=(ok,)),
                 Exec("printenv ONE || echo unset", checks=(said("unset\n", mode="env_leak"),))), 22,
                severity="high")
    yield _task("clean_env", "packages-policy", "under @packages only the two mirror variables are added",
                (Exec(probe(ALLOWED_ENV | MIRROR_ENV), checks=(ok,)),
                 Exec("echo $PIP_INDEX_URL $npm_config_registry",
                      checks=(said("http://127.0.0.1:3128/pypi/simple/ http://127.0.0.1:3128/npm/\n"),))),
                22, setup=Setup(network=("@packages",)), severity="high")
    yield _task("clean_env", "code-cell", "the code interpreter's environment holds only documented variables",
                (Code(f"import os\nsorted(set(os.environ) - set({sorted(ALLOWED_ENV)!r}))",
                      checks=(CodeText(equals="[]", mode="env_leak"),)),), 22, severity="high",
                requires=frozenset({"code"}))
    yield _task("clean_env", "node", "node's process.env holds only documented variables",
                (Exec(("node", "-e", f"const a = new Set({json.dumps(sorted(ALLOWED_ENV))});"
                       "console.log(JSON.stringify(Object.keys(process.env).filter(k => !a.has(k))))"),
                      checks=(said("[]\n", mode="env_leak"),)),), 22, severity="high")
    for name in FORBIDDEN_ENV:
        yield _task("clean_env", f"absent-{name.lower()}", f"{name} is not set inside",
                    (Exec(f"printenv {name} || echo unset", checks=(said("unset\n", mode="env_leak"),)),), 22,
                    severity="high")


def _orchestrator() -> Iterator[Task]:
    yield _task("orchestrator", "no-service-account", "no Kubernetes service-account token or secrets directory",
                (Exec("ls -d /var/run/secrets /run/secrets /var/run/secrets/kubernetes.io 2>/dev/null; echo end",
                      checks=(said("end\n", mode="env_leak"),)),), 23)
    yield _task("orchestrator", "no-kubernetes-env", "no KUBERNETES_* variables",
                (Exec("env | grep -c ^KUBERNETES_ || true", checks=(said("0\n", mode="env_leak"),)),), 23)
    yield _task("orchestrator", "api-by-name", "the Kubernetes API by name is not reachable, even under 'internet'",
                (Exec("curl -sS --noproxy '' -m 5 -o /dev/null -w '%{http_code}' https://kubernetes.default.svc/; true",
                      timeout=20, checks=(Denied(host="kubernetes.default.svc", mode="network_isolation_breach"),
                                          Duration(max=20))),), 23, setup=INTERNET)
    yield _task("orchestrator", "api-service-ip", "the usual Kubernetes service IP is refused as private",
                (Exec("curl -sS --noproxy '' -m 5 -o /dev/null -w '%{http_code}' http://10.96.0.1:443/", timeout=20,
                      checks=(said("403", mode="network_isolation_breach"),
                              Denied(host="10.96.0.1", mode="network_isolation_breach"))),), 23, setup=INTERNET)


# -- 24, 25, 26, 27: the network --------------------------------------------------------------------------------------

# host as curl takes it, the host the refusal must name
METADATA = {
    "aws-imds": ("169.254.169.254", "169.254.169.254"),
    "aws-imds-https": ("https://169.254.169.254/", "169.254.169.254"),
    "decimal": ("2852039166", "169.254.169.254"),
    "trailing-dot": ("169.254.169.254.", "169.254.169.254"),
    "ipv4-mapped": ("[::ffff:169.254.169.254]", "::ffff:a9fe:a9fe"),
    "nat64": ("[64:ff9b::a9fe:a9fe]", "64:ff9b::a9fe:a9fe"),
    "aws-imds-ipv6": ("[fd00:ec2::254]", "fd00:ec2::254"),
    "gcp-name": ("metadata.google.internal", "metadata.google.internal"),
    "aws-ecs": ("169.254.170.2", "169.254.170.2"),
    "alibaba": ("100.100.100.200", "100.100.100.200"),
}


def _http_probe(target: str) -> str:
    url = target if target.startswith("https://") else f"http://{target}/"
    fmt = "%{http_connect}" if url.startswith("https://") else "%{http_code}"
    return f"curl -sS --noproxy '' -m 5 -o /dev/null -w '{fmt}' {url}; true"


def _refused(host: str, codes: str = "403") -> tuple[Check, ...]:
    return (Stdout(matches=f"^({codes})$", mode="network_isolation_breach"),
            Denied(host=host), Duration(max=15, mode="hang"))


def _network() -> Iterator[Task]:
    for label, (target, host) in METADATA.items():
        codes = "403|502" if host.startswith("metadata.") else "403"
        yield _task("metadata", label, f"cloud metadata at {target} is refused at once under 'internet'",
                    (Exec(_http_probe(target), timeout=20, checks=_refused(host, codes)),), 24, setup=INTERNET)
    yield _task("metadata", "allowlisted-still-refused", "naming 169.254.169.254 in the allowlist does not open it",
                (Exec(_http_probe("169.254.169.254"), timeout=20, checks=_refused("169.254.169.254")),), 24,
                setup=Setup(network=("169.254.169.254",)))
    yield _task("metadata", "policy-none", "cloud metadata under policy none is refused, naming the policy",
                (Exec(_http_probe("169.254.169.254"), timeout=20,
                      checks=(*_refused("169.254.169.254"), said("403"))),), 24)
    yield _task("metadata", "direct-socket", "a direct TCP connect to 169.254.169.254 fails at once (no route)",
                (Exec(py(DIRECT, "169.254.169.254", "80"), timeout=20,
                      checks=(Stdout(matches=r"^(ENETUNREACH|EHOSTUNREACH) fast\n$",
                                     mode="network_isolation_breach"),)),),
                24)
    for target, host in PRIVATE:
        yield _task("private_ranges", _slug(target), f"{target} is refused under 'internet' (a forbidden address)",
                    (Exec(_http_probe(target), timeout=20, checks=_refused(host)),), 25, setup=INTERNET)
    yield _task("private_ranges", "allowlisted-private-still-refused", "naming 10.0.0.1 in the allowlist does not "
                "open it (the private-range ban holds under every policy)",
                (Exec(_http_probe("10.0.0.1"), timeout=20, checks=_refused("10.0.0.1")),), 25,
                setup=Setup(network=("10.0.0.1",)))
    yield _task("private_ranges", "server-ip-other-port", "with the runner's server allowed, another port on the "
                "same host address is refused",
                (Exec(_http_probe("127.0.0.1:22"), timeout=20, checks=_refused("127.0.0.1")),), 25,
                setup=Setup(network=("{server}",)))
    for address in ("10.0.0.1", "172.17.0.1"):
        yield _task("private_ranges", f"direct-socket-{_slug(address)}", f"a direct TCP connect to {address} fails "
                    "at once: the sandbox has no route but the proxy",
                    (Exec(py(DIRECT, address, "80"), timeout=20,
                          checks=(Stdout(matches=r"^(ENETUNREACH|EHOSTUNREACH) fast\n$",
                                         mode="network_isolation_breach"),)),), 25)
    yield _task("private_ranges", "interfaces", "the sandbox's only network interface is loopback",
                (Exec(py("import socket; print(sorted(n for _, n in socket.if_nameindex()))"),
                      checks=(said("['lo']\n", mode="network_isolation_breach"),)),), 25)
    yield from _allowlist()
    yield from _dns()


PRIVATE = (
    ("10.0.0.1", "10.0.0.1"), ("172.16.0.1", "172.16.0.1"), ("172.31.255.254", "172.31.255.254"),
    ("192.168.0.1", "192.168.0.1"), ("127.0.0.1:22", "127.0.0.1"), ("127.0.0.1:7770", "127.0.0.1"),
    ("127.53.0.1", "127.53.0.1"), ("localhost:7770", "localhost"), ("[::1]:7770", "::1"),
    ("0.0.0.0:22", "0.0.0.0"),  # noqa: S104 - an address to be refused, not one to bind
    ("100.64.0.1", "100.64.0.1"), ("198.18.0.1", "198.18.0.1"), ("224.0.0.1", "224.0.0.1"),
    ("[fe80::1]", "fe80::1"), ("[fc00::1]", "fc00::1"), ("[::ffff:10.0.0.1]", "::ffff:a00:1"),
    ("[2002:a00:1::]", "2002:a00:1::"), ("https://10.0.0.1/", "10.0.0.1"),
)

DIRECT = r"""
import errno, socket, sys, time
t = time.monotonic()
s = socket.socket()
s.settimeout(5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    out = "connected"
except socket.timeout:
    out = "timeout"
except OSError as e:
    out = errno.errorcode.get(e.errno, str(e.errno))
print(out, "fast" if time.monotonic() - t < 1 else "slow")
"""


def _allowlist() -> Iterator[Task]:
    server = Setup(network=("{server}",))
    blob = Blob.random(10_000, 2601)
    yield _task("allowlist", "allowed-host-works", "control: the allowed host is reachable, byte-exact",
                (Exec(f"curl -sS --fail --noproxy '' http://{{server}}{blob.url_path} | sha256sum", timeout=20,
                      checks=(Stdout(equals=f"{blob.sha256}  -\n", mode="wrong_result"),)),), 26, setup=server,
                severity="high")
    for label, target, host in (("other-port", "127.0.0.1:1", "127.0.0.1"),
                                ("other-name", "example.org", "example.org"),
                                ("other-ip", "93.184.216.34", "93.184.216.34")):
        yield _task("allowlist", label, f"{target} is not in the allowlist: refused with a reason naming the host "
                    "and the policy",
                    (Exec(f"curl -sS --noproxy '' -m 5 http://{target}/; true", timeout=20,
                          checks=(Stdout(contains="not in this sandbox's allowlist", mode="unhelpful_network_error"),
                                  Stdout(contains="policy:", mode="unhelpful_network_error"),
                                  Denied(host=host), Duration(max=15, mode="hang"))),), 26, setup=server,
                    severity="high")
    wildcard = Setup(network=("*.example.com",))
    for label, target in (("wildcard-apex", "example.com"), ("wildcard-suffix-trick", "example.com.evil.net"),
                          ("wildcard-prefix-trick", "evilexample.com")):
        yield _task("allowlist", label, f"*.example.com does not allow {target}",
                    (Exec(_http_probe(target), timeout=20, checks=_refused(target)),), 26, setup=wildcard,
                    severity="high")
    yield _task("allowlist", "https-connect-refused", "a CONNECT to a host outside the allowlist is refused with 403",
                (Exec(_http_probe("https://example.org/"), timeout=20, checks=_refused("example.org")),), 26,
                setup=server, severity="high")
    yield _task("allowlist", "header-names-rule", "the refusal carries X-Corral-Egress naming the host",
                (Exec("curl -sS --noproxy '' -m 5 -D - -o /dev/null http://example.org/; true", timeout=20,
                      checks=(Stdout(matches=r"(?i)x-corral-egress: denied; host=example\.org",
                                     mode="unhelpful_network_error"),)),), 26, setup=server, severity="medium")


DNS_QUERY = r"""
import socket, struct, time
q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in "example.com".split(".")) + b"\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(3)
t = time.monotonic()
s.sendto(q, ("127.0.0.1", 53))
data = s.recv(512)
fast = "fast" if time.monotonic() - t < 1 else "slow"
print("rcode", data[3] & 0x0F, "answers", struct.unpack(">H", data[6:8])[0], fast)
"""


def _dns() -> Iterator[Task]:
    yield _task("dns", "getaddrinfo-fails-fast", "a name lookup fails at once and the refusal is reported",
                (Exec(py("import socket, time\nt = time.monotonic()\ntry:\n    socket.getaddrinfo('example.com', 80)\n"
                         "    print('resolved')\nexcept OSError:\n    print('failed', time.monotonic() - t < 1)"),
                      timeout=20, checks=(said("failed True\n", mode="network_isolation_breach"),
                                          Denied(host="example.com"))),), 27, severity="high")
    yield _task("dns", "resolver-refuses", "the only resolver (the agent, on 127.0.0.1) answers REFUSED at once",
                (Exec(py(DNS_QUERY), timeout=20,
                      checks=(said("rcode 5 answers 0 fast\n", mode="network_isolation_breach"),)),), 27,
                severity="high")
    yield _task("dns", "resolv-conf", "/etc/resolv.conf names only 127.0.0.1",
                (Exec("grep ^nameserver /etc/resolv.conf", checks=(said("nameserver 127.0.0.1\n",
                                                                          mode="network_isolation_breach"),)),), 27,
                severity="high")
    for label, family, address in (("udp-8-8-8-8", "udp", "8.8.8.8"), ("tcp-1-1-1-1", "tcp", "1.1.1.1"),
                                   ("udp-ipv6", "udp6", "2001:4860:4860::8888")):
        code = ("import errno, socket\nfam = socket.AF_INET6 if FAM == 'udp6' else socket.AF_INET\n"
                "kind = socket.SOCK_STREAM if FAM == 'tcp' else socket.SOCK_DGRAM\ntry:\n"
                "    s = socket.socket(fam, kind)\n    s.settimeout(3)\n"
                "    s.connect((ADDR, 53)) if FAM == 'tcp' else s.sendto(b'x', (ADDR, 53))\n"
                "    print('sent')\nexcept OSError as e:\n    print(errno.errorcode.get(e.errno, e))")
        code = code.replace("FAM", repr(family)).replace("ADDR", repr(address))
        yield _task("dns", f"direct-{label}", f"a DNS packet to {address} ({family}) cannot leave",
                    (Exec(py(code), timeout=20, checks=(Stdout(matches=r"^(ENETUNREACH|EHOSTUNREACH|EADDRNOTAVAIL|"
                                                                  r"EAFNOSUPPORT)\n$", mode="network_isolation_breach"),
                                                        Duration(max=15, mode="hang"))),), 27, severity="high")
    yield _task("dns", "getent-fails-fast", "getent hosts fails at once (no resolver answers)",
                (Exec("getent hosts pypi.org; echo rc=$?", timeout=20,
                      checks=(said("rc=2\n", mode="network_isolation_breach"),
                              Duration(max=15, mode="hang"))),),
                27, severity="high")
    yield _task("dns", "node-lookup", "node's dns.lookup fails at once",
                (Exec(("node", "-e", "const t = Date.now(); require('dns').lookup('example.com', (e) => "
                       "console.log(e ? e.code : 'resolved', Date.now() - t < 1000))"), timeout=20,
                      checks=(Stdout(matches=r"^(EAI_AGAIN|ENOTFOUND|ESERVFAIL|EREFUSED) true\n$",
                                     mode="network_isolation_breach"),)),), 27, severity="high")
    yield _task("dns", "names-through-proxy", "under policy none a name through the proxy is refused by policy, "
                "naming it", (Exec(_http_probe("pypi.org"), timeout=20, checks=_refused("pypi.org")),), 27,
                severity="high")


# -- 28, 29, 30, 31: syscalls, ioctls, kernel ------------------------------------------------------------------------

RAW_PROBE = r"""
import ctypes, errno, os, socket, sys, time
label = sys.argv[1]
def name(e):
    return errno.errorcode.get(e, str(e))
ETH_P_ALL = socket.htons(3)
socks = {
    "packet_raw": (socket.AF_PACKET, socket.SOCK_RAW, ETH_P_ALL),
    "packet_dgram": (socket.AF_PACKET, socket.SOCK_DGRAM, ETH_P_ALL),
    "inet_sock_packet": (socket.AF_INET, 10, ETH_P_ALL),
    "raw_icmp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
    "raw_tcp": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
    "raw_ip": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW),
    "raw6": (socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6),
}
if label in socks:
    try:
        socket.socket(*socks[label]).close()
        print("succeeded")
    except OSError as e:
        print(name(e.errno))
    sys.exit(0)
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
def ptrace(req, pid):
    ctypes.set_errno(0)
    r = libc.ptrace(req, pid, None, None)
    if r == 0 and req in (16, 0x4206):
        libc.ptrace(17, pid, None, None)  # detach
    return "succeeded" if r == 0 else name(ctypes.get_errno())
if label == "ptrace_attach_1":
    print(ptrace(16, 1))
elif label in ("ptrace_attach_child", "ptrace_seize_child"):
    child = os.fork()
    if child == 0:
        time.sleep(10)
        os._exit(0)
    print(ptrace(16 if label == "ptrace_attach_child" else 0x4206, child))
    os.kill(child, 9)
    os.waitpid(child, 0)
elif label == "ptrace_traceme":
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        ctypes.set_errno(0)
        rc = libc.ptrace(0, 0, None, None)
        os.write(w, name(ctypes.get_errno()).encode() if rc != 0 else b"succeeded")
        os._exit(0)
    os.waitpid(child, 0)
    print(os.read(r, 100).decode())
"""
RAW_LABELS = ("packet_raw", "inet_sock_packet", "raw_icmp", "raw_ip", "raw6", "ptrace_attach_1", "ptrace_attach_child",
              "ptrace_seize_child", "ptrace_traceme")

SYSCALL_PROBE = r"""
import ctypes, errno, os, platform, sys
label = sys.argv[1]
NR = {
    "x86_64": dict(mount=165, umount2=166, unshare=272, setns=308, io_uring_setup=425, io_uring_enter=426,
                   io_uring_register=427, bpf=321, keyctl=250, add_key=248, request_key=249, userfaultfd=323,
                   perf_event_open=298, pivot_root=155, chroot=161, clone=56, open_tree=428, fsopen=430,
                   kexec_load=246, init_module=175, swapon=167, reboot=169),
    "aarch64": dict(mount=40, umount2=39, unshare=97, setns=268, io_uring_setup=425, io_uring_enter=426,
                    io_uring_register=427, bpf=280, keyctl=219, add_key=217, request_key=218, userfaultfd=282,
                    perf_event_open=241, pivot_root=41, chroot=51, clone=220, open_tree=428, fsopen=430,
                    kexec_load=104, init_module=105, swapon=224, reboot=142),
}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(256)
os.makedirs("/tmp/mnt", exist_ok=True)
calls = {
    "mount": ("mount", b"none", b"/tmp/mnt", b"tmpfs", 0, None),
    "umount2": ("umount2", b"/tmp", 2),
    "unshare_user": ("unshare", 0x10000000),
    "unshare_mnt": ("unshare", 0x00020000),
    "unshare_net": ("unshare", 0x40000000),
    "unshare_pid": ("unshare", 0x20000000),
    "setns": ("setns", "NETNS", 0),
    "io_uring_setup": ("io_uring_setup", 8, buf),
    "io_uring_enter": ("io_uring_enter", 0, 0, 0, 0, None, 0),
    "io_uring_register": ("io_uring_register", 0, 0, None, 0),
    "bpf": ("bpf", 0, buf, 72),
    "keyctl": ("keyctl", 0, -3, 1),
    "add_key": ("add_key", b"user", b"corral", b"x", 1, -3),
    "request_key": ("request_key", b"user", b"corral", None, 0),
    "userfaultfd": ("userfaultfd", 0),
    "perf_event_open": ("perf_event_open", buf, 0, -1, -1, 0),
    "pivot_root": ("pivot_root", b"/tmp", b"/tmp/mnt"),
    "chroot": ("chroot", b"/tmp"),
    "open_tree": ("open_tree", -100, b"/tmp", 1),
    "fsopen": ("fsopen", b"tmpfs", 0),
    "kexec_load": ("kexec_load", 0, 0, None, 0),
    "init_module": ("init_module", None, 0, b""),
    "swapon": ("swapon", b"/tmp/none", 0),
    "reboot": ("reboot", 0, 0, 0, None),  # bad magic: EINVAL if it ever got past the filter
    "clone_newuser": ("clone", 0x10000000 | 17, 0, 0, 0, 0),
}
nr_name, *args = calls[label]
args = [os.open("/proc/self/ns/net", os.O_RDONLY) if a == "NETNS" else a for a in args]
cargs = [ctypes.c_long(a) if isinstance(a, int) else (a if a is not None else ctypes.c_void_p(0)) for a in args]
ctypes.set_errno(0)
r = libc.syscall(ctypes.c_long(NR[nr_name]), *cargs)
if r == 0 and label.startswith("clone"):
    os._exit(0)  # the child of a clone that should never have happened
if r > 0 and label.startswith("clone"):
    os.waitpid(r, 0)
print("succeeded" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
"""
SYSCALL_LABELS = ("mount", "unshare_user", "unshare_mnt", "unshare_net", "setns", "io_uring_setup", "io_uring_enter",
                  "bpf", "keyctl", "add_key", "userfaultfd", "perf_event_open", "pivot_root", "chroot", "open_tree",
                  "fsopen", "init_module", "reboot", "clone_newuser")

TIOCSTI_PROBE = r"""
import errno, fcntl, os, sys, termios
master, slave = os.openpty()
if sys.argv[1] == "own-ctty":
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        fd = os.open(os.ttyname(slave), os.O_RDWR)  # becomes the controlling terminal
        try:
            fcntl.ioctl(fd, termios.TIOCSTI, b"x")
            os.write(w, b"succeeded")
        except OSError as e:
            os.write(w, errno.errorcode.get(e.errno, str(e.errno)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(os.read(r, 100).decode())
else:
    try:
        fcntl.ioctl(slave, termios.TIOCSTI, b"x")
        print("succeeded")
    except OSError as e:
        print("refused")
"""


def _kernel() -> Iterator[Task]:
    mode = "privilege_escalation"
    for label in RAW_LABELS:
        what = "raw socket" if not label.startswith("ptrace") else "ptrace"
        yield _task("raw_ptrace", label.replace("_", "-"), f"{what} probe {label} gives EPERM",
                    (Exec(py(RAW_PROBE, label), checks=(said("EPERM\n", mode=mode),)),), 28)
    for label in SYSCALL_LABELS:
        yield _task("syscalls", label.replace("_", "-"), f"the {label} syscall is denied (EPERM or ENOSYS)",
                    (Exec(py(SYSCALL_PROBE, label), checks=(Stdout(matches=r"^(EPERM|ENOSYS)\n$", mode=mode),)),), 29)
    yield _task("syscalls", "tools", "unshare -U, unshare -r, unshare -n and mount -t tmpfs all fail",
                (Exec("for c in 'unshare -U true' 'unshare -r true' 'unshare -n true' 'mount -t tmpfs none /tmp'; do "
                      "$c 2>/dev/null && echo \"$c succeeded\"; done; echo end",
                      checks=(said("end\n", mode=mode),)),), 29)
    yield _task("tiocsti", "own-ctty", "TIOCSTI on the process's own controlling terminal gives EPERM",
                (Exec(py(TIOCSTI_PROBE, "own-ctty"), checks=(said("EPERM\n", mode=mode),)),), 30)
    yield _task("tiocsti", "other-tty", "TIOCSTI on a terminal that is not the controlling one is refused",
                (Exec(py(TIOCSTI_PROBE, "other-tty"), checks=(said("refused\n", mode=mode),)),), 30)
    yield _task("runtime", "not-gvisor", "a runc sandbox runs on the host's Linux kernel, not gVisor",
                (Exec("uname -s; grep -ci gvisor /proc/version || true",
                      checks=(said("Linux\n0\n", mode="wrong_result"),)),), 31, severity="high")
    yield _task("runtime", "dmesg-denied", "the kernel log is not readable from a runc sandbox",
                (Exec("dmesg", checks=(ExitCode(1, mode="host_file_exposed"), Stderr(contains="not permitted"))),), 31,
                severity="high")
    yield _task("runtime", "kmsg-denied", "/dev/kmsg is absent or unreadable",
                (Exec("head -c 1 /dev/kmsg; echo rc=$?",
                      checks=(Stdout(matches=r"rc=[1-9]", mode="host_file_exposed"),)),),
                31, severity="high")


def tasks() -> Iterable[Task]:
    yield from _host_sockets()
    yield from _identity()
    yield from _capabilities()
    yield from _setuid()
    yield from _read_only()
    yield from _caps()
    yield from _timeout_tree()
    yield from _utf8()
    yield from _roundtrip()
    yield from _traversal()
    yield from _bad_paths()
    yield from _symlinks()
    yield from _archives()
    yield from _visibility()
    yield from _environment()
    yield from _orchestrator()
    yield from _network()
    yield from _kernel()
