"""What a sandbox is asked to be: template, runtime, limits, timeout, environment, egress policy, file roots.

A leaf shared by every layer that handles a spec (the service, the engine, the store, each backend): pydantic
models, because they validate what users send and say what is wrong. `SandboxState` is the one lifecycle enum.
"""

from __future__ import annotations

import dataclasses
import itertools
import posixpath
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .._exceptions import CorralError
from .._sizes import parse_size
from .._users import USERS, check_user, user_home  # what every layer means by a sandbox's users, re-exported
from ..egress._keyring import SecretKeyring
from ..egress._policy import EgressPolicy
from ..egress._secrets import PLACEHOLDER, SecretBinding

__all__ = ["DEFAULT_FILE_ROOTS", "MAX_SECRETS", "ROOT_FILE_ROOTS", "USERS", "Limits", "Runtime", "SandboxSpec",
           "SandboxState", "SealedSecret", "check_user", "parse_size", "user_home"]

DEFAULT_FILE_ROOTS = ("/workspace", "/home/user", "/tmp")
ROOT_FILE_ROOTS = (*DEFAULT_FILE_ROOTS, "/root")  # the defaults of a sandbox created with root: root's home too
# Kernel interfaces and Corral's own agent directory are never file-API roots: the sandbox's root user could
# otherwise be driven through the API into places its own processes only reach with care.
_FORBIDDEN_ROOTS = ("/proc", "/sys", "/dev", "/.corral")
_MAX_FILE_ROOTS = 16
DEFAULT_CHECKPOINT_KEEP = 20  # automatic checkpoints kept per sandbox (issue 26)
MAX_CHECKPOINT_KEEP = 1000
_MAX_VOLUMES = 8
MAX_SECRETS = 32
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Volumes are mounted over the disk's own tree; these are the kernel's, Corral's, or tmpfs mounts of their own.
_FORBIDDEN_VOLUME_PATHS = ("/proc", "/sys", "/dev", "/.corral", "/tmp")


class Runtime(StrEnum):
    RUNC = "runc"
    RUNSC = "runsc"


_TMPFS_RESERVE = 32 * 1024**2  # memory kept for processes when /tmp and /dev/shm are full


class Limits(BaseModel):
    """Resource limits of one sandbox. Sizes take bytes or strings like `512M`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory: int = 512 * 1024**2
    cpus: float = 1.0
    pids: int = 256
    disk: int = 1024**3
    open_files: int = 4096
    tmp: int = 256 * 1024**2  # /tmp tmpfs; counts against memory
    shm: int = 64 * 1024**2  # /dev/shm tmpfs; counts against memory

    @field_validator("memory", "disk", "tmp", "shm", mode="before")
    @classmethod
    def _size(cls, value: Any, info: Any) -> int:
        return parse_size(value, info.field_name)

    @field_validator("memory")
    @classmethod
    def _memory_floor(cls, value: int) -> int:
        if value < 32 * 1024**2:
            raise ValueError("memory must be at least 32M (the in-sandbox agent needs about 12M)")
        return value

    @field_validator("disk")
    @classmethod
    def _disk_floor(cls, value: int) -> int:
        if value < 16 * 1024**2:
            raise ValueError("disk must be at least 16M")
        return value

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: float) -> float:
        if not 0.01 <= value <= 1024:
            raise ValueError("cpus must be between 0.01 and 1024")
        return value

    @field_validator("pids")
    @classmethod
    def _pids(cls, value: int) -> int:
        if not 16 <= value <= 1_000_000:
            raise ValueError("pids must be between 16 and 1000000")
        return value

    @field_validator("open_files")
    @classmethod
    def _open_files(cls, value: int) -> int:
        if not 64 <= value <= 1_048_576:
            raise ValueError("open_files must be between 64 and 1048576")
        return value

    @model_validator(mode="after")
    def _tmpfs_fit_in_memory(self) -> Limits:
        # /tmp and /dev/shm are tmpfs, whose pages are charged to the sandbox's memory and which the OOM killer
        # cannot free: a /tmp as big as the memory limit, once full, leaves nothing for the agent, which is
        # killed (found by the eval corpus: 200 MiB into /tmp under memory=128M). So both must fit in memory
        # less a reserve; sizes left at their defaults shrink to fit, sizes given that do not fit are refused.
        budget = self.memory - min(_TMPFS_RESERVE, self.memory // 2)
        if self.tmp + self.shm <= budget:
            return self
        given = self.model_fields_set
        if {"tmp", "shm"} <= given:
            raise ValueError(f"tmp ({self.tmp >> 20}M) and shm ({self.shm >> 20}M) together must be at most "
                             f"{budget >> 20}M: tmpfs pages count against memory ({self.memory >> 20}M), which "
                             f"keeps {min(_TMPFS_RESERVE, self.memory // 2) >> 20}M for processes")
        if "tmp" in given:
            tmp, shm = self.tmp, min(self.shm, budget // 4, budget - self.tmp)
        else:
            shm = self.shm if "shm" in given else min(self.shm, budget // 4)
            tmp = min(self.tmp, budget - shm)
        if tmp < 1 << 20 or shm < 1 << 20 or tmp + shm > budget:
            what = "tmp" if "tmp" in given else "shm"
            raise ValueError(f"{what} ({getattr(self, what) >> 20}M) leaves no room in memory "
                             f"({self.memory >> 20}M) for the other tmpfs and for processes: lower it or raise "
                             f"memory")
        object.__setattr__(self, "tmp", tmp)  # frozen model: fixing up its own defaults while validating
        object.__setattr__(self, "shm", shm)
        return self


class SealedSecret(BaseModel):
    """A secret as a sandbox's spec keeps it (docs/secrets.md): `$name` inside is `placeholder`; the value is
    sealed (`SecretKeyring`) and opened only for the egress proxy, which puts it into requests to `hosts`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    placeholder: str
    hosts: tuple[str, ...]
    body: bool = False  # also replaced in request bodies
    sealed: str = Field(repr=False)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _ENV_NAME.fullmatch(value):
            raise ValueError(f"secret name {value!r} is not a valid environment variable name")
        return value

    @field_validator("placeholder")
    @classmethod
    def _placeholder(cls, value: str) -> str:
        if not PLACEHOLDER.fullmatch(value):
            raise ValueError("a secret's placeholder is Corral's own (corral-secret-<32 hex>)")
        return value

    def binding(self, keyring: SecretKeyring) -> SecretBinding:
        return SecretBinding(self.name, self.placeholder, keyring.open(self.sealed), self.hosts, self.body)


