"""The adapter contract: how the runner drives one sandbox service.

An `Adapter` opens a `Session` (one sandbox, set up as the task's `Setup` says, its files uploaded) and a session
runs steps, returning an `Outcome` for each. Adapters map every error of their service to `ErrorInfo` inside the
`Outcome`: a step that fails is data, not an exception. `open` raises `SetupError` when the sandbox cannot be
made; anything else an adapter raises is a bug the runner records as `sandbox_unavailable`.

`capabilities` says what the service can do (`CAPABILITIES` in `_task.py`); the runner skips, and reports as
skipped, every task that needs more.
"""

from __future__ import annotations

from typing import Protocol

from ._outcome import ErrorInfo, Outcome
from ._task import Step, Task

__all__ = ["Adapter", "Session", "SetupError"]


class SetupError(Exception):
    """The sandbox for a task could not be created or prepared."""

    def __init__(self, error: ErrorInfo, *, seconds: float = 0.0) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error
        self.seconds = seconds


class Session(Protocol):
    async def run(self, step: Step) -> Outcome: ...

    async def close(self) -> None: ...


class Adapter(Protocol):
    name: str
    capabilities: frozenset[str]

    async def open(self, task: Task) -> Session:
        """A sandbox for `task`, created from `task.setup` with its files uploaded (`SetupError` if not)."""
        ...

    async def aclose(self) -> None: ...
