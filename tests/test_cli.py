"""The `corral` CLI, run as a real subprocess against a throwaway state directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME

CORRAL = str(Path(sys.executable).parent / "corral")


def corral(home: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "CORRAL_HOME": str(home)}
    if stdin is None:
        return subprocess.run([CORRAL, *args], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    return subprocess.run([CORRAL, *args], env=env, input=stdin, capture_output=True, timeout=120)


@pytest.fixture
def cli_home(test_home: Path, unique: str) -> Iterator[Path]:
    home = test_home / f"cli-{unique}"  # not under pytest's tmp_path: that is 0700, sandboxes cannot reach it
    home.mkdir()
    (home / "templates").symlink_to(TEMPLATE_HOME / "templates")
    yield home
    shutil.rmtree(home)


@pytest.mark.runc
@pytest.mark.skipif(bool(DEV_ROOTFS), reason="the CLI needs a built template store, not a bare rootfs")
def test_sandbox_commands(cli_home: Path):
    created = corral(cli_home, "sandbox", "create", "--template", TEMPLATE, "--memory", "256M", "--json")
    assert created.returncode == 0, created.stderr
    sid = json.loads(created.stdout)["id"]
    try:
        r = corral(cli_home, "sandbox", "exec", sid, "cat; printf '\\xff' >&2; exit 4", stdin=b"in\x00put")
        assert (r.returncode, r.stdout, r.stderr) == (4, b"in\x00put", b"\xff")
        listed = json.loads(corral(cli_home, "sandbox", "ls", "--json").stdout)
        assert [s["id"] for s in listed] == [sid]
        r = corral(cli_home, "sandbox", "exec", sid, "sleep 10", "--timeout", "0.5")
        assert r.returncode != 0 and b"timed out" in r.stderr
    finally:
        assert corral(cli_home, "sandbox", "kill", sid).returncode == 0
    assert json.loads(corral(cli_home, "sandbox", "ls", "--json").stdout) == []


def test_errors_are_one_clear_line(cli_home: Path):
    r = corral(cli_home, "sandbox", "kill", "sb-doesnotexist")
    assert r.returncode == 1 and r.stderr.decode().strip() == "error: no sandbox 'sb-doesnotexist'"
    r = corral(cli_home, "sandbox", "create", "--memory", "lots")
    assert r.returncode != 0 and b"not a size" in r.stderr


def test_templates_ls(cli_home: Path):
    r = corral(cli_home, "templates", "ls", "--json")
    assert r.returncode == 0
    if not DEV_ROOTFS:
        assert TEMPLATE in [t["name"] for t in json.loads(r.stdout)]


def test_unreachable_home_is_refused_with_the_fix(tmp_path: Path):
    home = tmp_path / "private"  # pytest's tmp_path sits under a 0700 directory
    home.mkdir()
    (home / "templates").symlink_to(TEMPLATE_HOME / "templates")
    r = corral(home, "sandbox", "create", "--template", TEMPLATE)
    assert r.returncode == 1 and b"not traversable by other users" in r.stderr and b"chmod o+x" in r.stderr
    assert not list((home / "sandboxes").iterdir())
