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

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "AuthenticationError",
    "ConflictError",
    "CorralError",
    "DiskFullError",
    "InvalidRequestError",
    "NotFoundError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "RuntimeUnavailableError",
    "SandboxTimeoutError",
    "ServerError",
    "TemplateBuildError",
    "__version__",
    "error_from_code",
]
