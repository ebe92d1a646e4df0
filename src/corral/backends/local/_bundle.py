"""The OCI runtime-spec `config.json` of a sandbox: every hardening item of DESIGN.md in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._boot_id import BOOT_ID_PATH
from .._spec import Limits
from ._seccomp import seccomp_profile

SANDBOX_UID = 1000
SANDBOX_GID = 1000
ID_RANGE = 65536  # container ids 0..65535 map to one host range per sandbox
AGENT_DIR = "/.corral/agent"
AGENT_RUN_DIR = "/.corral/run"
EGRESS_DIR = "/.corral/egress"  # holds proxy.sock, the egress proxy's socket for this sandbox (docs/egress.md)
CPU_PERIOD = 100_000

# Paths under /proc and /sys that leak host information or offer kernel knobs.
MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/proc/sysrq-trigger",
    "/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel/debug", "/sys/kernel/security",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"]

# A sandbox created with root (docs/security.md): what its root needs to install packages and own files, no more.
# Capabilities of a user namespace's root act only on what that namespace owns (its files, its processes, its
# network namespace), never the host's; `noNewPrivileges` and the seccomp profile stay as in every sandbox.
ROOT_CAPABILITIES = [
    "CAP_CHOWN",  # chown: package managers, `chown` of files root wrote for the user
    "CAP_DAC_OVERRIDE",  # write files whatever their mode (dpkg's database, /etc): what root expects
    "CAP_DAC_READ_SEARCH",  # read and search any directory (root's `find /`, backups of the user's files)
    "CAP_FOWNER",  # chmod, utimes, xattrs on files root does not own (tar and dpkg restore modes and times)
    "CAP_FSETID",  # keep set-group-id bits on the files and directories packages install
    "CAP_KILL",  # signal the user's processes (`sudo kill`, service scripts)
    "CAP_SETUID",  # change uid: apt drops to `_apt` to download, `su`/`runuser`, and the agent's drop to the user
    "CAP_SETGID",  # change gid and supplementary groups, for the same
    "CAP_SETPCAP",  # drop capabilities from the bounding set: the agent empties it for the user's commands
    "CAP_NET_BIND_SERVICE",  # bind ports below 53 (53 and above are unprivileged in every sandbox's namespace)
]


@dataclass(frozen=True)
class BundleParams:
    sandbox_id: str
    rootfs: Path
    agent_source: Path  # the host directory of the agent package, bind-mounted read-only (local: a mount of its own)
    host_uid_base: int
    limits: Limits
    token: str
    cgroups_path: str
    swap_limit: bool  # whether the kernel accounts swap (cgroup v1 memsw / v2 memory.swap.max)
    hostname: str = "sandbox"
    agent_listen: str | None = None  # for runtimes that cannot inherit a socket: a path to bind instead
    agent_run_dir: Path | None = None  # the host directory mounted where `agent_listen` lives
    egress_dir: Path | None = None  # the host directory mounted at EGRESS_DIR
    # Volumes (docs/volumes.md): (path in the sandbox, host directory: the volume's idmapped bind for this sandbox)
    volume_mounts: tuple[tuple[str, Path], ...] = ()
    # Created with root: the agent starts as the namespace's uid 0 with ROOT_CAPABILITIES (docs/security.md)
    root: bool = False
    # runsc: this boot's boot id (`corral.backends._boot_id`), bind-mounted read-only over the kernel's
    boot_id_file: Path | None = None


def build_config(p: BundleParams) -> dict[str, Any]:
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8",
           f"CORRAL_AGENT_TOKEN={p.token}"]
    if p.agent_listen:
        env.append(f"CORRAL_AGENT_LISTEN={p.agent_listen}")
    return {
        "ociVersion": "1.0.2",
        "hostname": p.hostname,
        "root": {"path": str(p.rootfs), "readonly": False},
        "process": _process(p, env),
        "mounts": _mounts(p),
        "linux": _linux(p),
    }


def _process(p: BundleParams, env: list[str]) -> dict[str, Any]:
    uid, gid = (0, 0) if p.root else (SANDBOX_UID, SANDBOX_GID)
    caps = ROOT_CAPABILITIES if p.root else []
    return {
        "terminal": False,
        "user": {"uid": uid, "gid": gid, "additionalGids": []},
        # `-c`, not `-m agent`: -m imports runpy and its dependencies, milliseconds of every sandbox start.
        "args": ["/usr/bin/python3", "-S", "-B", "-c", "from agent.__main__ import main; main()"],
        "env": env,
        "cwd": "/.corral",
        "capabilities": {"bounding": list(caps), "effective": list(caps), "inheritable": [],
                         "permitted": list(caps), "ambient": []},
        "rlimits": [
            {"type": "RLIMIT_NOFILE", "hard": p.limits.open_files, "soft": p.limits.open_files},
            {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
        ],
        "noNewPrivileges": True,
        # No oomScoreAdj for the agent: lowering it needs CAP_SYS_RESOURCE, which many hosts (and user
        # namespaces) lack. Instead the agent's children raise their own score (see agent/processes.py).
    }


def _mounts(p: BundleParams) -> list[dict[str, Any]]:
    lim = p.limits
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={lim.shm}"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", f"size={lim.tmp}"]},
        *({"destination": path, "type": "bind", "source": str(source), "options": ["rbind", "rw", "nosuid", "nodev"]}
          for path, source in p.volume_mounts),
        {"destination": AGENT_DIR, "type": "bind", "source": str(p.agent_source),
         "options": ["rbind", "ro", "nosuid", "nodev"]},
        *([{"destination": AGENT_RUN_DIR, "type": "bind", "source": str(p.agent_run_dir),
            "options": ["rbind", "rw", "nosuid", "nodev", "noexec"]}] if p.agent_run_dir else []),
        # Read-only is enough to connect to a socket (connect needs write permission on the socket inode only).
        *([{"destination": EGRESS_DIR, "type": "bind", "source": str(p.egress_dir),
            "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]}] if p.egress_dir else []),
        *([{"destination": BOOT_ID_PATH, "type": "bind", "source": str(p.boot_id_file),
            "options": ["bind", "ro", "nosuid", "nodev", "noexec"]}] if p.boot_id_file else []),
    ]


def _linux(p: BundleParams) -> dict[str, Any]:
    mapping = [{"containerID": 0, "hostID": p.host_uid_base, "size": ID_RANGE}]
    return {
        "uidMappings": mapping,
        "gidMappings": mapping,
        "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network", "user", "cgroup")],
        "cgroupsPath": p.cgroups_path,
        "resources": _resources(p),
        "seccomp": seccomp_profile(),
        "maskedPaths": MASKED_PATHS,
        "readonlyPaths": READONLY_PATHS,
        # Per network namespace: lets the (capability-less) agent answer DNS on 127.0.0.1:53, so a lookup is
        # refused at once with a reason instead of timing out. Only this sandbox's loopback is affected.
        "sysctl": {"net.ipv4.ip_unprivileged_port_start": "53"},
    }


def _resources(p: BundleParams) -> dict[str, Any]:
    lim = p.limits
    memory: dict[str, Any] = {"limit": lim.memory}
    if p.swap_limit:
        memory["swap"] = lim.memory  # memory+swap == memory: no swap at all
    return {
        "devices": [{"allow": False, "access": "rwm"}],
        "memory": memory,
        "cpu": {"quota": cpu_quota(lim.cpus), "period": CPU_PERIOD},
        "pids": {"limit": lim.pids},
    }


def cpu_quota(cpus: float) -> int:
    """The CFS quota per `CPU_PERIOD` for `cpus` CPUs (the kernel's floor is 1 ms)."""
    return max(1000, int(cpus * CPU_PERIOD))
