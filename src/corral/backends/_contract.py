"""The backend contract: what a runtime must do to host Corral sandboxes (docs/backends.md).

A backend turns a `SandboxSpec` and a template into a running, isolated sandbox whose agent can be reached, and
takes it down again. Everything that happens *inside* a sandbox (exec, files, code, PTY) goes through the agent
protocol and is the same for every backend: a backend owns the lifecycle, the isolation, and the way to reach
the agent (`AgentAddress`), nothing else.

This module is a leaf: it imports the spec, the template type and the error tree, never the engine or an
implementation. The engine loads an implementation by name (`load_backend`), so `corral serve --backend docker`
needs the Docker SDK and `--backend local` does not.

What the engine does around the contract (so a backend does not): it chooses the sandbox id, keeps its own state
(spec, times, the backend's record as `to_json()`), waits for the agent to answer after `create` (up to
`ready_timeout`, quoting `diagnostics` if it never does), attaches the egress proxy to `egress_endpoint`, turns a
SIGKILL plus a moved `oom_kills` counter into an OOM outcome, and destroys what `create` made if anything after it
fails.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from .._exceptions import RuntimeUnavailableError
from ..templates import Template
from ._spec import Limits, Runtime, SandboxSpec

__all__ = [
    "BACKEND_NAMES",
    "CHANGE_KINDS",
    "CHECKPOINTS_LIMITATION",
    "ROOT_LIMITATION",
    "AgentAddress",
    "Backend",
    "BackendCapacity",
    "BackendRecord",
    "CheckpointArtifact",
    "Checkpointing",
    "DeclaresLimitations",
    "Endpoint",
    "PathChange",
    "RemoteEgress",
    "SandboxUsage",
    "SnapshotArtifact",
    "TCPEndpoint",
    "UnixEndpoint",
    "backend_limitations",
    "backend_runtimes",
    "load_backend",
    "runtime_limitation",
    "supports_checkpoints",
    "supports_root",
]

JSON = dict[str, Any]  # JSON-serialisable: what `BackendRecord.to_json` returns and `Backend.restore` takes


@dataclass(frozen=True)
class UnixEndpoint:
    """A Unix socket on the engine's host (the local and Docker backends)."""

    path: str


@dataclass(frozen=True)
class TCPEndpoint:
    """A TCP address the engine can reach (a Pod's IP on the Kubernetes backend)."""

    host: str
    port: int


Endpoint = UnixEndpoint | TCPEndpoint


@dataclass(frozen=True)
class AgentAddress:
    """How to reach one sandbox's agent: where, and the per-sandbox token every request must carry."""

    endpoint: Endpoint
    token: str


@dataclass(frozen=True)
class BackendRecord(ABC):
    """What a backend needs to find one of its sandboxes again, also after a restart of the engine.

    Each backend subclasses it with its own typed fields; the engine stores `to_json()` and gives it back to
    `Backend.restore`. It holds no secrets beyond the agent token, which lives with the sandbox anyway.
    """

    sandbox_id: str

    @abstractmethod
    def to_json(self) -> JSON: ...


