"""The agent's code on the host: a private, stable copy of `corral/agent`, mounted read-only into every sandbox.

Made once per agent version (a digest of its files and of this interpreter's version) under
`<home>/agent/<digest>/agent`, with the static spawn helper compiled and the bytecode precompiled; beside it an
empty directory, `<home>/agent/<digest>/empty`, the second layer of the read-only overlay that the local backend
mounts per sandbox (`agent_layers`), so that the sandbox's mount table does not name this directory; and
`<home>/agent/<digest>/root-layer/`, a tiny filesystem layer with `/usr/local/bin/sudo` (the agent's `sudo`
client), which only sandboxes created with root get, as the top read-only layer of their root (`root_layer`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger("corral.backends.local")

AGENT_PACKAGE = Path(__file__).resolve().parents[2] / "agent"
# The `sudo` of root sandboxes: the agent's client (agent/sudo.py), run by the template's Python, isolated (-I)
# and without site (-S): it runs as whoever calls it and needs nothing but the agent's read-only files.
SUDO_SCRIPT = b"""#!/usr/bin/python3 -SIB
# Corral's sudo: asks the sandbox's agent to run the command as root (see /.corral/agent/sudo.py).
import sys; sys.path.insert(0, "/.corral"); from agent.sudo import main; main()
"""


def install_agent(home: Path) -> Path:
    """The directory holding this version of the agent, made if missing. Blocking (copies, a C compile):
    call it in a thread."""
    files = sorted([*AGENT_PACKAGE.glob("*.py"), AGENT_PACKAGE / "spawn.c"])
    content = b"".join(p.name.encode() + p.read_bytes() for p in files) + SUDO_SCRIPT
    # The bytecode made below belongs to this interpreter's version: part of the identity too.
    digest = hashlib.sha256(content + sys.version.encode()).hexdigest()[:16]
    dest = home / "agent" / digest / "agent"
    if not dest.exists():
        tmp = dest.parent / f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for p in files:
            shutil.copy2(p, tmp / p.name)
            os.chmod(tmp / p.name, 0o644)
        _build_spawn_shim(tmp)
        _precompile(tmp)
        _make_root_layer(tmp.parent / f".tmp-root-layer{os.getpid()}", dest.parent / "root-layer")
        os.chmod(tmp, 0o755)  # noqa: S103 - read-only code, readable by the sandbox user
        os.replace(tmp, dest)
    empty = dest.parent / "empty"
    empty.mkdir(mode=0o755, exist_ok=True)
    for parent in (home, home / "agent", dest.parent):
        os.chmod(parent, os.stat(parent).st_mode | 0o711)  # noqa: S103 - traverse only
    return dest


def agent_layers(agent_dir: Path) -> list[Path]:
    """The layers, top first, of a read-only overlay holding exactly the files of `agent_dir` (as made by
    `install_agent`): overlayfs without an upper layer wants two."""
    return [agent_dir, agent_dir.parent / "empty"]


def root_layer(agent_dir: Path) -> Path:
    """The read-only layer that root sandboxes get on top of their template: `/usr/local/bin/sudo`."""
    return agent_dir.parent / "root-layer"


def _make_root_layer(tmp: Path, dest: Path) -> None:
    """Host root's files, 0755: shown as the sandbox root's through the template's idmapped view."""
    if dest.exists():
        return
    shutil.rmtree(tmp, ignore_errors=True)
    bin_dir = tmp / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True)
    for path in (tmp, tmp / "usr", tmp / "usr" / "local", bin_dir):
        os.chmod(path, 0o755)  # noqa: S103 - the template's own modes for these directories
    (bin_dir / "sudo").write_bytes(SUDO_SCRIPT)
    os.chmod(bin_dir / "sudo", 0o755)  # noqa: S103 - every user of the sandbox runs it
    os.replace(tmp, dest)


def _build_spawn_shim(agent_dir: Path) -> None:
    """Compile the agent's static spawn helper (see agent/spawn.c); without a compiler the agent does without."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("agent.no_spawn_shim", extra={"reason": "no C compiler on the host; commands start slower"})
        return
    out = agent_dir / "corral-spawn"
    proc = subprocess.run([cc, "-static", "-Os", "-s", "-o", str(out), str(agent_dir / "spawn.c")],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        logger.warning("agent.no_spawn_shim", extra={"reason": proc.stderr.strip()[-500:]})
        out.unlink(missing_ok=True)
        return
    os.chmod(out, 0o755)  # noqa: S103 - the sandbox user executes it


def _precompile(agent_dir: Path) -> None:
    """Bytecode for the agent, made once here: the sandbox mounts it read-only, so the agent could never
    cache its own, and compiling it on every start costs every sandbox's start ~15 ms. Unchecked hashes:
    the files never change under a given digest. A template whose Python differs simply ignores them."""
    for source in agent_dir.glob("*.py"):
        py_compile.compile(str(source), cfile=importlib.util.cache_from_source(str(source)), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    for path in [agent_dir / "__pycache__", *agent_dir.glob("__pycache__/*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
