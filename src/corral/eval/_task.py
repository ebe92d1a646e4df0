"""Tasks: what an agent does in a sandbox, and how we know it worked.

A task is data, not code: a `Setup` (template, network policy, limits, files uploaded first), `steps` (commands,
code cells, file transfers, a policy change, a pause) and, on each step, `checks` of its `Outcome`. Every check
names the failure mode (`_taxonomy.py`) its failure reveals, so a failed run explains itself. Adapters
(`_adapter.py`) turn steps into calls on one sandbox service; nothing here does I/O.

`{server}` in a command, code cell or network rule is the runner's loopback file server (`host:port`), which
serves deterministic blobs at `/blob/<kind>/<size>/<seed>` (see `Blob.url_path`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ._blob import Blob, blob_from_path

if TYPE_CHECKING:
    from ._checks import Check

__all__ = [
    "CATEGORIES",
    "SEVERITIES",
    "Blob",
    "Checkpoint",
    "Code",
    "Exec",
    "Fingerprint",
    "Pause",
    "Read",
    "Restore",
    "SetNetwork",
    "Setup",
    "Step",
    "Task",
    "Write",
    "WriteArchive",
    "blob_from_path",
]

Severity = Literal["critical", "high", "medium", "low"]
SEVERITIES: tuple[Severity, ...] = ("critical", "high", "medium", "low")

# The categories the field report grouped its 1,000 tasks into, plus the two that probe the sandbox itself and
# `undo` (a destructive command undone by restoring a checkpoint).
CATEGORIES = (
    "file_io",
    "packages",
    "data_analysis",
    "ml_training",
    "downloads",
    "multi_language",
    "long_running",
    "security",
    "resource_abuse",
    "undo",
)

# Capabilities a task may require of an adapter; a task an adapter cannot run is skipped, never passed.
CAPABILITIES = frozenset({
    "archive",          # upload a tar archive that the sandbox extracts (Corral's write_archive)
    "code",             # stateful code cells (run_code)
    "limits",           # memory / cpus / pids / disk limits at create
    "loopback_server",  # reach the runner's loopback server through an explicit allowance
    "network_policy",   # per-sandbox egress policies (allowlists, none) and live changes
    "egress_denials",   # the command's result lists the refusals that happened while it ran
    "output_cap",       # output over a cap comes back cut, flagged as truncated, with its true size
    "pause",            # pause and resume keeping state
    "polyglot",         # the `polyglot` template (Java, Go, Rust, TypeScript)
    "packages",         # pip/npm reach their registries (through the policy's @packages)
    "checkpoints",      # checkpoint the sandbox's files and restore them in place (issue 26)
    "auto_checkpoints", # `checkpoints="auto"` at create: a checkpoint before each command, cell or write
})


@dataclass(frozen=True)
class Setup:
    """The sandbox a task starts from. `files` are uploaded (and must arrive) before the first step."""

    template: str = "default"
    network: str | tuple[str, ...] = "none"
    limits: Mapping[str, Any] = field(default_factory=dict)
    files: tuple[tuple[str, Blob], ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: int = 300
    checkpoints: Literal["manual", "auto"] = "manual"


@dataclass(frozen=True)
class Exec:
    """Run a command (`bash -lc` for a string, argv for a tuple) and wait for it."""

    cmd: str | tuple[str, ...]
    checks: tuple[Check, ...] = ()
    stdin: Blob | None = None
    timeout: float = 30
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    kind: Literal["exec"] = "exec"


@dataclass(frozen=True)
class Code:
    """Run a code cell in a stateful session (`language` python, bash, javascript, c, cpp, java, go, ...)."""

    code: str
    checks: tuple[Check, ...] = ()
    language: str = "python"
    session: str | None = None
    timeout: float = 60
    kind: Literal["code"] = "code"


@dataclass(frozen=True)
class Write:
    """Upload `data` to `path` through the file API."""

    path: str
    data: Blob
    checks: tuple[Check, ...] = ()
    kind: Literal["write"] = "write"


@dataclass(frozen=True)
class Read:
    """Download `path` through the file API; checks see the bytes in `Outcome.data`."""

    path: str
    checks: tuple[Check, ...] = ()
    kind: Literal["read"] = "read"


@dataclass(frozen=True)
class WriteArchive:
    """Upload a tar archive (`data`) to be extracted under the directory `path`."""

    path: str
    data: Blob
    checks: tuple[Check, ...] = ()
    kind: Literal["write_archive"] = "write_archive"


@dataclass(frozen=True)
class SetNetwork:
    """Change the sandbox's egress policy while it runs."""

    network: str | tuple[str, ...]
    checks: tuple[Check, ...] = ()
    kind: Literal["set_network"] = "set_network"