class SandboxSpec(BaseModel):
    """What to create: template, runtime, limits, timeout (TTL, seconds), env and metadata."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    template: str = "default"
    runtime: Runtime = Runtime.RUNC
    limits: Limits = Field(default_factory=Limits)
    timeout: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] = 300.0
    env: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    # Where file operations may go: paths outside these directories, `..` escapes and symlinks leading out
    # are refused inside the sandbox. None: anywhere (the engine's trusted callers); the API always sets them.
    file_roots: tuple[str, ...] | None = None
    # Egress policy (docs/egress.md): "none", "internet" or a list of rules; `network_private` are the exact
    # private ip:port pairs the tenant's operator allowed. Enforced by the egress proxy, when the engine has one.
    network: str | tuple[str, ...] = "none"
    network_private: tuple[str, ...] = ()
    # Lifecycle (docs/lifecycle.md): what the end of the TTL does, volumes mounted by path (volume ids: the
    # service resolves a tenant's names), and whether the sandbox's ports answer without the tenant's key.
    # "pause": paused to disk when the TTL ends; "pause_memory": frozen in place (docs/lifecycle.md)
    on_timeout: Literal["kill", "pause", "pause_memory"] = "kill"
    # Paused (by its timeout or by a caller), it resumes when a request reaches it (E2B's autoResume;
    # service/_auto_resume.py). Records from before the field read as False.
    auto_resume: bool = False
    volumes: dict[str, str] = Field(default_factory=dict)
    public_ports: bool = False
    # Root inside the sandbox (docs/security.md): its agent runs as the user namespace's uid 0 with a bounded set
    # of capabilities, so commands and file operations may ask for `user="root"`, and `sudo` works; the user's
    # own commands stay as unprivileged as in any sandbox. Only where the backend has a user namespace per sandbox.
    root: bool = False
    # Secrets (docs/secrets.md): placeholders in the sandbox's environment, values only at the egress proxy.
    secrets: tuple[SealedSecret, ...] = ()
    # Checkpoints (docs/lifecycle.md): "auto" takes one before each command, code cell, file change and archive
    # upload, keeping the last `checkpoint_keep` automatic ones within `checkpoint_bytes` (None: a quarter of
    # the disk). The service takes them; records from before the fields read as "manual".
    checkpoints: Literal["auto", "manual"] = "manual"
    checkpoint_keep: Annotated[int, Field(ge=1, le=MAX_CHECKPOINT_KEEP)] = DEFAULT_CHECKPOINT_KEEP
    checkpoint_bytes: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _network(self) -> SandboxSpec:
        try:
            self.egress_policy()
        except CorralError as exc:  # a ValueError is what pydantic turns into a validation error
            raise ValueError(exc.message) from None
        return self

    def egress_policy(self, keyring: SecretKeyring | None = None) -> EgressPolicy:
        """The policy the proxy enforces; with `keyring`, carrying the secrets' values to put into requests."""
        # The policy language lives with the proxy that enforces it.
        policy = EgressPolicy.parse(self.network if isinstance(self.network, str) else list(self.network),
                                    private=list(self.network_private))
        if keyring is None or not self.secrets:
            return policy
        return dataclasses.replace(policy, secrets=tuple(s.binding(keyring) for s in self.secrets))

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, value: tuple[SealedSecret, ...]) -> tuple[SealedSecret, ...]:
        if len(value) > MAX_SECRETS:
            raise ValueError(f"a sandbox has at most {MAX_SECRETS} secrets")
        if len({s.name for s in value}) != len(value):
            raise ValueError("each secret name appears once")
        return value

    @field_validator("file_roots")
    @classmethod
    def _file_roots(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("file_roots must name at least one directory (omit it for the defaults)")
        if len(value) > _MAX_FILE_ROOTS:
            raise ValueError(f"file_roots takes at most {_MAX_FILE_ROOTS} directories")
        return tuple(dict.fromkeys(_file_root(root) for root in value))

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, val in value.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"environment variable name {key!r} is not valid")
            if "\x00" in val:
                raise ValueError(f"environment variable {key} contains a NUL byte")
        return value

    @field_validator("volumes")
    @classmethod
    def _volumes(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > _MAX_VOLUMES:
            raise ValueError(f"a sandbox mounts at most {_MAX_VOLUMES} volumes")
        mounts = {_volume_path(path): volume for path, volume in value.items()}
        paths = sorted(mounts)
        for outer, inner in itertools.pairwise(paths):
            if inner.startswith(outer + "/"):
                raise ValueError(f"volume mount {inner!r} is inside volume mount {outer!r}")
        if len(set(mounts.values())) != len(mounts):
            raise ValueError("a volume is mounted at most once per sandbox")
        return mounts

    def pool_key(self) -> tuple[str, str, Limits, bool, bool]:
        """Sandboxes that agree on this can be served from the same warm pool (pooled ones mount no volume)."""
        return (self.template, self.runtime.value, self.limits, bool(self.volumes), self.root)


def _file_root(root: str) -> str:
    if "\x00" in root:
        raise ValueError("a file root contains a NUL byte")
    if not root.startswith("/"):
        raise ValueError(f"file root {root!r} is not an absolute path")
    if posixpath.normpath(root) != (root.rstrip("/") or "/") or "//" in root:
        raise ValueError(f"file root {root!r} is not a normalized path (no '..', '.', or '//')")
    root = root.rstrip("/")
    if not root:  # every path the user reaches, but never the forbidden ones (the agent refuses those anyway)
        return "/"
    for forbidden in _FORBIDDEN_ROOTS:
        if root == forbidden or root.startswith(forbidden + "/"):
            raise ValueError(f"file root {root!r} is inside {forbidden}, which the file API never touches")
    return root


def _volume_path(path: str) -> str:
    if "\x00" in path:
        raise ValueError("a volume mount path contains a NUL byte")
    if not path.startswith("/") or posixpath.normpath(path) != path or path == "/":
        raise ValueError(f"volume mount path {path!r} is not a normalized absolute path below '/'")
    if len(path) > 255:
        raise ValueError("a volume mount path is at most 255 characters")
    for forbidden in _FORBIDDEN_VOLUME_PATHS:
        if path == forbidden or path.startswith(forbidden + "/"):
            raise ValueError(f"volume mount path {path!r} is inside {forbidden}, where no volume can be mounted")
    return path


class SandboxState(StrEnum):
    """The one lifecycle enum: the store records it for tenants, the engine for what runs on its node."""

    CREATING = "creating"  # quota reserved, the backend is creating it
    RUNNING = "running"
    PAUSED = "paused"
    DESTROYED = "destroyed"
    FAILED = "failed"  # creation failed; it never ran
    LOST = "lost"  # its replica stopped answering (docs/replicas.md); live again if that replica comes back
    STOPPED = "destroyed"  # an alias of DESTROYED, the engine's older name
