"""What the SDK hands back: command results, directory entries, sandbox descriptions and resource metrics.

Bytes are the truth; text is a view of them. `CommandResult.stdout` decodes `stdout_bytes` as UTF-8 with invalid
sequences replaced by U+FFFD, so reading output never raises.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .._exceptions import ServerError
from .._output import OutputText, ReclaimedTree, egress_notice, reclaim_notice, reclaimed_from_wire

__all__ = ["CommandResult", "EgressDenial", "Entry", "ReclaimedTree", "SandboxInfo", "SandboxMetric"]


def _b64(value: Any, what: str) -> bytes:
    if value is None or value == "":
        return b""
    if not isinstance(value, str):
        raise ServerError(f"malformed response from Corral: {what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ServerError(f"malformed response from Corral: {what} is not valid base64") from exc


def _network(value: Any) -> str | tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else str(value or "none")


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True)
class EgressDenial:
    """A connection or DNS lookup the sandbox's network policy refused (docs/egress.md)."""

    kind: str  # "connect", "http", "mirror" or "dns"
    host: str
    port: int | None
    reason: str  # names the host, the policy and how to get it allowed
    rule: str = ""

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> EgressDenial:
        return cls(kind=str(data.get("kind") or ""), host=str(data.get("host") or ""),
                   port=_opt_int(data.get("port")), reason=str(data.get("reason") or ""),
                   rule=str(data.get("rule") or ""))


@dataclass(frozen=True)
class CommandResult(OutputText):
    """The outcome of one command. Never raised: a non-zero exit, a timeout or an OOM kill are fields here.

    **Fields:**

    * `exit_code` - the process's exit status; `None` when it has none (killed by `signal`).
    * `stdout_bytes`, `stderr_bytes` - the exact bytes (with `truncated`, the kept part only).
    * `timed_out`, `oom_killed`, `killed` - how the command ended, if not by itself.
    * `truncated` - output went over the limit; `stdout_size`/`stderr_size` still count every byte produced.
    * `stdout_cut`, `stderr_cut` - with `truncated`, the offset in `stdout_bytes`/`stderr_bytes` where the
      omitted middle was (the kept head before it, the kept tail after it); `None` when nothing was omitted.
    * `duration` - wall-clock seconds.
    * `egress_denials` - network access the sandbox's policy refused while the command ran (pip, curl and git
      do not print a proxy's reason), one per attempt; `notice` is the same as text to show next to stderr, one
      line per host, port and reason with its count of attempts.
    * `reclaimed` - what the sandbox stopped to make room for this command under its pids limit: processes that
      commands which had already ended left running (a fork bomb's last generations, say), one `ReclaimedTree`
      per command they came from (its id and command line, and how many were stopped); `notice` says it too.
    """

    exit_code: int | None
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    timed_out: bool = False
    oom_killed: bool = False
    killed: bool = False
    truncated: bool = False
    stdout_size: int = 0
    stderr_size: int = 0
    stdout_cut: int | None = None
    stderr_cut: int | None = None
    signal: int | None = None
    duration: float = 0.0
    egress_denials: tuple[EgressDenial, ...] = ()
    reclaimed: tuple[ReclaimedTree, ...] = ()
    checkpoint: str | None = None  # the automatic checkpoint taken before it (`checkpoints="auto"`), else None

    @property
    def notice(self) -> str:
        """One line per refused host, port and reason, then one per leftover tree stopped to make room
        (`reclaimed`), e.g. for an agent to read next to stderr ("" if none).

        A tool that retries (pip tries 6 times) is refused as often; the line says so once: `... (6 attempts)`.
        """
        return (egress_notice((d.host, d.port, d.reason) for d in self.egress_denials)
                + reclaim_notice(self.reclaimed))

    @classmethod
    def from_wire(
        cls, data: dict[str, Any], *, stdout_prefix: bytes = b"", stderr_prefix: bytes = b""
    ) -> CommandResult:
        """Build from the API's result object; `*_prefix` are bytes already received as stream events."""
        out = stdout_prefix + _b64(data.get("stdout_b64"), "stdout_b64")
        err = stderr_prefix + _b64(data.get("stderr_b64"), "stderr_b64")
        return cls(
            exit_code=_opt_int(data.get("exit_code")),
            stdout_bytes=out,
            stderr_bytes=err,
            timed_out=bool(data.get("timed_out")),
            oom_killed=bool(data.get("oom_killed")),
            killed=bool(data.get("killed")),
            truncated=bool(data.get("truncated")),
            stdout_size=int(data.get("stdout_size") or len(out)),
            stderr_size=int(data.get("stderr_size") or len(err)),
            stdout_cut=_opt_int(data.get("stdout_cut")),
            stderr_cut=_opt_int(data.get("stderr_cut")),
            signal=_opt_int(data.get("signal")),
            duration=float(data.get("duration") or 0.0),
            egress_denials=tuple(EgressDenial.from_wire(d) for d in data.get("egress_denials") or ()
                                 if isinstance(d, dict)),
            reclaimed=reclaimed_from_wire(data.get("reclaimed")),
            checkpoint=_opt_str(data.get("checkpoint")),
        )


