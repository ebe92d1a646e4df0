"""Running build commands so that an interrupted build stops them, and SIGTERM reaches `finally` blocks."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType

from .._exceptions import TemplateBuildError

__all__ = ["Progress", "discard", "run_streamed", "sigterm_raises"]

Progress = Callable[[str], None]

_TAIL_LINES = 12
# A log explains more than the output tail (dpkg says which dependency broke), and the build directory that
# holds it is deleted after the failure, so more of it goes into the error.
_LOG_TAIL_LINES = 40
_STOP_GRACE_S = 10.0


def discard(_line: str) -> None:
    """The `progress` callback used when the caller gives none."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into `SystemExit(143)` inside the block, so cleanup in `finally` blocks runs.

    Only where SIGTERM would otherwise kill the process outright (the main thread, default handler): an
    application with its own handler (a server) keeps it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def _raise(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End `proc` and its process group if it is still running (an exception interrupted the build)."""
    if proc.poll() is None:
        # The group leader is alive, so its process group id cannot have been reused.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # mmdebstrap cleans up what it mounted on TERM
        try:
            proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _log_tail(log: Path | None) -> list[str]:
    if log is None:
        return []
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [f"--- last lines of {log.name}:", *lines[-_LOG_TAIL_LINES:]] if lines else []


def run_streamed(
    cmd: Sequence[str],
    *,
    emit: Progress,
    what: str,
    env: Mapping[str, str],
    log: Path | None = None,
) -> None:
    """Run `cmd`, streaming its merged output to `emit` line by line.

    `TemplateBuildError` with its last lines (and those of `log`, if given) when it exits non-zero. However
    this returns, the command and everything it started in its process group are gone.
    """
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    try:
        proc = subprocess.Popen(
            # If this process dies outright (SIGKILL), the command dies too instead of running on. KILL, not
            # TERM: `unshare --fork` ignores TERM while it waits for its child.
            ["setpriv", "--pdeathsig", "KILL", "--", *cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,  # its own process group, so an interrupted build can stop all of it
        )
    except OSError as exc:
        raise TemplateBuildError(f"{what}: cannot run {cmd[0]}: {exc.strerror}") from exc
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            emit(line)
        returncode = proc.wait()
    finally:
        _stop(proc)
    if returncode != 0:
        details = [*tail, *_log_tail(log)]
        raise TemplateBuildError(
            f"{what} failed with exit code {returncode}:\n" + "\n".join(details),
            details={"exit_code": returncode, "output_tail": details},
        )
