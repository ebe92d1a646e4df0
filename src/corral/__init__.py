"""Corral: a self-hostable sandbox runtime for AI agents."""

from ._exceptions import (
    AgentError,
    AuthenticationError,
    ConflictError,
    CorralError,
    DiskFullError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    RuntimeUnavailableError,
    SandboxTimeoutError,
    ServerError,
    TemplateBuildError,
    error_from_code,
)
from ._sdk import AsyncSandbox, CommandResult, Entry, Sandbox, SandboxInfo

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "AsyncSandbox",
    "AuthenticationError",
    "CommandResult",
    "ConflictError",
    "CorralError",
    "DiskFullError",
    "Entry",
    "InvalidRequestError",
    "NotFoundError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "RuntimeUnavailableError",
    "Sandbox",
    "SandboxInfo",
    "SandboxTimeoutError",
    "ServerError",
    "TemplateBuildError",
    "__version__",
    "error_from_code",
]
