"""What the engine holds of one sandbox it runs: its spec, the backend's record, its agent, its state.

`LiveSandbox` is the engine's in-memory view; what of it outlives a restart is `_records.py`'s business.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime

from .._exceptions import InvalidRequestError
from .._settings import agent_seconds
from ..backends import AgentAddress, BackendRecord
from ._agent_client import AgentClient, Liveness
from ._models import SandboxInfo, SandboxSpec, SandboxState

_SANDBOX_ID = re.compile(r"sb-[a-z0-9][a-z0-9-]{3,62}")


@dataclass
class LiveSandbox:
    id: str
    spec: SandboxSpec
    record: BackendRecord
    agent: AgentClient  # made once from the backend's `agent_address`, fixed until a boot from disk replaces it
    created_at: float
    state: SandboxState = SandboxState.RUNNING
    template_env: dict[str, str] = field(default_factory=dict)
    # Paused to disk (docs/lifecycle.md): no process, no memory. When a sandbox ends is the store's record alone
    # (the service's reconciler ends it): the engine keeps no timeout.
    paused_to_disk: bool = False
    # Serialises what changes the sandbox's state (pause, resume, snapshot, destroy): a snapshot must not copy a
    # disk that a pause is unmounting, nor the reconciler pause what a caller is resuming.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, compare=False, repr=False)

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            state=self.state,
            template=self.spec.template,
            runtime=self.spec.runtime.value,
            limits=self.spec.limits,
            created_at=datetime.fromtimestamp(self.created_at, UTC),
            env=dict(self.spec.env),
            metadata=dict(self.spec.metadata),
            paused_to_disk=self.paused_to_disk,
        )

    def tmp_agent(self, agent: AgentClient | None = None) -> AgentClient:
        """Who saves and restores the sandbox's /tmp across a pause to disk: root where the sandbox has it (its
        files there keep their owners), else the user, who owns or may read everything there."""
        agent = agent or self.agent
        return agent.as_user("root") if self.spec.root else agent


def check_sandbox_id(sandbox_id: str) -> None:
    # It names a directory, a runc container and a cgroup: keep it to a safe alphabet.
    if not _SANDBOX_ID.fullmatch(sandbox_id):
        raise InvalidRequestError(f"sandbox id {sandbox_id!r} must match sb-[a-z0-9][a-z0-9-]{{3,62}}")


def agent_client(sandbox_id: str, address: AgentAddress, liveness: Liveness) -> AgentClient:
    return AgentClient(address.endpoint, address.token, label=f"sandbox {sandbox_id}", liveness=liveness,
                       sandbox_id=sandbox_id)


def liveness_from_settings() -> Liveness:
    """`Liveness` from the environment (`_settings.agent_seconds`), else its defaults; an idle timeout of 0 is
    none."""
    default = Liveness()
    interval = agent_seconds("HEARTBEAT_INTERVAL")
    idle = agent_seconds("IDLE_TIMEOUT")
    return Liveness(heartbeat_interval=interval or default.heartbeat_interval,
                    idle_timeout=default.idle_timeout if idle is None else (idle or None))
