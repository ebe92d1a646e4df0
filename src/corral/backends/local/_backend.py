"""The local backend: each sandbox is an OCI bundle on this machine, run by runc (or runsc).

Layout of one sandbox, under `<home>/sandboxes/<id>/` (this backend's own business; the engine keeps its state
elsewhere and holds the record `create` returned):

    backend.json   the record again, for `sweep` to tear down what no engine remembers (runtime, uid range); 0600
    config.json    the OCI runtime spec (see `_bundle`)
    disk.img       the sandbox's disk: a sparse ext4 image of `limits.disk` bytes
    disk/          where it is loop-mounted: `upper/` and `work/` of the overlay
    layers/<n>/    started from a snapshot: each of its layers (`_layers`), idmapped onto the sandbox's uid range
    lower/         created with root (docs/security.md): `template/`, the template's root idmapped from host ids
                   onto the sandbox's range (its files become the sandbox root's), and `root/`, the agent's
                   `root-layer` (`/usr/local/bin/sudo`) idmapped the same way
    rootfs/        the overlay: the template read-only below, the snapshot's layers above it (and `lower/root`
                   above those, with root), `disk/upper` on top
    agent/         a read-only overlay of the agent's files (`<home>/agent/<digest>/`), bind-mounted at /.corral/agent
    agent.sock     the agent's listening socket, root's, 0600. runc: bound here and inherited by the agent (stdin).
                   runsc cannot pass it: the agent binds it in `run/` and `create` moves it here (still bound)
    run/           runsc only, at /.corral/run: where the agent binds its socket; then root's, empty, 0555
    egress/        a tiny tmpfs where the egress proxy listens for this sandbox (`proxy.sock`); only the sandbox
                   user enters
    agent.log      the runtime's and the agent's stderr
    boot_id        runsc only: this boot's boot id, bind-mounted read-only at /proc/sys/kernel/random/boot_id
                   (runc's sandboxes get theirs mounted from here once started: `corral.backends._boot_id`)

Paused to disk (`stop`), only `backend.json`, `disk.img` and the empty mount points stay: no process, mount,
loop device or cgroup. The uid range stays the sandbox's (its files are owned by it); `boot` mounts everything
again and starts the agent on the same disk.

`agent/` and `egress/` are mounts of their own, not plain directories bind-mounted: the "root" field of the
sandbox's /proc/self/mountinfo shows a bind mount's source path within its filesystem, and so would name the
engine's home; the root of a filesystem of its own shows as `/`.

Blocking work (disk images, mounts, removing a tree, installing the agent's files) runs in threads; the small
metadata calls (a mkdir, a chown, a slot file, a cgroup file, /proc/meminfo) stay inline, each well under a
millisecond.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from ..._atomic import write_json_atomic
from ..._exceptions import AgentError, ConflictError, NotFoundError, ServerError
from ...templates import Template
from .. import _idmap
from .._boot_id import give_boot_id, write_boot_id
from .._contract import (
    JSON,
    AgentAddress,
    BackendCapacity,
    BackendRecord,
    SandboxUsage,
    SnapshotArtifact,
    UnixEndpoint,
)
from .._spec import Limits, Runtime, SandboxSpec
from .._volumes import HostVolumes, prepare_mountpoints
from . import _cgroups, _disk, _preflight
from ._agent_files import agent_layers, install_agent, root_layer
from ._bundle import AGENT_RUN_DIR, CPU_PERIOD, ID_RANGE, SANDBOX_UID, BundleParams, build_config, cpu_quota
from ._checkpoints import LocalCheckpoints
from ._host import listening, tail, take_socket
from ._layers import Layers, mount_views
from ._record import LocalRecord, local_record
from ._runtime import OCIRuntime
from ._snapshots import LocalSnapshots
from ._system import check_open_files, free_disk, meminfo, raise_open_files_limit
from ._upper import prepare_upper
from ._usage import sandbox_usage

logger = logging.getLogger("corral.backends.local")

UID_BASE = 1 << 20  # host uid of sandbox slot 0's root; slot n uses [base + n*65536, base + (n+1)*65536)
MAX_SLOTS = 60_000
# Machine-wide, not per home: two engines (a server and a test run) must never hand out the same uid range.
SLOTS_DIR = Path("/run/corral/uid-slots")
PREFLIGHT_TTL = 5.0
AGENT_READY_TIMEOUT = {Runtime.RUNC: 15.0, Runtime.RUNSC: 60.0}
SOCKET_POLL = 0.005  # runsc: how often `create` looks for the agent's socket
ALIVE_POLL = 0.25  # and how often, meanwhile, whether the sandbox still runs
# The egress socket's directory holds the socket and, for a sandbox with secrets, the deployment's CA and a trust
# bundle (~250 KiB, docs/secrets.md): bounded, and never on disk.
EGRESS_TMPFS_SIZE = 1024 * 1024  # room to rewrite the bundle (old and new side by side) at a reattach
EGRESS_TMPFS_INODES = 8


class LocalBackend(LocalSnapshots, LocalCheckpoints):
    """Sandboxes as OCI bundles on this host (runc, or runsc for gVisor); see docs/backends.md.

    **Parameters:**
    * **home** - the state directory: sandboxes under `sandboxes/`, runtime state under `runtime/`, disk images
      under `cache/disks/`, the agent's files under `agent/`.
    * **cgroup_parent** - the cgroup every sandbox's cgroup is made under (`/<parent>/<sandbox id>`).
    """

    name = "local"
    # Nothing of DESIGN.md's isolation is missing, under runc or runsc (docs/backends.md, `DeclaresLimitations`).
    limitations: Mapping[str, str] = MappingProxyType({})

    def __init__(self, home: Path, *, cgroup_parent: str = "corral") -> None:
        self.home = Path(home)
        self.cgroup_parent = cgroup_parent
        # The usual soft limit (1024) is short of what hundreds of sandboxes hold here; the hard one is not.
        self.open_files_limit = raise_open_files_limit()
        self.sandboxes_dir = self.home / "sandboxes"
        self.runtimes = {rt: OCIRuntime(rt.value, self.home / "runtime" / rt.value) for rt in Runtime}
        self.disks = DiskImagesHolder.get(self.home / "cache" / "disks")
        self.layers = Layers(self.home / "layers")
        self.volumes = HostVolumes(self.home)  # docs/volumes.md
        self._slots: set[int] = set()
        self._checked: dict[Runtime, float] = {}  # runtime -> when the preflight check last passed
        self._agent_dir: Path | None = None
        self._agent_lock = asyncio.Lock()
        self._captured: dict[str, tuple[str, int]] = {}  # see `LocalSnapshots`

    # -- the contract ------------------------------------------------------------------------------

    async def check(self, spec: SandboxSpec) -> None:
        self._preflight(spec.runtime)

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template,
                     source: SnapshotArtifact | None = None) -> LocalRecord:
        self._preflight(spec.runtime)  # again: `create` is where isolation must not be missing
        check_open_files()  # a clear CapacityError now, not an EMFILE halfway through
        layers = self._source_layers(source, template)
        sbdir = self.sandboxes_dir / sandbox_id
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.sandboxes_dir, 0o711)  # noqa: S103 - traverse only: runc's init must reach the rootfs
        try:
            sbdir.mkdir(mode=0o711)  # before the slot: a slot whose directory exists is never taken as stale
        except FileExistsError:
            raise ConflictError(f"sandbox {sandbox_id} already exists on the local backend") from None
        record = LocalRecord(sandbox_id=sandbox_id, dir=sbdir, runtime=spec.runtime, slot=-1, uid_base=0,
                             token=secrets.token_urlsafe(32), cgroups_path=f"/{self.cgroup_parent}/{sandbox_id}",
                             template=template.digest, template_rootfs=str(template.rootfs), layers=layers)
        try:
            slot = self._alloc_slot(sbdir)
            record = replace(record, slot=slot, uid_base=UID_BASE + slot * ID_RANGE)
            _write_state(sbdir / "backend.json", record.to_json())
            for layer in layers:  # before anything is mounted: `destroy` drops what it finds in the record
                self.layers.add_ref(layer, sandbox_id)
            await self.disks.create(spec.limits.disk, sbdir / "disk.img")
            await self._build_root(record, spec)
            await self._start(record, spec)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.destroy(record))
            raise
        return record

    def agent_address(self, record: BackendRecord) -> AgentAddress:
        rec = local_record(record)
        return AgentAddress(UnixEndpoint(str(rec.dir / "agent.sock")), rec.token)

    def ready_timeout(self, record: BackendRecord) -> float:
        return AGENT_READY_TIMEOUT[local_record(record).runtime]

    def egress_endpoint(self, record: BackendRecord) -> UnixEndpoint:
        return UnixEndpoint(str(local_record(record).dir / "egress" / "proxy.sock"))

    async def diagnostics(self, record: BackendRecord) -> str:
        return tail(local_record(record).dir / "agent.log")  # inline: reads at most the last few KiB

    async def pause(self, record: BackendRecord) -> None:
        rec = local_record(record)
        await self.runtimes[rec.runtime].pause(rec.sandbox_id)

    async def resume(self, record: BackendRecord) -> None:
        rec = local_record(record)
        await self.runtimes[rec.runtime].resume(rec.sandbox_id)

    async def stop(self, record: BackendRecord) -> None:
        rec = local_record(record)
        await self._take_down(rec)
        # What `_start` makes afresh: a stale socket file would make the next bind fail.
        (rec.dir / "agent.sock").unlink(missing_ok=True)
        await asyncio.to_thread(shutil.rmtree, rec.dir / "run", True)
        logger.info("sandbox.stopped", extra={"sandbox": rec.sandbox_id})

    async def boot(self, record: BackendRecord, spec: SandboxSpec) -> LocalRecord:
        rec = local_record(record)
        if not rec.template_rootfs:
            raise ConflictError(f"sandbox {rec.sandbox_id} was made by an older Corral and cannot be booted again")
        if not Path(rec.template_rootfs).is_dir():
            raise NotFoundError(f"sandbox {rec.sandbox_id}'s template ({rec.template[:12]}) was removed from "
                                f"{self.home / 'templates'}; it cannot start again")
        self._preflight(rec.runtime)
        try:
            await self._build_root(rec, spec)
            await self._start(rec, spec)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.stop(rec))
            raise
        return rec

    async def create_volume(self, volume_id: str, size: int) -> None:
        await self.volumes.create(volume_id, size)

    async def delete_volume(self, volume_id: str) -> None:
        await self.volumes.delete(volume_id)

    async def volume_used(self, volume_id: str) -> int:
        return await self.volumes.used(volume_id)

    async def destroy(self, record: BackendRecord) -> None:
        rec = local_record(record)
        await self._take_down(rec)
        leftover = _disk.mounts_under(rec.dir)
        if leftover:
            raise ServerError(f"sandbox {rec.sandbox_id}: mounts still present after destroy: {leftover}")
        await self._drop_layers(rec.sandbox_id)
        await asyncio.to_thread(shutil.rmtree, rec.dir, True)
        self._release_slot(rec.slot, rec.dir)

    async def _drop_layers(self, sandbox_id: str) -> None:
        """Every layer the sandbox holds: those it stands on and its latest capture (found on disk, not in memory,
        so that a restart of the engine in between loses none)."""
        self._captured.pop(sandbox_id, None)
        for layer, holders in self.layers.holders().items():
            if sandbox_id in holders:
                await self.layers.drop_ref(layer, sandbox_id)

    async def _take_down(self, rec: LocalRecord) -> None:
        """End every process and undo every mount and cgroup of the sandbox; its directory and disk stay."""
        if (last := self._captured.pop(rec.sandbox_id, None)) is not None and last[0] not in rec.layers:
            await self.layers.drop_ref(last[0], rec.sandbox_id)  # stopped: its disk changes when it boots
        runtime = self.runtimes[rec.runtime]
        await runtime.kill(rec.sandbox_id)
        await runtime.delete(rec.sandbox_id)
        await _wait_cgroup_empty(rec.cgroups_path)
        await self.volumes.detach_all(rec.dir / "volumes")  # no process uses them now
        # The root before the layers below it and the disk that holds its upper layer.
        unmounted = await _disk.unmount_all([rec.dir / "rootfs", *_layer_views(rec.dir), *_root_views(rec.dir),
                                             rec.dir / "disk", rec.dir / "agent", rec.dir / "egress"])
        disk = unmounted.get(rec.dir / "disk")
        if disk is not None and not await _disk.wait_loop_detached(disk, rec.dir / "disk.img"):
            logger.warning("sandbox.loop_device_kept", extra={"sandbox": rec.sandbox_id, "device": disk})
        _cgroups.remove(rec.cgroups_path)

    async def alive(self, record: BackendRecord) -> bool:
        rec = local_record(record)
        if rec.runtime == Runtime.RUNC and (known := _init_alive(rec)) is not None:
            return known
        state = await self.runtimes[rec.runtime].state(rec.sandbox_id)
        return state is not None and state.get("status") in ("running", "paused")

    async def frozen(self, record: BackendRecord) -> bool:
        rec = local_record(record)
        state = await self.runtimes[rec.runtime].state(rec.sandbox_id)
        return state is not None and state.get("status") == "paused"

    async def resize(self, record: BackendRecord, limits: Limits) -> None:
        """`Resizable`: the cgroup's memory (no swap), CPU quota and pids limits, written in place."""
        rec = local_record(record)
        try:
            _cgroups.resize(rec.cgroups_path, memory=limits.memory, cpu_quota=cpu_quota(limits.cpus),
                            cpu_period=CPU_PERIOD, pids=limits.pids, swap=_cgroups.swap_accounting())
        except OSError as exc:
            raise ServerError(f"resizing sandbox {rec.sandbox_id} failed: {exc}") from exc

    async def oom_kills(self, record: BackendRecord) -> int:
        return _cgroups.oom_kills(local_record(record).cgroups_path)

    async def usage(self, record: BackendRecord) -> SandboxUsage | None:
        rec = local_record(record)
        return sandbox_usage(rec.cgroups_path, rec.dir / "disk")  # inline: a few cgroup files and a statvfs

    def restore(self, data: JSON) -> LocalRecord:
        record = LocalRecord.from_json(data)
        # The directory is removed on destroy: it must be this backend's, whatever the file said.
        if record.dir != self.sandboxes_dir / record.sandbox_id:
            raise ValueError(f"sandbox {record.sandbox_id}'s directory {record.dir} is not under "
                             f"{self.sandboxes_dir}")
        return record

    async def adopt(self, record: BackendRecord) -> None:
        """Its uid range stays reserved. A runsc sandbox made before its agent's socket was moved out of the
        sandbox's reach (its `run/agent.sock`) gets that done now: `agent_address` names the moved one."""
        rec = local_record(record)
        self._slots.add(rec.slot)
        bound = rec.dir / "run" / "agent.sock"
        if rec.runtime == Runtime.RUNSC and os.path.lexists(bound) and not os.path.lexists(rec.dir / "agent.sock"):
            try:
                take_socket(bound, rec.dir / "agent.sock")
            except (OSError, ServerError) as exc:  # its agent is unreachable then; the engine still starts
                logger.warning("sandbox.agent_socket_not_taken", extra={"sandbox": rec.sandbox_id, "error": str(exc)})

    async def sweep(self, known: set[str]) -> list[str]:
        """Tear down every sandbox directory or runtime container that `known` does not name."""
        ids: set[str] = set()
        if self.sandboxes_dir.exists():
            ids |= {p.name for p in self.sandboxes_dir.iterdir() if p.is_dir()}
        for rt in self.runtimes.values():
            if rt.state_root.exists():
                ids |= {c["id"] for c in await rt.list()}
        removed: list[str] = []
        for sid in sorted(ids - known):
            await self.destroy(self._orphan_record(sid))
            removed.append(sid)
        await self.volumes.unmount_idle()  # a volume image left mounted by a crash between two steps
        for holders in self.layers.holders().values():  # sandboxes gone without their destroy running
            for holder in holders:
                if holder.startswith("sb-") and holder not in known:
                    await self._drop_layers(holder)
        return removed

    async def capacity(self) -> BackendCapacity:
        total, available = meminfo()
        return BackendCapacity(memory_total=total, memory_available=available, disk_free=free_disk(self.home),
                               sandboxes_max=MAX_SLOTS)

    async def close(self) -> None:
        """Leave no empty cgroup parent behind; a parent that still holds sandboxes stays (rmdir refuses)."""
        _cgroups.remove_parent(f"/{self.cgroup_parent}/x")

    # -- beyond the contract -------------------------------------------------------------------------

    async def memory_usage(self, record: BackendRecord) -> int:
        """Bytes the sandbox's cgroup charges now (the benchmarks report it)."""
        return _cgroups.memory_usage(local_record(record).cgroups_path)

    # -- building a sandbox ------------------------------------------------------------------------

    def _preflight(self, runtime: Runtime) -> None:
        """Fail closed. A passing check is trusted for a few seconds (it reads a dozen small files, inline); a
        failing one is never cached, so a fixed host is noticed at the next create."""
        if time.monotonic() - self._checked.get(runtime, -PREFLIGHT_TTL) < PREFLIGHT_TTL:
            return
        _preflight.check(runtime.value, self.home)
        self._checked[runtime] = time.monotonic()

    async def _build_root(self, record: LocalRecord, spec: SandboxSpec) -> None:
        """Mount the disk (made already), the snapshot layers and the overlay root on them."""
        sbdir = record.dir
        await _disk.mount_image(sbdir / "disk.img", sbdir / "disk")
        upper, work = sbdir / "disk" / "upper", sbdir / "disk" / "work"
        prepare_upper(upper, work, record.uid_base)
        prepare_mountpoints(upper, spec.volumes, record.uid_base,
                            lower=Path(record.template_rootfs) if record.template_rootfs else None)
        (sbdir / "layers").mkdir(mode=0o700, exist_ok=True)
        views = [sbdir / "layers" / str(i) for i in range(len(record.layers))]
        trees = [self.layers.tree(layer) for layer in record.layers]
        if not spec.root:
            await _disk.in_thread(mount_views, trees, views, record.uid_base)
            await _disk.mount_overlay([*views, Path(record.template_rootfs)], upper, work, sbdir / "rootfs")
            return
        # Root: the template's files shown as the sandbox root's, and `sudo` on top. Two user namespaces (the
        # snapshot layers' mapping and this one overlap on the sandbox's side), made at the same time.
        lower = sbdir / "lower"
        lower.mkdir(mode=0o700, exist_ok=True)
        roots = [Path(record.template_rootfs), root_layer(await self._agent_source())]
        await asyncio.gather(_disk.in_thread(mount_views, trees, views, record.uid_base),
                             _disk.in_thread(_mount_host_views, roots, [lower / "template", lower / "root"],
                                             record.uid_base))
        await _disk.mount_overlay([lower / "root", *views, lower / "template"], upper, work, sbdir / "rootfs")

    async def _start(self, record: LocalRecord, spec: SandboxSpec) -> None:
        sbdir = record.dir
        runtime = self.runtimes[record.runtime]
        run_dir = None if runtime.inherits_fds else sbdir / "run"
        user_id = record.uid_base + SANDBOX_UID
        if run_dir is not None:
            run_dir.mkdir(mode=0o700)
            os.chown(run_dir, user_id, user_id)
        # The egress socket's directory: only the sandbox user (and root) may enter it, so no other host user
        # can borrow the sandbox's egress policy through a socket that must be connectable by the sandbox.
        egress_dir = sbdir / "egress"
        await _disk.in_thread(_mount_own_dirs, await self._agent_source(), sbdir / "agent", egress_dir, user_id)
        volume_mounts = await self.volumes.attach_all(spec.volumes, sbdir / "volumes", record.uid_base)
        params = BundleParams(
            sandbox_id=record.sandbox_id,
            rootfs=sbdir / "rootfs",
            agent_source=sbdir / "agent",
            host_uid_base=record.uid_base,
            limits=spec.limits,
            token=record.token,
            cgroups_path=record.cgroups_path,
            swap_limit=_cgroups.swap_accounting(),
            hostname="sandbox",
            agent_listen=None if run_dir is None else f"{AGENT_RUN_DIR}/agent.sock",
            agent_run_dir=run_dir,
            egress_dir=egress_dir,
            volume_mounts=volume_mounts,
            root=spec.root,
            # runsc's kernel has no boot id (this gVisor); it takes a bind mount there, which runc refuses.
            boot_id_file=write_boot_id(sbdir / "boot_id") if record.runtime == Runtime.RUNSC else None,
        )
        _write_state(sbdir / "config.json", build_config(params))
        if run_dir is not None:
            # Not left running when cancelled: `destroy` would not find the container it is still making.
            await _disk.finish_first(runtime.start(record.sandbox_id, sbdir, listen_fd=None, log=sbdir / "agent.log"))
            await self._take_agent_socket(record)
            return
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(sbdir / "agent.sock"))
            os.chmod(sbdir / "agent.sock", 0o600)
            listener.listen(128)
            await _disk.finish_first(runtime.start(record.sandbox_id, sbdir, listen_fd=listener.fileno(),
                                                   log=sbdir / "agent.log"))
        finally:
            listener.close()  # the agent holds its own copy now; if it dies, connects fail at once
        # runc's sandboxes share the host's kernel and so its boot id: each boot gets one of its own, before
        # anything but the agent runs in it (`corral.backends._boot_id`).
        await give_boot_id(_init_pid(sbdir), record.sandbox_id)

    async def _take_agent_socket(self, record: LocalRecord) -> None:
        """runsc: wait for the agent to listen on its socket in `run/`, then take it out of the sandbox's reach.

        Listening, not just bound: gVisor creates the host socket file and then still looks it up by name to
        finish the agent's bind(2), which fails (ENOENT, and the agent dies) if the file was moved meanwhile.
        """
        bound = record.dir / "run" / "agent.sock"
        start = time.monotonic()
        timeout = AGENT_READY_TIMEOUT[record.runtime]
        next_alive = start + ALIVE_POLL
        while not listening(bound):
            now = time.monotonic()
            stopped = now >= next_alive and not await self.alive(record)
            if stopped or now - start > timeout:
                what = "it stopped" if stopped else f"its agent did not listen on its socket within {timeout:g}s"
                raise AgentError(f"sandbox {record.sandbox_id} started but {what}: "
                                  f"{await self.diagnostics(record)}", details={"sandbox_id": record.sandbox_id})
            if now >= next_alive:
                next_alive = now + ALIVE_POLL
            await asyncio.sleep(SOCKET_POLL)
        take_socket(bound, record.dir / "agent.sock")

    async def _agent_source(self) -> Path:
        """The agent's files, installed once per process in a thread (copies and a C compile)."""
        if self._agent_dir is None:
            async with self._agent_lock:
                if self._agent_dir is None:
                    self._agent_dir = await asyncio.to_thread(install_agent, self.home)
        return self._agent_dir

    # -- helpers -------------------------------------------------------------------------------------

    def _alloc_slot(self, sbdir: Path) -> int:
        SLOTS_DIR.mkdir(parents=True, exist_ok=True)
        for slot in range(MAX_SLOTS):
            if slot in self._slots:
                continue
            path = SLOTS_DIR / str(slot)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                if not _stale_slot(path):
                    continue
                path.unlink(missing_ok=True)
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    continue
            with os.fdopen(fd, "w") as f:
                f.write(str(sbdir))
            self._slots.add(slot)
            return slot
        raise ServerError("no free uid range left for a new sandbox")

    def _release_slot(self, slot: int, sbdir: Path) -> None:
        self._slots.discard(slot)
        path = SLOTS_DIR / str(slot)
        try:
            if path.read_text() == str(sbdir):
                path.unlink()
        except OSError:
            pass

    def _orphan_record(self, sandbox_id: str) -> LocalRecord:
        """What is known of a sandbox no engine remembers: its own backend.json, else the defaults."""
        with contextlib.suppress(OSError, ValueError):
            return self.restore(_read_json(self.sandboxes_dir / sandbox_id / "backend.json"))
        return LocalRecord(sandbox_id=sandbox_id, dir=self.sandboxes_dir / sandbox_id, runtime=Runtime.RUNC,
                           slot=-1, uid_base=0, token="", cgroups_path=f"/{self.cgroup_parent}/{sandbox_id}")


