"""The Docker backend: each sandbox is a Docker container, hardened as the local backend's bundles are.

`corral serve --backend docker` runs the same templates, through a Docker daemon on this machine (the official
SDK, `corral[docker]`): each template is imported once as an image (`_image`), each sandbox is one container
(`_container` has its whole configuration and what Docker cannot give), and everything inside a sandbox goes
through the same agent protocol as on every backend.

Layout of one sandbox, under `<home>/docker/<id>/` (this backend's own; the engine keeps its state elsewhere):

    disk.img    the sandbox's disk: a sparse ext4 image of `limits.disk` bytes
    disk/       where it is loop-mounted: `workspace/`, `home/`, `var-tmp/`, bind-mounted into the container
    run/        bind-mounted at /.corral/run, where the agent binds its socket when it starts
    agent.sock  that socket, moved here by `create` (root's, 0600): out of the sandbox's reach
    egress/     bind-mounted read-only at /.corral/egress: the egress proxy's `proxy.sock` for this sandbox
    volumes/<n> each volume of `spec.volumes`, attached (idmapped) here and bind-mounted where the spec says

and of its snapshots, `<home>/docker-snapshots/<snapshot id>.img`: copies of sandbox disks (`_snapshot`); its
volumes are `<home>/volumes/`, shared with the local backend's code (`corral.backends._volumes`).

Docker cannot hand the agent a listening socket made on the host (the local backend's way with runc), so the
agent binds one in `run/`, as under runsc. As soon as it is there, `create` moves it out of the bind-mounted
directory (a Unix socket stays bound to its inode, whatever its name) and makes `run/` root's: nothing inside the
sandbox can then connect to the agent, nor fill the host's disk through `run/`.

The container is named `corral-<home key>-<sandbox id>` and labelled `corral.home=<home>`,
`corral.sandbox=<id>` and `corral.backend=docker` (plus the operator's own `labels`): `sweep` finds by label
whatever no engine remembers, and a container whose create was interrupted is still found by its name.

Lifecycle (docs/lifecycle.md): the container's own writable layer holds nothing of the sandbox (its root is
read-only), so the sandbox's state is its disk. `stop` kills the container (its processes, memory and cgroup go;
the container stays, exited, and keeps its template image in use) and unmounts the disk; `boot` mounts the disk
again and replaces the container with a new one made exactly as `create` makes it, from the spec it is given (its
limits and volumes may differ), with a fresh agent socket taken out of the sandbox's reach again. A snapshot is
a copy of the disk taken frozen (`_snapshot`); `create(source=...)` starts from a copy of that copy instead of a
fresh disk, with everything else as from the template.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..._exceptions import (
    AgentError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    RuntimeUnavailableError,
    ServerError,
)
from ...templates import Template
from .._boot_id import give_boot_id
from .._contract import (
    JSON,
    ROOT_LIMITATION,
    AgentAddress,
    BackendCapacity,
    BackendRecord,
    SandboxUsage,
    SnapshotArtifact,
    UnixEndpoint,
)
from .._spec import Runtime, SandboxSpec
from .._volumes import VOLUMES_DIR, HostVolumes
from ..local import _cgroups, _disk
from ..local._agent_files import install_agent
from ..local._bundle import SANDBOX_UID
from ..local._system import free_disk, meminfo
from ..local._usage import sandbox_usage
from ._api import DEFAULT_BASE_URL, DockerAPI
from ._checkpoints import DockerCheckpoints
from ._container import ContainerParams, container_config
from ._image import Images
from ._preflight import check_volume_paths, daemon_problems, host_problems
from ._record import DockerRecord
from ._record import docker_record as _docker
from ._snapshot import allocated, copy_image, flush_filesystem, frozen_filesystem, grow_image, mark_clean
from ._volume import mount_disk, prepare_disk, release_disk, unmount_disk, write_resolv_conf

__all__ = ["LIMITATIONS", "DockerBackend", "DockerRecord"]

PREFLIGHT_TTL = 5.0
AGENT_READY_TIMEOUT = 15.0
LABEL_HOME, LABEL_SANDBOX, LABEL_BACKEND = "corral.home", "corral.sandbox", "corral.backend"
_LOG_TAIL = 40
_SOCKET_POLL = 0.005  # seconds between looks for the agent's socket (it appears ~50 ms after the start)
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_ALIVE_POLL = 0.5  # seconds between asking the daemon whether a container whose agent is slow still runs
_PAUSE_ATTEMPTS = 12  # tries at freezing a sandbox whose processes keep forking (see `pause`): about 2.5 s
_PAUSE_BACKOFF_MAX = 0.25
_CGROUP_WAIT = 10.0  # seconds for a killed container's cgroup to be removed (by runc, through containerd)

# What this backend cannot give that the local one does, each with its reason: for `corral check` and the docs.
LIMITATIONS: dict[str, str] = {
    "user_namespace": (
        "no per-sandbox user namespace: Docker offers only the daemon-wide userns-remap (all containers in one "
        "shifted uid range; this backend refuses such a daemon), so the sandbox user is uid 1000 of the host "
        "too, with no capabilities, no_new_privs and the seccomp profile; a host process running as uid 1000 "
        "could signal sandbox processes (and trace them where kernel.yama.ptrace_scope is 0): keep uid 1000 "
        "free of other use on a Docker backend host. The sandbox's files on the host stay out of its reach "
        "(under a root-only directory)"),
    "agent_socket": (
        "the agent's socket is bound inside the sandbox's network namespace (Docker cannot hand a container a "
        "socket made outside), so the sandbox's /proc/net/unix names it (/.corral/run/agent.sock); the file is "
        "moved out of the sandbox's mounts the moment it exists, so nothing inside can connect to it"),
    "runtime_runsc": (
        "no gVisor: the Docker backend runs runc only (runsc would have to be registered as a Docker runtime "
        "with --host-uds for the agent's socket); use the local backend for runtime=runsc"),
    ROOT_LIMITATION: (
        "no sandbox with root (root=True): without a user namespace per sandbox, root inside a container would "
        "be root of the host running the Docker daemon, kept in only by its capabilities and seccomp; use the "
        "local backend (runc or runsc), where a sandbox's root is an unprivileged host uid"),
}


class DockerBackend(DockerCheckpoints):
    """Sandboxes as hardened Docker containers on this machine's daemon; see docs/backends.md.

    **Parameters:**
    * **home** - the state directory: sandboxes under `docker/`, disk images under `cache/disks/`, the agent's
      files under `agent/`.
    * **base_url** - the daemon's API (default `unix:///var/run/docker.sock`). It must run on this machine:
      sandboxes bind-mount directories and loop-mounted disks of `home`.
    * **labels** - more labels for every container (`corral.home`, `corral.sandbox` and `corral.backend` are
      the backend's own).
    """

    name = "docker"
    limitations: Mapping[str, str] = MappingProxyType(LIMITATIONS)  # `DeclaresLimitations` (docs/backends.md)

    def __init__(self, home: Path, *, base_url: str = DEFAULT_BASE_URL,
                 labels: Mapping[str, str] | None = None) -> None:
        self.home = Path(home)
        self.dir = self.home / "docker"
        self.snapshots = self.home / "docker-snapshots"
        self.api = DockerAPI(base_url)
        self.images = Images(self.api)
        self.volumes = HostVolumes(self.home)
        extra = dict(labels or {})
        if own := extra.keys() & {LABEL_HOME, LABEL_SANDBOX, LABEL_BACKEND}:
            raise ValueError(f"labels {sorted(own)} belong to the Docker backend")
        self.labels = {**extra, LABEL_HOME: str(self.home), LABEL_BACKEND: "docker"}
        # Container names are daemon-wide: a short key of the home keeps two homes' sandboxes apart.
        self._home_key = hashlib.sha256(str(self.home).encode()).hexdigest()[:8]
        self._checked = -PREFLIGHT_TTL
        self._swap_limit = False
        self._agent_dir: Path | None = None
        self._agent_lock = asyncio.Lock()
        self._snapshot_locks: dict[str, asyncio.Lock] = {}  # per sandbox: one freeze at a time

    # -- the contract ------------------------------------------------------------------------------

    async def check(self, spec: SandboxSpec) -> None:
        await self._preflight(spec)

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template,
                     source: SnapshotArtifact | None = None) -> DockerRecord:
        await self._preflight(spec)  # again: `create` is where isolation must not be missing
        check_volume_paths(spec, template.rootfs)
        snapshot_disk = self._snapshot_disk(source, template, spec) if source is not None else None
        # Root's only: Docker resolves bind-mount sources as root, so no host user needs to enter. That matters
        # here more than on the local backend: the sandbox user is uid 1000 of the host too, and must not be
        # able to reach, from outside, its disk, the agent's socket or the egress proxy's.
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        sbdir = self.dir / sandbox_id
        try:
            sbdir.mkdir(mode=0o700)
        except FileExistsError:
            raise ConflictError(f"sandbox {sandbox_id} already exists on the Docker backend") from None
        record = DockerRecord(sandbox_id=sandbox_id, name=self._container_name(sandbox_id), dir=sbdir,
                              token=secrets.token_urlsafe(32), template=template.digest)
        try:
            record = replace(record, image=await self.images.ensure(template))
            if snapshot_disk is None:
                await mount_disk(self.home / "cache" / "disks", spec.limits.disk, sbdir / "disk.img",
                                 sbdir / "disk")
                await asyncio.to_thread(prepare_disk, sbdir / "disk", template.rootfs)
            else:
                await _disk.in_thread(copy_image, snapshot_disk, sbdir / "disk.img")
                await grow_image(sbdir / "disk.img", spec.limits.disk)
                await _disk.mount_image(sbdir / "disk.img", sbdir / "disk")
            record = await self._start(record, spec)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.destroy(record))
            raise
        return record

    def agent_address(self, record: BackendRecord) -> AgentAddress:
        rec = _docker(record)
        return AgentAddress(UnixEndpoint(str(rec.dir / "agent.sock")), rec.token)

    def ready_timeout(self, record: BackendRecord) -> float:
        return AGENT_READY_TIMEOUT

    def egress_endpoint(self, record: BackendRecord) -> UnixEndpoint:
        return UnixEndpoint(str(_docker(record).dir / "egress" / "proxy.sock"))

    async def diagnostics(self, record: BackendRecord) -> str:
        rec = _docker(record)
        found = await self.api.inspect(rec.name)
        if found is None:
            return f"container {rec.name} does not exist"
        state = found.get("State") or {}
        summary = (f"container {rec.name} is {state.get('Status')} (exit code {state.get('ExitCode')}, "
                   f"OOM-killed {state.get('OOMKilled')}{', error ' + state['Error'] if state.get('Error') else ''})")
        log = (await self.api.logs(rec.name, _LOG_TAIL)).decode(errors="replace").strip()
        return f"{summary}; its log: {log[-1500:] or '(empty)'}"

    async def pause(self, record: BackendRecord) -> None:
        # As on the local backend (the same runc, the same cgroup v1 freezer): a tree that keeps forking makes
        # runc give up ("unable to freeze") and thaw it again, which the daemon answered as a bare 500. Found by
        # the eval corpus (long_running.pause/while-forking on --backend docker): the next try usually lands
        # between forks, so retry briefly, then answer the retryable 409 of docs/api.md.
        rec = _docker(record)
        text = ""
        for attempt in range(_PAUSE_ATTEMPTS):
            try:
                await self.api.pause(rec.name)
                return
            except ServerError as exc:
                if "unable to freeze" not in exc.message:
                    raise
                text = exc.message
            await asyncio.sleep(min(_PAUSE_BACKOFF_MAX, 0.05 * (attempt + 1)))
        raise ConflictError(
            f"sandbox {rec.sandbox_id} could not be paused: its processes kept changing while the cgroup freezer "
            f"tried to stop them ({_PAUSE_ATTEMPTS} attempts: {text[-300:]}); it is still running, try again",
            details={"retryable": True})

    async def resume(self, record: BackendRecord) -> None:
        await self.api.unpause(_docker(record).name)

    async def stop(self, record: BackendRecord) -> None:
        """Kill the container (kept, exited: its cgroup and memory are gone) and unmount the disk."""
        rec = _docker(record)
        await self.api.kill(rec.name)  # a paused container too: the daemon kills it frozen
        await self._wait_cgroup_gone(rec)
        await self.volumes.detach_all(rec.dir / VOLUMES_DIR)  # `boot` attaches the spec's volumes again
        await release_disk(rec.dir / "disk.img", rec.dir / "disk")  # then `boot` and `snapshot` see its last write
        (rec.dir / "agent.sock").unlink(missing_ok=True)

    async def boot(self, record: BackendRecord, spec: SandboxSpec) -> DockerRecord:
        """Mount the kept disk again and run a new container on it, made as `create` makes one from `spec`."""
        rec = _docker(record)
        if not rec.image:
            raise ServerError(f"sandbox {rec.sandbox_id} was created before the Docker backend could boot "
                              "sandboxes again: its record names no image")
        await self._preflight(spec)
        check_volume_paths(spec, None)
        if await self.alive(rec):
            raise ConflictError(f"sandbox {rec.sandbox_id} is running: only a stopped sandbox boots")
        if not (rec.dir / "disk.img").is_file():
            raise ServerError(f"sandbox {rec.sandbox_id} cannot boot: its disk {rec.dir / 'disk.img'} is gone")
        try:
            if not _disk.is_mounted(rec.dir / "disk"):
                await release_disk(rec.dir / "disk.img", rec.dir / "disk")  # a stop that gave up waiting for it
                await _disk.mount_image(rec.dir / "disk.img", rec.dir / "disk")
            return await self._start(replace(rec, container_id="", cgroup=""), spec, replacing=True)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.stop(rec))
            raise

    async def snapshot(self, record: BackendRecord, snapshot_id: str) -> SnapshotArtifact:
        """Copy the sandbox's disk, its processes and filesystem frozen for the copy (a stopped sandbox's
        unmounted disk is copied as it is), and check the copy. The sandbox runs on as before."""
        rec = _docker(record)
        if not _SAFE_ID.fullmatch(snapshot_id):
            raise ValueError(f"snapshot id {snapshot_id!r} is not a plain name")
        if not rec.template:
            raise ServerError(f"sandbox {rec.sandbox_id} was created before the Docker backend could snapshot "
                              "sandboxes: its record names no template")
        dest = self._snapshot_path(snapshot_id)
        if dest.exists():
            raise ConflictError(f"snapshot {snapshot_id} already exists on the Docker backend")
        self.snapshots.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.snapshots, 0o700)
        tmp = dest.with_name(f".{dest.name}.tmp")
        try:
            async with self._snapshot_locks.setdefault(rec.sandbox_id, asyncio.Lock()):
                await self._copy_disk(rec, tmp)
            await mark_clean(tmp)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return SnapshotArtifact(snapshot_id=snapshot_id, template=rec.template, size_bytes=allocated(dest),
                                data={"backend": "docker", "disk": dest.name, "disk_size": dest.stat().st_size})

    async def delete_snapshot(self, snapshot: SnapshotArtifact) -> None:
        """Remove the snapshot's disk copy. Sandboxes started from it have copies of their own."""
        self._snapshot_path_of(snapshot).unlink(missing_ok=True)

    async def create_volume(self, volume_id: str, size: int) -> None:
        await self.volumes.create(volume_id, size)

    async def delete_volume(self, volume_id: str) -> None:
        await self.volumes.delete(volume_id)

    async def volume_used(self, volume_id: str) -> int:
        return await self.volumes.used(volume_id)

    async def destroy(self, record: BackendRecord) -> None:
        rec = _docker(record)
        await self.api.remove(rec.name)
        await self.volumes.detach_all(rec.dir / VOLUMES_DIR)  # no process uses them now
        await unmount_disk(rec.dir / "disk")
        leftover = _disk.mounts_under(rec.dir)
        if leftover:
            raise ServerError(f"sandbox {rec.sandbox_id}: mounts still present after destroy: {leftover}")
        await asyncio.to_thread(shutil.rmtree, rec.dir, True)
        await self.drop_checkpoints(rec.sandbox_id)
        self._snapshot_locks.pop(rec.sandbox_id, None)

    async def alive(self, record: BackendRecord) -> bool:
        found = await self.api.inspect(_docker(record).name)
        return found is not None and (found.get("State") or {}).get("Status") in ("running", "paused")

    async def frozen(self, record: BackendRecord) -> bool:
        found = await self.api.inspect(_docker(record).name)
        return found is not None and bool((found.get("State") or {}).get("Paused"))

    async def oom_kills(self, record: BackendRecord) -> int:
        rec = _docker(record)
        return _cgroups.oom_kills(rec.cgroup) if rec.cgroup else 0

    async def usage(self, record: BackendRecord) -> SandboxUsage | None:
        """From the container's cgroup files and its disk's filesystem, as on the local backend: the daemon's
        stats API would cost a request (and, unless one-shot, a second of waiting) per sandbox and sample."""
        rec = _docker(record)
        return sandbox_usage(rec.cgroup, rec.dir / "disk") if rec.cgroup else None

    def restore(self, data: JSON) -> DockerRecord:
        record = DockerRecord.from_json(data)
        # The directory is removed and the container killed on destroy: both must be this backend's.
        if record.dir != self.dir / record.sandbox_id:
            raise ValueError(f"sandbox {record.sandbox_id}'s directory {record.dir} is not under {self.dir}")
        if record.name != self._container_name(record.sandbox_id):
            raise ValueError(f"sandbox {record.sandbox_id}'s container {record.name!r} is not this home's")
        return record

    async def adopt(self, record: BackendRecord) -> None:
        """Nothing to reserve: the container, its disk and its sockets are all named by the record."""
        _docker(record)

    async def sweep(self, known: set[str]) -> list[str]:
        """Remove every container of this home, and every sandbox directory, that `known` does not name."""
        ids = {(c.get("Labels") or {}).get(LABEL_SANDBOX, "") for c in await self.api.containers(self._home_labels())}
        if self.dir.is_dir():
            ids |= {p.name for p in self.dir.iterdir() if p.is_dir()}
        removed: list[str] = []
        # A label names a directory to remove: only a plain name may (whoever can label containers is root anyway).
        for sid in sorted(i for i in ids - known if _SAFE_ID.fullmatch(i)):
            await self.destroy(DockerRecord(sandbox_id=sid, name=self._container_name(sid), dir=self.dir / sid,
                                            token=""))
            removed.append(sid)
        await self.volumes.unmount_idle()  # a volume image left mounted by a crash between two steps
        if self.snapshots.is_dir():  # copies a crash interrupted (a snapshot is renamed into place once whole)
            for tmp in self.snapshots.glob(".*.img.tmp"):
                tmp.unlink(missing_ok=True)
        return removed

    async def capacity(self) -> BackendCapacity:
        total, available = meminfo()
        return BackendCapacity(memory_total=total, memory_available=available, disk_free=free_disk(self.home))

    async def close(self) -> None:
        await self.api.close()

    # -- beyond the contract -------------------------------------------------------------------------

    async def memory_usage(self, record: BackendRecord) -> int:
        """Bytes the sandbox's cgroup charges now (the benchmarks report it)."""
        rec = _docker(record)
        return _cgroups.memory_usage(rec.cgroup) if rec.cgroup else 0

    async def containers(self) -> list[dict[str, Any]]:
        """This home's containers as the daemon lists them (for tests and operators)."""
        return await self.api.containers(self._home_labels())

    # -- helpers -------------------------------------------------------------------------------------

    def _container_name(self, sandbox_id: str) -> str:
        return f"corral-{self._home_key}-{sandbox_id}"

    def _snapshot_path(self, snapshot_id: str) -> Path:
        return self.snapshots / f"{snapshot_id}.img"

    def _snapshot_path_of(self, snapshot: SnapshotArtifact) -> Path:
        """The disk copy of one of this backend's snapshots; `ValueError` for anything else (it is deleted)."""
        data = snapshot.data
        if data.get("backend") != "docker" or not _SAFE_ID.fullmatch(snapshot.snapshot_id):
            raise ValueError(f"snapshot {snapshot.snapshot_id!r} is not one of the Docker backend's")
        path = self._snapshot_path(snapshot.snapshot_id)
        if data.get("disk") != path.name:
            raise ValueError(f"snapshot {snapshot.snapshot_id!r} names a disk {data.get('disk')!r} that is not its own")
        return path

    def _snapshot_disk(self, source: SnapshotArtifact, template: Template, spec: SandboxSpec) -> Path:
        """The disk copy a sandbox starts from, checked against what it is asked to start with."""
        path = self._snapshot_path_of(source)
        if source.template != template.digest:
            raise ValueError(f"snapshot {source.snapshot_id} was taken of a sandbox of template {source.template}, "
                             f"not of {template.name} ({template.digest})")
        if not path.is_file():
            raise NotFoundError(f"snapshot {source.snapshot_id} has no disk on the Docker backend any more "
                                f"({path} is gone: deleted?)", details={"snapshot_id": source.snapshot_id})
        size = int(source.data.get("disk_size") or path.stat().st_size)
        if spec.limits.disk < size:
            raise InvalidRequestError(
                f"limits.disk of {spec.limits.disk} bytes is smaller than snapshot {source.snapshot_id}'s disk "
                f"({size} bytes): a sandbox started from it needs at least that much",
                details={"snapshot_id": source.snapshot_id, "disk": size})
        return path

    async def _copy_disk(self, rec: DockerRecord, dest: Path) -> None:
        """Copy the sandbox's disk image to `dest`: frozen, if it is mounted (the sandbox runs or is paused)."""
        image, disk = rec.dir / "disk.img", rec.dir / "disk"
        if not image.is_file():
            raise NotFoundError(f"sandbox {rec.sandbox_id} has no disk on the Docker backend")
        if not _disk.is_mounted(disk):  # stopped: the image is an unmounted filesystem already, once released
            await release_disk(image, disk)
            await _disk.in_thread(copy_image, image, dest)
            return
        await _disk.in_thread(flush_filesystem, disk)  # most of the freeze's writing, done while it runs
        state = ((await self.api.inspect(rec.name)) or {}).get("State") or {}
        # A container that died on its own has nothing to freeze; one paused already stays paused.
        freeze = state.get("Status") == "running" and not state.get("Paused")
        if freeze:
            await self.pause(rec)
        try:
            await _disk.in_thread(_copy_frozen, image, disk, dest)
        finally:
            if freeze:
                await asyncio.shield(self.api.unpause(rec.name))

    async def _start(self, record: DockerRecord, spec: SandboxSpec, *, replacing: bool = False) -> DockerRecord:
        """Make and start the container on the mounted disk, then take the agent's socket out of its reach.
        `replacing`: a stopped container of the sandbox is there; it makes way (the new one has the spec's
        limits and mounts) only once everything else for the new one is ready."""
        sbdir = record.dir
        await asyncio.to_thread(_prepare_socket_dirs, sbdir)
        # No user namespace: the volume's canonical owners are shown as the host's (and the sandbox's) own ids.
        volumes = await self.volumes.attach_all(spec.volumes, sbdir / VOLUMES_DIR, 0)
        params = ContainerParams(
            sandbox_id=record.sandbox_id, image=record.image, limits=spec.limits, token=record.token,
            agent_source=await self._agent_source(), run_dir=sbdir / "run", egress_dir=sbdir / "egress",
            disk=sbdir / "disk", resolv_conf=self.dir / "resolv.conf", swap_limit=self._swap_limit,
            labels={**self.labels, LABEL_SANDBOX: record.sandbox_id}, volumes=volumes)
        if replacing:
            await self.api.remove(record.name)
        container_id = await self.api.create(record.name, container_config(params))
        record = replace(record, container_id=container_id)
        await self.api.start(record.name)
        pid = await self._init_pid(record)
        record = replace(record, cgroup=_memory_cgroup(pid))
        # The host kernel's boot id is every container's: each boot gets one of its own (`_boot_id`), before
        # anything but the agent runs in it.
        await give_boot_id(pid, record.sandbox_id)
        await self._take_agent_socket(record)
        return record

    async def _wait_cgroup_gone(self, rec: DockerRecord) -> None:
        """A stopped sandbox holds no memory: its container's cgroup is removed once its processes are gone."""
        if not rec.cgroup:
            return
        deadline = time.monotonic() + _CGROUP_WAIT
        while left := _cgroups.leftover(rec.cgroup):
            if time.monotonic() > deadline:
                raise ServerError(f"sandbox {rec.sandbox_id} was stopped but its cgroup is still there after "
                                  f"{_CGROUP_WAIT:g}s: {', '.join(map(str, left))}")
            await asyncio.sleep(0.02)

    def _home_labels(self) -> dict[str, str]:
        return {LABEL_HOME: str(self.home), LABEL_BACKEND: "docker"}

    async def _preflight(self, spec: SandboxSpec) -> None:
        """Fail closed, naming what is missing. A passing check is trusted for a few seconds (it asks the
        daemon); a failing one is never cached, so a fixed host is noticed at the next create."""
        if spec.runtime != Runtime.RUNC:
            raise RuntimeUnavailableError(f"runtime {spec.runtime.value!r} is not available on the Docker backend: "
                                          f"{LIMITATIONS['runtime_runsc']}", details={"runtime": spec.runtime.value})
        if spec.root:  # before anything is asked of the daemon: a request no Docker host can serve
            raise InvalidRequestError(f"root=True is refused on the Docker backend: {LIMITATIONS[ROOT_LIMITATION]}",
                                      details={"root": True, "backend": self.name})
        if time.monotonic() - self._checked < PREFLIGHT_TTL:
            return
        problems = host_problems()
        info: dict[str, Any] = {}
        try:
            info = await self.api.info()
        except RuntimeUnavailableError as exc:
            problems.append(exc.message)
        problems += daemon_problems(info) if info else []
        if problems:
            raise RuntimeUnavailableError("cannot create sandboxes safely on the Docker backend, so none will be "
                                          "created: " + "; ".join(problems), details={"problems": problems})
        self._swap_limit = bool(info.get("SwapLimit"))
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_resolv_conf(self.dir / "resolv.conf")
        self._checked = time.monotonic()

    async def _agent_source(self) -> Path:
        async with self._agent_lock:
            if self._agent_dir is None:
                self._agent_dir = await asyncio.to_thread(install_agent, self.home)
        return self._agent_dir

    async def _take_agent_socket(self, record: DockerRecord) -> None:
        """Wait for the agent to bind its socket in `run/`, then move it out of the sandbox's reach."""
        bound, sock = record.dir / "run" / "agent.sock", record.dir / "agent.sock"
        start = time.monotonic()
        next_alive = start + _ALIVE_POLL
        while not bound.exists():
            now = time.monotonic()
            stopped = now >= next_alive and not await self.alive(record)
            if stopped or now - start > AGENT_READY_TIMEOUT:
                what = "it stopped" if stopped else f"its agent did not bind its socket within {AGENT_READY_TIMEOUT:g}s"
                raise AgentError(f"sandbox {record.sandbox_id} started but {what}: {await self.diagnostics(record)}",
                                  details={"sandbox_id": record.sandbox_id})
            next_alive = now + _ALIVE_POLL if now >= next_alive else next_alive
            await asyncio.sleep(_SOCKET_POLL)
        os.rename(bound, sock)
        os.chown(sock, 0, 0)
        os.chmod(sock, 0o600)
        os.chown(record.dir / "run", 0, 0)
        os.chmod(record.dir / "run", 0o555)  # noqa: S103 - read-only to the sandbox: it stays mounted there

    async def _init_pid(self, record: DockerRecord) -> int:
        """The host pid of the just-started container's PID 1 (the agent)."""
        found = await self.api.inspect(record.name) or {}
        pid = (found.get("State") or {}).get("Pid") or 0
        if not isinstance(pid, int) or pid <= 0:
            raise AgentError(f"sandbox {record.sandbox_id} was started but its container runs no process: "
                             f"{await self.diagnostics(record)}", details={"sandbox_id": record.sandbox_id})
        return pid


def _memory_cgroup(pid: int) -> str:
    """The container's memory cgroup, read from its PID 1 on the host (whatever the cgroup driver)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return ""
    v2 = ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
        if controllers == "":
            v2 = path
    return v2 if _cgroups.is_v2() else ""


def _prepare_socket_dirs(sbdir: Path) -> None:
    """`run/` and `egress/` as a container start needs them: the sandbox user's, 0700; `run/` empty (whatever a
    previous run left there, its agent's socket was moved out and the directory locked: see `create`)."""
    for sub in ("run", "egress"):
        path = sbdir / sub
        path.mkdir(mode=0o700, exist_ok=True)
        if sub == "run":
            for entry in path.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        # The sandbox user's, inside: it binds the agent's socket and connects to the proxy's.
        os.chown(path, SANDBOX_UID, SANDBOX_UID)
        os.chmod(path, 0o700)


def _copy_frozen(image: Path, disk: Path, dest: Path) -> None:
    with frozen_filesystem(disk):
        copy_image(image, dest)
