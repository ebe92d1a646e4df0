"""The local backend: each sandbox is an OCI bundle on this machine, run by runc (or runsc).

Layout of one sandbox, under `<home>/sandboxes/<id>/` (this backend's own business; the engine keeps its state
elsewhere and holds the record `create` returned):

    backend.json   the record again, for `sweep` to tear down what no engine remembers (runtime, uid range); 0600
    config.json    the OCI runtime spec (see `_bundle`)
    disk.img       the sandbox's disk: a sparse ext4 image of `limits.disk` bytes
    disk/          where it is loop-mounted: `upper/` and `work/` of the overlay
    rootfs/        the overlay: the template read-only below, `disk/upper` on top
    agent/         a read-only overlay of the agent's files (`<home>/agent/<digest>/`), bind-mounted at /.corral/agent
    agent.sock     the agent's listening socket, root's, 0600. runc: bound here and inherited by the agent (stdin).
                   runsc cannot pass it: the agent binds it in `run/` and `create` moves it here (still bound)
    run/           runsc only, at /.corral/run: where the agent binds its socket; then root's, empty, 0555
    egress/        a tiny tmpfs where the egress proxy listens for this sandbox (`proxy.sock`); only the sandbox
                   user enters
    agent.log      the runtime's and the agent's stderr

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
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from ..._atomic import write_json_atomic
from ..._exceptions import ConflictError, ServerError
from ...templates import Template
from .._contract import JSON, AgentAddress, BackendCapacity, BackendRecord, UnixEndpoint
from .._spec import Runtime, SandboxSpec
from . import _cgroups, _disk, _preflight
from ._agent_files import agent_layers, install_agent
from ._bundle import AGENT_RUN_DIR, ID_RANGE, SANDBOX_UID, BundleParams, build_config
from ._runtime import OCIRuntime
from ._system import free_disk, meminfo

logger = logging.getLogger("corral.backends.local")

UID_BASE = 1 << 20  # host uid of sandbox slot 0's root; slot n uses [base + n*65536, base + (n+1)*65536)
MAX_SLOTS = 60_000
# Machine-wide, not per home: two engines (a server and a test run) must never hand out the same uid range.
SLOTS_DIR = Path("/run/corral/uid-slots")
PREFLIGHT_TTL = 5.0
AGENT_READY_TIMEOUT = {Runtime.RUNC: 15.0, Runtime.RUNSC: 60.0}
SOCKET_POLL = 0.005  # runsc: how often `create` looks for the agent's socket
ALIVE_POLL = 0.25  # and how often, meanwhile, whether the sandbox still runs
# The egress socket's directory holds one socket: a few pages and inodes are plenty, and it is never on disk.
EGRESS_TMPFS_SIZE = 16 * 1024
EGRESS_TMPFS_INODES = 4


@dataclass(frozen=True)
class LocalRecord(BackendRecord):
    """One local sandbox: its directory, runtime, uid range (slot), agent token and cgroup."""

    dir: Path
    runtime: Runtime
    slot: int  # -1: none allocated yet
    uid_base: int  # host uid of the sandbox's root
    token: str
    cgroups_path: str

    def to_json(self) -> JSON:
        return {"sandbox_id": self.sandbox_id, "dir": str(self.dir), "runtime": self.runtime.value,
                "slot": self.slot, "uid_base": self.uid_base, "token": self.token,
                "cgroups_path": self.cgroups_path}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LocalRecord:
        """`ValueError` unless `data` is what `to_json` made."""
        try:
            record = cls(sandbox_id=_typed(data, "sandbox_id", str), dir=Path(_typed(data, "dir", str)),
                         runtime=Runtime(data["runtime"]), slot=_typed(data, "slot", int),
                         uid_base=_typed(data, "uid_base", int), token=_typed(data, "token", str),
                         cgroups_path=_typed(data, "cgroups_path", str))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a local backend record: {exc!r}") from None
        if not record.cgroups_path.startswith("/") or ".." in record.cgroups_path.split("/"):
            raise ValueError(f"not a local backend record: cgroups path {record.cgroups_path!r}")
        return record


class LocalBackend:
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
        self.sandboxes_dir = self.home / "sandboxes"
        self.runtimes = {rt: OCIRuntime(rt.value, self.home / "runtime" / rt.value) for rt in Runtime}
        self.disks = DiskImagesHolder.get(self.home / "cache" / "disks")
        self._slots: set[int] = set()
        self._checked: dict[Runtime, float] = {}  # runtime -> when the preflight check last passed
        self._agent_dir: Path | None = None
        self._agent_lock = asyncio.Lock()

    # -- the contract ------------------------------------------------------------------------------

    async def check(self, spec: SandboxSpec) -> None:
        self._preflight(spec.runtime)

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template) -> LocalRecord:
        self._preflight(spec.runtime)  # again: `create` is where isolation must not be missing
        sbdir = self.sandboxes_dir / sandbox_id
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.sandboxes_dir, 0o711)  # noqa: S103 - traverse only: runc's init must reach the rootfs
        try:
            sbdir.mkdir(mode=0o711)  # before the slot: a slot whose directory exists is never taken as stale
        except FileExistsError:
            raise ConflictError(f"sandbox {sandbox_id} already exists on the local backend") from None
        record = LocalRecord(sandbox_id=sandbox_id, dir=sbdir, runtime=spec.runtime, slot=-1, uid_base=0,
                             token=secrets.token_urlsafe(32), cgroups_path=f"/{self.cgroup_parent}/{sandbox_id}")
        try:
            slot = self._alloc_slot(sbdir)
            record = replace(record, slot=slot, uid_base=UID_BASE + slot * ID_RANGE)
            _write_state(sbdir / "backend.json", record.to_json())
            await self._build_root(record, spec, template)
            await self._start(record, spec)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.destroy(record))
            raise
        return record

    def agent_address(self, record: BackendRecord) -> AgentAddress:
        rec = _local(record)
        return AgentAddress(UnixEndpoint(str(rec.dir / "agent.sock")), rec.token)

    def ready_timeout(self, record: BackendRecord) -> float:
        return AGENT_READY_TIMEOUT[_local(record).runtime]

    def egress_endpoint(self, record: BackendRecord) -> UnixEndpoint:
        return UnixEndpoint(str(_local(record).dir / "egress" / "proxy.sock"))

    async def diagnostics(self, record: BackendRecord) -> str:
        return _tail(_local(record).dir / "agent.log")  # inline: reads at most the last few KiB

    async def pause(self, record: BackendRecord) -> None:
        rec = _local(record)
        await self.runtimes[rec.runtime].pause(rec.sandbox_id)

    async def resume(self, record: BackendRecord) -> None:
        rec = _local(record)
        await self.runtimes[rec.runtime].resume(rec.sandbox_id)

    async def destroy(self, record: BackendRecord) -> None:
        rec = _local(record)
        runtime = self.runtimes[rec.runtime]
        await runtime.kill(rec.sandbox_id)
        await runtime.delete(rec.sandbox_id)
        await _wait_cgroup_empty(rec.cgroups_path)
        # The root before the disk that holds its upper layer.
        unmounted = await _disk.unmount_all([rec.dir / "rootfs", rec.dir / "disk", rec.dir / "agent",
                                             rec.dir / "egress"])
        disk = unmounted.get(rec.dir / "disk")
        if disk is not None and not await _disk.wait_loop_detached(disk, rec.dir / "disk.img"):
            logger.warning("sandbox.loop_device_kept", extra={"sandbox": rec.sandbox_id, "device": disk})
        _cgroups.remove(rec.cgroups_path)
        leftover = _disk.mounts_under(rec.dir)
        if leftover:
            raise ServerError(f"sandbox {rec.sandbox_id}: mounts still present after destroy: {leftover}")
        await asyncio.to_thread(shutil.rmtree, rec.dir, True)
        self._release_slot(rec.slot, rec.dir)

    async def alive(self, record: BackendRecord) -> bool:
        rec = _local(record)
        state = await self.runtimes[rec.runtime].state(rec.sandbox_id)
        return state is not None and state.get("status") in ("running", "paused")

    async def oom_kills(self, record: BackendRecord) -> int:
        return _cgroups.oom_kills(_local(record).cgroups_path)

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
        rec = _local(record)
        self._slots.add(rec.slot)
        bound = rec.dir / "run" / "agent.sock"
        if rec.runtime == Runtime.RUNSC and os.path.lexists(bound) and not os.path.lexists(rec.dir / "agent.sock"):
            try:
                _take_socket(bound, rec.dir / "agent.sock")
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
        return _cgroups.memory_usage(_local(record).cgroups_path)

    # -- building a sandbox ------------------------------------------------------------------------

    def _preflight(self, runtime: Runtime) -> None:
        """Fail closed. A passing check is trusted for a few seconds (it reads a dozen small files, inline); a
        failing one is never cached, so a fixed host is noticed at the next create."""
        if time.monotonic() - self._checked.get(runtime, -PREFLIGHT_TTL) < PREFLIGHT_TTL:
            return
        _preflight.check(runtime.value, self.home)
        self._checked[runtime] = time.monotonic()

    async def _build_root(self, record: LocalRecord, spec: SandboxSpec, template: Template) -> None:
        sbdir = record.dir
        await self.disks.create(spec.limits.disk, sbdir / "disk.img")
        await _disk.mount_image(sbdir / "disk.img", sbdir / "disk")
        upper, work = sbdir / "disk" / "upper", sbdir / "disk" / "work"
        _prepare_upper(upper, work, record.uid_base)
        await _disk.mount_overlay(template.rootfs, upper, work, sbdir / "rootfs")

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

    async def _take_agent_socket(self, record: LocalRecord) -> None:
        """runsc: wait for the agent to listen on its socket in `run/`, then take it out of the sandbox's reach.

        Listening, not just bound: gVisor creates the host socket file and then still looks it up by name to
        finish the agent's bind(2), which fails (ENOENT, and the agent dies) if the file was moved meanwhile.
        """
        bound = record.dir / "run" / "agent.sock"
        start = time.monotonic()
        timeout = AGENT_READY_TIMEOUT[record.runtime]
        next_alive = start + ALIVE_POLL
        while not _listening(bound):
            now = time.monotonic()
            stopped = now >= next_alive and not await self.alive(record)
            if stopped or now - start > timeout:
                what = "it stopped" if stopped else f"its agent did not listen on its socket within {timeout:g}s"
                raise ServerError(f"sandbox {record.sandbox_id} started but {what}: "
                                  f"{await self.diagnostics(record)}", details={"sandbox_id": record.sandbox_id})
            if now >= next_alive:
                next_alive = now + ALIVE_POLL
            await asyncio.sleep(SOCKET_POLL)
        _take_socket(bound, record.dir / "agent.sock")

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


def _local(record: BackendRecord) -> LocalRecord:
    if not isinstance(record, LocalRecord):
        raise TypeError(f"the local backend was given a {type(record).__name__}, not one of its own records")
    return record


def _typed(data: Mapping[str, Any], key: str, kind: type[Any]) -> Any:
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{key} is a {type(value).__name__}, not a {kind.__name__}")
    return value


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


RESOLV_CONF = """\
# Corral: names resolve through the egress proxy only (HTTP_PROXY=http://127.0.0.1:3128); direct DNS is refused.
nameserver 127.0.0.1
options timeout:1 attempts:1
"""


def _prepare_upper(upper: Path, work: Path, uid_base: int) -> None:
    """Create, from the host, what the container's root cannot: its writable dirs and mount points.

    Template files belong to host root, which the sandbox's user namespace does not map (they show up as
    `nobody`); so the sandbox's own directories are made here, owned by the right ids of its range.
    """
    root_id, user_id = uid_base, uid_base + SANDBOX_UID
    for path, uid, mode in (
        (upper, root_id, 0o755),
        (work, 0, 0o700),
        (upper / "home", root_id, 0o755),
        (upper / "home" / "user", user_id, 0o750),
        (upper / "workspace", user_id, 0o755),
        (upper / "tmp", root_id, 0o1777),
        (upper / ".corral", root_id, 0o755),
        (upper / ".corral" / "agent", root_id, 0o755),
        (upper / ".corral" / "egress", root_id, 0o755),
        (upper / "etc", root_id, 0o755),
    ):
        path.mkdir(exist_ok=True)
        os.chown(path, uid, uid)
        os.chmod(path, mode)
    # No resolver is reachable: the agent answers on 127.0.0.1:53 and refuses at once (docs/egress.md).
    resolv = upper / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text(RESOLV_CONF)
    os.chown(resolv, root_id, root_id)
    os.chmod(resolv, 0o644)


def _mount_own_dirs(agent_files: Path, agent: Path, egress: Path, user_id: int) -> None:
    """The sandbox's `agent/` and `egress/` (see the module's docstring), in one thread."""
    _disk.mount_readonly_layers(agent_layers(agent_files), agent)
    _disk.mount_tmpfs(egress, size=EGRESS_TMPFS_SIZE, inodes=EGRESS_TMPFS_INODES, mode=0o700, owner=user_id)


def _listening(path: Path) -> bool:
    """Whether a socket at `path` accepts connections (a non-blocking connect, closed at once: the agent takes a
    connection that sends nothing as a client that left)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(str(path))
    except BlockingIOError:
        return True  # listening, its backlog full for the moment
    except OSError:
        return False  # not there yet (ENOENT), or bound but not listening (ECONNREFUSED)
    finally:
        probe.close()
    return True


def _take_socket(bound: Path, dest: Path) -> None:
    """Move the socket the agent bound in `run/` (writable by the sandbox, which sees it at /.corral/run) to
    `dest` in the sandbox's root-only directory, root's and 0600. It stays bound and listening: a Unix socket is
    reached through its inode, whatever its name. Then `run/` becomes root's, empty and 0555, so the sandbox can
    write nothing there (it stays mounted: it is on the host's disk, outside the sandbox's quota) and cannot plant
    a socket of its own where the engine would connect. The same as the Docker backend does with its `run/`."""
    os.rename(bound, dest)
    if not stat.S_ISSOCK(os.lstat(dest).st_mode):  # the agent alone ran so far; anything else is not ours
        dest.unlink()
        raise ServerError(f"{bound} is not the agent's socket")
    os.chown(dest, 0, 0, follow_symlinks=False)
    os.chmod(dest, 0o600)
    run_dir = bound.parent
    os.chown(run_dir, 0, 0)
    os.chmod(run_dir, 0o555)  # noqa: S103 - read-only to the sandbox: it stays mounted there


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return "(no agent log)"
    return text or "(agent log empty)"
