"""Volumes (docs/volumes.md) for real: the host side (`HostVolumes`: images, idmapped binds, the mount table) on
its own, then real runc sandboxes through the real API and the SDK: the size limit, sharing between sandboxes,
data outliving them, tenancy, listing, deletion rules, bad input, the CLI, and nothing left mounted."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from corral import (
    AsyncSandbox,
    AsyncVolume,
    CapacityError,
    ConflictError,
    DiskFullError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    ServerError,
    Volume,
)
from corral.backends._idmap import CANONICAL_BASE, canonical_to_sandbox
from corral.backends._volumes import IMAGE, MOUNT, VOLUME_OWNER, HostVolumes, prepare_mountpoints
from corral.backends.local import LocalBackend
from corral.backends.local._bundle import SANDBOX_UID, BundleParams, build_config
from corral.cli import app
from corral.engine import Adoption, Limits, SandboxSpec

from .conftest import TEMPLATE, make_engine
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

MIB = 2**20
# Host uid ranges for the host-side tests, from slots no engine hands out this early (each run is short-lived).
BASE_A = (1 << 20) + 59_990 * 65536
BASE_B = (1 << 20) + 59_991 * 65536
BASE_C = (1 << 20) + 59_992 * 65536


def as_uid(uid: int, script: str) -> subprocess.CompletedProcess[str]:
    """Run `sh -c script` as host uid/gid `uid` (how a sandbox's user reaches its idmapped mount)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60)


def mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(prefix)]


def loops_of(path: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(path) in line]


# -- the host side: HostVolumes on its own ------------------------------------------------------------------------


@pytest.fixture
async def host(test_home: Path) -> AsyncIterator[HostVolumes]:
    home = test_home / f"hv-{uuid.uuid4().hex[:8]}"
    home.mkdir()
    volumes = HostVolumes(home)
    try:
        yield volumes
    finally:
        for parent in home.glob("*/volumes"):
            await volumes.detach_all(parent)
        for vdir in volumes.root.glob("*") if volumes.root.exists() else []:
            await volumes.delete(vdir.name)
        assert mounts_under(home) == [] and loops_of(home) == []
        shutil.rmtree(home)


def target(host: HostVolumes, user: str, n: int = 0) -> Path:
    (host.root.parent / user).mkdir(exist_ok=True)
    return host.root.parent / user / "volumes" / str(n)


async def test_two_uid_ranges_see_one_volume_as_their_own_user(host: HostVolumes) -> None:
    await host.create("vol-shared", 32 * MIB)
    a, b = target(host, "sb-a"), target(host, "sb-b")
    await host.attach("vol-shared", a, BASE_A)
    await host.attach("vol-shared", b, BASE_B)
    for where, base in ((a, BASE_A), (b, BASE_B)):  # the root: the sandbox user's, 0755, in each range
        st = os.stat(where)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (base + 1000, base + 1000, 0o755)
    r = as_uid(BASE_A + 1000, f"head -c 300000 /dev/urandom > {a}/blob && printf 'a\\0b' >> {a}/blob")
    assert r.returncode == 0, r.stderr
    assert (b / "blob").read_bytes() == (a / "blob").read_bytes()
    assert os.stat(b / "blob").st_uid == BASE_B + 1000 and os.stat(a / "blob").st_uid == BASE_A + 1000
    on_disk = host.root / "vol-shared" / MOUNT / "blob"  # stored canonical: nobody's on the host
    assert os.stat(on_disk).st_uid == CANONICAL_BASE + 1000
    r = as_uid(BASE_B + 1000, f"echo more >> {b}/blob && mkdir {b}/dir-of-b")
    assert r.returncode == 0, r.stderr  # writable by the other sandbox's user too
    assert os.stat(a / "dir-of-b").st_uid == BASE_A + 1000
    r = as_uid(BASE_C + 1000, f"echo x > {a}/intruder")  # a uid this mount does not map cannot write
    assert r.returncode != 0 and not (a / "intruder").exists()
    assert host.users("vol-shared") == ["sb-a", "sb-b"]
    with pytest.raises(ConflictError, match="sb-a, sb-b"):
        await host.delete("vol-shared")
    await host.detach_all(a.parent)
    assert host.users("vol-shared") == ["sb-b"] and not a.parent.exists()
    await host.detach(b)
    assert host.users("vol-shared") == [] and mounts_under(host.root.parent) == []  # the image is unmounted too
    await host.delete("vol-shared")
    assert not (host.root / "vol-shared").exists() and loops_of(host.root) == []


