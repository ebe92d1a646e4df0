"""What the SDK and the engine share about a command's output, with no I/O and no dependency: a leaf module.

`OutputText` gives text views of exact output bytes; the engine's `ExecResult` and `CodeResult` and the SDK's
`CommandResult` and `Execution` all mix it in. `egress_notice` is the text that tells an agent what the egress
policy refused while its command ran (the SDK shows it next to stderr; the E2B API puts it in the command's
`error`). The SDK imports both from here, never from the engine, so that `import corral` loads no server-side code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

__all__ = ["OutputText", "egress_notice"]


def egress_notice(denials: Iterable[tuple[str, int | None, str]]) -> str:
    """One line per refused (host, port, reason), in the order first refused, e.g. for an agent to read next to
    stderr ("" if none). A tool that retries (pip tries 6 times) is refused as often; the line says so once."""
    seen = Counter(denials)
    return "".join(f"corral: {reason}{f' ({n} attempts)' if n > 1 else ''}\n" for (_, _, reason), n in seen.items())


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
