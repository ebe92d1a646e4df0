"""The sandbox engine: an async Python API over isolated sandboxes (what the control plane serves)."""

from ._agent_client import AgentClient, Liveness, PtySession, StartCallback, WatchStream
from ._capacity import Capacity, MachineUsage
from ._code import (
    LANGUAGES,
    SESSION_LANGUAGES,
    CodeError,
    CodeResult,
    CodeSession,
    RichResult,
    default_context,
    normalize_language,
)
from ._engine import Engine
from ._exec_options import ExecOptions
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
from ._pool import PoolStats, WarmPool, parse_pools, pools_notice, serve_pools
from ._records import Adoption, read_agent_address
from ._session import Files, Processes, SandboxSession

__all__ = [
    "DEFAULT_FILE_ROOTS",
    "LANGUAGES",
    "SESSION_LANGUAGES",
    "Adoption",
    "AgentClient",
    "Capacity",
    "CodeError",
    "CodeResult",
    "CodeSession",
    "Engine",
    "Entry",
    "ExecOptions",
    "ExecResult",
    "Files",
    "Limits",
    "Liveness",
    "MachineUsage",
    "PoolStats",
    "ProcessInfo",
    "ProcessRef",
    "ProcessSelector",
    "Processes",
    "PtySession",
    "PtySize",
    "RichResult",
    "Runtime",
    "SandboxInfo",
    "SandboxSession",
    "SandboxSpec",
    "SandboxState",
    "StartCallback",
    "WarmPool",
    "WatchEvent",
    "WatchEventType",
    "WatchStream",
    "default_context",
    "normalize_language",
    "parse_pools",
    "parse_size",
    "pools_notice",
    "read_agent_address",
    "serve_pools",
]
