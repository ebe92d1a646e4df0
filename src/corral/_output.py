"""What the SDK and the engine share about a command's output, with no I/O and no dependency: a leaf module.

`OutputText` gives text views of exact output bytes; the engine's `ExecResult` and `CodeResult` and the SDK's
`CommandResult` and `Execution` all mix it in. The SDK imports it from here, never from the engine, so that
`import corral` loads no server-side code.
"""

from __future__ import annotations

__all__ = ["OutputText"]


class OutputText:
    """Text views of a command's exact output bytes: invalid UTF-8 becomes U+FFFD, never an exception."""

    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")
