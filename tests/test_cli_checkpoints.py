"""`corral sandbox checkpoint|checkpoints|changes|restore|delete-checkpoint` and `create --checkpoints auto` as a
user runs them (docs/lifecycle.md, "Checkpoints"): the CLI in-process through typer's runner against the whole
server over the fake engine (its backend's checkpoints copy the fake sandbox's files; tests/live_front.py's
`threaded_front`), so what is checked is the CLI's and the API's own: output, --json, errors, roles; and one
destructive command undone on a real `corral serve` with runc sandboxes (marked `runc`)."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator

import pytest

from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME, TEST_HOME
from .live_front import LiveFront, threaded_front
from .test_cli import Cli, one_error_line


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFront]:
    with threaded_front(tmp_path_factory.mktemp("cli-checkpoints")) as front:
        yield front


@pytest.fixture(scope="module")
def dev(server: LiveFront) -> Cli:
    return Cli(server.url, server.keys["a_dev"])


@pytest.fixture
def sandbox(dev: Cli) -> Iterator[str]:
    sid = dev.ok("sandbox", "create", "--template", TEMPLATE, "--timeout", "300").decode().strip()
    yield sid
    dev.run("sandbox", "kill", sid)


def _read(dev: Cli, sid: str, path: str) -> bytes:
    return dev.ok("cp", f"{sid}:{path}", "-")


def test_checkpoint_changes_restore_and_delete(dev: Cli, sandbox: str) -> None:
    dev.ok("cp", "-", f"{sandbox}:/workspace/notes.txt", stdin=b"one\ntwo\n")
    ckpt = dev.ok("sandbox", "checkpoint", sandbox, "--name", "good").decode().strip()
    assert ckpt.startswith("ckpt-")
    dev.ok("cp", "-", f"{sandbox}:/workspace/notes.txt", stdin=b"one\nTWO\n")
    dev.ok("cp", "-", f"{sandbox}:/workspace/junk.txt", stdin=b"junk\n")

    table = dev.ok("sandbox", "checkpoints", sandbox).decode()
    assert ckpt in table and "good" in table and "manual" in table
    listed = json.loads(dev.ok("sandbox", "checkpoints", sandbox, "--json"))
    assert [(c["id"], c["name"], c["automatic"], c["sandbox_id"]) for c in listed] == [(ckpt, "good", False,
                                                                                         sandbox)]

    changed = dev.ok("sandbox", "changes", sandbox, "--since", "good").decode()
    assert "modified" in changed and "/workspace/notes.txt" in changed, changed
    assert "added" in changed and "/workspace/junk.txt" in changed
    assert "+TWO" not in changed  # diffs only with --diff
    diffed = dev.ok("sandbox", "changes", sandbox, "--since", ckpt, "--diff").decode()
    assert "-two" in diffed and "+TWO" in diffed, diffed
    found = json.loads(dev.ok("sandbox", "changes", sandbox, "--since", "good", "--json"))
    kinds = {c["path"]: c["kind"] for c in found["changes"]}
    assert kinds == {"/workspace/notes.txt": "modified", "/workspace/junk.txt": "added"}, found
    assert found["until"] is None and found["truncated"] is False

    out = dev.ok("sandbox", "restore", sandbox, "good").decode()
    assert out.startswith(f"restored {sandbox} to {ckpt} (every file)"), out
    assert _read(dev, sandbox, "/workspace/notes.txt") == b"one\ntwo\n"
    one_error_line(dev.run("cp", f"{sandbox}:/workspace/junk.txt", "-"), "not_found")
    after = json.loads(dev.ok("sandbox", "changes", sandbox, "--since", "good", "--json"))["changes"]
    assert [c for c in after if c["path"].startswith("/workspace/")] == []  # (a boot may touch /etc/passwd)

    assert dev.ok("sandbox", "delete-checkpoint", sandbox, "good").decode().strip() == "good"
    assert json.loads(dev.ok("sandbox", "checkpoints", sandbox, "--json")) == []
    one_error_line(dev.run("sandbox", "restore", sandbox, "good"), "not_found")


def test_restore_of_some_paths_as_json(dev: Cli, sandbox: str) -> None:
    for name in ("a.txt", "b.txt"):
        dev.ok("cp", "-", f"{sandbox}:/workspace/{name}", stdin=b"old\n")
    made = json.loads(dev.ok("sandbox", "checkpoint", sandbox, "--json"))
    assert made["name"] is None and made["automatic"] is False and made["size"] >= 0
    for name in ("a.txt", "b.txt"):
        dev.ok("cp", "-", f"{sandbox}:/workspace/{name}", stdin=b"new\n")
    done = json.loads(dev.ok("sandbox", "restore", sandbox, made["id"], "--path", "/workspace/a.txt", "--json"))
    assert done["paths"] == ["/workspace/a.txt"] and done["checkpoint"]["id"] == made["id"]
    assert set(done["stopped"]) == {"processes", "code_contexts", "terminals"}
    assert _read(dev, sandbox, "/workspace/a.txt") == b"old\n"
    assert _read(dev, sandbox, "/workspace/b.txt") == b"new\n"
    one_error_line(dev.run("sandbox", "restore", sandbox, made["id"], "--path", "workspace"), "invalid_request")


def test_create_with_automatic_checkpoints(dev: Cli) -> None:
    info = json.loads(dev.ok("sandbox", "create", "--template", TEMPLATE, "--checkpoints", "auto", "--json"))
    sid = info["id"]
    try:
        dev.ok("cp", "-", f"{sid}:/workspace/data.csv", stdin=b"x,y\n")
        (auto,) = json.loads(dev.ok("sandbox", "checkpoints", sid, "--json"))
        assert auto["automatic"] is True and "/workspace/data.csv" in auto["command"], auto
        table = dev.ok("sandbox", "checkpoints", sid).decode()
        assert "auto" in table and "/workspace/data.csv" in table
        changed = json.loads(dev.ok("sandbox", "changes", sid, "--since", auto["id"], "--json"))
        assert [(c["path"], c["kind"]) for c in changed["changes"]] == [("/workspace/data.csv", "added")]
        ran = dev.run("exec", sid, "--", "rm", "/workspace/data.csv")
        assert ran.returncode == 0 and ran.stdout == b""  # stdout stays the command's
        newest = json.loads(dev.ok("sandbox", "checkpoints", sid, "--json"))[0]
        assert newest["command"] == "rm /workspace/data.csv"
        assert ran.stderr.decode() == (f"corral: checkpoint {newest['id']} was taken before this command (undo it: "
                                       f"corral sandbox restore {sid} {newest['id']})\n")
    finally:
        dev.run("sandbox", "kill", sid)
    one_error_line(dev.run("sandbox", "create", "--template", TEMPLATE, "--checkpoints", "always"),
                   "invalid_request")


def test_an_auditor_lists_but_cannot_restore(server: LiveFront, dev: Cli, sandbox: str) -> None:
    ckpt = dev.ok("sandbox", "checkpoint", sandbox).decode().strip()
    auditor = Cli(server.url, server.keys["a_aud"])
    # an auditor reads the checkpoints and their changes (not the sandbox itself), and may not change them
    assert [c["id"] for c in json.loads(auditor.ok("sandbox", "checkpoints", sandbox, "--json"))] == [ckpt]
    assert b"no changes" in auditor.ok("sandbox", "changes", sandbox, "--since", ckpt)
    one_error_line(auditor.run("sandbox", "restore", sandbox, ckpt), "permission_denied")
    one_error_line(auditor.run("sandbox", "delete-checkpoint", sandbox, ckpt), "permission_denied")
    one_error_line(auditor.run("sandbox", "checkpoint", sandbox), "permission_denied")
    other = Cli(server.url, server.keys["b_dev"])
    one_error_line(other.run("sandbox", "checkpoints", sandbox), "not_found")
    one_error_line(other.run("sandbox", "restore", sandbox, ckpt), "not_found")
    assert [c["id"] for c in json.loads(dev.ok("sandbox", "checkpoints", sandbox, "--json"))] == [ckpt]


# -- on real runc sandboxes --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_dev() -> Iterator[Cli]:
    """A developer on a real `corral serve` (runc sandboxes), made with the CLI itself."""
    TEST_HOME.mkdir(parents=True, exist_ok=True)
    home = TEST_HOME / f"cli-ckpt-{uuid.uuid4().hex[:8]}"  # not pytest's tmp_path: 0700, sandboxes cannot reach it
    with ServerProcess(home, template_home=TEMPLATE_HOME) as srv:
        yield Cli(srv.url, srv.admin_key).developer("undo")
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.runc
@pytest.mark.slow
@pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs")
def test_a_destructive_command_undone_on_runc(real_dev: Cli) -> None:
    sid = real_dev.ok("sandbox", "create", "--template", TEMPLATE, "--checkpoints", "auto").decode().strip()
    try:
        setup = ("mkdir -p proj/src && seq 1 20000 > proj/src/data.txt && chmod 640 proj/src/data.txt && "
                 "ln -s src/data.txt proj/link")
        real_dev.ok("exec", sid, "--", "sh", "-c", setup)
        probe = ("sh", "-c", "cd proj && sha256sum src/data.txt && stat -c %a src/data.txt && readlink link")
        before = real_dev.ok("exec", sid, "--", *probe)
        real_dev.ok("exec", sid, "--", "rm", "-rf", "proj")
        listed = json.loads(real_dev.ok("sandbox", "checkpoints", sid, "--json"))
        (before_rm,) = [c for c in listed if c["command"] == "rm -rf proj"]
        changed = real_dev.ok("sandbox", "changes", sid, "--since", before_rm["id"]).decode()
        assert "deleted" in changed and "/workspace/proj" in changed, changed
        out = real_dev.ok("sandbox", "restore", sid, before_rm["id"]).decode()
        assert out.startswith(f"restored {sid} to {before_rm['id']} (every file)"), out
        assert real_dev.ok("exec", sid, "--", *probe) == before  # bytes, mode and symlink, in the same sandbox
    finally:
        real_dev.run("sandbox", "kill", sid)