async def test_a_full_volume_is_enospc_and_the_host_keeps_its_space(host: HostVolumes) -> None:
    await host.create("vol-small", 16 * MIB)
    t = target(host, "sb-a")
    await host.attach("vol-small", t, BASE_A)
    r = as_uid(BASE_A + 1000, f"dd if=/dev/zero of={t}/fill bs=1M count=64")
    assert r.returncode != 0 and "No space left on device" in r.stderr, r.stderr
    image = os.stat(host.root / "vol-small" / IMAGE)
    assert image.st_size == 16 * MIB and image.st_blocks * 512 <= 16 * MIB  # sparse, and never beyond its size
    assert 10 * MIB < await host.used("vol-small") <= 16 * MIB
    await host.detach(t)
    assert 10 * MIB < await host.used("vol-small") <= 16 * MIB  # also when no one mounts it (mounted for the look)
    assert mounts_under(host.root) == []


async def test_a_restarted_server_counts_the_binds_it_finds(host: HostVolumes) -> None:
    await host.create("vol-r", 16 * MIB)
    t = target(host, "sb-a")
    await host.attach("vol-r", t, BASE_A)
    again = HostVolumes(host.root.parent)  # a new process: nothing in memory
    assert again.users("vol-r") == ["sb-a"]
    with pytest.raises(ConflictError, match="sb-a"):
        await again.delete("vol-r")
    assert await again.unmount_idle() == []  # in use: left mounted
    await again.detach(t)
    assert mounts_under(host.root.parent) == []
    await again.delete("vol-r")


async def test_no_user_namespace_is_uid_base_zero(host: HostVolumes) -> None:
    assert canonical_to_sandbox(0) == [(CANONICAL_BASE, 0, 65536)]  # host root's own (0 -> 0) would overlap it
    await host.create("vol-docker", 16 * MIB)
    t = target(host, "ctr-1")
    await host.attach("vol-docker", t, 0)
    st = os.stat(t)
    assert (st.st_uid, st.st_gid) == (1000, 1000)
    await host.detach(t)


async def test_bad_host_requests_change_nothing(host: HostVolumes) -> None:
    with pytest.raises(InvalidRequestError):
        await host.create("../escape", 16 * MIB)
    with pytest.raises(InvalidRequestError, match="at least 16 MiB"):
        await host.create("vol-tiny", MIB)
    free = shutil.disk_usage(host.root.parent).free
    with pytest.raises(CapacityError, match="does not fit"):
        await host.create("vol-huge", free + 1024 * MIB)
    assert not host.root.exists() or list(host.root.iterdir()) == []
    await host.create("vol-one", 16 * MIB)
    with pytest.raises(ConflictError):
        await host.create("vol-one", 32 * MIB)
    assert os.stat(host.root / "vol-one" / IMAGE).st_size == 16 * MIB  # the first one is untouched
    with pytest.raises(NotFoundError):
        await host.attach("vol-none", target(host, "sb-a"), BASE_A)
    with pytest.raises(ValueError, match="volumes"):
        await host.attach("vol-one", host.root.parent / "elsewhere", BASE_A)
    assert mounts_under(host.root.parent) == []
    await host.delete("vol-none")  # idempotent



