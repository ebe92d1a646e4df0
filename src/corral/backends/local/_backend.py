"""The local backend: each sandbox is an OCI bundle on this machine, run by runc (or runsc).

Layout of one sandbox, under `<home>/sandboxes/<id>/`:

    backend.json   what we need to find it again (uid range, token, cgroup path); 0600
    config.json    the OCI runtime spec (see `_bundle`)
    disk.img       the sandbox's disk: a sparse ext4 image of `limits.disk` bytes
    disk/          where it is loop-mounted: `upper/` and `work/` of the overlay
    rootfs/        the overlay: the template read-only below, `disk/upper` on top
    agent.sock     the agent's listening socket (bound here, inherited by the agent as fd 3)
    agent.log      the runtime's and the agent's stderr
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import py_compile
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from ..._exceptions import AgentError, ServerError
from ...engine._agent_client import AgentClient
from ...engine._models import SandboxSpec
from ...templates import Template
from .._base import Record
from . import _cgroups, _disk, _preflight
from ._bundle import AGENT_RUN_DIR, ID_RANGE, SANDBOX_UID, BundleParams, build_config
from ._runtime import OCIRuntime

logger = logging.getLogger("corral.backends.local")

UID_BASE = 1 << 20  # host uid of sandbox slot 0's root; slot n uses [base + n*65536, base + (n+1)*65536)
MAX_SLOTS = 60_000
# Machine-wide, not per home: two engines (a server and a test run) must never hand out the same uid range.
SLOTS_DIR = Path("/run/corral/uid-slots")
PREFLIGHT_TTL = 5.0
AGENT_READY_TIMEOUT = {"runc": 15.0, "runsc": 60.0}


class LocalBackend:
    name = "local"

    def __init__(self, home: Path, runtime: str = "runc", *, cgroup_parent: str = "corral") -> None:
        self.home = home
        self.cgroup_parent = cgroup_parent
        self.runtime_name = runtime
        self.sandboxes_dir = home / "sandboxes"
        self.runtimes = {name: OCIRuntime(name, home / "runtime" / name) for name in ("runc", "runsc")}
        self.disks = DiskImagesHolder.get(home / "cache" / "disks")
        self._slots: set[int] = set()
        self._checked: dict[str, float] = {}  # runtime -> when the preflight check last passed
        self._agent_dir: Path | None = None

    # -- contract ------------------------------------------------------------------------------------

    def check(self, runtime: str | None = None) -> None:
        """Fail closed. A passing check is trusted for a few seconds (it reads a dozen files); a failing one
        is never cached, so a fixed host is noticed at the next create."""
        runtime = runtime or self.runtime_name
        if time.monotonic() - self._checked.get(runtime, -PREFLIGHT_TTL) < PREFLIGHT_TTL:
            return
        _preflight.check(runtime, self.home)
        self._checked[runtime] = time.monotonic()

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template) -> Record:
        runtime = spec.runtime.value
        self.check(runtime)
        sbdir = self.sandboxes_dir / sandbox_id
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.sandboxes_dir, 0o711)  # noqa: S103 - traverse only: runc's init must reach the rootfs
        sbdir.mkdir(mode=0o711)  # before the slot: a slot whose directory exists is never taken as stale
        record: Record = {
            "id": sandbox_id,
            "dir": str(sbdir),
            "runtime": runtime,
            "slot": -1,
            "uid_base": 0,
            "token": secrets.token_urlsafe(32),
            "cgroups_path": f"/{self.cgroup_parent}/{sandbox_id}",
        }
        try:
            slot = self._alloc_slot(sbdir)
            record.update(slot=slot, uid_base=UID_BASE + slot * ID_RANGE)
            _write_private(sbdir / "backend.json", record)
            await self._build_root(record, spec, template)
            await self._start(record, spec)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.destroy(record))
            raise
        return record

    def egress_socket(self, record: Record) -> Path:
        """Where the egress proxy must listen for this sandbox (the agent bridges 127.0.0.1:3128 to it)."""
        return Path(record["dir"]) / "egress" / "proxy.sock"

    def agent(self, record: Record) -> AgentClient:
        return AgentClient(_socket_path(record), record["token"], label=f"sandbox {record['id']}")

    async def pause(self, record: Record) -> None:
        await self._runtime(record).pause(record["id"])

    async def resume(self, record: Record) -> None:
        await self._runtime(record).resume(record["id"])

    async def alive(self, record: Record) -> bool:
        state = await self._runtime(record).state(record["id"])
        return state is not None and state.get("status") in ("running", "paused")

    async def state(self, record: Record) -> str | None:
        state = await self._runtime(record).state(record["id"])
        return None if state is None else str(state.get("status"))

    def oom_kills(self, record: Record) -> int:
        return _cgroups.oom_kills(record["cgroups_path"])

    def memory_usage(self, record: Record) -> int:
        return _cgroups.memory_usage(record["cgroups_path"])

    async def destroy(self, record: Record) -> None:
        sbdir = Path(record["dir"])
        runtime = self._runtime(record)
        await runtime.kill(record["id"])
        await runtime.delete(record["id"])
        await _wait_cgroup_empty(record["cgroups_path"])
        await _disk.unmount(sbdir / "rootfs")
        await _disk.unmount(sbdir / "disk")
        _cgroups.remove(record["cgroups_path"])
        leftover = _disk.mounts_under(sbdir)
        if leftover:
            raise ServerError(f"sandbox {record['id']}: mounts still present after destroy: {leftover}")
        await asyncio.to_thread(shutil.rmtree, sbdir, True)
        self._release_slot(int(record["slot"]), sbdir)

    async def sweep(self, known: set[str]) -> list[str]:
        """Tear down every sandbox directory or runtime container that no live record claims."""
        removed: list[str] = []
        ids = set()
        if self.sandboxes_dir.exists():
            ids |= {p.name for p in self.sandboxes_dir.iterdir() if p.is_dir()}
        for rt in self.runtimes.values():
            if rt.state_root.exists():
                ids |= {c["id"] for c in await rt.list()}
        for sid in sorted(ids - known):
            await self.destroy(self._orphan_record(sid))
            removed.append(sid)
        return removed

    async def close(self) -> None:
        """Leave no empty cgroup parent behind; a parent that still holds sandboxes stays (rmdir refuses)."""
        _cgroups.remove_parent(f"/{self.cgroup_parent}/x")

    def adopt(self, record: Record) -> None:
        """Take back a sandbox found after a restart (its uid range stays reserved)."""
        self._slots.add(int(record["slot"]))

    def load_record(self, sandbox_id: str) -> Record | None:
        try:
            record: Record = json.loads((self.sandboxes_dir / sandbox_id / "backend.json").read_text())
        except (OSError, ValueError):
            return None
        return record

    # -- building a sandbox ------------------------------------------------------------------------

    async def _build_root(self, record: Record, spec: SandboxSpec, template: Template) -> None:
        sbdir = Path(record["dir"])
        await self.disks.create(spec.limits.disk, sbdir / "disk.img")
        await _disk.mount_image(sbdir / "disk.img", sbdir / "disk")
        upper, work = sbdir / "disk" / "upper", sbdir / "disk" / "work"
        _prepare_upper(upper, work, int(record["uid_base"]))
        await _disk.mount_overlay(template.rootfs, upper, work, sbdir / "rootfs")

    async def _start(self, record: Record, spec: SandboxSpec) -> None:
        sbdir = Path(record["dir"])
        runtime = self._runtime(record)
        run_dir = None if runtime.inherits_fds else sbdir / "run"
        user_id = int(record["uid_base"]) + SANDBOX_UID
        if run_dir is not None:
            run_dir.mkdir(mode=0o700)
            os.chown(run_dir, user_id, user_id)
        # The egress socket's directory: only the sandbox user (and root) may enter it, so no other host user
        # can borrow the sandbox's egress policy through a socket that must be connectable by the sandbox.
        egress_dir = sbdir / "egress"
        egress_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(egress_dir, user_id, user_id)
        params = BundleParams(
            sandbox_id=record["id"],
            rootfs=sbdir / "rootfs",
            agent_source=self._agent_source(),
            host_uid_base=int(record["uid_base"]),
            limits=spec.limits,
            token=record["token"],
            cgroups_path=record["cgroups_path"],
            swap_limit=_cgroups.swap_accounting(),
            hostname="sandbox",
            agent_listen=None if run_dir is None else f"{AGENT_RUN_DIR}/agent.sock",
            agent_run_dir=run_dir,
            egress_dir=egress_dir,
        )
        _write_private(sbdir / "config.json", build_config(params))
        if run_dir is not None:
            await runtime.start(record["id"], sbdir, listen_fd=None, log=sbdir / "agent.log")
            await self._wait_ready(record)
            return
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(sbdir / "agent.sock"))
            os.chmod(sbdir / "agent.sock", 0o600)
            listener.listen(128)
            await self._runtime(record).start(record["id"], sbdir, listen_fd=listener.fileno(),
                                              log=sbdir / "agent.log")
        finally:
            listener.close()  # the agent holds its own copy now; if it dies, connects fail at once
        await self._wait_ready(record)

    async def _wait_ready(self, record: Record) -> None:
        deadline = time.monotonic() + AGENT_READY_TIMEOUT[record["runtime"]]
        client = self.agent(record)
        while True:
            try:
                await asyncio.wait_for(client.ping(), max(0.1, deadline - time.monotonic()))
                return
            except (AgentError, TimeoutError) as exc:
                # An inherited socket answers at once or never; a socket the agent binds itself appears later.
                if self._runtime(record).inherits_fds or time.monotonic() >= deadline:
                    log = _tail(Path(record["dir"]) / "agent.log")
                    raise ServerError(f"sandbox {record['id']} started but its agent did not answer: {log}") from exc
                await asyncio.sleep(0.02)

    def _agent_source(self) -> Path:
        """A private, stable copy of the agent package: mounted read-only into every sandbox."""
        if self._agent_dir is None:
            src = Path(__file__).resolve().parents[2] / "agent"
            files = sorted([*src.glob("*.py"), src / "spawn.c"])
            content = b"".join(p.name.encode() + p.read_bytes() for p in files)
            # The bytecode made below belongs to this interpreter's version: part of the identity too.
            digest = hashlib.sha256(content + sys.version.encode()).hexdigest()[:16]
            dest = self.home / "agent" / digest / "agent"
            if not dest.exists():
                tmp = dest.parent / f".tmp{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                for p in files:
                    shutil.copy2(p, tmp / p.name)
                    os.chmod(tmp / p.name, 0o644)
                _build_spawn_shim(tmp)
                _precompile(tmp)
                os.chmod(tmp, 0o755)  # noqa: S103 - read-only code, readable by the sandbox user
                os.replace(tmp, dest)
            for parent in (self.home, self.home / "agent", dest.parent):
                os.chmod(parent, os.stat(parent).st_mode | 0o711)  # noqa: S103 - traverse only
            self._agent_dir = dest
        return self._agent_dir

    # -- helpers -------------------------------------------------------------------------------------

    def _runtime(self, record: Record) -> OCIRuntime:
        return self.runtimes[record.get("runtime", "runc")]

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

    def _orphan_record(self, sandbox_id: str) -> Record:
        record = self.load_record(sandbox_id)
        if record is not None:
            return record
        return {"id": sandbox_id, "dir": str(self.sandboxes_dir / sandbox_id), "runtime": "runc", "slot": -1,
                "uid_base": 0, "token": "", "cgroups_path": f"/{self.cgroup_parent}/{sandbox_id}"}


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


def _build_spawn_shim(agent_dir: Path) -> None:
    """Compile the agent's static spawn helper (see agent/spawn.c); without a compiler the agent does without."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("agent.no_spawn_shim", extra={"reason": "no C compiler on the host; commands start slower"})
        return
    out = agent_dir / "corral-spawn"
    proc = subprocess.run([cc, "-static", "-Os", "-s", "-o", str(out), str(agent_dir / "spawn.c")],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        logger.warning("agent.no_spawn_shim", extra={"reason": proc.stderr.strip()[-500:]})
        out.unlink(missing_ok=True)
        return
    os.chmod(out, 0o755)  # noqa: S103 - the sandbox user executes it


def _precompile(agent_dir: Path) -> None:
    """Bytecode for the agent, made once here: the sandbox mounts it read-only, so the agent could never
    cache its own, and compiling it on every start costs every sandbox's start ~15 ms. Unchecked hashes:
    the files never change under a given digest. A template whose Python differs simply ignores them."""
    for source in agent_dir.glob("*.py"):
        py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    for path in [agent_dir / "__pycache__", *agent_dir.glob("__pycache__/*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _socket_path(record: Record) -> Path:
    sbdir = Path(record["dir"])
    return sbdir / "run" / "agent.sock" if record.get("runtime") == "runsc" else sbdir / "agent.sock"


def _write_private(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(obj))  # not json.dump: it streams through the slow pure-Python encoder
    os.replace(tmp, path)


def _tail(path: Path, limit: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip() or "(agent log empty)"
    except OSError:
        return "(no agent log)"
