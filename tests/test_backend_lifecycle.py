"""The lifecycle part of the backend contract, the same on every real backend (docs/backends.md): snapshot ->
create(source) -> the same file; stop -> boot -> the same file; a fork (a snapshot of a running sandbox, then a
sandbox from it), both independent afterwards; a snapshot deleted under a running child.

Parametrized over the backends as tests/test_backend_contract.py's parity tests are, but against real runtimes:
`local` (runc, `make_engine`'s cgroup parent) and `docker` (tests/test_docker_backend.py's fixtures: skipped,
saying why, when no daemon answers). Only the contract is used: records, `agent_address`, `ready_timeout`,
and the agent protocol through `AgentClient`, as the engine does.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from corral import ServerError
from corral.backends import BACKEND_NAMES, Backend, BackendRecord, SandboxSpec, SnapshotArtifact
from corral.backends.local import LocalBackend
from corral.engine import AgentClient, ExecOptions
from corral.templates import Template
from corral.templates._build import _isolated

from .conftest import CGROUP_PARENT, TEMPLATE, TEST_HOME, leaks, template_store

try:  # the Docker SDK is optional (corral[docker]): without it only the docker parametrization skips
    from .test_docker_backend import docker_client, home, make_backend, template  # noqa: F401 - fixtures
except pytest.skip.Exception as exc:
    DOCKER_MISSING: str | None = str(exc)
else:
    DOCKER_MISSING = None

pytestmark = [pytest.mark.anyio]

BACKENDS = ["docker", "local"]
PAYLOAD = b"\x00\xff corral lifecycle \r\n" + os.urandom(4096)


class Lab:
    """One backend and what a test made with it; `close` destroys and deletes all of it, whatever happened."""

    def __init__(self, backend: Backend, tpl: Template) -> None:
        self.backend = backend
        self.template = tpl
        self.records: dict[str, BackendRecord] = {}
        self.snapshots: list[SnapshotArtifact] = []

    async def create(self, sandbox_spec: SandboxSpec | None = None,
                     source: SnapshotArtifact | None = None) -> BackendRecord:
        sid = f"sb-{os.urandom(8).hex()}"
        record = await self.backend.create(sid, sandbox_spec or SandboxSpec(template=TEMPLATE), self.template,
                                           source)
        self.records[sid] = record
        await self.ready(record)
        return record

    async def boot(self, record: BackendRecord, sandbox_spec: SandboxSpec | None = None) -> BackendRecord:
        booted = await self.backend.boot(record, sandbox_spec or SandboxSpec(template=TEMPLATE))
        self.records[booted.sandbox_id] = booted
        await self.ready(booted)
        return booted

    async def destroy(self, record: BackendRecord) -> None:
        await self.backend.destroy(record)
        del self.records[record.sandbox_id]

    async def snapshot(self, record: BackendRecord) -> SnapshotArtifact:
        artifact = await self.backend.snapshot(record, f"snap-{os.urandom(6).hex()}")
        self.snapshots.append(artifact)
        return artifact

    def agent(self, record: BackendRecord) -> AgentClient:
        address = self.backend.agent_address(record)
        return AgentClient(address.endpoint, address.token, label=record.sandbox_id)

    async def ready(self, record: BackendRecord) -> None:
        """As the engine's `_wait_ready`: ping until the agent answers or the backend's ready timeout passes."""
        deadline = time.monotonic() + self.backend.ready_timeout(record)
        while True:
            try:
                assert (await self.agent(record).ping())["event"] == "pong"
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.02)

    async def sh(self, record: BackendRecord, cmd: str) -> str:
        r = await self.agent(record).exec(cmd, timeout=60)
        assert r.exit_code == 0, (cmd, r.exit_code, r.stdout, r.stderr)
        return r.stdout

    async def read(self, record: BackendRecord, path: str) -> bytes:
        return await self.agent(record).read_file(path)

    async def write(self, record: BackendRecord, path: str, data: bytes) -> None:
        await self.agent(record).write_file(path, data)

    async def close(self) -> None:
        try:
            for record in list(self.records.values()):
                await self.backend.destroy(record)
            for artifact in self.snapshots:
                await self.backend.delete_snapshot(artifact)
        finally:
            await self.backend.close()


def _local(request: pytest.FixtureRequest) -> tuple[Backend, Template, Callable[[], None]]:
    path = TEST_HOME / f"lifecycle-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)

    def check() -> None:
        found = [leak for leak in leaks(path) if not leak.startswith("process")]  # processes: the session's check
        shutil.rmtree(path, ignore_errors=True)
        assert found == [], found
    tpl = template_store().get(TEMPLATE)  # type: ignore[no-untyped-call,unused-ignore]
    return LocalBackend(path, cgroup_parent=CGROUP_PARENT), tpl, check


def _docker(request: pytest.FixtureRequest) -> tuple[Backend, Template, Callable[[], None]]:
    if DOCKER_MISSING is not None:
        pytest.skip(DOCKER_MISSING)
    backend = make_backend(request.getfixturevalue("home"))  # its teardown checks containers, mounts, dirs
    return backend, request.getfixturevalue("template"), lambda: None


@pytest.fixture(params=BACKENDS)
async def lab(request: pytest.FixtureRequest) -> AsyncIterator[Lab]:
    backend, tpl, check = (_docker if request.param == "docker" else _local)(request)
    made = Lab(backend, tpl)
    try:
        yield made
    finally:
        await made.close()
        check()


# -- snapshot and create(source) ---------------------------------------------------------------------------------


async def test_a_sandbox_from_a_snapshot_has_the_snapshots_files(lab: Lab) -> None:
    parent = await lab.create()
    await lab.write(parent, "/workspace/payload.bin", PAYLOAD)
    await lab.sh(parent, "mkdir -p ~/.local/bin && printf '#!/bin/sh\\necho installed\\n' > ~/.local/bin/tool "
                         "&& chmod +x ~/.local/bin/tool")
    artifact = await lab.snapshot(parent)
    assert artifact.template == lab.template.digest and artifact.size_bytes > 0
    assert SnapshotArtifact.from_json(artifact.to_json()) == artifact

    child = await lab.create(source=artifact)
    assert await lab.read(child, "/workspace/payload.bin") == PAYLOAD
    assert await lab.sh(child, "tool; stat -c '%U %a' /workspace/payload.bin ~/.local/bin/tool") == \
        "installed\nuser 644\nuser 755\n"
    assert await lab.sh(parent, "echo parent runs on") == "parent runs on\n"


# -- stop and boot ------------------------------------------------------------------------------------------------


async def test_a_stopped_sandbox_boots_with_its_files_and_without_its_processes(lab: Lab) -> None:
    record = await lab.create()
    await lab.write(record, "/workspace/payload.bin", PAYLOAD)
    await lab.agent(record).launch(ExecOptions("sleep 1000"), None)
    await lab.backend.stop(record)
    assert await lab.backend.alive(record) is False
    await lab.backend.stop(record)  # idempotent

    booted = await lab.boot(record)
    assert booted.sandbox_id == record.sandbox_id and await lab.backend.alive(booted)
    assert await lab.read(booted, "/workspace/payload.bin") == PAYLOAD
    assert "sleep 1000" not in await lab.sh(booted, "ps -eo args")
    await lab.write(booted, "/workspace/after", b"booted")
    await lab.backend.stop(booted)
    again = await lab.boot(booted)
    assert await lab.read(again, "/workspace/after") == b"booted"


async def test_the_last_writes_survive_a_stop_while_another_namespace_holds_the_disk(lab: Lab) -> None:
    """A mount namespace made while the sandbox runs (a template build's `unshare --mount`) copies its disk's
    mount: our unmount then is not the filesystem's last, which alone would write its dirty pages back. The
    boot after the stop must still see what was written just before it."""
    record = await lab.create()
    await lab.write(record, "/workspace/last.bin", PAYLOAD)
    holder = await asyncio.create_subprocess_exec("unshare", "--mount", "--propagation", "private", "sleep", "60")
    try:
        for _ in range(500):  # bounded: until `unshare` has made its namespace and become `sleep`
            if Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep":
                break
            await asyncio.sleep(0.01)
        if lab.backend.name == "docker":
            # Docker's stop waits for every hold on the disk to go, and says so when one stays (the disk is
            # flushed all the same; a namespace of ours cannot be told to let go).
            with pytest.raises(ServerError, match="still held"):
                await lab.backend.stop(record)
            holder.kill()
            await holder.wait()
            await lab.backend.stop(record)
        else:
            await lab.backend.stop(record)
        booted = await lab.boot(record)
        assert await lab.read(booted, "/workspace/last.bin") == PAYLOAD
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


async def test_a_template_builds_namespace_lets_go_of_running_sandboxes(lab: Lab) -> None:
    """The root cause of the test above, in template builds (whose every step runs in a new mount namespace):
    the build's namespace holds none of a running sandbox's mounts, where a plain new namespace holds them all."""
    record = await lab.create()

    def mounts(argv: list[str]) -> str:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout

    assert record.sandbox_id in mounts(["unshare", "--mount", "cat", "/proc/self/mountinfo"])  # the copies
    assert record.sandbox_id not in mounts(_isolated("cat", "/proc/self/mountinfo"))
    await lab.backend.stop(record)  # nothing held: Docker's stop too goes through at once


# -- the boot id: each boot of a sandbox its own ------------------------------------------------------------------


BOOT_ID = "/proc/sys/kernel/random/boot_id"


async def test_each_boot_has_a_boot_id_of_its_own_that_a_freeze_keeps(lab: Lab) -> None:
    host = Path(BOOT_ID).read_text()
    first = await lab.create()
    boot_id = await lab.sh(first, f"cat {BOOT_ID}")
    assert uuid.UUID(boot_id.strip()).version == 4 and boot_id != host
    assert await lab.read(first, BOOT_ID) == boot_id.encode()  # the file API reads the same: stable in one boot
    await lab.backend.pause(first)  # frozen, not booted again
    await lab.backend.resume(first)
    assert await lab.sh(first, f"cat {BOOT_ID}") == boot_id
    # Read-only and there to stay, even for the sandbox's root.
    for attempt in (f"echo x > {BOOT_ID}", f"umount {BOOT_ID}", f"umount -l {BOOT_ID}"):
        assert (await lab.agent(first).exec(attempt, timeout=60)).exit_code != 0, attempt
    assert await lab.sh(first, f"cat {BOOT_ID}") == boot_id
    mount = await lab.sh(first, f"grep ' {BOOT_ID} ' /proc/self/mountinfo")
    assert str(lab.backend.home) not in mount and " ro," in mount  # names no host path

    await lab.backend.stop(first)
    booted = await lab.boot(first)
    again = await lab.sh(booted, f"cat {BOOT_ID}")
    assert again not in (boot_id, host)
    second = await lab.create(source=await lab.snapshot(booted))
    assert await lab.sh(second, f"cat {BOOT_ID}") not in (again, boot_id, host)


# -- fork: a snapshot of a running sandbox, then sandboxes from it -------------------------------------------------


async def test_a_fork_and_its_parent_are_independent(lab: Lab) -> None:
    parent = await lab.create()
    await lab.write(parent, "/workspace/state", b"at the fork")
    artifact = await lab.snapshot(parent)
    first, second = await lab.create(source=artifact), await lab.create(source=artifact)

    await lab.write(parent, "/workspace/state", b"the parent went on")
    await lab.write(first, "/workspace/state", b"the first fork went its way")
    await lab.sh(second, "rm /workspace/state; echo mine > /workspace/second-only")

    assert await lab.read(parent, "/workspace/state") == b"the parent went on"
    assert await lab.read(first, "/workspace/state") == b"the first fork went its way"
    assert await lab.sh(second, "ls /workspace") == "second-only\n"
    assert not await lab.agent(parent).exists("/workspace/second-only")
    assert not await lab.agent(first).exists("/workspace/second-only")


async def test_a_deleted_snapshot_leaves_its_children_running(lab: Lab) -> None:
    parent = await lab.create()
    await lab.write(parent, "/workspace/a", PAYLOAD)
    artifact = await lab.snapshot(parent)
    child = await lab.create(source=artifact)
    await lab.destroy(parent)
    await lab.backend.delete_snapshot(artifact)
    await lab.backend.delete_snapshot(artifact)  # idempotent
    assert await lab.read(child, "/workspace/a") == PAYLOAD
    await lab.write(child, "/workspace/b", b"still writing")
    await lab.backend.stop(child)
    booted = await lab.boot(child)
    assert await lab.read(booted, "/workspace/b") == b"still writing"


# Backends that declare they have no snapshots, pause or boot (their `limitations`): the Kubernetes backend, whose
# tests are tests/test_k8s_backend.py.
WITHOUT_LIFECYCLE = {"kubernetes"}


def test_the_parametrization_covers_every_real_backend() -> None:
    assert sorted(BACKENDS) == sorted(set(BACKEND_NAMES) - WITHOUT_LIFECYCLE)
