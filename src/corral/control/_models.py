"""The tables (SQLAlchemy 2.0 declarative models) and the frozen records the store hands out.

Rows never leave the store: callers get frozen dataclasses, so no lazy load can happen outside a session.
Types are portable (SQLite and PostgreSQL): strings, integers, floats, booleans, JSON, and timestamps that are
always stored and returned in UTC.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Protocol

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from ..backends._spec import SandboxSpec, SandboxState
from ._rbac import Role

SCHEMA_VERSION = 1


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is aware UTC on the way in and out; SQLite keeps no zone, so it is normalised here."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous; pass an aware (UTC) datetime")
        return value.astimezone(UTC).replace(tzinfo=None) if dialect.name == "sqlite" else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class SchemaVersionRow(Base):
    """One row: the schema version this database was created with, for later migrations."""

    __tablename__ = "schema_version"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int]
    created_at: Mapped[datetime]


class TenantRow(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime]
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    # Quotas; NULL means unlimited.
    max_sandboxes: Mapped[int | None] = mapped_column(Integer)
    max_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_cpus: Mapped[float | None] = mapped_column(Float)
    max_sandbox_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_sandbox_cpus: Mapped[float | None] = mapped_column(Float)
    max_sandbox_disk_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_sandbox_timeout: Mapped[float | None] = mapped_column(Float)
    # Lifecycle (docs/lifecycle.md); columns added to older databases by `_db.add_missing_columns`.
    max_paused: Mapped[int | None] = mapped_column(Integer)  # sandboxes paused to disk at once
    max_paused_seconds: Mapped[float | None] = mapped_column(Float)  # NULL: DEFAULT_MAX_PAUSED_SECONDS
    max_snapshots: Mapped[int | None] = mapped_column(Integer)
    max_snapshot_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_volumes: Mapped[int | None] = mapped_column(Integer)  # volumes kept (docs/volumes.md)
    max_volume_bytes: Mapped[int | None] = mapped_column(BigInteger)  # total size of the tenant's volumes
    # "runsc": every sandbox of the tenant runs on gVisor whatever its callers ask (docs/security.md); NULL: any.
    required_runtime: Mapped[str | None] = mapped_column(String(16))
    # "auto": its sandboxes take automatic checkpoints unless a create says otherwise (docs/lifecycle.md)
    default_checkpoints: Mapped[str | None] = mapped_column(String(8))


class TenantEgressRow(Base):
    """A tenant's egress settings (docs/egress.md); no row means the defaults. A table of its own so that
    databases made before egress control gain it from `create_all`, with no migration."""

    __tablename__ = "tenant_egress"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    ceiling: Mapped[Any] = mapped_column(JSON)  # "none" | "internet" | [rules]: the most a sandbox may get
    private: Mapped[Any] = mapped_column(JSON)  # ["10.0.0.5:5432", ...]: private ip:port pairs allowed


class PrivateGrantRow(Base):
    """A private `ip:port` an admin granted a tenant (docs/egress.md): its operators may switch on only these.
    A table of its own, so older databases gain it from `create_all` (their pairs count once granted)."""

    __tablename__ = "tenant_private_grants"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    destination: Mapped[str] = mapped_column(String(64), primary_key=True)  # normalised "ip:port"
    granted_at: Mapped[datetime]
    key_id: Mapped[str | None] = mapped_column(String(40))  # the admin key that granted it


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(128), default="")
    hash: Mapped[str] = mapped_column(String(64))
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


class SandboxRow(Base):
    __tablename__ = "sandboxes"
    __table_args__ = (Index("ix_sandboxes_tenant_live", "tenant_id", "destroyed_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    template: Mapped[str] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]]
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    # Copies of spec fields as columns: quota sums must be plain SQL SUM()s, and reading inside JSON is not
    # portable between SQLite and PostgreSQL.
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    cpus: Mapped[float] = mapped_column(Float)
    disk_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)
    destroyed_at: Mapped[datetime | None]
    # Paused to disk (docs/lifecycle.md): holds no memory, so it counts against `max_paused`, not the running
    # totals; its timeout's clock stops (`ttl_left`) and `paused_at` starts the tenant's `max_paused_seconds`.
    paused_to_disk: Mapped[bool | None] = mapped_column(Boolean)
    paused_at: Mapped[datetime | None]
    ttl_left: Mapped[float | None] = mapped_column(Float)
    # Replicas (docs/replicas.md): the replica whose backend runs it (NULL: made before replicas, by the one
    # server there was), and why it is `lost` or failed when a replica stopped answering.
    owner: Mapped[str | None] = mapped_column(String(64))
    reason: Mapped[str | None] = mapped_column(String(512))


class ReplicaRow(Base):
    """A `corral serve` sharing the database (docs/replicas.md): where the others reach it, and its heartbeat."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(512))
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime] = mapped_column(index=True)


