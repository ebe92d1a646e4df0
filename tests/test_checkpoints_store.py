"""The backend-neutral checkpoint store on plain directories: an "upper" written as overlayfs writes one
(whiteouts as char 0/0 devices, the opaque xattr, symlinks, modes, owners, hard links) and a "lower" standing for
the template. Root only (owners, devices, trusted xattrs); no runtime."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral._exceptions import CapacityError, NotFoundError
from corral.backends._checkpoints import CheckpointStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: owners, device nodes, trusted xattrs")

BASE = 100_000  # the sandbox's uid base: its root is BASE, its user BASE + 1000
OPAQUE = "trusted.overlay.opaque"
Lab = tuple[Path, Path, CheckpointStore]  # lower, upper, the store


def tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything a restore must bring back, by path: type, mode, owner, bytes or target or device, xattrs,
    and a file's mtime."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            st = os.lstat(path)
            rel = str(path.relative_to(root))
            names = () if stat.S_ISLNK(st.st_mode) else os.listxattr(path, follow_symlinks=False)
            xattrs = tuple(sorted((n, os.getxattr(path, n, follow_symlinks=False)) for n in names))
            body: object = None
            if stat.S_ISREG(st.st_mode):
                body = path.read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(path)
            elif stat.S_ISCHR(st.st_mode):
                body = st.st_rdev
            mtime = None if stat.S_ISDIR(st.st_mode) else st.st_mtime_ns
            out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, body, xattrs, mtime)
    return out


def whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "motd").write_text("welcome\n")
    (lower / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (lower / "opt" / "tool").mkdir(parents=True)
    (lower / "opt" / "tool" / "bin").write_text("tool\n")
    (upper / "workspace" / "proj" / "src").mkdir(parents=True)
    (upper / "workspace" / "proj" / "src" / "main.py").write_text("print('hi')\n")
    (upper / "workspace" / "proj" / "data.bin").write_bytes(os.urandom(300_000))
    os.chmod(upper / "workspace" / "proj" / "data.bin", 0o640)
    (upper / "workspace" / "run.sh").write_text("#!/bin/sh\n")
    os.symlink("proj/src/main.py", upper / "workspace" / "link")
    os.link(upper / "workspace" / "proj" / "data.bin", upper / "workspace" / "hard.bin")
    (upper / "etc").mkdir()
    whiteout(upper / "etc" / "motd")  # a deleted template file
    (upper / "opt" / "tool").mkdir(parents=True)
    os.setxattr(upper / "opt" / "tool", OPAQUE, b"y")  # a template directory removed and made again
    (upper / "opt" / "tool" / "new").write_text("mine\n")
    for dirpath, dirnames, filenames in os.walk(upper):
        for name in [*dirnames, *filenames]:
            os.chown(Path(dirpath) / name, BASE + 1000, BASE + 1000, follow_symlinks=False)
    os.chown(upper / "etc", BASE, BASE)
    os.chmod(upper / "workspace" / "run.sh", 0o4755)  # after the chown, which clears set-uid
    yield lower, upper, CheckpointStore(tmp_path / "store")


def test_rm_rf_then_restore_brings_back_every_byte_mode_owner_link_and_whiteout(lab: Lab) -> None:
    _, upper, store = lab
    before = tree(upper)
    store.capture(upper, BASE, "ckpt-0000000000000001")
    subprocess.run(["rm", "-rf", str(upper / "workspace"), str(upper / "etc"), str(upper / "opt")], check=True)
    (upper / "created-since").write_text("gone after the restore")
    store.restore(upper, BASE, "ckpt-0000000000000001")
    assert tree(upper) == before
    assert os.lstat(upper / "workspace" / "hard.bin").st_ino == os.lstat(upper / "workspace/proj/data.bin").st_ino


def test_owners_are_kept_relative_to_the_uid_base(lab: Lab, tmp_path: Path) -> None:
    _, upper, store = lab
    store.capture(upper, BASE, "ckpt-0000000000000001")
    other = tmp_path / "other"
    other.mkdir()
    store.restore(other, BASE + 65536, "ckpt-0000000000000001")
    st = os.lstat(other / "workspace" / "run.sh")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (BASE + 65536 + 1000, BASE + 65536 + 1000, 0o4755)
    assert os.lstat(other / "etc").st_uid == BASE + 65536


def test_an_unchanged_tree_adds_only_its_manifest_and_a_change_only_its_file(lab: Lab) -> None:
    _, upper, store = lab
    first = store.capture(upper, BASE, "ckpt-0000000000000001")
    assert first > 300_000
    assert store.capture(upper, BASE, "ckpt-0000000000000002") < 10_000  # no object read or written again
    (upper / "workspace" / "run.sh").write_text("#!/bin/sh\necho changed\n")
    assert store.capture(upper, BASE, "ckpt-0000000000000003") < 10_000 + 100
    assert len(store.objects.all()) == 5  # main.py, data.bin (once for its two names), run.sh, new; run.sh again
    # Objects are copies: writing the file in place after a checkpoint does not change the checkpoint.
    with open(upper / "workspace" / "proj" / "src" / "main.py", "r+") as f:
        f.write("XXXXX")
    assert store.read("ckpt-0000000000000001", "/workspace/proj/src/main.py", 100, []) == b"print('hi')\n"


def test_changes_between_checkpoints_and_now_say_what_the_sandbox_sees(lab: Lab) -> None:
    lower, upper, store = lab
    store.capture(upper, BASE, "ckpt-0000000000000001")
    (upper / "workspace" / "proj" / "src" / "main.py").write_text("print('bye!')\n")
    (upper / "workspace" / "new.txt").write_text("new")
    os.unlink(upper / "workspace" / "run.sh")
    whiteout(upper / "workspace" / "run.sh")  # overlayfs would leave no whiteout for an upper-only file; either way
    os.chmod(upper / "workspace" / "proj" / "data.bin", 0o600)
    whiteout(upper / "etc" / "hosts")
    now = {c.path: (c.kind, c.type, c.size, c.old_size) for c in store.changes("ckpt-0000000000000001", None, upper,
                                                                               BASE, [lower])}
    assert now == {
        "/workspace/proj/src/main.py": ("modified", "file", 14, 12),
        "/workspace/new.txt": ("added", "file", 3, None),
        "/workspace/run.sh": ("deleted", "file", None, 10),
        "/workspace/proj/data.bin": ("mode", "file", 300_000, 300_000),
        "/workspace/hard.bin": ("mode", "file", 300_000, 300_000),  # one inode, two names
        "/etc/hosts": ("deleted", "file", None, 20),
    }
    store.capture(upper, BASE, "ckpt-0000000000000002")
    between = store.changes("ckpt-0000000000000001", "ckpt-0000000000000002", upper, BASE, [lower])
    assert {c.path: c.kind for c in between} == {p: v[0] for p, v in now.items()}
    assert store.changes("ckpt-0000000000000002", None, upper, BASE, [lower]) == []


def test_a_copied_up_template_file_is_a_change_only_if_it_differs(lab: Lab) -> None:
    lower, upper, store = lab
    store.capture(upper, BASE, "ckpt-0000000000000001")
    (upper / "etc" / "hosts").write_text("127.0.0.1 localhost\n")  # copied up, same bytes and mode
    os.chmod(upper / "etc" / "hosts", 0o644)
    os.chmod(lower / "etc" / "hosts", 0o644)
    assert store.changes("ckpt-0000000000000001", None, upper, BASE, [lower]) == []
    (upper / "etc" / "hosts").write_text("10.0.0.1 evil\n")
    assert [c.kind for c in store.changes("ckpt-0000000000000001", None, upper, BASE, [lower])] == ["modified"]


def test_restore_of_paths_restores_those_and_leaves_the_rest(lab: Lab) -> None:
    _, upper, store = lab
    store.capture(upper, BASE, "ckpt-0000000000000001")
    subprocess.run(["rm", "-rf", str(upper / "workspace" / "proj")], check=True)
    (upper / "workspace" / "run.sh").write_text("kept as it is now")
    (upper / "workspace" / "later").write_text("kept too")
    store.restore(upper, BASE, "ckpt-0000000000000001", ["/workspace/proj", "/workspace/link", "/etc/absent"])
    assert (upper / "workspace" / "proj" / "src" / "main.py").read_text() == "print('hi')\n"
    assert (upper / "workspace" / "run.sh").read_text() == "kept as it is now"
    assert (upper / "workspace" / "later").read_text() == "kept too"
    # A path absent at the checkpoint is removed: made since, it goes.
    (upper / "workspace" / "later2").write_text("x")
    store.restore(upper, BASE, "ckpt-0000000000000001", ["/workspace/later2"])
    assert not (upper / "workspace" / "later2").exists()


def test_reading_a_file_at_a_checkpoint_sees_the_lower_layers_unless_hidden(lab: Lab) -> None:
    lower, upper, store = lab
    store.capture(upper, BASE, "ckpt-0000000000000001")
    read = lambda path: store.read("ckpt-0000000000000001", path, 1 << 20, [lower])  # noqa: E731
    assert read("/etc/hosts") == b"127.0.0.1 localhost\n"  # the template's: the sandbox never changed it
    assert read("/etc/motd") is None  # deleted (a whiteout)
    assert read("/opt/tool/bin") is None  # below an opaque directory
    assert read("/opt/tool/new") == b"mine\n"
    assert read("/workspace/hard.bin") == (upper / "workspace" / "hard.bin").read_bytes()
    assert read("/workspace/link") is None and read("/workspace") is None  # a symlink, a directory
    assert store.read("ckpt-0000000000000001", "/workspace/run.sh", 4, []) == b"#!/b"


def test_deleting_checkpoints_collects_their_objects(lab: Lab) -> None:
    _, upper, store = lab
    store.capture(upper, BASE, "ckpt-0000000000000001")
    full = store.size()
    (upper / "workspace" / "proj" / "data.bin").write_bytes(os.urandom(200_000))
    store.capture(upper, BASE, "ckpt-0000000000000002")
    assert store.size() > full + 150_000
    store.delete("ckpt-0000000000000001")
    store.delete("ckpt-0000000000000001")  # idempotent
    assert store.size() < full + 50_000  # the old data.bin went with the only checkpoint naming it
    with pytest.raises(NotFoundError):
        store.restore(upper, BASE, "ckpt-0000000000000001")
    store.delete("ckpt-0000000000000002")
    assert store.objects.all() == set()
    # The index forgot the removed objects: the next checkpoint copies every file again.
    assert store.capture(upper, BASE, "ckpt-0000000000000003") > 200_000


def test_a_full_disk_is_a_capacity_error_and_leaves_nothing(lab: Lab, tmp_path: Path) -> None:
    _, upper, _ = lab
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(small)], check=True)
    try:
        store = CheckpointStore(small / "store")
        with pytest.raises(CapacityError, match="no room"):
            store.capture(upper, BASE, "ckpt-0000000000000001")
        assert not store.has("ckpt-0000000000000001") and store.objects.all() == set()
    finally:
        subprocess.run(["umount", str(small)], check=True)
