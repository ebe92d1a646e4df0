"""The Python SDK over Corral's HTTP API (`docs/api.md`); the public names are re-exported by `corral`.

One module per concept: `_transport` (HTTP, errors), `_sandbox` (`Sandbox`, `AsyncSandbox`), `_commands`,
`_processes` (background commands), `_pty` (terminals), `_code` (the code interpreter), `_files`, `_models` (what
calls return), `_config` (where to connect), `_admin` (`Admin`, `AsyncAdmin`: tenants, keys, audit, kill switch).
"""

from ._admin import (
    Admin,
    AsyncAdmin,
    AuditProblem,
    AuditRecord,
    AuditVerification,
    KeyInfo,
    KillResult,
    NewKey,
    TenantInfo,
)
from ._checkpoints import Change, Changes, Checkpoint, RestoreResult, StoppedProcess
from ._code import AsyncCodeInterpreter, CodeInterpreter, CodeSessionInfo, Execution, ExecutionError, Result
from ._commands import AsyncCommands, Commands
from ._config import DEFAULT_REQUEST_TIMEOUT, ConnectionConfig
from ._files import AsyncFiles, Files
from ._models import CommandResult, EgressDenial, Entry, ReclaimedTree, SandboxInfo, SandboxMetric
from ._processes import AsyncCommandHandle, CommandHandle, ProcessInfo
from ._pty import AsyncPty, AsyncPtySession, Pty, PtySession
from ._sandbox import AsyncSandbox, Sandbox
from ._secrets import AsyncSecret, Secret
from ._snapshots import AsyncSnapshot, Snapshot
from ._volumes import AsyncVolume, Volume

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT",
    "Admin",
    "AsyncAdmin",
    "AsyncCodeInterpreter",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncPty",
    "AsyncPtySession",
    "AsyncSandbox",
    "AsyncSecret",
    "AsyncSnapshot",
    "AsyncVolume",
    "AuditProblem",
    "AuditRecord",
    "AuditVerification",
    "Change",
    "Changes",
    "Checkpoint",
    "CodeInterpreter",
    "CodeSessionInfo",
    "CommandHandle",
    "CommandResult",
    "Commands",
    "ConnectionConfig",
    "EgressDenial",
    "Entry",
    "Execution",
    "ExecutionError",
    "Files",
    "KeyInfo",
    "KillResult",
    "NewKey",
    "ProcessInfo",
    "Pty",
    "PtySession",
    "ReclaimedTree",
    "RestoreResult",
    "Result",
    "Sandbox",
    "SandboxInfo",
    "SandboxMetric",
    "Secret",
    "Snapshot",
    "StoppedProcess",
    "TenantInfo",
    "Volume",
]