def _init_pid(sbdir: Path) -> int:
    """The host pid of a just-started container's init (the agent), from the pid file `runc run` wrote."""
    try:
        return int((sbdir / "pid").read_text())
    except (OSError, ValueError) as exc:
        raise ServerError(f"the runtime started sandbox {sbdir.name} but wrote no pid file: {exc}") from exc


def _init_alive(rec: LocalRecord) -> bool | None:
    """runc: whether the container's init (the agent, its host pid in `pid`) still runs or is frozen, read from
    /proc: a few small files, where `runc state` reads the whole mount table (4,000 lines at 1,000 sandboxes,
    ~0.1 s under load) and an engine's restart asks once per sandbox. None when /proc cannot tell (no pid file,
    or that pid is now another cgroup's process): ask runc."""
    try:
        pid = int((rec.dir / "pid").read_text())
    except (OSError, ValueError):
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except (OSError, IndexError):
        return False  # gone: runc would say "stopped"
    if not any(line.split(":", 2)[-1] == rec.cgroups_path for line in cgroups.splitlines()):
        return None  # the pid was reused
    return state not in ("Z", "X")  # a zombie init is a stopped container


def _root_views(sbdir: Path) -> list[Path]:
    return [sbdir / "lower" / "root", sbdir / "lower" / "template"]


