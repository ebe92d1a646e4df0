"""The sandbox engine: an async Python API over isolated sandboxes (what the control plane serves)."""

from ._agent_client import AgentClient, PtySession
from ._capacity import Capacity, MachineUsage
from ._code import CodeError, CodeResult, CodeSession, RichResult, default_context, normalize_language
from ._engine import Engine, Files, Processes, SandboxHandle, read_agent_address
from ._models import (
    DEFAULT_FILE_ROOTS,
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
    "DEFAULT_FILE_ROOTS",
    "AgentClient",
    "Capacity",
    "CodeError",
    "CodeResult",
    "CodeSession",
    "Engine",
    "Entry",
    "ExecResult",
    "Files",
    "Limits",
    "MachineUsage",
    "ProcessInfo",
    "Processes",
    "PtySession",
    "RichResult",
    "Runtime",
    "SandboxHandle",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxState",
    "default_context",
    "normalize_language",
    "parse_size",
    "read_agent_address",
]
