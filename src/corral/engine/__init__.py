"""The sandbox engine: an async Python API over isolated sandboxes (what the control plane serves)."""

from ._agent_client import AgentClient, PtySession
from ._engine import Engine, Files, Processes, SandboxHandle
from ._models import (
    Entry,
    ExecResult,
    Limits,
    ProcessInfo,
    Runtime,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    parse_size,
)

__all__ = [
    "AgentClient",
    "Engine",
    "Entry",
    "ExecResult",
    "Files",
    "Limits",
    "ProcessInfo",
    "Processes",
    "PtySession",
    "Runtime",
    "SandboxHandle",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxState",
    "parse_size",
]
