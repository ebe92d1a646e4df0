"""The lifecycle part of the backend contract on a real dockerd: snapshot, create from a snapshot, stop (pause to
disk) and boot, delete_snapshot, with the Docker backend driven directly and its agents reached as the engine
reaches them (`AgentClient` on `agent_address`, pinged until `ready_timeout`).

The fixtures (`docker_client`, `template`, `home`, with their leak checks) are tests/test_docker_backend.py's:
skipped, saying why, only when no Docker daemon answers; under CI that is a failure. Every sandbox and snapshot a
test makes is destroyed or deleted whatever happens, and the test's home must hold no snapshot file afterwards.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral import ConflictError, InvalidRequestError, NotFoundError
from corral.backends import BackendRecord, Limits, SandboxSpec, SnapshotArtifact
from corral.backends.docker import DockerBackend, DockerRecord
from corral.backends.docker._volume import disk_in_use
from corral.backends.local import _cgroups, _disk
from corral.engine import ExecOptions
from corral.templates import Template

from .conftest import TEMPLATE
from .test_backend_lifecycle import Lab
from .test_docker_backend import (  # noqa: F401 - fixtures
    docker_client,
    home,
    make_backend,
    template,
)

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

MiB = 1024**2
# Bytes no text transport survives: NUL, invalid UTF-8, CR LF, every byte value.
PAYLOAD = b"\x00\xff\xfe corral \r\n" + bytes(range(256)) * 64
PROBE_MODULE = "VALUE = 'installed before the snapshot'\n"
USER_SITE = "python3 -c 'import site; print(site.getusersitepackages())'"


def spec(**limits: Any) -> SandboxSpec:
    return SandboxSpec(template=TEMPLATE, limits=Limits(**limits))


class DockerLab(Lab):
    """tests/test_backend_lifecycle.py's `Lab`, with the Docker backend's records; on close, no snapshot file of
    its home may be left."""

    backend: DockerBackend

    async def create(self, sandbox_spec: SandboxSpec | None = None,
                     source: SnapshotArtifact | None = None) -> DockerRecord:
        record = await super().create(sandbox_spec, source)
        assert isinstance(record, DockerRecord)
        return record

    async def boot(self, record: BackendRecord, sandbox_spec: SandboxSpec | None = None) -> DockerRecord:
        booted = await super().boot(record, sandbox_spec or spec())
        assert isinstance(booted, DockerRecord)
        return booted

    async def close(self) -> None:
        await super().close()
        left = sorted(p.name for p in self.backend.snapshots.iterdir()) if self.backend.snapshots.exists() else []
        assert left == [], f"snapshot files left behind: {left}"


@pytest.fixture
async def lab(home: Path, template: Template) -> AsyncIterator[DockerLab]:  # noqa: F811 - the imported fixtures
    made = DockerLab(make_backend(home), template)
    try:
        yield made
    finally:
        await made.close()


def inspect(client: Any, record: DockerRecord) -> dict[str, Any]:
    return dict(client.inspect_container(record.name))


def memory_cgroup_dir(record: DockerRecord) -> Path:
    rel = record.cgroup.lstrip("/")
    return _cgroups.CGROUP_ROOT / rel if _cgroups.is_v2() else _cgroups.CGROUP_ROOT / "memory" / rel


async def seed(lab: DockerLab, record: DockerRecord) -> None:
    """Files in every place a sandbox keeps them (and one in /tmp, a tmpfs, which no snapshot keeps)."""
    agent = lab.agent(record)
    await agent.write_file("/workspace/payload.bin", PAYLOAD)
    await agent.write_file("/home/user/.local/bin/corral-hello", b"#!/bin/sh\necho hello from the snapshot\n",
                           mode=0o755)
    site = (await lab.sh(record, USER_SITE)).strip()
    await lab.sh(record, f"mkdir -p {site} && printf %s \"{PROBE_MODULE}\" > {site}/corral_probe.py")
    await lab.sh(record, "echo kept > /var/tmp/kept; echo gone > /tmp/gone")


# -- snapshot, and sandboxes started from it -------------------------------------------------------------------


async def test_a_snapshot_starts_sandboxes_with_the_same_bytes_and_the_parent_runs_on(
        lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    parent = await lab.create()
    await seed(lab, parent)
    # A writer keeps going through the snapshot: the parent is frozen for the copy only.
    await lab.agent(parent).launch(ExecOptions("while :; do echo tick >> /workspace/ticks; sleep 0.01; done"), None)
    await asyncio.sleep(0.2)

    artifact = await lab.snapshot(parent)

    assert artifact.template == lab.template.digest and artifact.size_bytes > 0
    assert SnapshotArtifact.from_json(artifact.to_json()) == artifact
    assert inspect(docker_client, parent)["State"]["Status"] == "running"  # thawed again
    ticks = int(await lab.sh(parent, "wc -l < /workspace/ticks"))
    await asyncio.sleep(0.2)
    assert int(await lab.sh(parent, "wc -l < /workspace/ticks")) > ticks, "the parent's writer stopped"

    child = await lab.create(source=artifact)
    agent = lab.agent(child)
    assert await agent.read_file("/workspace/payload.bin") == PAYLOAD
    assert await lab.sh(child, "corral-hello") == "hello from the snapshot\n"  # ~/.local/bin is on PATH
    assert await lab.sh(child, "python3 -c 'import corral_probe; print(corral_probe.VALUE)'") == \
        "installed before the snapshot\n"
    assert await lab.sh(child, "cat /var/tmp/kept; ls /tmp") == "kept\n"  # /tmp is a tmpfs: not kept
    assert await lab.sh(child, "stat -c '%u:%g %a' /workspace /home/user /workspace/payload.bin") == \
        "1000:1000 755\n1000:1000 750\n1000:1000 644\n"
    # the child's writer did not come along (processes are not kept), and its log is a clean prefix
    assert "while :" not in await lab.sh(child, "ps -eo args")
    assert set((await lab.sh(child, "cat /workspace/ticks")).split()) == {"tick"}

    # independent from now on, both ways
    await lab.agent(parent).write_file("/workspace/payload.bin", b"the parent's new bytes")
    await lab.sh(parent, "rm /home/user/.local/bin/corral-hello")
    await agent.write_file("/workspace/child-only", b"x")
    assert await agent.read_file("/workspace/payload.bin") == PAYLOAD
    assert await lab.sh(child, "corral-hello") == "hello from the snapshot\n"
    assert not await lab.agent(parent).exists("/workspace/child-only")

    # everything else is a template create's: the same image, hardening and mounts; a fresh token and socket
    p, c = inspect(docker_client, parent), inspect(docker_client, child)
    for key in ("Image", "User", "Entrypoint", "Cmd", "WorkingDir"):
        assert c["Config"][key] == p["Config"][key], key
    assert [e for e in c["Config"]["Env"] if "TOKEN" not in e] == [e for e in p["Config"]["Env"] if "TOKEN" not in e]
    for key in ("SecurityOpt", "CapDrop", "ReadonlyRootfs", "NetworkMode", "MaskedPaths", "ReadonlyPaths",
                "Memory", "PidsLimit", "Tmpfs"):
        assert c["HostConfig"][key] == p["HostConfig"][key], key
    assert sorted(m["Destination"] for m in c["Mounts"]) == sorted(m["Destination"] for m in p["Mounts"])
    assert child.token != parent.token
    sock = Path(lab.backend.agent_address(child).endpoint.path)  # type: ignore[union-attr]
    assert (sock.stat().st_uid, sock.stat().st_mode & 0o777) == (0, 0o600)


async def test_a_snapshot_of_a_paused_sandbox_leaves_it_paused(lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    parent = await lab.create()
    await lab.agent(parent).write_file("/workspace/a", b"paused")
    await lab.backend.pause(parent)
    artifact = await lab.snapshot(parent)
    assert inspect(docker_client, parent)["State"]["Paused"] is True
    await lab.backend.resume(parent)
    child = await lab.create(source=artifact)
    assert await lab.agent(child).read_file("/workspace/a") == b"paused"


async def test_concurrent_snapshots_of_one_sandbox_take_turns(lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    parent = await lab.create()
    await lab.agent(parent).write_file("/workspace/a", b"same")
    artifacts = await asyncio.gather(*(lab.snapshot(parent) for _ in range(3)))
    assert len({a.snapshot_id for a in artifacts}) == 3
    assert inspect(docker_client, parent)["State"]["Status"] == "running"  # the last one out thawed it
    child = await lab.create(source=artifacts[-1])
    assert await lab.agent(child).read_file("/workspace/a") == b"same"


async def test_a_sandbox_that_died_on_its_own_can_still_be_snapshotted(lab: DockerLab,
                                                                     docker_client: Any) -> None:  # noqa: F811
    parent = await lab.create()
    await lab.agent(parent).write_file("/workspace/a", b"before it died")
    docker_client.kill(parent.name)  # not through `stop`: its disk is still mounted
    docker_client.wait(parent.name)
    artifact = await lab.snapshot(parent)
    child = await lab.create(source=artifact)
    assert await lab.agent(child).read_file("/workspace/a") == b"before it died"


async def test_a_snapshot_disk_grows_but_never_shrinks_for_a_new_sandbox(lab: DockerLab) -> None:
    parent = await lab.create(spec(disk=256 * MiB))
    await lab.agent(parent).write_file("/workspace/a", b"grown")
    artifact = await lab.snapshot(parent)
    with pytest.raises(InvalidRequestError, match="smaller than snapshot"):
        await lab.create(spec(disk=128 * MiB), source=artifact)
    assert sorted(p.name for p in (lab.backend.dir).iterdir() if p.is_dir()) == [parent.sandbox_id]

    child = await lab.create(spec(disk=512 * MiB), source=artifact)
    assert await lab.agent(child).read_file("/workspace/a") == b"grown"
    size = int(await lab.sh(child, "df -B1 --output=size /workspace | tail -1"))
    assert 400 * MiB < size <= 512 * MiB
    # the parent's own disk is as it was
    assert int(await lab.sh(parent, "df -B1 --output=size /workspace | tail -1")) <= 256 * MiB


async def test_sweep_removes_interrupted_snapshot_copies_only(lab: DockerLab) -> None:
    parent = await lab.create()
    artifact = await lab.snapshot(parent)
    interrupted = lab.backend.snapshots / ".snap-interrupted.img.tmp"
    interrupted.write_bytes(b"half a copy")
    assert await lab.backend.sweep({parent.sandbox_id}) == []
    assert sorted(p.name for p in lab.backend.snapshots.iterdir()) == [f"{artifact.snapshot_id}.img"]


async def test_create_refuses_a_snapshot_that_is_not_its_own(lab: DockerLab, template: Template) -> None:  # noqa: F811
    parent = await lab.create()
    artifact = await lab.snapshot(parent)
    other = Template(name="other", digest="0" * 64, rootfs=template.rootfs, env={}, created_at=template.created_at,
                     size_bytes=0, source="debootstrap", spec={})
    with pytest.raises(ValueError, match="taken of a sandbox of template"):
        await lab.backend.create("sb-wrongtemplate1", spec(), other, artifact)
    forged = SnapshotArtifact(artifact.snapshot_id, artifact.template, 1, {**artifact.data, "disk": "../x.img"})
    with pytest.raises(ValueError, match="not its own"):
        await lab.backend.create("sb-forgedsnapshot", spec(), lab.template, forged)
    with pytest.raises(ValueError):
        await lab.backend.delete_snapshot(SnapshotArtifact("../../etc", artifact.template, 1, artifact.data))
    assert not (lab.backend.dir / "sb-wrongtemplate1").exists()


async def test_deleting_a_snapshot_leaves_its_children_working(lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    parent = await lab.create()
    await lab.agent(parent).write_file("/workspace/a", PAYLOAD)
    artifact = await lab.snapshot(parent)
    child = await lab.create(source=artifact)

    await lab.backend.delete_snapshot(artifact)
    await lab.backend.delete_snapshot(artifact)  # idempotent
    assert list(lab.backend.snapshots.iterdir()) == []
    assert await lab.agent(child).read_file("/workspace/a") == PAYLOAD
    await lab.agent(child).write_file("/workspace/b", b"after the delete")
    assert await lab.sh(child, "cat /workspace/b") == "after the delete"
    with pytest.raises(NotFoundError, match="deleted"):
        await lab.backend.create("sb-fromdeleted01", spec(), lab.template, artifact)
    assert not (lab.backend.dir / "sb-fromdeleted01").exists()

    await lab.destroy(child)
    assert not (lab.backend.dir / child.sandbox_id).exists()
    assert docker_client.containers(all=True, filters={"name": child.name}) == []


# -- stop (pause to disk) and boot --------------------------------------------------------------------------------


async def test_stop_releases_processes_memory_and_cgroup_and_boot_brings_the_files_back(
        lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    record = await lab.create()
    await seed(lab, record)
    await lab.agent(record).launch(ExecOptions("sleep 1000"), None)
    cgroup = memory_cgroup_dir(record)
    assert record.cgroup and cgroup.is_dir()
    assert _disk.is_mounted(record.dir / "disk")
    old_image = inspect(docker_client, record)["Image"]

    await lab.backend.stop(record)

    state = inspect(docker_client, record)["State"]
    assert (state["Status"], state["Running"], state["Pid"]) == ("exited", False, 0)
    assert not cgroup.exists() and _cgroups.leftover(record.cgroup) == []
    assert not _disk.is_mounted(record.dir / "disk") and (record.dir / "disk.img").is_file()
    assert disk_in_use(record.dir / "disk.img") == []  # released: no dead container's mount holds it still
    assert not Path(lab.backend.agent_address(record).endpoint.path).exists()  # type: ignore[union-attr]
    assert await lab.backend.alive(record) is False
    await lab.backend.stop(record)  # idempotent

    booted = await lab.boot(record)

    assert booted.container_id != record.container_id and booted.token == record.token
    assert booted.sandbox_id == record.sandbox_id and booted.name == record.name
    assert await lab.backend.alive(booted) is True
    agent = lab.agent(booted)
    assert await agent.read_file("/workspace/payload.bin") == PAYLOAD
    assert await lab.sh(booted, "corral-hello; cat /var/tmp/kept; ls /tmp") == "hello from the snapshot\nkept\n"
    assert "sleep 1000" not in await lab.sh(booted, "ps -eo args")  # processes are not kept
    info = inspect(docker_client, booted)
    assert info["Image"] == old_image and info["HostConfig"]["ReadonlyRootfs"] is True
    # the agent's new socket is out of the sandbox's reach again, as after create
    sock = Path(lab.backend.agent_address(booted).endpoint.path)  # type: ignore[union-attr]
    run = booted.dir / "run"
    assert (sock.stat().st_uid, sock.stat().st_mode & 0o777) == (0, 0o600)
    assert (run.stat().st_uid, run.stat().st_mode & 0o777, list(run.iterdir())) == (0, 0o555, [])
    out = await agent.exec("ls -A /.corral/run; touch /.corral/run/x 2>&1 || true")
    assert out.stdout.strip().endswith("Permission denied"), out.stdout
    with pytest.raises(ConflictError, match="only a stopped sandbox boots"):
        await lab.backend.boot(booted, spec())
    # and it writes on, and stops and boots again
    await agent.write_file("/workspace/second", b"2")
    await lab.backend.stop(booted)
    again = await lab.boot(booted)
    assert await lab.agent(again).read_file("/workspace/second") == b"2"


async def test_boot_applies_the_specs_limits(lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    record = await lab.create(spec(memory=256 * MiB, pids=128))
    await lab.backend.stop(record)
    booted = await lab.boot(record, spec(memory=384 * MiB, pids=200, tmp=32 * MiB))
    host = inspect(docker_client, booted)["HostConfig"]
    assert (host["Memory"], host["PidsLimit"]) == (384 * MiB, 200)
    assert "size=33554432" in host["Tmpfs"]["/tmp"]
    assert memory_cgroup_dir(booted).is_dir()
    limit = (memory_cgroup_dir(booted) / ("memory.max" if _cgroups.is_v2() else "memory.limit_in_bytes"))
    assert int(limit.read_text()) == 384 * MiB


async def test_a_paused_sandbox_stops_and_a_stopped_one_snapshots(lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    record = await lab.create()
    await lab.agent(record).write_file("/workspace/a", b"before the stop")
    await lab.backend.pause(record)
    await lab.backend.stop(record)  # frozen processes die too
    assert inspect(docker_client, record)["State"]["Status"] == "exited"

    artifact = await lab.snapshot(record)  # its unmounted disk, as it is
    assert not _disk.is_mounted(record.dir / "disk")
    child = await lab.create(source=artifact)
    assert await lab.agent(child).read_file("/workspace/a") == b"before the stop"
    booted = await lab.boot(record)
    assert await lab.agent(booted).read_file("/workspace/a") == b"before the stop"


async def test_a_failed_boot_leaves_the_sandbox_stopped_with_its_files(lab: DockerLab,
                                                                      docker_client: Any) -> None:  # noqa: F811
    record = await lab.create()
    await lab.agent(record).write_file("/workspace/a", b"kept")
    await lab.backend.stop(record)
    with pytest.raises(NotFoundError, match="no volume"):
        await lab.backend.boot(record, SandboxSpec(template=TEMPLATE, volumes={"/mnt/x": "vol-never-made"}))
    assert inspect(docker_client, record)["State"]["Running"] is False
    assert not _disk.mounts_under(record.dir) and await lab.backend.alive(record) is False
    booted = await lab.boot(record)
    assert await lab.agent(booted).read_file("/workspace/a") == b"kept"


async def test_a_failed_create_from_a_snapshot_leaves_nothing(lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    parent = await lab.create()
    artifact = await lab.snapshot(parent)
    with pytest.raises(NotFoundError, match="no volume"):
        await lab.backend.create("sb-failedfromsnap", SandboxSpec(template=TEMPLATE, volumes={"/mnt/x": "vol-no"}),
                                 lab.template, artifact)
    assert not (lab.backend.dir / "sb-failedfromsnap").exists() and not _disk.mounts_under(lab.backend.dir /
                                                                                           "sb-failedfromsnap")
    assert docker_client.containers(all=True, filters={"name": "sb-failedfromsnap"}) == []


async def test_destroying_a_stopped_sandbox_leaves_nothing(lab: DockerLab, docker_client: Any) -> None:  # noqa: F811
    record = await lab.create()
    await lab.backend.stop(record)
    await lab.destroy(record)
    assert docker_client.containers(all=True, filters={"name": record.name}) == []
    assert not record.dir.exists()


async def test_a_record_from_before_lifecycle_support_restores_but_cannot_boot(lab: DockerLab) -> None:
    record = await lab.create()
    old = {k: v for k, v in record.to_json().items() if k not in ("image", "template")}
    restored = lab.backend.restore(old)
    assert isinstance(restored, DockerRecord) and (restored.image, restored.template) == ("", "")
    await lab.backend.stop(restored)
    with pytest.raises(Exception, match="names no image"):
        await lab.backend.boot(restored, spec())
    with pytest.raises(Exception, match="names no template"):
        await lab.backend.snapshot(restored, "snap-old")


# -- volumes -----------------------------------------------------------------------------------------------------


@pytest.fixture
async def volumes(lab: DockerLab) -> AsyncIterator[list[str]]:
    """Volume ids a test makes; deleted after its sandboxes are gone (the lab's own teardown runs after this)."""
    made: list[str] = []
    yield made
    for record in lab.records.values():
        await lab.backend.destroy(record)
    lab.records.clear()
    for volume_id in made:
        await lab.backend.delete_volume(volume_id)
    root = lab.backend.home / "volumes"
    assert not root.exists() or list(root.iterdir()) == []


async def test_volumes_are_shared_limited_and_outlive_their_sandboxes(lab: DockerLab, volumes: list[str]) -> None:
    data, small = f"vol-{os.urandom(4).hex()}", f"vol-{os.urandom(4).hex()}"
    await lab.backend.create_volume(data, 64 * MiB)
    volumes.append(data)
    await lab.backend.create_volume(small, 16 * MiB)
    volumes.append(small)
    with_volumes = SandboxSpec(template=TEMPLATE, volumes={"/mnt/data": data, "/workspace/small": small})

    first = await lab.create(with_volumes)
    assert await lab.sh(first, "stat -c '%u:%g' /mnt/data /workspace/small; id -u") == "1000:1000\n" * 2 + "1000\n"
    await lab.agent(first).write_file("/mnt/data/shared.bin", PAYLOAD)
    second = await lab.create(SandboxSpec(template=TEMPLATE, volumes={"/data": data}))
    assert await lab.agent(second).read_file("/data/shared.bin") == PAYLOAD  # the same volume, at once
    await lab.agent(second).write_file("/data/from-second", b"2")
    assert await lab.agent(first).read_file("/mnt/data/from-second") == b"2"
    assert await lab.backend.volume_used(data) >= len(PAYLOAD)

    # a hard limit: ENOSPC inside, the sandbox's own disk untouched
    r = await lab.agent(first).exec("dd if=/dev/zero of=/workspace/small/fill bs=1M count=64 2>&1; "
                                    "echo still > /workspace/own")
    assert "No space left on device" in r.stdout, r.stdout
    assert await lab.sh(first, "cat /workspace/own") == "still\n"

    with pytest.raises(ConflictError, match=first.sandbox_id):
        await lab.backend.delete_volume(data)
    # stop detaches (the other sandbox keeps it), boot attaches again; the volume's files stayed
    await lab.backend.stop(first)
    assert lab.backend.volumes.users(data) == [second.sandbox_id]
    assert lab.backend.volumes.users(small) == [] and not _disk.mounts_under(first.dir)
    with pytest.raises(ConflictError, match=second.sandbox_id):
        await lab.backend.delete_volume(data)
    booted = await lab.boot(first, with_volumes)
    assert await lab.agent(booted).read_file("/mnt/data/from-second") == b"2"
    # and after both are gone, a new sandbox finds the files
    for record in (booted, second):
        await lab.destroy(record)
    third = await lab.create(SandboxSpec(template=TEMPLATE, volumes={"/mnt/data": data}))
    assert await lab.agent(third).read_file("/mnt/data/shared.bin") == PAYLOAD


async def test_a_snapshot_keeps_the_disk_not_the_volumes(lab: DockerLab, volumes: list[str]) -> None:
    vid = f"vol-{os.urandom(4).hex()}"
    await lab.backend.create_volume(vid, 32 * MiB)
    volumes.append(vid)
    parent = await lab.create(SandboxSpec(template=TEMPLATE, volumes={"/mnt/v": vid}))
    await lab.sh(parent, "echo disk > /workspace/a; echo volume > /mnt/v/b")
    artifact = await lab.snapshot(parent)
    child = await lab.create(source=artifact)  # no volume asked for: none mounted
    assert await lab.sh(child, "cat /workspace/a; test ! -e /mnt/v/b && echo no volume") == "disk\nno volume\n"


@pytest.mark.parametrize(("path", "reason"), [
    ("/home", "Corral's own mount at /home/user"),
    ("/etc", "Corral's own mount at /etc/resolv.conf"),
    ("/etc/resolv.conf", "Corral's own mount"),
    ("/lib/data", "/lib is a symlink in the template"),
    ("/etc/passwd", "/etc/passwd is a file in the template"),
])
async def test_a_volume_path_the_container_cannot_take_is_refused(lab: DockerLab, path: str, reason: str) -> None:
    with pytest.raises(InvalidRequestError, match=reason):
        await lab.create(SandboxSpec(template=TEMPLATE, volumes={path: "vol-never-made"}))
    assert not lab.backend.dir.exists() or [p for p in lab.backend.dir.iterdir() if p.is_dir()] == []
