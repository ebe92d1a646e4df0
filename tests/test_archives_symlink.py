"""Uploaded archives never follow a symbolic link below their target (agent/archives.py).

Sandbox code can plant `/workspace/out -> /home/user/.ssh` (or `-> /etc`, or to anywhere inside the file roots
but outside the target) and then have an archive with `out/x` uploaded to /workspace: the upload is refused and
nothing lands where the link points. The first tests run in a real sandbox (whose Python may have no
`tarfile.data_filter`); the last drive the extraction directly on the host, with and without that filter, and
with a link that appears after the check before extraction (the race the descriptor walk closes).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import InvalidRequestError, PermissionDeniedError
from corral.agent import archives
from corral.agent.file_access import FileError
from corral.engine import SandboxSpec

from .conftest import TEMPLATE

Member = tuple[str, str, str]  # kind ("file", "dir", "sym", "hard"), name, payload (data or link target)


def _tar(*members: Member) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for kind, name, payload in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o755 if kind == "dir" else 0o644
            if kind == "file":
                info.size = len(payload.encode())
                tar.addfile(info, io.BytesIO(payload.encode()))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE}[kind]
            info.linkname = payload
            tar.addfile(info)
    return buf.getvalue()


# -- in a real sandbox ------------------------------------------------------------------------------------

# (what sandbox code plants, the target of the upload, the archive, where nothing may appear)
PLANTED = {
    "file-through-link-to-home": (
        "mkdir -p ~/.ssh && ln -s /home/user/.ssh /workspace/out", "/workspace",
        [("file", "out/authorized_keys", "ssh-ed25519 AAAA attacker")], "/home/user/.ssh/authorized_keys"),
    "dir-entry-on-a-link": (
        "mkdir -p ~/.ssh && ln -s /home/user/.ssh /workspace/out", "/workspace",
        [("dir", "out", ""), ("file", "out/authorized_keys", "x")], "/home/user/.ssh/authorized_keys"),
    "deep-link-inside-the-roots": (
        "mkdir -p /workspace/t/a /workspace/other && ln -s /workspace/other /workspace/t/a/b", "/workspace/t",
        [("file", "a/b/x", "x")], "/workspace/other/x"),
    "link-to-tmp": (
        "mkdir -p /tmp/evil && ln -s /tmp/evil /workspace/t", "/workspace",
        [("file", "ok.txt", "ok"), ("file", "t/x", "x")], "/tmp/evil/x"),
    "hard-link-through-a-link": (
        "mkdir -p /workspace/t && echo secret > ~/secret && ln -s /home/user /workspace/t/l", "/workspace/t",
        [("hard", "h", "l/secret")], "/workspace/t/h"),
}


@pytest.mark.anyio
@pytest.mark.runc
@pytest.mark.parametrize("case", sorted(PLANTED))
async def test_a_planted_link_below_the_target_is_refused(sandbox, case):
    plant, target, members, forbidden = PLANTED[case]
    assert (await sandbox.exec(plant)).exit_code == 0
    with pytest.raises(InvalidRequestError, match="symbolic link"):
        await sandbox.files.upload_tar(target, _tar(*members))
    r = await sandbox.exec(f"test -e {forbidden} && echo present || echo absent; ls -A /workspace/ok.txt 2>&1")
    assert r.stdout.split()[0] == "absent", f"{forbidden} was written through the link"
    assert "No such file" in r.stdout  # refused whole: not even the harmless entry before it


@pytest.mark.anyio
@pytest.mark.runc
async def test_a_link_to_etc_is_refused_too(sandbox):
    await sandbox.exec("ln -s /etc /workspace/out")
    with pytest.raises(InvalidRequestError, match="symbolic link"):
        await sandbox.files.upload_tar("/workspace", _tar(("file", "out/x-corral", "x")))
    assert (await sandbox.exec("test -e /etc/x-corral")).exit_code == 1


@pytest.mark.anyio
@pytest.mark.runc
async def test_an_entry_replaces_a_planted_link_instead_of_writing_through_it(sandbox):
    await sandbox.exec("echo original > ~/.profile-x && mkdir -p /workspace/t && ln -s ~/.profile-x /workspace/t/f")
    assert await sandbox.files.upload_tar("/workspace/t", _tar(("file", "f", "new"))) == 1
    r = await sandbox.exec("cat ~/.profile-x; test -L /workspace/t/f && echo link || cat /workspace/t/f")
    assert r.stdout.split() == ["original", "new"]


@pytest.mark.anyio
@pytest.mark.runc
async def test_with_file_roots_a_link_out_of_them_is_refused(engine):
    async with await engine.create(SandboxSpec(template=TEMPLATE, file_roots=("/workspace",))) as sb:
        await sb.exec("mkdir -p /tmp/evil && ln -s /tmp/evil /workspace/out && ln -s /tmp/evil /workspace/whole")
        with pytest.raises(InvalidRequestError, match="symbolic link"):
            await sb.files.upload_tar("/workspace", _tar(("file", "out/x", "x")))
        with pytest.raises(PermissionDeniedError):  # the target itself resolves out of the roots
            await sb.files.upload_tar("/workspace/whole", _tar(("file", "x", "x")))
        assert (await sb.exec("ls -A /tmp/evil")).stdout == ""


@pytest.mark.anyio
@pytest.mark.runc
async def test_links_inside_the_archive_and_a_linked_target_still_work(sandbox):
    await sandbox.exec("mkdir -p /workspace/real && ln -s real /workspace/alias")
    good = _tar(("dir", "sub", ""), ("file", "sub/a.txt", "A"), ("sym", "link", "sub/a.txt"),
                ("hard", "hard", "sub/a.txt"))
    assert await sandbox.files.upload_tar("/workspace/alias", good) == 4  # the target's own link is followed
    assert await sandbox.files.read("/workspace/real/link") == b"A"
    assert await sandbox.files.read("/workspace/real/hard") == b"A"
    assert await sandbox.files.upload_tar("/workspace/alias", good) == 4  # again, over the first extraction
    r = await sandbox.exec("ls -A /workspace/real")
    assert r.stdout.split() == ["hard", "link", "sub"]  # and no spool file left behind


# -- on the host: the extraction itself, with and without tarfile's filter -------------------------------


@pytest.fixture(params=["data_filter", "no_filter"])
def data_filter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.param == "data_filter":
        if getattr(tarfile, "data_filter", None) is None:
            pytest.skip("this Python has no tarfile.data_filter")
        monkeypatch.setattr(archives, "_DATA_FILTER", tarfile.data_filter)
    else:
        monkeypatch.setattr(archives, "_DATA_FILTER", None)
    yield


def _extract(target: Path, blob: bytes) -> int:
    real = os.path.realpath(target)
    root = archives._open_target(real, str(target))
    try:
        return archives._extract_safely(io.BytesIO(blob), archives._Dirs(root, str(target)), real)
    finally:
        os.close(root)


def test_host_extraction_refuses_a_planted_link(tmp_path: Path, data_filter: None) -> None:
    outside, target = tmp_path / "outside", tmp_path / "target"
    outside.mkdir()
    target.mkdir()
    (target / "out").symlink_to(outside)
    with pytest.raises(FileError) as caught:
        _extract(target, _tar(("file", "ok", "ok"), ("file", "out/x", "x")))
    assert caught.value.code == "invalid_request"
    assert list(outside.iterdir()) == [] and not (target / "ok").exists()


def test_a_link_planted_after_the_check_is_still_not_followed(tmp_path: Path, data_filter: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The race: the link appears between the check before extraction and the write."""
    outside, target = tmp_path / "outside", tmp_path / "target"
    outside.mkdir()
    target.mkdir()
    original = archives._Dirs.refuse_planted_links

    def then_plant(self: archives._Dirs, members: list[tarfile.TarInfo]) -> None:
        original(self, members)
        (target / "out").symlink_to(outside)

    monkeypatch.setattr(archives._Dirs, "refuse_planted_links", then_plant)
    with pytest.raises(FileError, match="symbolic link"):
        _extract(target, _tar(("file", "out/x", "x")))
    assert list(outside.iterdir()) == []


def test_a_link_swapped_into_the_targets_own_path_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "ws").symlink_to(outside)  # resolved and checked as tmp_path/ws/t, then swapped to a link
    with pytest.raises(FileError, match="symbolic link"):
        archives._open_target(str(tmp_path / "ws" / "t"), "/workspace/t")
    assert list(outside.iterdir()) == []


def test_host_extraction_of_a_good_archive(tmp_path: Path, data_filter: None) -> None:
    target = tmp_path / "t"
    blob = _tar(("dir", "d", ""), ("file", "d/a", "A"), ("sym", "l", "d/a"), ("hard", "h", "d/a"),
                ("file", "x/y/z", "Z"))
    assert _extract(target, blob) == 5
    assert (target / "l").read_text() == "A" and (target / "h").read_text() == "A"
    assert (target / "x/y/z").read_text() == "Z"
    assert _extract(target, blob) == 5  # again, over itself
    assert os.readlink(target / "l") == "d/a"
