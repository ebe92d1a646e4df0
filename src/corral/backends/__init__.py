"""Backends: where sandboxes get their isolation (docs/backends.md).

This package exports the contract only; implementations load by name (`load_backend("local" | "docker", home)`)
so that choosing one never imports another's dependencies.
"""

from ._contract import (
    BACKEND_NAMES,
    AgentAddress,
    Backend,
    BackendCapacity,
    BackendRecord,
    DeclaresLimitations,
    Endpoint,
    RemoteEgress,
    SandboxUsage,
    SnapshotArtifact,
    TCPEndpoint,
    UnixEndpoint,
    backend_limitations,
    backend_runtimes,
    load_backend,
    runtime_limitation,
    supports_root,
)
from ._spec import (
    DEFAULT_FILE_ROOTS,
    ROOT_FILE_ROOTS,
    USERS,
    Limits,
    Runtime,
    SandboxSpec,
    SandboxState,
    check_user,
    parse_size,
    user_home,
)

__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_FILE_ROOTS",
    "ROOT_FILE_ROOTS",
    "USERS",
    "AgentAddress",
    "Backend",
    "BackendCapacity",
    "BackendRecord",
    "DeclaresLimitations",
    "Endpoint",
    "Limits",
    "RemoteEgress",
    "Runtime",
    "SandboxSpec",
    "SandboxState",
    "SandboxUsage",
    "SnapshotArtifact",
    "TCPEndpoint",
    "UnixEndpoint",
    "backend_limitations",
    "backend_runtimes",
    "check_user",
    "load_backend",
    "parse_size",
    "runtime_limitation",
    "supports_root",
    "user_home",
]
