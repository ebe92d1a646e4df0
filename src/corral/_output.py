"""What the SDK and the engine share about a command's output, with no I/O and no dependency: a leaf module.

`OutputText` gives text views of exact output bytes; the engine's `ExecResult` and `CodeResult` and the SDK's
`CommandResult` and `Execution` all mix it in. `egress_notice` is the text that tells an agent what the egress
policy refused while its command ran (the SDK shows it next to stderr; the E2B API puts it in the command's
`error`). `ReclaimedTree` and `reclaim_notice` say what the sandbox's agent stopped to make room under its pids
limit before a command could start (docs/api.md). The SDK imports them from here, never from the engine, so that
`import corral` loads no server-side code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["OutputText", "ReclaimedTree", "egress_notice", "reclaim_notice", "reclaimed_from_wire"]


@dataclass(frozen=True)
class ReclaimedTree:
    """Processes an ended command left running, which the sandbox's agent stopped (SIGKILL) so that a command
    could start under the sandbox's pids limit: `processes` of them, from the command `id` (Corral's process id)
    whose command line was `command`; both None for processes of no known command (they had left its session)."""

    processes: int
    id: str | None = None
    command: str | None = None

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ReclaimedTree:
        ident, command = data.get("id"), data.get("command")
        return cls(processes=int(data.get("processes") or 0), id=None if ident is None else str(ident),
                   command=None if command is None else str(command))

    def to_wire(self) -> dict[str, Any]:
        return {"processes": self.processes, "id": self.id, "command": self.command}


def reclaimed_from_wire(items: object) -> tuple[ReclaimedTree, ...]:
    """The `reclaimed` list of an agent's or the API's result; anything malformed is left out."""
    if not isinstance(items, list):
        return ()
    return tuple(ReclaimedTree.from_wire(d) for d in items if isinstance(d, dict))


def reclaim_notice(trees: Iterable[ReclaimedTree]) -> str:
    """One line per stopped tree, e.g. for an agent to read next to stderr ("" if none)."""
    lines = []
    for tree in trees:
        origin = (f"of command {tree.id} ({tree.command!r}), which had ended" if tree.id is not None else
                  "of no running command")
        lines.append(f"corral: stopped {tree.processes} leftover process{'es' if tree.processes != 1 else ''} "
                     f"{origin}, to make room under the sandbox's process limit\n")
    return "".join(lines)


def egress_notice(denials: Iterable[tuple[str, int | None, str]]) -> str:
    """One line per refused (host, port, reason), in the order first refused, e.g. for an agent to read next to
    stderr ("" if none). A tool that retries (pip tries 6 times) is refused as often; the line says so once."""
    seen = Counter(denials)
    return "".join(f"corral: {reason}{f' ({n} attempts)' if n > 1 else ''}\n" for (_, _, reason), n in seen.items())


class OutputText:
    """Text views of a command's exact output bytes: invalid UTF-8 becomes U+FFFD, never an exception."""

    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")
