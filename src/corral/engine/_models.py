"""Typed results of the engine API: plain frozen dataclasses (made by us, often, and cheap). The spec they answer
to lives in `corral.backends._spec`, shared with the backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from .._exceptions import InvalidRequestError
from .._output import OutputText, ReclaimedTree  # a leaf shared with the SDK, which must not import the engine
from ..backends._spec import DEFAULT_FILE_ROOTS, Limits, Runtime, SandboxSpec, SandboxState, parse_size

if TYPE_CHECKING:
    from ..egress import EgressEvent

__all__ = [
    "DEFAULT_FILE_ROOTS", "Entry", "ExecResult", "FollowedOutput", "Limits", "OutputCollector", "ProcessInfo",
    "ProcessRef", "ProcessSelector", "PtySize", "Runtime", "SandboxInfo", "SandboxSpec", "SandboxState",
    "WatchEvent", "WatchEventType", "parse_size",
]


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    state: SandboxState
    template: str
    runtime: str
    limits: Limits
    created_at: datetime
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
    # Leftovers of ended commands the agent stopped to make room under the pids limit before this one started.
    reclaimed: tuple[ReclaimedTree, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.oom_killed)


@dataclass(frozen=True)
class ProcessInfo:
    """A background (or running) process inside a sandbox.

    `env` is the command's own environment, what it was started with on top of the sandbox's (which `ps`
    never shows); `tag` the name it was started under, if any."""

    id: str
    pid: int
    argv: list[str]
    running: bool
    pty: bool = False
    started_at: float = 0.0
    exit_code: int | None = None
    tag: str | None = None
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PtySize:
    """A terminal's size in character cells."""

    rows: int
    cols: int


@dataclass(frozen=True)
class ProcessRef:
    """Which process of a sandbox: Corral's `id`, the `pid` inside the sandbox, or the `tag` it was started
    with; exactly one. Wherever a `ProcessSelector` is taken, a plain `str` is Corral's id.

    A pid or a tag can have named a finished process before a running one (pids are reused; a tag is free once
    its process ended): the running one is meant, else the newest. The agent checks the values.
    """

    id: str | None = None
    pid: int | None = None
    tag: str | None = None

    def __post_init__(self) -> None:
        if sum(value is not None for value in (self.id, self.pid, self.tag)) != 1:
            raise InvalidRequestError("name a process by exactly one of id, pid or tag")

    @classmethod
    def of(cls, ref: ProcessSelector) -> ProcessRef:
        return ref if isinstance(ref, ProcessRef) else cls(id=ref)

    def selector(self) -> dict[str, str | int]:
        """The one field that names the process, as the agent's requests (and audit records) carry it."""
        if self.pid is not None:
            return {"pid": self.pid}
        return {"tag": self.tag} if self.tag is not None else {"id": str(self.id)}

    def __str__(self) -> str:
        [(key, value)] = self.selector().items()
        return f"{key} {value!r}"


ProcessSelector = ProcessRef | str


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


@dataclass
class FollowedOutput:
    """One stream of a followed process as the host keeps it (I/O-free): all of it up to `limit` bytes, past
    that the first 3/4 of the limit and the newest 1/4 (the agent's own rule), so that following a process for
    days costs bounded memory. `gap()`: the agent left bytes out here (its kept output had a tail)."""

    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    omitted: bool = False

    def feed(self, data: bytes) -> None:
        if not self.omitted:
            room = max(0, self.limit - self.limit // 4 - len(self.head))
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > 2 * self._tail_cap:  # trimmed now and then, not per chunk: amortized O(1)
            self._trim()

    def gap(self) -> None:
        self.omitted = True

    def kept(self) -> tuple[bytes, int | None]:
        """The bytes kept and where the omitted middle was in them (None: nothing omitted)."""
        self._trim()
        return bytes(self.head + self.tail), len(self.head) if self.omitted else None

    @property
    def _tail_cap(self) -> int:
        return self.limit // 4

    def _trim(self) -> None:
        excess = len(self.tail) - self._tail_cap
        if excess > 0:
            del self.tail[:excess]
            self.omitted = True