class LeaseRow(Base):
    """A cluster-wide job's lease: one holder at a time, until `expires_at` (renewed by the holder)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime]


class ClusterSecretRow(Base):
    """Secrets every replica shares and no client knows (the replica-to-replica signing key), made once."""

    __tablename__ = "cluster_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime]


class SnapshotRow(Base):
    """A tenant's snapshot: what the backend keeps (`artifact`, `SnapshotArtifact.to_json()`) and whose it is."""

    __tablename__ = "snapshots"
    __table_args__ = (Index("ix_snapshots_tenant_live", "tenant_id", "deleted_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    key_id: Mapped[str | None] = mapped_column(String(40))
    name: Mapped[str | None] = mapped_column(String(128))
    sandbox_id: Mapped[str] = mapped_column(String(64))  # the sandbox it was taken of
    template: Mapped[str] = mapped_column(String(128))  # that sandbox's template (a name, or another snapshot)
    backend: Mapped[str] = mapped_column(String(32))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    artifact: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]


class VolumeRow(Base):
    """A tenant's volume (docs/volumes.md): storage on the backend that outlives sandboxes, mounted by name.
    A name is unique among the tenant's live volumes (a deleted one's name can be used again)."""

    __tablename__ = "volumes"
    __table_args__ = (Index("ux_volumes_tenant_name_live", "tenant_id", "name", unique=True,
                            sqlite_where=text("deleted_at IS NULL"), postgresql_where=text("deleted_at IS NULL")),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(63))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    backend: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]


class SecretRow(Base):
    """A tenant's stored secret (docs/secrets.md): a sandbox asks for it by name. The value is sealed (never
    readable through the API, never in this database in the clear); `hosts` are the only hosts it may reach."""

    __tablename__ = "secrets"
    __table_args__ = (Index("ux_secrets_tenant_name", "tenant_id", "name", unique=True),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(64))
    hosts: Mapped[Any] = mapped_column(JSON)
    body: Mapped[bool] = mapped_column(Boolean, default=False)
    sealed: Mapped[str] = mapped_column(Text)  # a value of 8192 characters seals to ~44 KB of text
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class AuditRow(Base):
    __tablename__ = "audit"

    # Assigned by the appender (last seq + 1), never by the database: a second writer that read the same head
    # collides on the primary key instead of forking the chain.
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    time: Mapped[datetime] = mapped_column(index=True)
    tenant_id: Mapped[str | None] = mapped_column(String(40), index=True)
    key_id: Mapped[str | None] = mapped_column(String(40))
    role: Mapped[str | None] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str | None] = mapped_column(String(256), index=True)
    params: Mapped[dict[str, Any]]
    outcome: Mapped[dict[str, Any]]
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The HTTP request that caused the record (`X-Request-Id`); NULL in records older than it and in those no
    # request caused (the reconciler's, the egress proxy's). Hashed only when set: older chains still verify.
    request_id: Mapped[str | None] = mapped_column(String(128))
    # The id of the audit key whose HMAC `hash` is (8 hex digits, `_auditkeys`); NULL in records from before
    # audit keys, which are plain SHA-256. Never the key itself: that stays outside the database.
    hmac_key_id: Mapped[str | None] = mapped_column(String(8))


# -- what the store hands out ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; `None` is unlimited. Totals count live sandboxes (not yet destroyed)."""

    max_sandboxes: int | None = None
    max_memory_bytes: int | None = None
    max_cpus: float | None = None
    max_sandbox_memory_bytes: int | None = None
    max_sandbox_cpus: float | None = None
    max_sandbox_disk_bytes: int | None = None
    max_sandbox_timeout: float | None = None
    max_paused: int | None = None
    max_paused_seconds: float | None = None  # how long a sandbox may stay paused to disk; None: 7 days
    max_snapshots: int | None = None
    max_snapshot_bytes: int | None = None
    max_volumes: int | None = None
    max_volume_bytes: int | None = None  # the total size of the tenant's volumes


