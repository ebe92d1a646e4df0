"""The Docker ContainerCreate body of a sandbox: every hardening item of DESIGN.md, as the local backend's OCI
`config.json` has them (`corral.backends.local._bundle`), in the Engine API's terms.

What maps one to one: all capabilities dropped, `no-new-privileges`, Corral's own seccomp profile (the same
JSON; Docker 20.10 reads `defaultErrnoRet` and `errnoRet`), the same masked and read-only `/proc` and `/sys`
paths, new pid / ipc / uts / mount / net / cgroup namespaces, memory (no swap) / pids / CPU limits, a nofile and
a zero core rlimit, `/tmp` and `/dev/shm` as size-capped tmpfs, the agent as PID 1 (`python3 -S`, no init),
user 1000, a clean environment, and no network but loopback (`NetworkMode: none`): the egress proxy's socket
directory is bind-mounted read-only, as the local backend does, and the agent bridges 127.0.0.1:3128 to it.

What differs, and why:
- No user namespace: Docker has only the daemon-wide `userns-remap` (every container in one shifted range), not
  one range per sandbox. The sandbox user is uid 1000 of the host too, with no capabilities.
- The root filesystem is the image, read-only (`ReadonlyRootfs`). Everything the sandbox can write lives on its
  own loop-mounted ext4 disk of `limits.disk` bytes, bind-mounted at the writable directories (`WRITABLE`), or
  in the size-capped tmpfs: a hard disk quota without the overlay2 `size=` option (which needs xfs with
  project quotas under /var/lib/docker).
- The agent binds its own socket in a bind-mounted run directory (`CORRAL_AGENT_LISTEN`), as it does under
  runsc: Docker cannot hand a container an inherited file descriptor. The backend then moves the socket out of
  that directory and makes the directory read-only (see `_backend`).
- Volumes (`spec.volumes`) are bind mounts of their idmapped targets (`corral.backends._volumes`, with
  `uid_base=0`: no user namespace to map into); one at a `WRITABLE` path takes the disk's place there, and none
  may sit above Corral's own mounts (`volume_path_problem`).
- Bind mounts take no nosuid/nodev/noexec options through the API: no_new_privs makes setuid bits inert, the
  device cgroup admits only Docker's default devices, and the disk is itself mounted nosuid,nodev on the host
  (a bind mount keeps its source's flags).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._spec import Limits

# Reused from the local backend so that both backends harden sandboxes from the same definitions.
from ..local._bundle import (
    AGENT_DIR,
    AGENT_RUN_DIR,
    CPU_PERIOD,
    EGRESS_DIR,
    MASKED_PATHS,
    READONLY_PATHS,
    SANDBOX_GID,
    SANDBOX_UID,
)
from ..local._seccomp import seccomp_profile

__all__ = ["AGENT_ARGV", "AGENT_SOCKET", "WRITABLE", "ContainerParams", "WritableDir", "container_config",
           "volume_path_problem"]

# As the local backend's bundle starts the agent: `-c`, not `-m agent` (runpy costs milliseconds of every start).
AGENT_ARGV = ["/usr/bin/python3", "-S", "-B", "-c", "from agent.__main__ import main; main()"]
AGENT_SOCKET = f"{AGENT_RUN_DIR}/agent.sock"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RESOLV_CONF = "/etc/resolv.conf"


@dataclass(frozen=True)
class WritableDir:
    """A directory of the sandbox that lives on its disk: `name` on the disk, mounted at `path`."""

    path: str
    name: str
    uid: int
    mode: int


# Where the sandbox may write, besides the tmpfs (/tmp, /dev/shm): the file API's roots and /var/tmp.
WRITABLE = (
    WritableDir("/workspace", "workspace", SANDBOX_UID, 0o755),
    WritableDir("/home/user", "home", SANDBOX_UID, 0o750),
    WritableDir("/var/tmp", "var-tmp", 0, 0o1777),
)


@dataclass(frozen=True)
class ContainerParams:
    sandbox_id: str
    image: str
    limits: Limits
    token: str
    agent_source: Path  # the host directory of the agent package, bind-mounted read-only at AGENT_DIR
    run_dir: Path  # the host directory at AGENT_RUN_DIR, where the agent binds its socket
    egress_dir: Path  # the host directory at EGRESS_DIR, where the egress proxy listens (read-only inside)
    disk: Path  # where the sandbox's disk is mounted on the host: one directory per `WRITABLE` entry
    resolv_conf: Path  # names resolve through the egress proxy only
    swap_limit: bool  # whether the kernel accounts swap: then memory+swap == memory, no swap at all
    labels: Mapping[str, str] = field(default_factory=dict)
    hostname: str = "sandbox"
    # (mount path, host directory): each volume, already attached (idmapped) at that directory. A volume at one
    # of the `WRITABLE` paths takes the disk's place there.
    volumes: tuple[tuple[str, Path], ...] = ()


def container_config(p: ContainerParams) -> dict[str, Any]:
    return {
        "Image": p.image,
        "Hostname": p.hostname,
        "User": f"{SANDBOX_UID}:{SANDBOX_GID}",
        "Env": [f"PATH={PATH}", "LANG=C.UTF-8", f"CORRAL_AGENT_TOKEN={p.token}",
                f"CORRAL_AGENT_LISTEN={AGENT_SOCKET}"],
        "Entrypoint": AGENT_ARGV,
        "Cmd": [],
        "WorkingDir": "/.corral",
        "Labels": dict(p.labels),
        "AttachStdin": False, "AttachStdout": False, "AttachStderr": False,
        "OpenStdin": False, "StdinOnce": False, "Tty": False,
        "StopSignal": "SIGKILL",  # the agent handles no signal (PID 1): a stop is a kill
        "HostConfig": _host_config(p),
    }


def _host_config(p: ContainerParams) -> dict[str, Any]:
    lim = p.limits
    return {
        "Runtime": "runc",  # whatever the daemon's default is: the runtime `corral check` expects
        "NetworkMode": "none",
        "IpcMode": "private",
        "PidMode": "",
        "UTSMode": "",
        "CgroupnsMode": "private",
        "UsernsMode": "",
        "Privileged": False,
        "Init": False,  # the agent is PID 1 and reaps
        "ReadonlyRootfs": True,
        "CapAdd": [],
        "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges:true", f"seccomp={json.dumps(seccomp_profile())}"],
        "MaskedPaths": list(MASKED_PATHS),
        "ReadonlyPaths": list(READONLY_PATHS),
        "Sysctls": {
            # Per network namespace: the capability-less agent answers DNS on 127.0.0.1:53 and refuses at once.
            "net.ipv4.ip_unprivileged_port_start": "53",
        },
        **_resources(lim, swap_limit=p.swap_limit),
        "Tmpfs": {"/tmp": f"rw,exec,nosuid,nodev,mode=1777,size={lim.tmp}"},
        "ShmSize": lim.shm,  # /dev/shm of the private IPC namespace: nosuid,noexec,nodev,mode=1777
        "Mounts": _mounts(p),
        "Devices": [],
        "RestartPolicy": {"Name": "no"},
        "AutoRemove": False,
        "LogConfig": {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}},
        "PublishAllPorts": False,
        "PortBindings": {},
    }


def _resources(lim: Limits, *, swap_limit: bool) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "Memory": lim.memory,
        "CpuPeriod": CPU_PERIOD,
        "CpuQuota": max(1000, int(lim.cpus * CPU_PERIOD)),
        "PidsLimit": lim.pids,
        "Ulimits": [{"Name": "nofile", "Soft": lim.open_files, "Hard": lim.open_files},
                    {"Name": "core", "Soft": 0, "Hard": 0}],
        "OomKillDisable": False,
    }
    if swap_limit:
        resources["MemorySwap"] = lim.memory
    return resources


def _bind(source: Path, target: str, *, read_only: bool) -> dict[str, Any]:
    return {"Type": "bind", "Source": str(source), "Target": target, "ReadOnly": read_only,
            "BindOptions": {"Propagation": "rprivate"}}


def _mounts(p: ContainerParams) -> list[dict[str, Any]]:
    on_volumes = {path for path, _ in p.volumes}
    return [
        _bind(p.agent_source, AGENT_DIR, read_only=True),
        _bind(p.run_dir, AGENT_RUN_DIR, read_only=False),
        # Read-only is enough to connect to a socket (connect needs write permission on the socket inode only).
        _bind(p.egress_dir, EGRESS_DIR, read_only=True),
        _bind(p.resolv_conf, RESOLV_CONF, read_only=True),
        *(_bind(p.disk / d.name, d.path, read_only=False) for d in WRITABLE if d.path not in on_volumes),
        # Docker mounts in path order (parents first), so a volume below /workspace lands on the disk's.
        *(_bind(source, path, read_only=False) for path, source in p.volumes),
    ]


def volume_path_problem(path: str) -> str | None:
    """Why a volume cannot be mounted at `path` in a Docker sandbox (None: it can). Above one of Corral's own
    mounts, the volume would get that mount's mount point made in it (a stray `user/` in a shared volume)."""
    if path == RESOLV_CONF:
        return f"{RESOLV_CONF} is Corral's own mount; mount the volume elsewhere"
    for own in (RESOLV_CONF, *(d.path for d in WRITABLE)):
        if own.startswith(path + "/"):
            return f"it would hold Corral's own mount at {own}; mount the volume elsewhere (or at {own} itself)"
    return None