@dataclass(frozen=True)
class SnapshotArtifact:
    """What a backend keeps of a snapshot (docs/lifecycle.md): the filesystem of a sandbox at one instant.

    `template` is the digest of the template the sandbox started from (a snapshot starts sandboxes on top of
    it); `data` is the backend's own (a layer's id, an image's name), JSON, kept by the caller and given back to
    `create(source=...)` and `delete_snapshot`.
    """

    snapshot_id: str
    template: str
    size_bytes: int
    data: JSON

    def to_json(self) -> JSON:
        return {"snapshot_id": self.snapshot_id, "template": self.template, "size_bytes": self.size_bytes,
                "data": self.data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SnapshotArtifact:
        try:
            return cls(snapshot_id=str(data["snapshot_id"]), template=str(data["template"]),
                       size_bytes=int(data["size_bytes"]), data=dict(data["data"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a snapshot artifact: {exc!r}") from None


@dataclass(frozen=True)
class CheckpointArtifact:
    """What a backend keeps of a checkpoint (docs/lifecycle.md, "Checkpoints"): a sandbox's writable filesystem
    at one instant, to be put back in place in that same sandbox (`Checkpointing.restore_checkpoint`).

    `checkpoint_id` is the caller's (`ckpt-<16 hex>`); `size_bytes` the bytes of objects this checkpoint added
    (what changed since the one before it, not the whole disk); `data` the backend's own, JSON, kept by the caller
    and given back to every other `Checkpointing` call.
    """

    checkpoint_id: str
    size_bytes: int
    data: JSON

    def to_json(self) -> JSON:
        return {"checkpoint_id": self.checkpoint_id, "size_bytes": self.size_bytes, "data": self.data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointArtifact:
        try:
            return cls(checkpoint_id=str(data["checkpoint_id"]), size_bytes=int(data["size_bytes"]),
                       data=dict(data["data"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a checkpoint artifact: {exc!r}") from None


ChangeKind = Literal["added", "modified", "deleted", "mode"]
EntryType = Literal["file", "dir", "symlink", "other"]
CHANGE_KINDS: tuple[ChangeKind, ...] = get_args(ChangeKind)


@dataclass(frozen=True)
class PathChange:
    """One path that differs between two states of a sandbox's filesystem (`Checkpointing.checkpoint_changes`).

    `kind` "mode": only its mode or owner changed (its contents did not). Sizes are bytes of a regular file's
    contents (a symlink's: its target's length; 0 for a directory); `size` None when deleted, `old_size` None when
    added. `type` is what the path is now (what it was, for a deleted one).
    """

    path: str  # absolute, as the sandbox sees it ("/workspace/a.txt")
    kind: ChangeKind
    size: int | None
    old_size: int | None
    type: EntryType

    def to_json(self) -> JSON:
        return {"path": self.path, "kind": self.kind, "size": self.size, "old_size": self.old_size,
                "type": self.type}


@runtime_checkable
class Checkpointing(Protocol):
    """Optional beside `Backend`: checkpoints of a sandbox's writable filesystem, restored in place.

    Errors: `CapacityError` when a checkpoint does not fit (the sandbox's disk, or the backend's room for
    them), `NotFoundError` for a checkpoint the backend no longer has, `ConflictError` for a state that forbids
    the call (a restore of a sandbox that runs). A backend that cannot declares the `checkpoints` limitation.
    """

    async def checkpoint(self, record: BackendRecord, checkpoint_id: str) -> CheckpointArtifact:
        """Keep the sandbox's writable filesystem as it is now, its processes frozen for it (never torn); a
        sandbox paused to disk stays so. Costs what changed since its last checkpoint or restore."""

    async def restore_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact,
                                 paths: Sequence[str] | None = None) -> None:
        """Put the filesystem back as it was at `checkpoint` (contents, modes, owners, symlinks; deletions undone,
        files made since removed). The sandbox is stopped (`stop`: nothing of its overlay is mounted). `paths`:
        absolute sandbox paths, checked already; each is restored with everything below it, the rest untouched
        (a path absent at the checkpoint is removed)."""

    async def checkpoint_changes(self, record: BackendRecord, since: CheckpointArtifact,
                                 until: CheckpointArtifact | None = None) -> list[PathChange]:
        """What differs between `since` and `until` (None: the filesystem now), sorted by path."""

    async def checkpoint_read(self, record: BackendRecord, checkpoint: CheckpointArtifact, path: str,
                              limit: int) -> bytes | None:
        """Up to `limit` bytes of the regular file at `path` as it was at `checkpoint` (the template's file where
        the sandbox had not changed it); None where there was none, or not a regular file."""

    async def delete_checkpoint(self, record: BackendRecord, checkpoint: CheckpointArtifact) -> None:
        """Forget a checkpoint and free what no other one uses. Idempotent."""

    async def checkpoints_size(self, record: BackendRecord) -> int:
        """Bytes all the sandbox's checkpoints hold now."""


@dataclass(frozen=True)
class BackendCapacity:
    """What the place sandboxes run in can still take, as the backend sees it (None: no figure).

    The engine's `Capacity` policy turns these into refusals (503 with Retry-After) before anything starts.
    """

    memory_total: int | None = None  # bytes of memory sandboxes share (a machine's, a cluster's allocatable)
    memory_available: int | None = None  # bytes that could be given now without swapping or evicting
    disk_free: int | None = None  # bytes free where sandbox disks grow
    sandboxes_max: int | None = None  # a hard count the backend itself imposes (slots, node pod limits)


@dataclass(frozen=True, slots=True)
class SandboxUsage:
    """What one sandbox uses now, as its runtime accounts it (`Backend.usage`); the service samples it.

    Counters, not rates: `cpu_seconds` grows while the sandbox runs (it starts again from 0 when a sandbox
    paused to disk boots); whoever wants a CPU percentage divides the difference of two readings by the time
    between their `at`. Limits are the ones in force (the host's figure where there is none).
    """

    cpu_seconds: float  # CPU time every process of the sandbox has used (user + system)
    memory_bytes: int  # memory it holds that the kernel cannot simply drop: charged minus inactive file cache
    memory_cache_bytes: int  # page cache charged to it (tmpfs pages too: /tmp is memory)
    memory_limit: int
    disk_used: int  # bytes used on its own disk (what `limits.disk` bounds), not the template's files
    disk_total: int
    cpus: float  # CPUs it may use (its quota)
    at: float  # unix time the figures were read


@runtime_checkable
class Backend(Protocol):
    """A runtime for sandboxes. Every method is async and safe to call concurrently for different sandboxes.

    Errors: a backend raises `CorralError` subclasses only, foreign errors mapped at its boundary with
    `raise ... from`: `RuntimeUnavailableError` when isolation cannot be had (fail closed, say what is missing and
    how to fix it), `ConflictError` for a state that forbids the operation, `ServerError` for the rest.
    """

    name: str

    async def check(self, spec: SandboxSpec) -> None:
        """Raise `RuntimeUnavailableError` naming whatever isolation `spec` needs and this host lacks."""

    async def create(self, sandbox_id: str, spec: SandboxSpec, template: Template,
                     source: SnapshotArtifact | None = None) -> BackendRecord:
        """Start the sandbox with every protection of docs/backends.md and return its record.

        With `source` (one of this backend's snapshots, taken of a sandbox of `template`), the sandbox starts
        with that snapshot's files on top of the template. `spec.volumes` maps mount paths to ids of this
        backend's volumes (`create_volume`). On return the sandbox runs; its agent may still be starting (the
        engine waits for it). On failure, including cancellation, nothing of the sandbox is left.
        """

    def agent_address(self, record: BackendRecord) -> AgentAddress:
        """Where the engine reaches the agent. Fixed for the sandbox's life: the engine may keep it."""

    def ready_timeout(self, record: BackendRecord) -> float:
        """Seconds the engine waits after `create` for the agent's first answer before giving up."""

    def egress_endpoint(self, record: BackendRecord) -> UnixEndpoint:
        """Where the egress proxy must listen for this sandbox: the agent bridges 127.0.0.1:3128 to it."""

    async def diagnostics(self, record: BackendRecord) -> str:
        """A short text on why a sandbox may have failed (the end of its runtime's and agent's log)."""

    async def pause(self, record: BackendRecord) -> None:
        """Freeze every process of the sandbox in place (memory kept)."""

    async def resume(self, record: BackendRecord) -> None: ...

    async def stop(self, record: BackendRecord) -> None:
        """Pause to disk: end every process and release the sandbox's memory and cgroup; its filesystem (the
        disk, not the tmpfs mounts) stays. `boot` starts it again; `destroy` removes it. Idempotent."""

    async def boot(self, record: BackendRecord, spec: SandboxSpec) -> BackendRecord:
        """Start a stopped sandbox again on its kept filesystem, with `spec`'s limits and volumes. On return it
        runs (the engine waits for its agent again); the record returned replaces the old one. On failure the
        sandbox is stopped again, its filesystem untouched."""

    async def snapshot(self, record: BackendRecord, snapshot_id: str) -> SnapshotArtifact:
        """Keep the sandbox's filesystem as it is now (processes frozen for the copy, never a torn one) as an
        artifact that `create(source=...)` starts sandboxes from. The sandbox runs on as before."""

    async def delete_snapshot(self, snapshot: SnapshotArtifact) -> None:
        """Remove a snapshot. Sandboxes started from it keep working (what they still use stays until they
        end). Idempotent."""

    async def create_volume(self, volume_id: str, size: int) -> None:
        """Make an empty volume of `size` bytes, a hard limit (ENOSPC inside a sandbox at the limit)."""

    async def delete_volume(self, volume_id: str) -> None:
        """Remove a volume no sandbox mounts (`ConflictError` otherwise, naming them). Idempotent."""

    async def volume_used(self, volume_id: str) -> int:
        """Bytes the volume's files take now."""

    async def destroy(self, record: BackendRecord) -> None:
        """Stop the sandbox and remove every trace of it (processes, mounts, cgroups, containers, files).

        Idempotent: destroying what is already gone succeeds."""

    async def alive(self, record: BackendRecord) -> bool:
        """Whether the sandbox still runs (or is paused)."""

    async def frozen(self, record: BackendRecord) -> bool:
        """Whether the sandbox's processes are frozen in place (`pause`), as the runtime says now. Asked after a
        restart, so that a server killed between a pause and its record can make the backend agree with the
        store, which is the only record. False for one that runs, is gone, or a runtime that cannot freeze."""

    async def oom_kills(self, record: BackendRecord) -> int:
        """How many processes the OOM killer has killed in the sandbox so far (0 if the runtime cannot tell)."""

    async def usage(self, record: BackendRecord) -> SandboxUsage | None:
        """What the sandbox uses now: a few small reads, no subprocess (called every few seconds per sandbox).
        None when nothing of it runs to measure (paused to disk, gone, still being made)."""

    def restore(self, data: JSON) -> BackendRecord:
        """The record from its `to_json()`; `ValueError` if `data` is not one of this backend's records."""

    async def adopt(self, record: BackendRecord) -> None:
        """Take back a sandbox found alive after a restart (reserve what it holds, such as its uid range)."""

    async def sweep(self, known: set[str]) -> list[str]:
        """Remove this backend's sandboxes whose ids are not in `known` (half-created, orphaned); their ids."""

    async def capacity(self) -> BackendCapacity: ...

    async def close(self) -> None:
        """Release what the backend holds for all sandboxes (not the sandboxes: they outlive the engine)."""


@runtime_checkable
class DeclaresLimitations(Protocol):
    """Optional beside `Backend`: what of DESIGN.md's isolation this backend cannot give, each with its reason.

    Keys are stable names (docs/backends.md): `user_namespace`, `agent_socket`, `root` (no sandbox with root:
    `supports_root`), and `runtime_<name>` for each `Runtime` it cannot run. A backend that gives everything
    declares nothing, or an empty mapping. `corral check` reads it (through `GET /v1/info`) to mark what cannot
    hold as not applicable, with the reason.
    """

    limitations: Mapping[str, str]


def backend_limitations(backend: object) -> Mapping[str, str]:
    """What `backend` declares it cannot give (`DeclaresLimitations`); empty when it declares nothing."""
    found = backend.limitations if isinstance(backend, DeclaresLimitations) else {}
    return MappingProxyType(dict(found))


@runtime_checkable
class Resizable(Protocol):
    """Optional beside `Backend`: it can change a running sandbox's memory, CPU and pids limits in place. Warm
    pools (docs/performance.md) then serve specs that differ from the pool's in those limits only, resized at the
    claim; other limits (disk, open files, /tmp, /dev/shm) are fixed when a sandbox starts and stay in the pool key.
    A refusal (e.g. memory under what the sandbox uses) raises; the engine then starts one cold instead."""

    async def resize(self, record: BackendRecord, limits: Limits) -> None: ...


RESIZABLE_LIMITS = ("memory", "cpus", "pids")  # what `Resizable.resize` changes


@runtime_checkable
class RemoteEgress(Protocol):
    """Optional beside `Backend`: its sandboxes reach an egress proxy of their own platform (the Kubernetes
    backend's proxy Service), not one the engine runs for them on a Unix socket.

    The engine then attaches no local proxy (`egress_endpoint` is not called) and gives every command
    `egress_env(record, packages=...)` in place of its local proxy variables: the proxy URL, with the sandbox's
    credential in it, and with `packages` (the policy grants `@packages`) the package mirror's variables. Empty:
    no proxy is known, and the sandbox has no way out. The engine reads the refusals of such a proxy from
    `Engine.remote_denials` (the proxy records them where the engine's caller can read them).
    """

    def egress_env(self, record: BackendRecord, *, packages: bool = False) -> Mapping[str, str]: ...


ROOT_LIMITATION = "root"  # the key of a backend that cannot give a sandbox root (`SandboxSpec.root`) safely


def supports_root(backend: object) -> bool:
    """Whether `backend` can create sandboxes with root inside (`SandboxSpec.root`): those with a user namespace
    per sandbox, so that its root is an unprivileged host uid. A backend that cannot declares the limitation."""
    return ROOT_LIMITATION not in backend_limitations(backend)


CHECKPOINTS_LIMITATION = "checkpoints"  # the key of a backend that cannot checkpoint and restore in place


def supports_checkpoints(backend: object) -> bool:
    """Whether `backend` implements `Checkpointing` and declares no `checkpoints` limitation."""
    return isinstance(backend, Checkpointing) and CHECKPOINTS_LIMITATION not in backend_limitations(backend)


def runtime_limitation(runtime: Runtime) -> str:
    """The `limitations` key of a runtime a backend cannot run (`runtime_runsc`)."""
    return f"runtime_{runtime.value}"


def backend_runtimes(backend: object) -> tuple[Runtime, ...]:
    """The runtimes `backend` can run: every `Runtime` it does not declare a limitation of."""
    limits = backend_limitations(backend)
    return tuple(rt for rt in Runtime if runtime_limitation(rt) not in limits)


# name -> (module, class, the extra that brings its dependencies)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "local": ("corral.backends.local", "LocalBackend", "server"),
    "docker": ("corral.backends.docker", "DockerBackend", "docker"),
    # The module itself, not the package: the package imports without the client (`corral k8s manifests`).
    "kubernetes": ("corral.backends.kubernetes._backend", "KubernetesBackend", "kubernetes"),
}
BACKEND_NAMES: tuple[str, ...] = tuple(_BACKENDS)


class _Factory(Protocol):
    def __call__(self, home: Path, **options: Any) -> Backend: ...


def load_backend(name: str, home: Path, **options: Any) -> Backend:
    """The backend called `name`, imported only now: its dependencies are needed only when it is chosen."""
    try:
        module_name, class_name, extra = _BACKENDS[name]
    except KeyError:
        raise RuntimeUnavailableError(f"no backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}",
                                      details={"backend": name}) from None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RuntimeUnavailableError(f"the {name} backend needs {exc.name!r}: install corral[{extra}]",
                                      details={"backend": name, "missing": exc.name}) from exc
    factory: _Factory = getattr(module, class_name)
    return factory(home, **options)

