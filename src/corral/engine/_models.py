"""Typed results of the engine API: plain frozen dataclasses (made by us, often, and cheap). The spec they answer
to lives in `corral.backends._spec`, shared with the backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from .._output import OutputText  # a leaf shared with the SDK, which must not import the engine
from ..backends._spec import DEFAULT_FILE_ROOTS, Limits, Runtime, SandboxSpec, SandboxState, parse_size

if TYPE_CHECKING:
    from ..egress import EgressEvent

__all__ = [
    "DEFAULT_FILE_ROOTS", "Entry", "ExecResult", "Limits", "OutputCollector", "ProcessInfo", "Runtime",
    "SandboxInfo", "SandboxSpec", "SandboxState", "WatchEvent", "WatchEventType", "parse_size",
]


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    state: SandboxState
    template: str
    runtime: str
    limits: Limits
    created_at: datetime
    expires_at: datetime
    env: dict[str, str]
    metadata: dict[str, str]
    paused_to_disk: bool = False


@dataclass(frozen=True)
class ExecResult(OutputText):
    """The outcome of one command: never raised for a non-zero exit, a timeout or an OOM kill."""

    exit_code: int | None
    stdout_bytes: bytes
    stderr_bytes: bytes
    signal: int | None = None
    duration: float = 0.0
    timed_out: bool = False
    oom_killed: bool = False
    killed: bool = False
    truncated: bool = False
    stdout_size: int = 0  # the true size, also when truncated
    stderr_size: int = 0
    stdout_cut: int | None = None  # where the omitted middle was, in stdout_bytes (None: nothing omitted)
    stderr_cut: int | None = None
    pid: int = 0
    id: str = ""
    # Egress the command tried that policy refused (the proxy's records, in order): tools like pip and curl do
    # not print a proxy's reason, so the result carries it.
    egress_denials: tuple[EgressEvent, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.oom_killed)


@dataclass(frozen=True)
class ProcessInfo:
    """A background (or running) process inside a sandbox."""

    id: str
    pid: int
    argv: list[str]
    running: bool
    pty: bool = False
    started_at: float = 0.0
    exit_code: int | None = None


@dataclass(frozen=True)
class Entry:
    """One file system entry, as the sandbox sees it."""

    name: str
    path: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    mtime: float
    target: str | None = None  # a symlink's text
    owner: str = ""  # names as the sandbox's /etc/passwd and /etc/group say; the number as text if unknown
    group: str = ""
    permissions: str = ""  # as `ls -l` shows them: "-rw-r--r--", "drwxr-xr-x", "lrwxrwxrwx"
    metadata: dict[str, str] = field(default_factory=dict, hash=False)  # its user.e2b.* xattrs, prefix stripped
    resolved: str | None = None  # a symlink: the absolute path it finally leads to
    target_type: str | None = None  # a symlink: the type of what is there; None if nothing (it dangles)

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"


WatchEventType = Literal["create", "write", "chmod", "remove", "rename", "overflow"]


@dataclass(frozen=True)
class WatchEvent:
    """One change in a watched directory, named as Go's fsnotify names inotify's events (E2B's envd does too).

    `name` is relative to the watched directory ("nested/f.txt" in a recursive watch, "." the directory
    itself). `overflow`: events were lost here (a full queue), `name` is empty. `entry` (when the watch was
    asked to include it, for create, write and chmod): the entry as it was when the event was read; None if it
    was gone by then."""

    type: WatchEventType
    name: str
    entry: Entry | None = None


@dataclass
class OutputCollector:
    """Rebuilds one stream from live frames, a `tail` event and the tail frames (I/O-free)."""

    data: bytearray = field(default_factory=bytearray)
    cut: int | None = None

    def mark_tail(self, omitted: int) -> None:
        if omitted:
            self.cut = len(self.data)
