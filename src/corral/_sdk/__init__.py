"""The Python SDK over Corral's HTTP API (`docs/api.md`); the public names are re-exported by `corral`.

One module per concept: `_transport` (HTTP, errors), `_sandbox` (`Sandbox`, `AsyncSandbox`), `_commands`,
`_files`, `_models` (what calls return), `_config` (where to connect).
"""

from ._commands import AsyncCommands, Commands
from ._config import DEFAULT_REQUEST_TIMEOUT, ConnectionConfig
from ._files import AsyncFiles, Files
from ._models import CommandResult, Entry, SandboxInfo
from ._sandbox import AsyncSandbox, Sandbox

__all__ = [
    "DEFAULT_REQUEST_TIMEOUT",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncSandbox",
    "CommandResult",
    "Commands",
    "ConnectionConfig",
    "Entry",
    "Files",
    "Sandbox",
    "SandboxInfo",
]
