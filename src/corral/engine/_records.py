"""The backend's recovery record: one file per sandbox, `<home>/engine/<id>.json`, and /tmp saved across a pause.

A file holds only what the backend needs to find and adopt its sandbox after a restart: the backend's name, its
record (`Backend.restore`), and the environment its processes start with (the template build's and the spec's
values: the store keeps only the names of those, since they often carry secrets, so the values stay on the node
that runs the sandbox, in the engine's 0700 directory). What the sandbox is (its spec), what state it is in and
when it ends are the control store's (`SandboxRecord`): a restarted engine is told
them (`Adoption`, from the store's live records) and reattaches those sandboxes, and only those; the backend
sweeps the rest (`Runtime.recover`). The files are small and written whole (never torn); not durable (no fsync):
a machine crash takes the sandbox's processes with it, and a lost file means the sandbox is swept.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._atomic import write_json_atomic
from .._exceptions import CorralError, NotFoundError
from ..backends import AgentAddress, Backend, load_backend
from ._agent_client import Liveness
from ._models import SandboxSpec, SandboxState
from ._sandbox import LiveSandbox, agent_client, check_sandbox_id

logger = logging.getLogger("corral.engine")

STATE_DIR = "engine"  # under the home: one `<sandbox id>.json` per sandbox


@dataclass(frozen=True)
class Adoption:
    """What the store says of a sandbox a restarted engine should reattach: its spec, its state, since when."""

    spec: SandboxSpec
    state: SandboxState = SandboxState.RUNNING  # PAUSED: frozen in place, or (`paused_to_disk`) stopped
    paused_to_disk: bool = False
    created_at: float | None = None


def to_json(sb: LiveSandbox, backend: str) -> dict[str, Any]:
    return {"id": sb.id, "backend": backend, "record": sb.record.to_json(), "template_env": sb.template_env,
            "env": dict(sb.spec.env)}


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class StateFiles:
    """The state directory of one engine and backend."""

    def __init__(self, home: Path, backend: Backend, liveness: Liveness) -> None:
        self.dir = home / STATE_DIR
        self._backend = backend
        self._liveness = liveness

    def path(self, sandbox_id: str) -> Path:
        return self.dir / f"{sandbox_id}.json"

    def tmp_path(self, sandbox_id: str) -> Path:
        return self.dir / f"{sandbox_id}.tmp.tar"

    def save(self, sb: LiveSandbox) -> None:
        write_json_atomic(self.path(sb.id), to_json(sb, self._backend.name), durable=False)

    def forget(self, sandbox_id: str) -> None:
        self.path(sandbox_id).unlink(missing_ok=True)
        self.tmp_path(sandbox_id).unlink(missing_ok=True)

    def entries(self) -> list[tuple[Path, dict[str, Any] | None]]:
        """Every state file of this backend and what it holds (None: unreadable); another backend's are left be
        (this home served with another `--backend` before: not ours to sweep nor to forget)."""
        out = []
        for path in sorted(self.dir.glob("*.json")):  # inline: a few small files, once at start
            data = read_state(path)
            if data is None or data.get("backend") == self._backend.name:
                out.append((path, data))
            else:
                logger.warning("sandbox.other_backend", extra={"sandbox": path.stem, "backend": data.get("backend")})
        return out

    def load(self, data: dict[str, Any], adoption: Adoption) -> LiveSandbox | None:
        """The sandbox of a state file as the store describes it; None if the file does not name it."""
        try:
            sandbox_id = str(data["id"])
            check_sandbox_id(sandbox_id)
            record = self._backend.restore(data["record"])
            if record.sandbox_id != sandbox_id:
                return None
            return LiveSandbox(
                id=sandbox_id, spec=adoption.spec.model_copy(update={"env": dict(data.get("env", {}))}),
                record=record,
                agent=agent_client(sandbox_id, self._backend.agent_address(record), self._liveness),
                created_at=time.time() if adoption.created_at is None else adoption.created_at,
                state=adoption.state, template_env=dict(data.get("template_env", {})),
                paused_to_disk=adoption.paused_to_disk)
        except (ValueError, KeyError, TypeError, CorralError):
            return None

    def clean(self, stale: list[Path], known: set[str]) -> None:
        """Forget the stale files, the /tmp of sandboxes no longer known, and half-written files."""
        saved = [p for p in self.dir.glob("*.tmp.tar") if p.name.removesuffix(".tmp.tar") not in known]
        for path in [*stale, *saved, *self.dir.glob(".*.tmp-*"), *self.dir.glob("*.partial")]:
            path.unlink(missing_ok=True)


def read_agent_address(home: str | os.PathLike[str], sandbox_id: str) -> AgentAddress:
    """Where a sandbox's agent listens and its token, read from the engine state in `home` (for `corral check`
    beside a running server, which owns that home). `NotFoundError` if that engine has no such sandbox;
    `ValueError` if its state or the backend's record in it is not readable."""
    home = Path(home)
    check_sandbox_id(sandbox_id)
    data = read_state(home / STATE_DIR / f"{sandbox_id}.json")
    if data is None:
        raise NotFoundError(f"no readable engine state of sandbox {sandbox_id} under {home / STATE_DIR}")
    backend = load_backend(str(data.get("backend")), home)
    return backend.agent_address(backend.restore(data["record"]))
