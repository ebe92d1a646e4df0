"""File transfer through the agent: exact bytes, safe paths, archives."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest

from corral import InvalidRequestError, NotFoundError, PermissionDeniedError
from corral.engine import SandboxSpec

from .conftest import TEMPLATE

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_round_trips(sandbox):
    cases = {
        "/workspace/random.bin": os.urandom(50 * 2**20),
        "/workspace/all256.bin": bytes(range(256)) * 1000,
        "/workspace/empty": b"",
        "/workspace/with space ünïcødé ✓.txt": "héllo\n".encode(),
        "relative/nested/file.txt": b"rel",
    }
    for path, data in cases.items():
        assert await sandbox.files.write(path, data) == len(data)
    for path, data in cases.items():
        got = await sandbox.files.read(path)
        assert sha(got) == sha(data) and len(got) == len(data)
    # the sandbox sees the same bytes
    r = await sandbox.exec(["sha256sum", "/workspace/random.bin"])
    assert r.stdout.split()[0] == sha(cases["/workspace/random.bin"])
    assert (await sandbox.exec(["cat", "/workspace/relative/nested/file.txt"])).stdout == "rel"


async def test_write_from_file_object_and_iterable(sandbox):
    data = os.urandom(3 * 2**20 + 7)
    await sandbox.files.write("/workspace/a", io.BytesIO(data))
    assert await sandbox.files.read("/workspace/a") == data

    async def gen():
        for i in range(0, len(data), 100_000):
            yield data[i : i + 100_000]

    await sandbox.files.write("/workspace/b", gen())
    assert await sandbox.files.read("/workspace/b") == data


async def test_listing_and_metadata(sandbox):
    await sandbox.files.write("/workspace/d/x.txt", b"12345")
    assert await sandbox.files.make_dir("/workspace/d/sub") is True
    assert await sandbox.files.make_dir("/workspace/d/sub") is False
    entries = {e.name: e for e in await sandbox.files.list("/workspace/d")}
    assert entries["x.txt"].size == 5 and not entries["x.txt"].is_dir and entries["sub"].is_dir
    assert (await sandbox.files.stat("/workspace/d/x.txt")).size == 5
    await sandbox.files.rename("/workspace/d/x.txt", "/workspace/d/y.txt")
    assert not await sandbox.files.exists("/workspace/d/x.txt")
    assert await sandbox.files.exists("/workspace/d/y.txt")
    await sandbox.files.remove("/workspace/d")
    assert not await sandbox.files.exists("/workspace/d")
    with pytest.raises(NotFoundError):
        await sandbox.files.read("/workspace/d/y.txt")
    with pytest.raises(NotFoundError):
        await sandbox.files.remove("/workspace/nothing")


async def test_files_are_owned_by_the_sandbox_user(sandbox):
    await sandbox.files.write("/workspace/owned", b"x")
    r = await sandbox.exec("stat -c %U:%G /workspace/owned")
    assert r.stdout.strip() == "user:user"


async def test_bad_paths_change_nothing(sandbox):
    for bad in ("/workspace/a\x00b", "/workspace/\udcff"):
        with pytest.raises(InvalidRequestError):
            await sandbox.files.write(bad, b"x")
    with pytest.raises(InvalidRequestError):
        await sandbox.files.read("/workspace")  # a directory
    r = await sandbox.exec("ls -A /workspace")
    assert r.stdout == ""


async def test_reading_a_fifo_does_not_hang(sandbox):
    await sandbox.exec("mkfifo /workspace/fifo")
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        await sandbox.files.read("/workspace/fifo")


async def test_tar_round_trip(sandbox):
    await sandbox.exec("mkdir -p /workspace/proj/sub && printf 'a\\x00' > /workspace/proj/sub/f && "
                       "ln -s sub/f /workspace/proj/link")
    blob = b"".join([c async for c in sandbox.files.download_tar("/workspace/proj")])
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        names = sorted(tar.getnames())
        assert names == ["proj", "proj/link", "proj/sub", "proj/sub/f"]
    assert await sandbox.files.upload_tar("/workspace/copy", blob) == 4
    assert await sandbox.files.read("/workspace/copy/proj/sub/f") == b"a\x00"
    r = await sandbox.exec("readlink /workspace/copy/proj/link")
    assert r.stdout.strip() == "sub/f"


def _tar(*members: tuple[str, bytes | None, str | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, link in members:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            else:
                info.size = len(data or b"")
                tar.addfile(info, io.BytesIO(data or b""))
    return buf.getvalue()


@pytest.mark.parametrize("members", [
    [("ok.txt", b"fine", None), ("../escape.txt", b"x", None)],
    [("ok.txt", b"fine", None), ("/abs.txt", b"x", None)],
    [("ok.txt", b"fine", None), ("lnk", None, "/etc"), ("lnk/passwd", b"x", None)],
    [("ok.txt", b"fine", None), ("up", None, "../../..")],
])
async def test_unsafe_archives_are_refused_whole(sandbox, members):
    with pytest.raises(InvalidRequestError):
        await sandbox.files.upload_tar("/workspace/t", _tar(*members))
    assert not await sandbox.files.exists("/workspace/t/ok.txt")
    assert not await sandbox.files.exists("/workspace/escape.txt")


async def test_upload_past_the_disk_limit_is_disk_full_and_leaves_nothing(engine):
    from corral import DiskFullError

    from .conftest import spec

    async with await engine.create(spec(disk="32M")) as sb:
        with pytest.raises(DiskFullError, match="disk limit"):
            await sb.files.write("/workspace/big.bin", os.urandom(64 * 2**20))
        r = await sb.exec("ls -A /workspace; df -k /workspace | tail -1")
        assert "big.bin" not in r.stdout and ".corral-upload" not in r.stdout
        await sb.files.write("/workspace/small.txt", b"still works")  # the space came back
        assert await sb.files.read("/workspace/small.txt") == b"still works"


async def test_file_roots_in_the_spec_confine_the_engines_file_api(engine):
    sb = await engine.create(SandboxSpec(template=TEMPLATE, file_roots=("/workspace/out",)))
    try:
        assert await sb.files.write("/workspace/out/ok", b"1") == 1
        for path in ("/workspace/no", "/tmp/no", "/workspace/out/../no"):
            with pytest.raises((InvalidRequestError, PermissionDeniedError)):
                await sb.files.write(path, b"x")
        assert (await sb.exec("ls /workspace /tmp")).stdout.split().count("no") == 0
        assert [e.name for e in await sb.files.list("/workspace/out")] == ["ok"]
    finally:
        await sb.destroy()


async def test_a_path_1500_directories_deep_is_written_and_read(sandbox):
    # Found by the eval corpus: creating the parents recursed past Python's limit (a RecursionError, a 500).
    deep = "/workspace/" + "d/" * 1500 + "x"
    await sandbox.files.write(deep, b"deep")
    assert await sandbox.files.read(deep) == b"deep"
    await sandbox.files.make_dir("/workspace/" + "e/" * 1500)
    assert await sandbox.files.exists("/workspace/" + "e/" * 1500)
