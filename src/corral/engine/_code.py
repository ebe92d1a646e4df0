"""Code sessions' results and contexts, as the engine returns them (docs/code.md, "Engine").

The language rules (aliases, default contexts' ids) are the agent's own (`corral.agent.languages`): re-exported
here so that a host names a default context exactly as the agent does."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .._output import OutputText
from ..agent.languages import SESSION_LANGUAGES, default_context
from ..agent.languages import normalize as normalize_language
from ..agent.output import OutputBuffer

# java, go, rust, typescript and r need the polyglot template (its toolchains); the others work in the default one.
LANGUAGES = ("python", "bash", "javascript", "c", "cpp", "java", "go", "rust", "typescript", "r")
CHART_MIME = "e2b/chart"  # a matplotlib figure's data as a chart, JSON text (docs/code.md, "Charts")


@dataclass(frozen=True)
class RichResult:
    """One displayed object: mime type -> content (base64 for image/png and image/jpeg, text otherwise)."""

    is_main_result: bool
    data: dict[str, str] = field(default_factory=dict)

    @property
    def chart(self) -> dict[str, Any] | None:
        """The chart of a figure (E2B's format: docs/code.md, "Charts"), or None: no chart, or not a JSON object
        (an object's own `_repr_e2b_chart_` may return any text)."""
        text = self.data.get(CHART_MIME)
        try:
            chart = json.loads(text) if text is not None else None
        except ValueError:
            return None
        return chart if isinstance(chart, dict) else None


@dataclass(frozen=True)
class CodeError:
    """What the cell raised; the session survives it (unless `CodeResult.session_restarted`)."""

    name: str
    value: str
    traceback: str


@dataclass(frozen=True)
class CodeResult(OutputText):
    """The outcome of one cell: never raised for an exception in the cell, a timeout or an OOM kill."""

    session: str
    language: str
    stdout_bytes: bytes
    stderr_bytes: bytes
    results: tuple[RichResult, ...] = ()
    error: CodeError | None = None
    timed_out: bool = False
    oom_killed: bool = False
    session_restarted: bool = False  # the session's process ended during the cell: its state is gone
    duration: float = 0.0
    signal: int | None = None  # what ended the session's process, when it ended
    killed: bool = False  # ended by us (an interrupt that did not stop it in time), not by itself or the kernel
    execution_count: int | None = None  # the cell's number in its session (1, 2, ...); None for a program
    # Output past `max_output` per stream (callbacks still get every byte): the first three quarters and the last
    # quarter are kept, as a command's are; the sizes count every byte, the cuts say where the middle was left out.
    truncated: bool = False
    stdout_size: int = 0
    stderr_size: int = 0
    stdout_cut: int | None = None
    stderr_cut: int | None = None

    def __post_init__(self) -> None:  # the sizes count at least what was kept (a result built without them)
        object.__setattr__(self, "stdout_size", max(self.stdout_size, len(self.stdout_bytes)))
        object.__setattr__(self, "stderr_size", max(self.stderr_size, len(self.stderr_bytes)))


@dataclass(frozen=True)
class CodeSession:
    """A code context: `name` is its id. `pid` 0 (and `started_at` 0): its session has not started (or ended);
    its next cell starts one, in `cwd`. `execution_count`: cells its current session ran."""

    name: str
    language: str
    pid: int
    started_at: float
    cwd: str = ""
    execution_count: int = 0


ResultCallback = Callable[[RichResult], Awaitable[None] | None]


def rich_result(ev: dict[str, Any]) -> RichResult:
    data = ev.get("data") or {}
    return RichResult(is_main_result=bool(ev.get("is_main_result")),
                      data={str(k): str(v) for k, v in data.items()})


def code_error(raw: Any) -> CodeError | None:
    if not isinstance(raw, dict):
        return None
    return CodeError(name=str(raw.get("name") or "Error"), value=str(raw.get("value") or ""),
                     traceback=str(raw.get("traceback") or ""))


def code_result(session: str, language: str, ev: dict[str, Any], out: OutputBuffer, err: OutputBuffer,
                results: list[RichResult]) -> CodeResult:
    (stdout, stdout_cut), (stderr, stderr_cut) = _kept(out), _kept(err)
    return CodeResult(
        session=session,
        language=language,
        stdout_bytes=stdout,
        stderr_bytes=stderr,
        truncated=stdout_cut is not None or stderr_cut is not None,
        stdout_size=out.total,
        stderr_size=err.total,
        stdout_cut=stdout_cut,
        stderr_cut=stderr_cut,
        results=tuple(results),
        error=code_error(ev.get("error")),
        timed_out=bool(ev.get("timed_out")),
        session_restarted=bool(ev.get("session_restarted")),
        duration=float(ev.get("duration") or 0.0),
        signal=ev.get("signal"),
        killed=bool(ev.get("killed")),
        execution_count=ev.get("execution_count"),
    )


def _kept(buffer: OutputBuffer) -> tuple[bytes, int | None]:
    """A stream's kept bytes, and where its omitted middle was (None: nothing was left out)."""
    return bytes(buffer.head) + buffer.tail_bytes(), len(buffer.head) if buffer.omitted else None


def code_session(raw: dict[str, Any]) -> CodeSession:
    return CodeSession(name=str(raw["name"]), language=str(raw["language"]), pid=int(raw["pid"]),
                       started_at=float(raw.get("started_at") or 0.0), cwd=str(raw.get("cwd") or ""),
                       execution_count=int(raw.get("execution_count") or 0))


__all__ = [
    "LANGUAGES",
    "SESSION_LANGUAGES",
    "CodeError",
    "CodeResult",
    "CodeSession",
    "ResultCallback",
    "RichResult",
    "default_context",
    "normalize_language",
]
