"""The sandbox engine: an async Python API over isolated sandboxes (what the control plane serves)."""

from ._agent_client import AgentClient, PtySession, StartCallback, WatchStream
from ._capacity import Capacity, MachineUsage
from ._code import CodeError, CodeResult, CodeSession, RichResult, default_context, normalize_language
from ._engine import Engine, Files, Processes, SandboxHandle, read_agent_address
from ._models import (
    DEFAULT_FILE_ROOTS,
    Entry,
    ExecResult,
    Limits,
    ProcessInfo,
    ProcessRef,
    ProcessSelector,
    PtySize,
    Runtime,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    WatchEvent,
    WatchEventType,
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
    "ProcessRef",
    "ProcessSelector",
    "Processes",
    "PtySession",
    "PtySize",
    "RichResult",
    "Runtime",
    "SandboxHandle",
    "SandboxInfo",
    "SandboxSpec",
    "SandboxState",
    "StartCallback",
    "WatchEvent",
    "WatchEventType",
    "WatchStream",
    "default_context",
    "normalize_language",
    "parse_size",
    "read_agent_address",
]
