"""File semantics E2B's envd has, through the engine against real runc: entries with owner, group, permissions
and metadata; listings with depth; writes in place; metadata on write (and its refusals); moves that make parents;
and a sandbox whose file root is "/" (system files, /proc)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corral import ConflictError, DiskFullError, InvalidRequestError, NotFoundError, PermissionDeniedError
from corral.agent.file_access import FileError
from corral.agent.file_entries import Names
from corral.agent.file_metadata import replace_metadata
from corral.engine import DEFAULT_FILE_ROOTS

from .conftest import spec

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


# -- entries ------------------------------------------------------------------------------------------------------


async def test_entries_say_what_ls_says(sandbox):
    await sandbox.files.write("/workspace/e/f.txt", b"hello")
    await sandbox.files.write("/workspace/e/secret", b"s", mode=0o600)
    await sandbox.files.make_dir("/workspace/e/sub")
    await sandbox.exec("cd /workspace/e && ln -s f.txt link && ln -s nowhere dangling && cp /home/user/.bashrc .")
    entries = {e.name: e for e in await sandbox.files.list("/workspace/e")}
    shown = (await sandbox.exec("cd /workspace/e && stat -c '%n %U %G %A' *")).stdout.split("\n")
    for line in filter(None, shown):
        name, owner, group, permissions = line.split()
        assert (entries[name].owner, entries[name].group, entries[name].permissions) == (owner, group, permissions)
    f = entries["f.txt"]
    assert (f.type, f.size, f.mode, f.permissions, f.owner, f.group) == ("file", 5, 0o644, "-rw-r--r--", "user", "user")
    assert f.metadata == {} and f.target is None and f.resolved is None
    assert (entries["secret"].mode, entries["secret"].permissions) == (0o600, "-rw-------")
    assert (entries["sub"].type, entries["sub"].permissions) == ("dir", "drwxr-xr-x")


async def test_a_symlink_entry_names_its_text_where_it_leads_and_what_is_there(sandbox):
    await sandbox.files.write("/workspace/l/target.txt", b"t")
    await sandbox.exec("cd /workspace/l && ln -s target.txt link && ln -s . here && ln -s nowhere dangling")
    link = await sandbox.files.stat("/workspace/l/link")
    assert (link.type, link.permissions, link.target) == ("symlink", "lrwxrwxrwx", "target.txt")
    assert (link.resolved, link.target_type) == ("/workspace/l/target.txt", "file")
    here = await sandbox.files.stat("/workspace/l/here")
    assert (here.resolved, here.target_type) == ("/workspace/l", "dir")
    dangling = await sandbox.files.stat("/workspace/l/dangling")
    assert (dangling.target, dangling.resolved, dangling.target_type) == ("nowhere", "/workspace/l/nowhere", None)


def test_names_come_from_passwd_and_group_and_unknown_ids_are_numbers(tmp_path: Path) -> None:
    passwd, group = tmp_path / "passwd", tmp_path / "group"
    passwd.write_text("root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\nalias:x:1000:1:::\n")
    group.write_text("root:x:0:\nusers:x:1000:\nbroken line\n")
    names = Names(str(passwd), str(group))
    assert [names.user(0), names.user(1000), names.user(4242)] == ["root", "user", "4242"]
    assert [names.group(1000), names.group(7)] == ["users", "7"]
    assert Names("/nonexistent/passwd", "/nonexistent/group").user(0) == "0"


# -- listing with depth -------------------------------------------------------------------------------------------


async def test_list_walks_depth_levels_depth_first_in_name_order(sandbox):
    await sandbox.exec("mkdir -p /workspace/t/subdir1/subdir1_1/deep /workspace/t/subdir1/subdir1_2 "
                       "/workspace/t/subdir2/subdir2_1 && echo hi > /workspace/t/file1.txt && "
                       "echo x > /workspace/t/a.txt && mkdir /workspace/t/a && touch /workspace/t/a/z")
    one = ["a", "a.txt", "file1.txt", "subdir1", "subdir2"]
    two = ["a", "a/z", "a.txt", "file1.txt", "subdir1", "subdir1/subdir1_1", "subdir1/subdir1_2", "subdir2",
           "subdir2/subdir2_1"]
    three = [*two[:6], "subdir1/subdir1_1/deep", *two[6:]]
    for depth, expected in ((1, one), (2, two), (3, three), (9, three)):
        entries = await sandbox.files.list("/workspace/t", depth=depth)
        assert [e.path for e in entries] == [f"/workspace/t/{p}" for p in expected], depth
        assert [e.name for e in entries] == [p.rsplit("/", 1)[-1] for p in expected]
    assert await sandbox.files.list("/workspace/t") == await sandbox.files.list("/workspace/t", depth=1)


async def test_list_never_follows_a_symlink_below_it_and_bad_depths_are_refused(sandbox):
    await sandbox.exec("mkdir -p /workspace/s/real && touch /workspace/s/real/inside && "
                       "ln -s real /workspace/s/link && ln -s /workspace/s /workspace/via")
    entries = await sandbox.files.list("/workspace/s", depth=5)
    assert [(e.name, e.type) for e in entries] == [("link", "symlink"), ("real", "dir"), ("inside", "file")]
    # The listed path itself may be a link: entries keep the path as asked.
    assert [e.path for e in await sandbox.files.list("/workspace/via")] == ["/workspace/via/link",
                                                                           "/workspace/via/real"]
    for depth in (0, -1, True, 1.5):
        with pytest.raises(InvalidRequestError, match="depth"):
            await sandbox.files.list("/workspace/s", depth=depth)
    with pytest.raises(InvalidRequestError):
        await sandbox.files.list("/workspace/s/real/inside")
    with pytest.raises(NotFoundError):
        await sandbox.files.list("/workspace/missing", depth=2)


async def test_a_directory_too_big_for_one_frame_is_listed_whole(sandbox):
    # 40,000 entries are ~6 MB of JSON, more than a protocol frame holds: they come in batches.
    await sandbox.exec(["python3", "-c", "import os\nos.makedirs('/workspace/big')\n"
                        "[open(f'/workspace/big/file-with-a-longer-name-{i:06d}', 'w').close() for i in range(40000)]"])
    entries = await sandbox.files.list("/workspace/big")
    assert len(entries) == 40000
    assert entries[0].name == "file-with-a-longer-name-000000" and entries[-1].name.endswith("039999")
    assert {e.owner for e in entries} == {"user"}


# -- writes in place ----------------------------------------------------------------------------------------------


async def test_an_in_place_write_replaces_the_bytes_and_sets_the_mode(sandbox):
    path = "/workspace/p/new/file.txt"
    assert await sandbox.files.write(path, b"a longer first content", in_place=True, mode=0o600) == 22
    assert await sandbox.files.read(path) == b"a longer first content"
    assert (await sandbox.files.stat(path)).mode == 0o600
    inode = (await sandbox.exec(["stat", "-c", "%i", path])).stdout
    assert await sandbox.files.write(path, b"short", in_place=True) == 5
    assert await sandbox.files.read(path) == b"short"
    after = await sandbox.files.stat(path)
    assert (after.size, after.mode) == (5, 0o644)
    assert (await sandbox.exec(["stat", "-c", "%i", path])).stdout == inode  # the same file, written in place
    await sandbox.files.write(path, b"", in_place=True)
    assert await sandbox.files.read(path) == b""


async def test_an_in_place_write_refuses_directories_and_fifos_without_waiting(sandbox):
    await sandbox.exec("mkdir -p /workspace/q/dir && mkfifo /workspace/q/fifo")
    with pytest.raises(InvalidRequestError, match="directory"):
        await sandbox.files.write("/workspace/q/dir", b"x", in_place=True)
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        await sandbox.files.write("/workspace/q/fifo", b"x", in_place=True)


async def test_a_failed_in_place_write_reports_disk_full(engine):
    async with await engine.create(spec(disk="32M")) as sb:
        await sb.files.write("/workspace/old", b"kept until rewritten")
        big = os.urandom(64 * 2**20)
        with pytest.raises(DiskFullError, match="disk limit"):
            await sb.files.write("/workspace/new", big, in_place=True)
        assert not await sb.files.exists("/workspace/new")  # a file the failed write made goes again
        with pytest.raises(DiskFullError):
            await sb.files.write("/workspace/old", big, in_place=True)
        size = (await sb.files.stat("/workspace/old")).size  # in place: what was written stays
        assert 0 < size < len(big)
        await sb.files.remove("/workspace/old")
        assert await sb.files.write("/workspace/after", b"room again", in_place=True) == 10


# -- metadata -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [False, True])
async def test_metadata_round_trips_and_each_write_replaces_it(sandbox, in_place):
    path = f"/workspace/m/{in_place}.txt"
    meta = {"author": "mish", "purpose": "upload"}
    await sandbox.files.write(path, b"one", metadata=meta, in_place=in_place)
    assert (await sandbox.files.stat(path)).metadata == meta
    assert [e.metadata for e in await sandbox.files.list("/workspace/m") if e.path == path] == [meta]
    r = await sandbox.exec(["python3", "-c", f"import os; print(os.getxattr({path!r}, 'user.e2b.author'))"])
    assert r.stdout.strip() == "b'mish'"  # stored as the sandbox's own tools see it
    await sandbox.files.write(path, b"two", metadata={"stage": "2"}, in_place=in_place)
    assert (await sandbox.files.stat(path)).metadata == {"stage": "2"}
    await sandbox.files.write(path, b"three", in_place=in_place)
    assert (await sandbox.files.stat(path)).metadata == {}
    assert await sandbox.files.read(path) == b"three"


async def test_metadata_set_inside_the_sandbox_is_read_and_foreign_attributes_are_not(sandbox):
    await sandbox.files.write("/workspace/x.txt", b"x")
    code = ("import os; p = '/workspace/x.txt'; os.setxattr(p, 'user.e2b.tag', b'v'); "
            "os.setxattr(p, 'user.other', b'o'); os.setxattr(p, 'user.e2b.binary', b'\\xff')")
    assert (await sandbox.exec(["python3", "-c", code])).exit_code == 0
    assert (await sandbox.files.stat("/workspace/x.txt")).metadata == {"tag": "v"}  # not UTF-8: skipped


@pytest.mark.parametrize("metadata", [
    {"": "v"}, {"bad\nkey": "v"}, {"key": "bad\nvalue"}, {"key": "value\n"}, {"key": "café"}, {"k\x7f": "v"},
    {"k" * 247: "v"}, {f"k{i}": "v" * 100 for i in range(40)}, {"key": 1}, ["not", "a", "dict"],
])
@pytest.mark.parametrize("in_place", [False, True])
async def test_invalid_metadata_is_refused_and_writes_nothing(sandbox, metadata, in_place):
    await sandbox.files.write("/workspace/kept.txt", b"original")
    for path in ("/workspace/kept.txt", "/workspace/never.txt"):
        with pytest.raises(InvalidRequestError, match="metadata"):
            await sandbox.files.write(path, b"new", metadata=metadata, in_place=in_place)
    assert await sandbox.files.read("/workspace/kept.txt") == b"original"
    assert not await sandbox.files.exists("/workspace/never.txt")


async def test_metadata_at_its_limits(sandbox):
    longest_key = {"k" * 246: "v"}  # user.e2b. + 246 = 255 bytes, the kernel's limit on a name
    await sandbox.files.write("/workspace/a", b"a", metadata=longest_key, in_place=True)
    assert (await sandbox.files.stat("/workspace/a")).metadata == longest_key
    full = {"key": "v" * (4096 - len("user.e2b.key"))}  # exactly 4096 bytes: the rule allows it, and tmpfs keeps it
    await sandbox.files.write("/tmp/b", b"b", metadata=full)
    assert (await sandbox.files.stat("/tmp/b")).metadata == full
    # ext4 keeps a little less per file (~4 KB with its headers): a clear refusal, not "disk full"; nothing written.
    for in_place in (False, True):
        with pytest.raises(InvalidRequestError, match="does not fit"):
            await sandbox.files.write("/workspace/b", b"b", metadata=full, in_place=in_place)
        assert not await sandbox.files.exists("/workspace/b")
    almost = {"key": "v" * 4000}
    await sandbox.files.write("/workspace/b", b"b", metadata=almost, in_place=True)
    assert (await sandbox.files.stat("/workspace/b")).metadata == almost


def test_metadata_on_a_file_system_without_user_attributes_is_a_clear_refusal() -> None:
    # procfs keeps no user.* attributes (tmpfs before Linux 6.6 neither): called in this process, on a file of it.
    fd = os.open("/proc/self/comm", os.O_RDONLY)
    try:
        with pytest.raises(FileError) as refused:
            replace_metadata(fd, {"author": "x"}, "/proc/self/comm")
        assert refused.value.code == "invalid_request" and "does not keep file metadata" in refused.value.message
        replace_metadata(fd, {}, "/proc/self/comm")  # nothing to keep: nothing to refuse
    finally:
        os.close(fd)


# -- moves ----------------------------------------------------------------------------------------------------------


async def test_a_move_with_parents_makes_them_and_answers_with_the_entry(sandbox):
    await sandbox.files.write("/workspace/mv/a.txt", b"a", metadata={"stage": "renamed"})
    moved = await sandbox.files.rename("/workspace/mv/a.txt", "/workspace/mv/new/deeper/b.txt", parents=True)
    assert (moved.path, moved.name, moved.size, moved.metadata) == ("/workspace/mv/new/deeper/b.txt", "b.txt", 1,
                                                                    {"stage": "renamed"})
    assert await sandbox.files.read("/workspace/mv/new/deeper/b.txt") == b"a"
    with pytest.raises(NotFoundError):  # without `parents`, as before
        await sandbox.files.rename("/workspace/mv/new/deeper/b.txt", "/workspace/mv/other/b.txt")
    with pytest.raises(NotFoundError):  # a missing source makes nothing
        await sandbox.files.rename("/workspace/mv/ghost", "/workspace/mv/never/made/x", parents=True)
    assert not await sandbox.files.exists("/workspace/mv/never")


async def test_a_move_overwrites_a_file_only_when_asked(sandbox):
    await sandbox.files.write("/workspace/o/a", b"new")
    await sandbox.files.write("/workspace/o/b", b"old")
    with pytest.raises(ConflictError):
        await sandbox.files.rename("/workspace/o/a", "/workspace/o/b", parents=True)
    entry = await sandbox.files.rename("/workspace/o/a", "/workspace/o/b", overwrite=True, parents=True)
    assert entry.size == 3 and await sandbox.files.read("/workspace/o/b") == b"new"


# -- the root "/" (E2B's sandboxes) ---------------------------------------------------------------------------------


async def test_with_root_slash_system_files_and_proc_can_be_read_stated_and_listed(engine, sandbox):
    files = engine.get(sandbox.id).files_for(roots=["/"])
    boot_id = await files.read("/proc/sys/kernel/random/boot_id")
    # The sandbox's own boot id (corral.backends._boot_id): a file of its own, not the kernel's (stat size 0).
    assert len(boot_id.strip()) == 36 and (await files.stat("/proc/sys/kernel/random/boot_id")).size == len(boot_id)
    assert b"user:x:1000:1000" in await files.read("/etc/passwd")
    assert "passwd" in [e.name for e in await files.list("/etc")]
    for leaky in ("/proc", "/proc/self/environ", "/proc/1/cmdline", "/proc/self/mem"):  # the agent's own
        with pytest.raises(PermissionDeniedError, match="never touches"):
            await files.read(leaky) if leaky != "/proc" else await files.list(leaky)
    top = {e.name: e.path for e in await files.list("/")}
    assert top["etc"] == "/etc" and top["home"] == "/home"
    shown = (await sandbox.exec(["stat", "-c", "%U %G %A", "/etc/passwd"])).stdout.split()
    passwd = await files.stat("/etc/passwd")
    assert [passwd.owner, passwd.group, passwd.permissions] == shown
    await files.write("/home/user/e2b.txt", b"home", in_place=True)
    assert await sandbox.files.read("/home/user/e2b.txt") == b"home"
    with pytest.raises(PermissionDeniedError):  # the default roots still keep /proc out
        await engine.get(sandbox.id).files_for(roots=list(DEFAULT_FILE_ROOTS)).read("/proc/sys/kernel/random/boot_id")


async def test_with_root_slash_kernel_interfaces_and_corrals_directory_are_never_changed(engine, sandbox):
    files = engine.get(sandbox.id).files_for(roots=["/"])
    hostname = await files.read("/proc/sys/kernel/hostname")
    await sandbox.exec("ln -s /proc/1/comm /home/user/comm && mkdir /home/user/d")
    refused = [
        files.write("/proc/sys/kernel/hostname", b"pwned", in_place=True),
        files.write("/home/user/comm", b"pwned", in_place=True),  # through a link
        files.write("/sys/kernel/x", b"x"),
        files.make_dir("/proc/new"),
        files.remove("/.corral/run"),
        files.rename("/home/user/d", "/.corral/run/d"),
        files.upload_tar("/proc", b""),
    ]
    for call in refused:
        with pytest.raises(PermissionDeniedError, match=r"never changes|never touches"):
            await call
    assert await files.read("/proc/sys/kernel/hostname") == hostname