def _mount_host_views(trees: list[Path], targets: list[Path], uid_base: int) -> None:
    """Each of `trees` (host-owned: the template, the root layer) on its target, its host ids shown as the
    sandbox's (`_idmap.host_to_sandbox`). Blocking: call it in a thread."""
    with _idmap.user_namespace(_idmap.host_to_sandbox(uid_base)) as userns:
        for tree, target in zip(trees, targets, strict=True):
            target.mkdir(mode=0o700, exist_ok=True)
            _idmap.idmapped_bind(tree, target, userns)


def _layer_views(sbdir: Path) -> list[Path]:
    try:
        return sorted((p for p in (sbdir / "layers").iterdir()), key=lambda p: p.name)
    except FileNotFoundError:
        return []


def _read_json(path: Path) -> JSON:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _write_state(path: Path, obj: Any) -> None:
    # Not durable (no fsync): a machine crash takes the sandbox's processes with it, so these files need only
    # never be torn; `sweep` copes with one lost or stale.
    write_json_atomic(path, obj, durable=False)


class DiskImagesHolder:
    """One `DiskImages` per cache directory, so concurrent creates share the golden-image locks."""

    _by_dir: ClassVar[dict[Path, _disk.DiskImages]] = {}

    @classmethod
    def get(cls, cache_dir: Path) -> _disk.DiskImages:
        if cache_dir not in cls._by_dir:
            cls._by_dir[cache_dir] = _disk.DiskImages(cache_dir)
        return cls._by_dir[cache_dir]


async def _wait_cgroup_empty(cgroups_path: str, timeout: float = 10.0) -> None:
    """Processes of a killed pid namespace die asynchronously: return only when none is left."""
    deadline = time.monotonic() + timeout
    while _cgroups.pids(cgroups_path):
        if time.monotonic() > deadline:
            raise ServerError(f"processes of cgroup {cgroups_path} survived SIGKILL for {timeout:.0f}s")
        _cgroups.kill_all(cgroups_path)
        await asyncio.sleep(0.01)


def _stale_slot(path: Path) -> bool:
    """A slot whose owner's sandbox directory is gone (its engine's home was deleted) can be reused."""
    try:
        owner = path.read_text()
    except OSError:
        return False
    return bool(owner) and not Path(owner).exists()


def _mount_own_dirs(agent_files: Path, agent: Path, egress: Path, user_id: int) -> None:
    """The sandbox's `agent/` and `egress/` (see the module's docstring), in one thread."""
    _disk.mount_readonly_layers(agent_layers(agent_files), agent)
    _disk.mount_tmpfs(egress, size=EGRESS_TMPFS_SIZE, inodes=EGRESS_TMPFS_INODES, mode=0o700, owner=user_id)


