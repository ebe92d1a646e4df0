"""The `corral` CLI as a user runs it: a real subprocess against a real `corral serve` (one per module, on a
home under /var/tmp whose templates are the built store), with the key and URL in the environment. The control
plane's own behaviour (tenants, keys, quotas, listing, audit, the admin SDK) is in tests/test_cli_admin.py, on the
fake engine."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral.cli import app
from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME, TEST_HOME

pytestmark = [
    pytest.mark.runc,
    pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs"),
]

CORRAL = str(Path(sys.executable).parent / "corral")
MIB = 2**20


@dataclass
class Cli:
    """Runs `corral` against one server, as one API key: in-process through typer's runner by default (a CLI
    start costs seconds of imports on a busy 2-CPU machine), as a real subprocess with `real=True` (streaming,
    signals, what `main()` adds)."""

    url: str
    key: str

    def env(self, key: str | None = None) -> dict[str, str | None]:
        unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CORRAL_")}
        return {**unset, "CORRAL_URL": self.url, "CORRAL_API_KEY": key or self.key}

    def run(self, *args: str, stdin: bytes | None = None, key: str | None = None,
            real: bool = False) -> subprocess.CompletedProcess[bytes]:
        if real:
            env = {k: v for k, v in {**os.environ, **self.env(key)}.items() if v is not None}
            return subprocess.run([CORRAL, *args], env=env, input=stdin, capture_output=True, timeout=120,
                                  stdin=None if stdin is not None else subprocess.DEVNULL)
        r = CliRunner().invoke(app, list(args), input=stdin or b"", env=self.env(key))
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception  # a bug, not a CLI outcome: show its traceback
        return subprocess.CompletedProcess(list(args), r.exit_code, r.stdout_bytes, r.stderr_bytes)

    def ok(self, *args: str, stdin: bytes | None = None) -> bytes:
        r = self.run(*args, stdin=stdin)
        assert r.returncode == 0, (args, r.returncode, r.stderr.decode(errors="replace"))
        return r.stdout

    def developer(self, tenant: str) -> Cli:
        """A developer of a new `tenant`, made with the CLI itself (this one an admin)."""
        self.ok("tenants", "create", tenant)
        out = self.ok("keys", "create", "--tenant", tenant, "--role", "developer")
        return Cli(self.url, out.decode().splitlines()[-1])

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in {**os.environ, **self.env()}.items() if v is not None}
        # Ctrl-C must work in the child even when this suite runs as a background job, whose children inherit
        # SIGINT ignored (and Python then never installs its KeyboardInterrupt handler).
        return subprocess.Popen([CORRAL, *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    TEST_HOME.mkdir(parents=True, exist_ok=True)
    home = TEST_HOME / f"cli-{uuid.uuid4().hex[:8]}"  # not pytest's tmp_path: 0700, sandboxes cannot reach it
    with ServerProcess(home, template_home=TEMPLATE_HOME) as srv:
        yield srv
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def admin(server: ServerProcess) -> Cli:
    return Cli(server.url, server.admin_key)


@pytest.fixture(scope="module")
def dev(admin: Cli) -> Cli:
    """A developer of tenant `cli`, made with the CLI itself."""
    return admin.developer("cli")


@pytest.fixture(scope="module")
def sandbox(dev: Cli) -> Iterator[str]:
    sid = dev.ok("sandbox", "create", "--template", TEMPLATE, "--memory", "512M").decode().strip()
    yield sid
    dev.run("sandbox", "kill", sid)


def one_error_line(r: subprocess.CompletedProcess[bytes], code: str) -> str:
    """The CLI's error contract: exit 1, one line `error: <code>: ...` on stderr, no traceback."""
    err = r.stderr.decode()
    assert r.returncode == 1, (r.returncode, err)
    assert err.startswith(f"error: {code}: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- tenants and keys ---------------------------------------------------------------------------------------------


# -- sandboxes ----------------------------------------------------------------------------------------------------


def test_pause_to_disk_resume_snapshot_fork_and_snapshot_ls_rm(dev: Cli) -> None:
    sid = dev.ok("sandbox", "create", "--template", TEMPLATE, "--timeout", "300", "--on-timeout", "pause"
                 ).decode().strip()
    dev.ok("exec", sid, "--", "sh", "-c", "echo cli-state > /workspace/s.txt")
    assert dev.ok("sandbox", "pause", sid, "--to-disk").decode().strip() == f"{sid} paused (to disk)"
    listed = {s["id"]: s for s in json.loads(dev.ok("sandbox", "ls", "--json"))}
    assert listed[sid]["state"] == "paused" and listed[sid]["paused_to_disk"] and listed[sid]["on_timeout"] == "pause"
    assert dev.ok("sandbox", "resume", sid).decode().strip() == f"{sid} running"
    snap = dev.ok("sandbox", "snapshot", sid, "--name", "cli-snap").decode().strip()
    assert snap.startswith("snap-")
    shown = json.loads(dev.ok("snapshot", "ls", "--json"))
    assert [(s["id"], s["name"], s["sandbox_id"]) for s in shown] == [(snap, "cli-snap", sid)]
    child = dev.ok("sandbox", "create", "--template", snap, "--timeout", "120").decode().strip()
    forked = dev.ok("sandbox", "fork", sid).decode().strip()
    twins = dev.ok("sandbox", "fork", sid, "--count", "2").decode().split()
    assert len(twins) == 2 and forked not in twins
    for other in (child, forked):
        assert dev.ok("exec", other, "--", "cat", "/workspace/s.txt") == b"cli-state\n"
    assert dev.ok("snapshot", "rm", "cli-snap").decode().strip() == "cli-snap"
    assert json.loads(dev.ok("snapshot", "ls", "--json")) == []
    r = dev.run("snapshot", "rm", "cli-snap")
    assert r.returncode == 1 and one_error_line(r, "not_found")
    dev.ok("sandbox", "kill", sid, child, forked, *twins)


def test_network_policy_at_create_and_live_and_the_refusal_notice(dev: Cli) -> None:
    info = json.loads(dev.ok("sandbox", "create", "--template", TEMPLATE, "--network", "example.org,@packages",
                             "--timeout", "120", "--json"))
    sid = info["id"]
    assert info["network"] == ["example.org", "@packages"]
    r = dev.run("exec", sid, "--", "curl", "-sS", "--max-time", "20", "https://pypi.org/", real=True)
    assert r.returncode != 0
    assert b"corral: Corral egress denied: pypi.org is not in this sandbox's allowlist" in r.stderr, r.stderr
    assert dev.ok("sandbox", "network", sid, "none").strip() == b"none"
    dev.ok("sandbox", "kill", sid)


def test_run_code_prints_results_saves_images_and_exits_1_on_an_exception(dev: Cli, sandbox: str,
                                                                         tmp_path: Path) -> None:
    assert dev.ok("run-code", sandbox, "x = 40\nx + 2").strip().splitlines()[-1] == b"42"
    plot = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nprint('plotted')"
    out = dev.ok("run-code", sandbox, plot, "--save-dir", str(tmp_path))
    assert b"plotted" in out
    pngs = list(tmp_path.glob("*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    r = dev.run("run-code", sandbox, "1 / 0", real=True)
    assert r.returncode == 1 and b"ZeroDivisionError" in r.stderr, r.stderr
    assert dev.ok("run-code", sandbox, "x").strip().splitlines()[-1] == b"40"  # the session kept its state


# -- exec ---------------------------------------------------------------------------------------------------------


def test_exec_exit_codes_and_exact_bytes(dev: Cli, sandbox: str) -> None:
    r = dev.run("exec", sandbox, r"printf 'a\x00b\xff\n'; printf '\xfe\x00' >&2; exit 3", real=True)
    assert (r.returncode, r.stdout, r.stderr) == (3, b"a\x00b\xff\n", b"\xfe\x00")
    r = dev.run("exec", sandbox, "--", "python3", "-c", "import sys; sys.stdout.buffer.write(bytes(range(256)))",
                real=True)
    assert (r.returncode, r.stdout) == (0, bytes(range(256)))
    r = dev.run("exec", sandbox, "cat; exit 0", stdin=b"in\x00put\xff", real=True)
    assert (r.returncode, r.stdout) == (0, b"in\x00put\xff")
    r = dev.run("exec", "--timeout", "0.5", sandbox, "sleep 30", real=True)
    assert r.returncode == 124 and b"timed out" in r.stderr
    r = dev.run("exec", sandbox, "--", "sh", "-c", "kill -9 $$", real=True)
    assert r.returncode == 128 + signal.SIGKILL


def test_exec_streams_output_live(dev: Cli, sandbox: str) -> None:
    proc = dev.popen("exec", sandbox, "echo first; sleep 3; echo second")
    assert proc.stdout is not None
    first = proc.stdout.readline()
    first_at = time.monotonic()
    rest, _ = proc.communicate(timeout=60)
    ahead = time.monotonic() - first_at
    assert first == b"first\n" and rest == b"second\n" and proc.returncode == 0
    assert ahead > 1.5, f"the first line came only {ahead:.1f}s before the end: output is not streamed"


# -- cp -----------------------------------------------------------------------------------------------------------


def test_cp_files_both_ways(dev: Cli, sandbox: str, tmp_path: Path) -> None:
    small = tmp_path / "small.bin"
    small.write_bytes(b"\x00" * 7 + b"a\x00b\xff" + b"\x00")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(5 * MIB + 3) + b"\x00" * 100)
    dev.ok("cp", str(small), f"{sandbox}:/workspace/small.bin")
    dev.ok("exec", sandbox, "mkdir -p /workspace/in")
    dev.ok("cp", str(big), f"{sandbox}:in")  # into an existing directory: in/big.bin
    digest = dev.ok("exec", sandbox, "sha256sum < /workspace/in/big.bin").split()[0].decode()
    assert digest == hashlib.sha256(big.read_bytes()).hexdigest()

    back = tmp_path / "back"
    back.mkdir()
    dev.ok("cp", f"{sandbox}:/workspace/small.bin", str(back / "small.copy"))
    dev.ok("cp", f"{sandbox}:in/big.bin", str(back))  # into an existing local directory
    assert (back / "small.copy").read_bytes() == small.read_bytes()
    assert (back / "big.bin").read_bytes() == big.read_bytes()

    dev.ok("cp", "-", f"{sandbox}:/workspace/from-stdin", stdin=b"\x00\xffpiped")
    assert dev.ok("cp", f"{sandbox}:/workspace/from-stdin", "-") == b"\x00\xffpiped"


def _tree(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = path.read_bytes()
    return out


def test_cp_directories_both_ways(dev: Cli, sandbox: str, tmp_path: Path) -> None:
    src = tmp_path / "project"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "empty-dir").mkdir()
    (src / "pkg" / "data.bin").write_bytes(os.urandom(2 * MIB) + b"\x00")
    (src / "pkg" / "deep" / "empty").write_bytes(b"")
    (src / "pkg" / "run.sh").write_bytes(b"#!/bin/sh\necho ran\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    (src / "link").symlink_to("pkg/run.sh")

    dev.ok("cp", str(src), f"{sandbox}:/workspace/proj")  # a new path: the directory becomes it
    assert dev.ok("exec", sandbox, "/workspace/proj/link") == b"ran\n"
    dev.ok("exec", sandbox, "mkdir -p /workspace/dest")
    dev.ok("cp", str(src), f"{sandbox}:/workspace/dest")  # an existing directory: it lands inside
    assert dev.ok("exec", sandbox, "cmp /workspace/proj/pkg/data.bin /workspace/dest/project/pkg/data.bin") == b""

    new = tmp_path / "copy"
    dev.ok("cp", f"{sandbox}:/workspace/proj", str(new))
    assert _tree(new) == _tree(src)
    assert os.access(new / "pkg" / "run.sh", os.X_OK)
    inside = tmp_path / "existing"
    inside.mkdir()
    dev.ok("cp", f"{sandbox}:/workspace/proj", str(inside))
    assert _tree(inside / "proj") == _tree(src)


# -- audit --------------------------------------------------------------------------------------------------------


def _tamper(db: Path, seq: int, params: str) -> str:
    """Overwrite one record's params behind the server's back; return what was there."""
    con = sqlite3.connect(db, isolation_level=None)
    try:
        (before,) = con.execute("SELECT params FROM audit WHERE seq = ?", (seq,)).fetchone()
        con.execute("UPDATE audit SET params = ? WHERE seq = ?", (params, seq))
    finally:
        con.close()
    return str(before)


# -- errors -------------------------------------------------------------------------------------------------------


def test_errors_are_one_clear_line(dev: Cli, server: ServerProcess) -> None:
    # The installed command itself, once: main() and the root group print the same line.
    one_error_line(dev.run("sandbox", "ls", key="corral_" + "0" * 8 + "_" + "A" * 43, real=True), "unauthenticated")
    err = one_error_line(dev.run("exec", "sb-doesnotexist", "true", real=True), "not_found")
    assert "sb-doesnotexist" in err
    one_error_line(dev.run("sandbox", "kill", "sb-doesnotexist"), "not_found")
    one_error_line(dev.run("cp", "sb-doesnotexist:/workspace/x", "/tmp/never-written"), "not_found")
    one_error_line(dev.run("tenants", "create", "nope"), "permission_denied")
    one_error_line(dev.run("sandbox", "create", "--template", "no-such-template"), "invalid_request")
    one_error_line(dev.run("sandbox", "ls", "--url", "http://127.0.0.1:9"), "server_error")
    r = dev.run("cp", "a", "b", real=True)
    assert r.returncode == 2 and b"ID:PATH" in r.stderr and b"Traceback" not in r.stderr


def test_templates_ls_stays_local() -> None:
    env = {**os.environ, "CORRAL_HOME": str(TEMPLATE_HOME)}
    r = subprocess.run([CORRAL, "templates", "ls", "--json"], env=env, capture_output=True, timeout=60)
    assert r.returncode == 0 and TEMPLATE in [t["name"] for t in json.loads(r.stdout)]


def test_root_sandboxes_and_exec_as_root(dev: Cli, sandbox: str) -> None:
    info = json.loads(dev.ok("sandbox", "create", "--template", TEMPLATE, "--root", "--timeout", "120", "--json"))
    try:
        assert info["root"] is True
        assert dev.ok("exec", "--user", "root", info["id"], "--", "id", "-u") == b"0\n"
        assert dev.ok("exec", info["id"], "sudo id -u; id -u") == b"0\n1000\n"
    finally:
        dev.run("sandbox", "kill", info["id"])
    refused = one_error_line(dev.run("exec", "--user", "root", sandbox, "id"), "permission_denied")
    assert "root=True" in refused


# -- secrets (they need the egress proxy of a real backend) ------------------------------------------------------


def test_secret_put_ls_rm(admin: Cli, dev: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values go in on stdin or from a variable, never as an argument, and never come back out."""
    op = Cli(admin.url, admin.ok("keys", "create", "--tenant", "cli", "--role", "operator").decode().splitlines()[-1])
    assert op.ok("secret", "put", "gh", "--host", "api.github.com", stdin=b"tok-from-stdin\n").strip() == b"gh"
    monkeypatch.setenv("MY_TOKEN", "tok-from-env")
    assert op.ok("secret", "put", "npm", "--host", "registry.npmjs.org", "--body", "--from-env",
                 "MY_TOKEN").strip() == b"npm"
    listed = json.loads(dev.ok("secret", "ls", "--json"))
    assert [(s["name"], s["hosts"], s["body"]) for s in listed] == [("gh", ["api.github.com"], False),
                                                                    ("npm", ["registry.npmjs.org"], True)]
    assert b"tok-from" not in dev.ok("secret", "ls") + json.dumps(listed).encode()
    one_error_line(dev.run("secret", "put", "x", "--host", "a.example", stdin=b"v"), "permission_denied")
    one_error_line(op.run("secret", "put", "1bad", "--host", "a.example", stdin=b"v"), "invalid_request")
    op.ok("secret", "rm", "gh")
    op.ok("secret", "rm", "npm")
    one_error_line(op.run("secret", "rm", "gh"), "not_found")
    assert json.loads(dev.ok("secret", "ls", "--json")) == []