async def test_sandboxes_that_outlive_their_engine_keep_their_volume(test_home: Path) -> None:
    first = make_engine(test_home)
    await first.start()
    vid = f"vol-{uuid.uuid4().hex[:8]}"
    await first.create_volume(vid, 16 * MIB)
    sb = await first.create(SandboxSpec(template=TEMPLATE, volumes={"/mnt/v": vid}))
    await sb.exec("echo kept > /mnt/v/f")
    await first.close()  # the sandbox runs on, its bind with it
    second = make_engine(test_home)
    await second.start(adopt={sb.id: Adoption(spec=SandboxSpec(template=TEMPLATE, volumes={"/mnt/v": vid}))})
    try:
        backend = second.backend
        assert isinstance(backend, LocalBackend)
        assert backend.volumes.users(vid) == [sb.id]  # found in the mount table, not in memory
        with pytest.raises(ConflictError, match=sb.id):
            await second.delete_volume(vid)
        assert (await second.get(sb.id).exec("cat /mnt/v/f")).stdout_bytes == b"kept\n"
        await second.destroy(sb.id)
        assert backend.volumes.users(vid) == [] and mounts_under(backend.volumes.root) == []
    finally:
        await second.close(destroy_all=True)
        await second.delete_volume(vid)

def test_mount_points_are_made_in_the_upper_layer(tmp_path: Path) -> None:
    assert VOLUME_OWNER == SANDBOX_UID  # the volume's root and each leaf belong to the sandbox user
    upper, lower, outside = tmp_path / "upper", tmp_path / "lower", tmp_path / "outside"
    for d in (upper, lower / "usr" / "lib", lower / "etc", outside, upper / "home" / "user"):
        d.mkdir(parents=True)
    (lower / "lib").symlink_to("usr/lib")
    (lower / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    os.chown(upper / "home" / "user", BASE_A + 1000, BASE_A + 1000)
    os.chmod(upper / "home" / "user", 0o750)
    prepare_mountpoints(upper, ["/mnt/data", "/home/user/work/in"], BASE_A, lower=lower)
    for path, owner in (("mnt", BASE_A), ("mnt/data", BASE_A + 1000), ("home/user/work", BASE_A),
                        ("home/user/work/in", BASE_A + 1000)):
        st = os.stat(upper / path)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (owner, owner, 0o755), path
    st = os.stat(upper / "home" / "user")  # what existed already is left as it was
    assert (st.st_uid, st.st_mode & 0o7777) == (BASE_A + 1000, 0o750)
    with pytest.raises(InvalidRequestError, match="/lib is a symlink in the template"):
        prepare_mountpoints(upper, ["/lib/data"], BASE_A, lower=lower)
    with pytest.raises(InvalidRequestError, match="/etc/passwd is a file in the template"):
        prepare_mountpoints(upper, ["/etc/passwd/x"], BASE_A, lower=lower)
    (upper / "evil").symlink_to(outside)  # planted by sandbox code: never followed from the host
    with pytest.raises(ServerError, match="not a directory"):
        prepare_mountpoints(upper, ["/evil/x"], BASE_A)
    assert list(outside.iterdir()) == [] and not (upper / "lib").exists()



def test_the_bundle_binds_each_volume_after_the_tmpfs_mounts(tmp_path: Path) -> None:
    params = BundleParams(sandbox_id="sb-x", rootfs=tmp_path, agent_source=tmp_path, host_uid_base=BASE_A,
                          limits=Limits(), token="t", cgroups_path="/corral/sb-x", swap_limit=True,
                          volume_mounts=(("/mnt/data", tmp_path / "volumes" / "0"),
                                         ("/home/user/d", tmp_path / "volumes" / "1")))
    mounts = build_config(params)["mounts"]
    where = [m["destination"] for m in mounts]
    assert where.index("/mnt/data") > where.index("/tmp") and where.index("/home/user/d") > where.index("/tmp")
    data = mounts[where.index("/mnt/data")]
    assert data == {"destination": "/mnt/data", "type": "bind", "source": str(tmp_path / "volumes" / "0"),
                    "options": ["rbind", "rw", "nosuid", "nodev"]}
    plain = build_config(BundleParams(sandbox_id="sb-x", rootfs=tmp_path, agent_source=tmp_path,
                                      host_uid_base=BASE_A, limits=Limits(), token="t",
                                      cgroups_path="/corral/sb-x", swap_limit=True))["mounts"]
    assert len(plain) == len(mounts) - 2

# -- through the server, the SDK and real sandboxes -----------------------------------------------------------------


def _opts(api: Api, url: str, who: str = "a_dev") -> dict[str, Any]:
    return {"api_key": api.keys[who], "base_url": url}


def _volumes_root(api: Api) -> Path:
    backend = api.engine.backend
    assert isinstance(backend, LocalBackend)
    return backend.volumes.root


def _volume_dirs(api: Api) -> set[str]:
    """The volumes the shared engine's backend holds now (other tests' too: compare before and after)."""
    root = _volumes_root(api)
    return {p.name for p in root.iterdir()} if root.exists() else set()


@pytest.fixture
def name() -> str:
    return f"v-{uuid.uuid4().hex[:8]}"


async def test_two_sandboxes_share_a_volume_that_outlives_them(api: Api, live_url: str, name: str) -> None:
    a = _opts(api, live_url)
    vol = await AsyncVolume.create(name, "64M", **a)
    assert vol.name == name and vol.size == 64 * MIB and vol.id.startswith("vol-")
    data = os.urandom(2 * MIB) + b"\x00\xff\x00"
    try:
        async with await AsyncSandbox.create(TEMPLATE, volumes={"/mnt/data": name},
                                             file_roots=["/workspace", "/mnt/data"], **a) as one, \
                await AsyncSandbox.create(TEMPLATE, volumes={"/home/user/shared": name}, **a) as two:
            await one.files.write("/mnt/data/blob.bin", data)
            r = await two.commands.run("sha256sum < shared/blob.bin; stat -c '%u %U %a' shared/blob.bin shared",
                                       cwd="/home/user")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split("\n")[:3] == [f"{hashlib.sha256(data).hexdigest()}  -", "1000 user 644",
                                                "1000 user 755"]
            r = await two.commands.run("echo from-two > /home/user/shared/two.txt && id -un")
            assert (r.exit_code, r.stdout) == (0, "user\n"), r.stderr
            assert await one.files.read("/mnt/data/two.txt") == b"from-two\n"
            r = await one.commands.run("stat -c '%u %U' /mnt/data/two.txt && echo from-one >> /mnt/data/two.txt")
            assert (r.exit_code, r.stdout) == (0, "1000 user\n"), r.stderr  # the other's file, writable by both
            assert (await two.commands.run("cat /home/user/shared/two.txt")).stdout == "from-two\nfrom-one\n"
        async with await AsyncSandbox.create(TEMPLATE, volumes={"/data": name}, file_roots=["/data"], **a) as three:
            assert await three.files.read("/data/blob.bin") == data  # both are gone; the data is not
            assert (await three.files.read("/data/two.txt")) == b"from-two\nfrom-one\n"
        used = (await AsyncVolume.get(name, **a)).used
        assert used is not None and used >= len(data)
    finally:
        await vol.delete()
    assert mounts_under(_volumes_root(api).parent) == [] and loops_of(_volumes_root(api)) == []


async def test_a_full_volume_is_enospc_inside_and_the_host_keeps_its_space(api: Api, live_url: str,
                                                                             name: str) -> None:
    a = _opts(api, live_url)
    vol = await AsyncVolume.create(name, "16M", **a)
    try:
        async with await AsyncSandbox.create(TEMPLATE, volumes={"/mnt/data": name},
                                             file_roots=["/workspace", "/mnt/data"], **a) as sb:
            r = await sb.commands.run("dd if=/dev/zero of=/mnt/data/fill bs=1M count=64")
            assert r.exit_code != 0 and "No space left on device" in r.stderr, r.stderr
            with pytest.raises(DiskFullError):  # a structured failure through the file API too
                await sb.files.write("/mnt/data/more.bin", os.urandom(4 * MIB))
            image = os.stat(_volumes_root(api) / vol.id / IMAGE)
            assert image.st_size == 16 * MIB and image.st_blocks * 512 <= 16 * MIB  # the host gave 16M, no more
            r = await sb.commands.run("echo ok > /workspace/ok && cat /workspace/ok")
            assert r.stdout == "ok\n"  # the sandbox's own disk is another quota
            r = await sb.commands.run("rm /mnt/data/fill && echo again > /mnt/data/small && cat /mnt/data/small")
            assert r.stdout == "again\n", r.stderr  # freed space is usable again
    finally:
        await vol.delete()


async def test_other_tenants_neither_see_nor_mount_a_volume(api: Api, live_url: str, name: str) -> None:
    a, b = _opts(api, live_url), _opts(api, live_url, "b_dev")
    vol = await AsyncVolume.create(name, "16M", **a)
    try:
        with pytest.raises(NotFoundError):
            await AsyncVolume.get(name, **b)
        async with api.client("b_dev") as other:
            r = await other.delete(f"/v1/volumes/{name}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        with pytest.raises(InvalidRequestError, match=f"no volume named '{name}'"):
            await AsyncSandbox.create(TEMPLATE, volumes={"/mnt/data": name}, **b)
        assert await AsyncSandbox.list(**b) == []  # nothing was created
        assert name not in [v.name for v in await AsyncVolume.list(**b)]
        mine = await AsyncVolume.create(name, "16M", **b)  # names are per tenant
        assert mine.id != vol.id
        await mine.delete()
        assert (await AsyncVolume.get(name, **a)).id == vol.id  # a's is untouched
    finally:
        await vol.delete()


async def test_deletion_is_refused_while_mounted_and_works_after(api: Api, live_url: str, name: str) -> None:
    a = _opts(api, live_url)
    vol = await AsyncVolume.create(name, "16M", **a)
    one = await AsyncSandbox.create(TEMPLATE, volumes={"/mnt/v": name}, **a)
    two = await AsyncSandbox.create(TEMPLATE, volumes={"/mnt/v": name}, **a)
    try:
        with pytest.raises(ConflictError) as refused:
            await vol.delete()
        assert one.id in refused.value.message and two.id in refused.value.message
        assert sorted(refused.value.details["sandboxes"]) == sorted([one.id, two.id])
        await one.kill()
        await two.pause()  # a paused sandbox still has it
        with pytest.raises(ConflictError, match=two.id) as refused:
            await vol.delete()
        assert one.id not in refused.value.message
        assert name in [v.name for v in await AsyncVolume.list(**a)]
    finally:
        await one.kill()
        await two.kill()
    await vol.delete()
    with pytest.raises(NotFoundError):
        await AsyncVolume.get(name, **a)
    assert name not in [v.name for v in await AsyncVolume.list(**a)]
    assert not (_volumes_root(api) / vol.id).exists() and mounts_under(_volumes_root(api).parent) == []
    async with api.client("a_aud") as aud:
        records = (await aud.get("/v1/audit", params={"action": "volume.delete"})).json()["records"]
    assert [r["outcome"]["status"] for r in records] == [409, 409, 204]


async def test_listing_and_the_sync_twin(api: Api, live_url: str, name: str) -> None:
    a = _opts(api, live_url)

    def flow() -> None:
        second = Volume.create(name + "-b", 32 * MIB, **a)
        first = Volume.create(name + "-a", "16M", **a)
        listed = [v for v in Volume.list(**a) if v.name.startswith(name)]
        assert [(v.name, v.size, v.id) for v in listed] == [(first.name, 16 * MIB, first.id),
                                                            (second.name, 32 * MIB, second.id)]
        assert all(v.created_at and v.used is None for v in listed)
        got = Volume.get(first.name, **a)
        assert (got.id, got.size) == (first.id, 16 * MIB) and got.used is not None and got.used < MIB
        first.delete()
        second.delete()
        assert [v for v in Volume.list(**a) if v.name.startswith(name)] == []

    await asyncio.to_thread(flow)


@pytest.mark.parametrize("bad", ["", "UPPER", "a" * 64, "-lead", "has space", "dot.name", "née", "x/y"])
async def test_a_bad_name_is_refused(api: Api, live_url: str, bad: str) -> None:
    with pytest.raises(InvalidRequestError):
        await AsyncVolume.create(bad, "16M", **_opts(api, live_url))
    assert await AsyncVolume.list(**_opts(api, live_url)) == []


@pytest.mark.parametrize("bad", ["1M", "15M", "2T", "lots", 0, -5, "1.5.5G"])
async def test_a_bad_size_is_refused(api: Api, live_url: str, name: str, bad: int | str) -> None:
    before = _volume_dirs(api)
    with pytest.raises(InvalidRequestError, match="size"):
        await AsyncVolume.create(name, bad, **_opts(api, live_url))
    assert await AsyncVolume.list(**_opts(api, live_url)) == []
    assert _volume_dirs(api) == before


async def test_bad_mounts_are_refused_and_create_nothing(api: Api, live_url: str, name: str) -> None:
    a = _opts(api, live_url)
    before = _volume_dirs(api)
    vol = await AsyncVolume.create(name, "16M", **a)
    try:
        with pytest.raises(ConflictError, match="exists already"):
            await AsyncVolume.create(name, "32M", **a)
        for mounts, says in [({"relative": name}, "absolute"), ({"/proc/x": name}, "/proc"),
                             ({"/tmp/x": name}, "/tmp"), ({"/": name}, "below '/'"), ({"/a/../b": name}, "normalized"),
                             ({"/a": name, "/b": name}, "at most once"), ({"/x": name, "/x/y": name}, "inside"),
                             ({"/lib/data": name}, "/lib is a symlink in the template")]:
            with pytest.raises(InvalidRequestError, match=says):
                await AsyncSandbox.create(TEMPLATE, volumes=mounts, **a)
        assert await AsyncSandbox.list(**a) == []
        assert [v.name for v in await AsyncVolume.list(**a)] == [name]
        assert _volume_dirs(api) - before == {vol.id}
        assert mounts_under(_volumes_root(api).parent) == []
    finally:
        await vol.delete()


async def test_the_cli_creates_lists_and_removes(api: Api, live_url: str, name: str) -> None:
    env = {"CORRAL_URL": live_url, "CORRAL_API_KEY": api.keys["a_dev"]}

    def corral(*args: str) -> tuple[int, str, str]:
        r = CliRunner().invoke(app, list(args), env=env)
        return r.exit_code, r.stdout, r.stderr

    code, out, err = await asyncio.to_thread(corral, "volume", "create", name, "--size", "32M")
    assert (code, out) == (0, f"{name}\n"), err
    code, out, _ = await asyncio.to_thread(corral, "volume", "ls", "--json")
    assert code == 0 and '"size": 33554432' in out and name in out
    code, out, _ = await asyncio.to_thread(corral, "volume", "ls")
    assert code == 0 and name in out and "32M" in out
    assert (await asyncio.to_thread(corral, "volume", "rm", name))[0] == 0
    code, _, err = await asyncio.to_thread(corral, "volume", "rm", name)
    assert code == 1 and err.startswith("error: not_found: ") and name in err
    code, _, err = await asyncio.to_thread(corral, "volume", "create", "Bad!", "--size", "32M")
    assert code == 1 and err.startswith("error: invalid_request: ")



async def test_the_admin_sets_volume_quotas(api: Api, live_url: str, name: str) -> None:
    async with api.client("admin") as admin:
        r = await admin.patch("/v1/tenants/a", json={"quotas": {"max_volumes": 1, "max_volume_bytes": 32 * MIB}})
        assert r.status_code == 200, r.text
        assert r.json()["quotas"]["max_volumes"] == 1 and r.json()["quotas"]["max_volume_bytes"] == 32 * MIB
        assert (await admin.patch("/v1/tenants/a", json={"quotas": {"max_volumes": -1}})).status_code == 400
    a = _opts(api, live_url)
    before = _volume_dirs(api)
    with pytest.raises(QuotaExceededError, match="max_volume_bytes"):
        await AsyncVolume.create(name, "33M", **a)
    vol = await AsyncVolume.create(name, "32M", **a)
    try:
        with pytest.raises(QuotaExceededError, match="max_volumes"):
            await AsyncVolume.create(name + "-2", "16M", **a)
    finally:
        await vol.delete()
    assert _volume_dirs(api) == before