@dataclass(frozen=True)
class Pause:
    """Pause the sandbox, then resume it; later steps see whether state survived."""

    checks: tuple[Check, ...] = ()
    kind: Literal["pause"] = "pause"


@dataclass(frozen=True)
class Checkpoint:
    """Checkpoint the sandbox's files; the session keeps its id under `label` for a later `Restore`."""

    label: str = "before"
    checks: tuple[Check, ...] = ()
    kind: Literal["checkpoint"] = "checkpoint"


AUTO = "auto"  # `Restore(to=AUTO)`: the automatic checkpoint taken before the last step that carried one


@dataclass(frozen=True)
class Restore:
    """Restore the sandbox in place to the checkpoint `to` (a `Checkpoint` label, or `AUTO`); only `paths` (and
    everything below them) when given."""

    to: str = "before"
    paths: tuple[str, ...] | None = None
    checks: tuple[Check, ...] = ()
    kind: Literal["restore"] = "restore"


@dataclass(frozen=True)
class Fingerprint:
    """Every entry under `paths` (type, mode, owner, size, sha256 of the bytes, link target), hashed inside the
    sandbox by a command. `record` keeps it under a label; `compare` puts the one kept under that label into the
    outcome beside it, for `Restored` (`_undo.py`) to compare entry by entry."""

    paths: tuple[str, ...]
    record: str | None = None
    compare: str | None = None
    checks: tuple[Check, ...] = ()
    kind: Literal["fingerprint"] = "fingerprint"


Step = Exec | Code | Write | Read | WriteArchive | SetNetwork | Pause | Checkpoint | Restore | Fingerprint

# What each step kind needs beyond plain commands and files.
STEP_REQUIRES: dict[str, frozenset[str]] = {
    "code": frozenset({"code"}),
    "write_archive": frozenset({"archive"}),
    "set_network": frozenset({"network_policy"}),
    "pause": frozenset({"pause"}),
    "checkpoint": frozenset({"checkpoints"}),
    "restore": frozenset({"checkpoints"}),
}


@dataclass(frozen=True)
class Task:
    """One agent task.

    **Fields:**

    * `id` - unique and stable, `<family>/<variant>` (e.g. `file_io.binary_roundtrip/random-10MiB`).
    * `family` - the parametrised family it belongs to; `category` - one of `CATEGORIES`.
    * `title` - what the agent is trying to do, in a line. `severity` - how bad a failure is for the user.
    * `requires` - adapter capabilities (`CAPABILITIES`); step kinds add their own (`STEP_REQUIRES`).
    * `budget` - seconds the whole task may take (sandbox create to destroy) before it counts as a hang.
    * `checklist` - the CHECKLIST.md items this task proves (used by `corral check`).
    """

    id: str
    family: str
    category: str
    title: str
    steps: tuple[Step, ...]
    setup: Setup = field(default_factory=Setup)
    severity: Severity = "high"
    tags: tuple[str, ...] = ()
    requires: frozenset[str] = frozenset()
    budget: float = 120.0
    checklist: tuple[int, ...] = ()

    def needs(self) -> frozenset[str]:
        """Every capability this task needs, its own and its steps'."""
        needed = set(self.requires)
        for step in self.steps:
            needed |= STEP_REQUIRES.get(step.kind, frozenset())
            for check in step.checks:
                needed |= check.requires
        if self.setup.template == "polyglot":
            needed.add("polyglot")
        if self.setup.limits:
            needed.add("limits")
        if self.setup.checkpoints == "auto":
            needed.add("auto_checkpoints")
        if self.setup.network not in ("none", "internet"):
            needed.add("network_policy")
        if _mentions_server(self):
            needed.add("loopback_server")
        return frozenset(needed)


def _mentions_server(task: Task) -> bool:
    texts: list[str] = [str(task.setup.network)]
    for step in task.steps:
        if isinstance(step, Exec):
            texts.append(step.cmd if isinstance(step.cmd, str) else " ".join(step.cmd))
        elif isinstance(step, Code):
            texts.append(step.code)
        elif isinstance(step, SetNetwork):
            texts.append(str(step.network))
    return any("{server}" in t for t in texts)
