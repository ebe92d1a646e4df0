"""What a sandbox's mount table says about the host: no paths of Corral's state (backends/local/_disk.py).

overlayfs shows its options as given, so a root mounted with `lowerdir=/var/lib/corral/templates/.../rootfs`
tells sandbox code where the templates and every sandbox's disk live on the host.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from corral.backends.local import LocalRecord
from corral.backends.local._backend import EGRESS_TMPFS_SIZE
from corral.backends.local._disk import is_mounted
from corral.engine import Engine, SandboxSession

from .conftest import TEMPLATE, TEMPLATE_HOME, TEST_HOME

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


def _host_paths(engine: Engine) -> list[str]:
    rootfs = str(engine.templates.get(TEMPLATE).rootfs)
    return sorted({str(TEST_HOME), str(TEMPLATE_HOME), rootfs, "/sandboxes/sb-", "/templates/"})


async def _read(sandbox: SandboxSession, path: str) -> str:
    r = await sandbox.exec(["cat", path])
    assert r.exit_code == 0, r.stderr
    return str(r.stdout)


async def test_proc_mounts_names_no_host_state_path(engine, sandbox):
    mounts = await _read(sandbox, "/proc/mounts")
    [root] = [line for line in mounts.splitlines() if line.split()[1] == "/"]
    assert root.split()[2] == "overlay"
    for path in _host_paths(engine):
        assert path not in mounts, f"/proc/mounts shows the host path {path!r}:\n{mounts}"
    layers = dict(re.findall(r"\b(lowerdir|upperdir|workdir)=([^,\s]+)", root))
    assert sorted(layers) == ["lowerdir", "upperdir", "workdir"]
    assert all(value.startswith("/proc/self/fd/") for value in layers.values()), root


async def test_the_roots_mountinfo_line_names_no_host_state_path(engine, sandbox):
    info = await _read(sandbox, "/proc/self/mountinfo")
    [root] = [line for line in info.splitlines() if line.split()[4] == "/"]
    for path in _host_paths(engine):
        assert path not in root, f"mountinfo's root line shows the host path {path!r}: {root}"


async def test_mountinfo_names_no_host_state_path(engine, sandbox):
    # Bind mounts would show their source's path inside its filesystem in the "root" field: /.corral/agent and
    # /.corral/egress are filesystems of their own (a read-only overlay, a tmpfs), so they show `/`.
    info = await _read(sandbox, "/proc/self/mountinfo")
    leaks = [line for line in info.splitlines() if any(p in line for p in _host_paths(engine))]
    assert leaks == []
    roots = {fields[4]: fields[3] for fields in (line.split() for line in info.splitlines())}
    assert roots["/.corral/agent"] == "/" and roots["/.corral/egress"] == "/"


async def test_agent_and_egress_mounts_on_the_host(engine, sandbox):
    """The egress socket's directory is a capped tmpfs only the sandbox user enters; the agent's files are
    read-only; both go with the sandbox."""
    record = engine.runtime.sandboxes[sandbox.id].record
    assert isinstance(record, LocalRecord)
    egress, agent = record.dir / "egress", record.dir / "agent"
    assert Path(engine.backend.egress_endpoint(record).path).parent == egress
    info = Path("/proc/self/mountinfo").read_text()
    mounts = {fields[4]: fields for fields in (line.split() for line in info.splitlines())}
    egress_mount, agent_mount = mounts[str(egress)], mounts[str(agent)]
    size = f"size={EGRESS_TMPFS_SIZE // 1024}k"  # room for a secrets sandbox's trust bundle (docs/secrets.md)
    assert egress_mount[egress_mount.index("-") + 1] == "tmpfs" and size in egress_mount[-1].split(","), egress_mount
    st = egress.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, record.uid_base + 1000,
                                                                record.uid_base + 1000)
    assert agent_mount[agent_mount.index("-") + 1] == "overlay" and "ro" in agent_mount[5].split(",")
    r = await sandbox.exec("test -r /.corral/agent/server.py && touch /.corral/agent/x")
    assert r.exit_code != 0 and "Read-only" in r.stderr, r
    await sandbox.destroy()
    assert not is_mounted(egress) and not is_mounted(agent)