DEFAULT_MAX_PAUSED_SECONDS = 7 * 24 * 3600.0  # a paused sandbox forgotten this long is destroyed
DEFAULT_EGRESS_CEILING = "internet"  # public addresses and every preset; admins narrow it per tenant


@dataclass(frozen=True)
class TenantEgress:
    """How far a tenant's sandboxes may reach: `ceiling` bounds every sandbox's `network`; `private` lists the
    exact private `ip:port` pairs (otherwise never reachable) its sandboxes may connect to."""

    ceiling: str | list[str] = DEFAULT_EGRESS_CEILING
    private: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PrivateGrant:
    """A private `ip:port` a tenant's operators may switch on (`TenantEgress.private`), granted by an admin."""

    destination: str
    granted_at: datetime
    key_id: str | None = None


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: datetime
    disabled: bool
    quotas: Quotas
    required_runtime: str | None = None  # "runsc": its sandboxes run on gVisor whatever is asked (docs/security.md)
    default_checkpoints: str | None = None  # "auto" | "manual" for creates that do not say (None: "manual")


@dataclass(frozen=True)
class ApiKey:
    """A key's record; the key itself is never stored (see `NewApiKey`)."""

    id: str
    tenant_id: str
    role: Role
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class NewApiKey:
    """A freshly created key: `key` is the only time the secret is available."""

    key: str
    info: ApiKey = field(repr=False)

    def __repr__(self) -> str:  # never print the secret by accident
        return f"NewApiKey(id={self.info.id!r}, prefix={self.info.prefix!r}, role={self.info.role.value!r})"


@dataclass(frozen=True)
class SandboxQuery:
    """Which of a tenant's live sandboxes to list, in which order, a page at a time.

    `after` is where the previous page ended: the (created_at, id) of its last record; pages never repeat or
    skip a sandbox that lives through the listing, whatever is created meanwhile.
    """

    metadata: Mapping[str, str] = field(default_factory=dict)
    states: frozenset[SandboxState] | None = None  # None: every live state
    template: str | None = None
    created_after: datetime | None = None  # inclusive: a sandbox created at that instant is listed
    newest_first: bool = False
    limit: int | None = None
    after: tuple[datetime, str] | None = None