_DIR_TYPES = frozenset({"dir", "directory"})


@dataclass(frozen=True)
class Entry:
    """One file system entry in a sandbox, from `files.list` (and `files.write`)."""

    name: str
    path: str
    size: int
    is_dir: bool
    type: str = "file"
    mode: int | None = None
    mtime: float | None = None
    owner: str | None = None  # user and group names inside the sandbox (None from servers before they were sent)
    group: str | None = None
    permissions: str | None = None  # as `ls -l` shows them, e.g. "-rw-r--r--"
    target: str | None = None  # a symlink's text
    metadata: dict[str, str] | None = field(default=None, hash=False)  # its user.e2b.* xattrs, prefix stripped
    checkpoint: str | None = None  # `files.write`'s: the automatic checkpoint taken before it (`checkpoints="auto"`)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Entry:
        kind = str(data.get("type") or "file")
        path = str(data["path"])
        metadata = data.get("metadata")
        return cls(
            name=str(data.get("name") or path.rstrip("/").rsplit("/", 1)[-1]),
            path=path,
            size=int(data.get("size") or 0),
            is_dir=kind in _DIR_TYPES,
            type=kind,
            mode=_opt_int(data.get("mode")),
            mtime=None if data.get("mtime") is None else float(data["mtime"]),
            owner=_opt_str(data.get("owner")),
            group=_opt_str(data.get("group")),
            permissions=_opt_str(data.get("permissions")),
            target=_opt_str(data.get("target")),
            metadata={str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else None,
            checkpoint=_opt_str(data.get("checkpoint")),
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the server describes it (`Sandbox.list()`, `sb.info`)."""

    id: str
    state: str
    template: str
    runtime: str | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    created_at: str | None = None
    expires_at: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    file_roots: tuple[str, ...] = ()  # the directories `files` may touch
    network: str | tuple[str, ...] = "none"  # the egress policy (docs/egress.md)
    paused_to_disk: bool = False  # state "paused" with no process nor memory left (docs/lifecycle.md)
    on_timeout: str = "kill"  # what the end of its time to live does: "kill" or "pause" (to disk)
    auto_resume: bool = False  # paused, the next request that reaches it resumes it (docs/lifecycle.md)
    ttl_left: float | None = None  # paused to disk: the seconds of life it gets back when it resumes
    root: bool = False  # created with root inside (docs/security.md)
    checkpoints: str = "manual"  # "auto": a checkpoint before each change to its files (docs/lifecycle.md)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> SandboxInfo:
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ServerError("malformed response from Corral: expected a sandbox object with an 'id'")
        return cls(
            id=data["id"],
            state=str(data.get("state") or ""),
            template=str(data.get("template") or ""),
            runtime=data.get("runtime"),
            limits=dict(data.get("limits") or {}),
            created_at=data.get("created_at"),
            expires_at=data.get("expires_at"),
            metadata=dict(data.get("metadata") or {}),
            file_roots=tuple(str(r) for r in data.get("file_roots") or ()),
            network=_network(data.get("network")),
            paused_to_disk=bool(data.get("paused_to_disk")),
            on_timeout=str(data.get("on_timeout") or "kill"),
            auto_resume=bool(data.get("auto_resume")),
            ttl_left=float(data["ttl_left"]) if isinstance(data.get("ttl_left"), int | float) else None,
            root=bool(data.get("root")),
            checkpoints=str(data.get("checkpoints") or "manual"),
        )


@dataclass(frozen=True)
class SandboxMetric:
    """One sample of what a sandbox used (`sb.get_metrics()`): one every 5 s while it runs, none while paused.

    Sizes are bytes; `cpu_used_pct` is the share of its `cpus` used since the sample before (100: all of them
    busy all the time); `memory_used` leaves out page cache the kernel can drop (files in /tmp count: /tmp is
    memory); `disk_used` is what it wrote to its own disk, not the template's files.
    """

    timestamp: datetime  # UTC, to the second
    cpus: float
    cpu_used_pct: float
    memory_used: int
    memory_total: int
    memory_cache: int
    disk_used: int
    disk_total: int

    @classmethod
    def from_wire(cls, data: Any) -> SandboxMetric:
        try:
            stamp = datetime.fromisoformat(data["timestamp"])
            return cls(timestamp=stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC),
                       cpus=float(data["cpus"]), cpu_used_pct=float(data["cpu_used_pct"]),
                       memory_used=int(data["memory_used"]), memory_total=int(data["memory_total"]),
                       memory_cache=int(data["memory_cache"]), disk_used=int(data["disk_used"]),
                       disk_total=int(data["disk_total"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ServerError(f"malformed response from Corral: not a metrics sample ({exc!r})") from exc
