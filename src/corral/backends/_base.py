"""The backend contract: where a sandbox's isolation comes from.

A backend turns a `SandboxSpec` and a template into a running, isolated sandbox whose agent can be reached,
and takes it down again. Everything that happens *inside* a sandbox (exec, files, code) goes through the
agent protocol and is the same for every backend; a backend only owns the lifecycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..engine._agent_client import AgentClient
from ..engine._models import SandboxSpec
from ..templates import Template

Record = dict[str, Any]  # what a backend needs to find a sandbox again after a restart; JSON-serialisable


class Backend(Protocol):
    name: str

    def check(self) -> None:
        """Raise `RuntimeUnavailableError` naming whatever isolation needs and is missing."""

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template) -> Record: ...

    def agent(self, record: Record) -> AgentClient: ...

    def egress_socket(self, record: Record) -> Path:
        """The host path where the egress proxy listens for this sandbox (docs/egress.md)."""

    async def pause(self, record: Record) -> None: ...

    async def resume(self, record: Record) -> None: ...

    async def destroy(self, record: Record) -> None:
        """Stop the sandbox and remove every trace of it (processes, mounts, cgroups, runtime state)."""

    async def alive(self, record: Record) -> bool: ...

    def oom_kills(self, record: Record) -> int:
        """How many processes the OOM killer has killed in the sandbox so far."""

    def load_record(self, sandbox_id: str) -> Record | None:
        """The record `create` returned for this sandbox, read back after a restart (None: unknown)."""

    def adopt(self, record: Record) -> None:
        """Take back a sandbox found running after a restart (reserve what it holds)."""

    async def close(self) -> None:
        """Release what the backend holds for all sandboxes (not the sandboxes: they outlive the engine)."""

    async def sweep(self, known: set[str]) -> list[str]:
        """Remove leftovers of sandboxes not in `known` (half-created, crashed); return their ids."""