SandboxStatus = SandboxState  # one lifecycle enum (backends/_spec.py); the store's older name


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    tenant_id: str
    key_id: str
    template: str
    spec: SandboxSpec  # as asked for, with the environment's values left out (they often carry secrets)
    metadata: dict[str, Any]
    memory_bytes: int
    cpus: float
    disk_bytes: int
    state: SandboxStatus
    created_at: datetime
    expires_at: datetime
    destroyed_at: datetime | None
    env_names: tuple[str, ...] = ()
    paused_to_disk: bool = False
    paused_at: datetime | None = None
    ttl_left: float | None = None  # paused to disk: the seconds its timeout had left
    owner: str | None = None  # the replica whose backend runs it (None: the one server before replicas)
    reason: str | None = None  # why it is lost or failed, when a replica's end decided it

    @property
    def live(self) -> bool:
        return self.destroyed_at is None


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica as the database knows it; `alive` if its heartbeat is younger than the TTL it was judged by."""

    id: str
    url: str
    started_at: datetime
    heartbeat_at: datetime
    alive: bool


@dataclass(frozen=True)
class SnapshotRecord:
    id: str
    tenant_id: str
    name: str | None
    sandbox_id: str
    template: str
    backend: str
    size_bytes: int
    artifact: dict[str, Any]
    created_at: datetime
    deleted_at: datetime | None = None

    @property
    def live(self) -> bool:
        return self.deleted_at is None


@dataclass(frozen=True)
class VolumeRecord:
    id: str
    tenant_id: str
    name: str
    size_bytes: int
    backend: str
    created_at: datetime
    deleted_at: datetime | None = None

    @property
    def live(self) -> bool:
        return self.deleted_at is None


def tenant_from_row(row: TenantRow) -> Tenant:
    quotas = Quotas(
        max_sandboxes=row.max_sandboxes,
        max_memory_bytes=row.max_memory_bytes,
        max_cpus=row.max_cpus,
        max_sandbox_memory_bytes=row.max_sandbox_memory_bytes,
        max_sandbox_cpus=row.max_sandbox_cpus,
        max_sandbox_disk_bytes=row.max_sandbox_disk_bytes,
        max_sandbox_timeout=row.max_sandbox_timeout,
        max_paused=row.max_paused,
        max_paused_seconds=row.max_paused_seconds,
        max_snapshots=row.max_snapshots,
        max_snapshot_bytes=row.max_snapshot_bytes,
        max_volumes=row.max_volumes,
        max_volume_bytes=row.max_volume_bytes,
    )
    return Tenant(id=row.id, name=row.name, created_at=row.created_at, disabled=row.disabled, quotas=quotas,
                  required_runtime=row.required_runtime, default_checkpoints=row.default_checkpoints)


def key_from_row(row: ApiKeyRow) -> ApiKey:
    return ApiKey(id=row.id, tenant_id=row.tenant_id, role=Role(row.role), name=row.name, prefix=row.prefix,
                  created_at=row.created_at, revoked_at=row.revoked_at, last_used_at=row.last_used_at)


def sandbox_from_row(row: SandboxRow) -> SandboxRecord:
    stored = dict(row.spec)
    env_names = tuple(stored.pop("env_names", ()))
    return SandboxRecord(id=row.id, tenant_id=row.tenant_id, key_id=row.key_id, template=row.template,
                         spec=_spec(stored), env_names=env_names, metadata=row.metadata_,
                         memory_bytes=row.memory_bytes, cpus=row.cpus,
                         disk_bytes=row.disk_bytes, state=SandboxStatus(row.state), created_at=row.created_at,
                         expires_at=row.expires_at, destroyed_at=row.destroyed_at,
                         paused_to_disk=bool(row.paused_to_disk), paused_at=row.paused_at, ttl_left=row.ttl_left,
                         owner=row.owner, reason=row.reason)


def snapshot_from_row(row: SnapshotRow) -> SnapshotRecord:
    return SnapshotRecord(id=row.id, tenant_id=row.tenant_id, name=row.name, sandbox_id=row.sandbox_id,
                          template=row.template, backend=row.backend, size_bytes=row.size_bytes,
                          artifact=dict(row.artifact), created_at=row.created_at, deleted_at=row.deleted_at)


@dataclass(frozen=True)
class StoredSecret:
    """A tenant's stored secret as the store hands it out: `sealed` only where a sandbox is being made with it."""

    name: str
    hosts: tuple[str, ...]
    body: bool
    created_at: datetime
    updated_at: datetime
    sealed: str = field(default="", repr=False)


class Resealer(Protocol):
    """What seals stored values again (`corral.egress.SecretKeyring`): the store never sees a key or a value."""

    def current(self, sealed: str) -> bool: ...

    def reseal(self, sealed: str) -> str: ...


@dataclass(frozen=True)
class Resealed:
    """What `ControlStore.reseal_secrets` did: values sealed again, values already under the newest key (a value
    `put` during the reseal is in neither)."""

    resealed: int
    current: int


def secret_from_row(row: SecretRow, *, sealed: bool = False) -> StoredSecret:
    return StoredSecret(name=row.name, hosts=tuple(row.hosts), body=row.body, created_at=row.created_at,
                        updated_at=row.updated_at, sealed=row.sealed if sealed else "")


def volume_from_row(row: VolumeRow) -> VolumeRecord:
    return VolumeRecord(id=row.id, tenant_id=row.tenant_id, name=row.name, size_bytes=row.size_bytes,
                        backend=row.backend, created_at=row.created_at, deleted_at=row.deleted_at)


@functools.lru_cache(maxsize=4096)
def _spec_from_json(text: str) -> SandboxSpec:
    return SandboxSpec.model_validate_json(text)


def _spec(stored: dict[str, Any]) -> SandboxSpec:
    """Typed again; memoised by content, since the same rows are read over and over and validating is not free."""
    return _spec_from_json(json.dumps(stored, sort_keys=True))
