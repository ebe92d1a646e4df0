"""`Outcome`: what one step did, in the same shape whichever sandbox service ran it.

Adapters fill the fields their step kind has (an exec fills exit code and output, a read fills `data`, a code
cell fills `text`, `results` and `code_error`) and map every error of the service to `ErrorInfo`, so checks
never see a foreign exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Denial", "ErrorInfo", "Outcome"]


@dataclass(frozen=True)
class ErrorInfo:
    """An error the service answered with. `code` is Corral's error code (`invalid_request`, `not_found`, ...)
    or, for other services, the closest one; `status` the HTTP status when there was one."""

    code: str
    message: str
    status: int | None = None


@dataclass(frozen=True)
class Denial:
    """A network access the sandbox's policy refused while the step ran, with the reason given."""

    host: str
    port: int | None
    reason: str


@dataclass(frozen=True)
class Outcome:
    kind: str
    duration: float = 0.0
    error: ErrorInfo | None = None
    # exec (and code cells' output)
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_size: int = 0
    stderr_size: int = 0
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    denials: tuple[Denial, ...] = ()
    # read
    data: bytes | None = None
    # code
    text: str | None = None
    results: tuple[dict[str, Any], ...] = ()  # MIME type -> value (images base64), as Jupyter sends them
    code_error: tuple[str, str] | None = None  # (name, value)
    # The service shows a string value without its repr's quotes ('a' as a): E2B's code interpreter does.
    text_unquoted: bool = False
    # checkpoints: the automatic one taken before the step (its id); a fingerprint of a tree (path -> what is
    # there, `_undo.py`) and the one recorded earlier to compare it with; the commands a restore stopped
    checkpoint: str | None = None
    fingerprint: dict[str, str] | None = None
    recorded: dict[str, str] | None = None
    stopped: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        """A short description for reports: how the step ended."""
        if self.error is not None:
            return f"error {self.error.code}: {self.error.message[:200]}"
        parts = [self.kind]
        if self.exit_code is not None:
            parts.append(f"exit {self.exit_code}")
        if self.signal:
            parts.append(f"signal {self.signal}")
        for flag in ("timed_out", "oom_killed", "truncated"):
            if getattr(self, flag):
                parts.append(flag)
        if self.kind == "exec":
            parts.append(f"stdout {self.stdout_size or len(self.stdout)} B")
        if self.data is not None:
            parts.append(f"{len(self.data)} B")
        if self.fingerprint is not None:
            parts.append(f"{len(self.fingerprint)} entries")
        if self.checkpoint is not None:
            parts.append(f"after checkpoint {self.checkpoint}")
        if self.code_error is not None:
            parts.append(f"{self.code_error[0]}: {self.code_error[1][:120]}")
        return ", ".join(parts)
