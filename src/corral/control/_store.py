"""`ControlStore`: tenants, API keys, sandbox records with quotas, and the audit log, in one database.

Every API request authenticates, looks up the sandbox it names and appends an audit record. The first two are
served from memory (`_cache.TTLCache`): principals by key hash, sandbox records by id, each for `cache_ttl`
seconds (default 5). Changes made through this store invalidate its caches at once (revoking a key, disabling a
tenant, every sandbox state, timeout or destroy). Changes made by another process or replica on the same
database reach this one within `cache_ttl`: a key revoked on replica A still authenticates on replica B for up
to 5 seconds, and a sandbox destroyed through A may still look live on B for as long.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from .._exceptions import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    ServerError,
)
from .._settings import corral_home
from ..backends._spec import SandboxSpec
from ._audit import AuditLog
from ._auditkeys import AuditKeyring, load_audit_keys
from ._cache import MISSING, TTLCache
from ._checkpoints import CheckpointStore, live_checkpoint_bytes, mark_sandbox_deleted
from ._db import Database, default_url
from ._denials import AuthDenials
from ._grants import PrivateGrants, granted_destinations
from ._keys import generate_key, hash_key, parse_key, same_hash, validate_key
from ._models import (
    DEFAULT_MAX_PAUSED_SECONDS,
    ApiKey,
    ApiKeyRow,
    NewApiKey,
    Quotas,
    Resealed,
    Resealer,
    SandboxQuery,
    SandboxRecord,
    SandboxRow,
    SandboxStatus,
    SecretRow,
    SnapshotRecord,
    SnapshotRow,
    StoredSecret,
    Tenant,
    TenantEgress,
    TenantEgressRow,
    TenantRow,
    VolumeRecord,
    VolumeRow,
    key_from_row,
    sandbox_from_row,
    secret_from_row,
    snapshot_from_row,
    tenant_from_row,
    volume_from_row,
)
from ._rbac import Action, Principal, Role, authorize, require_sandbox
from ._replicas import ReplicaRegistry

ADMIN_TENANT = "admin"
ADMIN_KEY_FILE = "admin.key"
# last_used_at is a hint for humans ("is this key still in use?"); writing it on every request would turn
# every read into a write, so it is refreshed at most this often.
LAST_USED_RESOLUTION = timedelta(minutes=1)
CACHE_TTL = 5.0  # seconds a principal or sandbox record is served from memory (see the module docstring)
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME_MAX = 128
_CPU_EPSILON = 1e-9  # CPU totals are float sums (0.1 + 0.2); do not refuse a request that fits exactly
# Hashed when a presented prefix is unknown, so a miss costs the same comparison as a hit.
_NO_SUCH_HASH = "0" * 64


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(8)}"


@dataclass
class _KnownKey:
    """A cached authentication: the principal, and when its key's last use was last written."""

    principal: Principal
    last_used: datetime | None


class ControlStore:
    """The control plane's state. Use as `async with ControlStore(url) as store:` (or `start()`/`close()`).

    **Parameters:**

    * **url** - a SQLAlchemy async URL; default `sqlite+aiosqlite:///<home>/corral.db`.
      PostgreSQL works too (`postgresql+asyncpg://...`).
    * **home** - the state directory (default `CORRAL_HOME`); the bootstrap admin key is written there, and the
      audit key (`audit.key`, unless `CORRAL_AUDIT_KEY` is set) is kept there.
    * **audit_keys** - the audit chain's keys, instead of loading them from `CORRAL_AUDIT_KEY` or the home.
    * **clock** - returns the current aware UTC time; tests pass a fake one.
    * **cache_ttl** - seconds principals and sandbox records are served from memory; 0 reads the database for
      every request. Other replicas' changes are seen within this time (see the module docstring).
    """

    def __init__(self, url: str | None = None, *, home: str | os.PathLike[str] | None = None,
                 clock: Callable[[], datetime] | None = None, cache_ttl: float = CACHE_TTL,
                 audit_keys: AuditKeyring | None = None) -> None:
        self.home: Path = corral_home(home)
        self.url = url or default_url(self.home)
        self._clock = clock or _utcnow
        self._db = Database(self.url)
        self._audit_keys = audit_keys
        reload = None if audit_keys is not None else self._load_audit_keys
        self.audit = AuditLog(self._db, self._now, audit_keys, reload_keys=reload)
        self.auth_denials = AuthDenials(self.audit)
        ttl = timedelta(seconds=cache_ttl)
        self._principals: TTLCache[str, _KnownKey] = TTLCache(ttl, self._now)  # by key hash
        self._sandboxes: TTLCache[str, SandboxRecord] = TTLCache(ttl, self._now)  # by sandbox id
        self.cache_ttl = ttl  # how late another replica's change may be seen here (module docstring)
        self.replicas = ReplicaRegistry(self._db, self._now, self._sandboxes)  # docs/replicas.md
        self.grants = PrivateGrants(self._db, self._now)  # private destinations admins granted (docs/egress.md)
        self.checkpoints = CheckpointStore(self._db, self._now, _check_checkpoint_bytes)  # docs/lifecycle.md
        # Quota check and insert must not interleave between two creates of this process; other processes
        # are held off by the write transaction (and, on PostgreSQL, the tenant row lock).
        self._create_lock = asyncio.Lock()

    def _now(self) -> datetime:
        return self._clock().astimezone(UTC)

    async def start(self) -> None:
        await self._db.start(self._now())
        if self._audit_keys is None:
            # Before any record is appended, so none goes out unkeyed. A new key file says the records up to
            # the current head are the only ones that may be unkeyed (those older versions wrote).
            head = await self.audit.head()
            self.audit.keys = load_audit_keys(self.home, create_after=head.seq)

    def _load_audit_keys(self) -> AuditKeyring:
        return load_audit_keys(self.home)

    async def close(self) -> None:
        try:
            await self.auth_denials.flush()
        finally:
            await self._db.close()

    async def __aenter__(self) -> ControlStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def schema_version(self) -> int | None:
        return await self._db.schema_version()

    # -- tenants ------------------------------------------------------------------------------------------

    async def create_tenant(self, name: str, quotas: Quotas | None = None, *,
                            required_runtime: str | None = None) -> Tenant:
        if not _TENANT_NAME.fullmatch(name):
            raise InvalidRequestError(f"tenant name {name!r} is not valid: use 1 to 128 letters, digits, '.', "
                                      f"'_' or '-', starting with a letter or digit")
        row = TenantRow(id=_new_id("tn"), name=name, created_at=self._now(), disabled=False,
                        required_runtime=required_runtime, **asdict(quotas or Quotas()))
        try:
            async with self._db.write() as session:
                session.add(row)
        except IntegrityError:
            raise ConflictError(f"a tenant named {name!r} already exists") from None
        return tenant_from_row(row)

    async def get_tenant(self, tenant_id: str) -> Tenant:
        async with self._db.read() as session:
            return tenant_from_row(await _tenant_row(session, tenant_id))

    async def tenant_by_name(self, name: str) -> Tenant:
        async with self._db.read() as session:
            row = await session.scalar(select(TenantRow).where(TenantRow.name == name))
        if row is None:
            raise NotFoundError(f"no tenant named {name!r}")
        return tenant_from_row(row)

    async def list_tenants(self) -> list[Tenant]:
        async with self._db.read() as session:
            rows = (await session.scalars(select(TenantRow).order_by(TenantRow.name))).all()
        return [tenant_from_row(r) for r in rows]

    async def set_quotas(self, tenant_id: str, quotas: Quotas) -> Tenant:
        async with self._db.write() as session:
            row = await _tenant_row(session, tenant_id)
            for name, value in asdict(quotas).items():
                setattr(row, name, value)
        return tenant_from_row(row)

    async def set_required_runtime(self, tenant_id: str, runtime: str | None) -> Tenant:
        """The runtime every sandbox of the tenant must run on (None: whatever each create asks)."""
        async with self._db.write() as session:
            row = await _tenant_row(session, tenant_id)
            row.required_runtime = runtime
        return tenant_from_row(row)

    async def set_default_checkpoints(self, tenant_id: str, mode: str | None) -> Tenant:
        """What the tenant's creates that do not say get: "auto" or "manual" checkpoints (None: "manual")."""
        async with self._db.write() as session:
            row = await _tenant_row(session, tenant_id)
            row.default_checkpoints = mode
        return tenant_from_row(row)

    async def set_tenant_disabled(self, tenant_id: str, disabled: bool) -> Tenant:
        """A disabled tenant's keys stop authenticating; its records stay."""
        async with self._db.write() as session:
            row = await _tenant_row(session, tenant_id)
            row.disabled = disabled
        self._principals.invalidate_where(lambda known: known.principal.tenant_id == tenant_id)
        return tenant_from_row(row)

    # -- keys -----------------------------------------------------------------------------------------------

    async def create_key(self, tenant_id: str, role: Role | str, name: str = "") -> NewApiKey:
        """A new key; `NewApiKey.key` is the only time its secret is available."""
        if len(name) > _NAME_MAX:  # SQLite would store it, PostgreSQL would refuse it: refuse it everywhere
            raise InvalidRequestError(f"key name is longer than {_NAME_MAX} characters")
        return await self._add_key(tenant_id, _role(role), name, generate_key())

    async def _add_key(self, tenant_id: str, role: Role, name: str, raw: str) -> NewApiKey:
        prefix = parse_key(raw).prefix
        row = ApiKeyRow(id=_new_id("key"), tenant_id=tenant_id, role=role.value, name=name, hash=hash_key(raw),
                        prefix=prefix, created_at=self._now(), revoked_at=None, last_used_at=None)
        try:
            async with self._db.write() as session:
                await _tenant_row(session, tenant_id)
                session.add(row)
        except IntegrityError:
            # A prefix collision (1 in 36**8 per existing key): the caller may simply try again.
            raise ConflictError(f"key prefix {prefix!r} is taken; create the key again") from None
        return NewApiKey(key=raw, info=key_from_row(row))

    async def get_key(self, key_id: str) -> ApiKey:
        async with self._db.read() as session:
            return key_from_row(await _key_row(session, key_id))

    async def list_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        stmt = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        if tenant_id is not None:
            stmt = stmt.where(ApiKeyRow.tenant_id == tenant_id)
        async with self._db.read() as session:
            return [key_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key for good (idempotent: the first revocation time is kept)."""
        async with self._db.write() as session:
            row = await _key_row(session, key_id)
            if row.revoked_at is None:
                row.revoked_at = self._now()
        self._principals.invalidate_where(lambda known: known.principal.key_id == key_id)
        return key_from_row(row)

    async def authenticate(self, raw_key: str) -> Principal:
        """The principal a presented key stands for; `AuthenticationError` for anything else.

        Served from memory for `cache_ttl` seconds after the database accepted the same key (looked up by its
        SHA-256: only a caller presenting the whole key can hit the entry). Writing `last_used_at` is coalesced
        to once per `LAST_USED_RESOLUTION` per key, so authentication costs no write per request.
        """
        parsed = parse_key(raw_key)
        digest = hash_key(raw_key)
        known = self._principals.get(digest)
        if known is MISSING:
            token = self._principals.token()
            known = await self._authenticate_in_db(parsed.prefix, digest)
            self._principals.put(digest, known, token)
        await self._touch(known)
        return known.principal

    async def _authenticate_in_db(self, prefix: str, digest: str) -> _KnownKey:
        async with self._db.read() as session:
            row = await session.scalar(select(ApiKeyRow).where(ApiKeyRow.prefix == prefix))
            tenant = await session.get(TenantRow, row.tenant_id) if row is not None else None
        matched = same_hash(digest, row.hash if row is not None else _NO_SUCH_HASH)
        if row is None or not matched:
            raise AuthenticationError("invalid API key")
        if row.revoked_at is not None:
            raise AuthenticationError("this API key was revoked")
        if tenant is None or tenant.disabled:
            raise AuthenticationError("this API key's tenant is disabled")
        principal = Principal(tenant_id=row.tenant_id, key_id=row.id, role=Role(row.role))
        return _KnownKey(principal, row.last_used_at)

    async def _touch(self, known: _KnownKey) -> None:
        now = self._now()
        if known.last_used is not None and now - known.last_used < LAST_USED_RESOLUTION:
            return
        known.last_used = now  # before the write, so requests arriving meanwhile do not write it too
        stmt = update(ApiKeyRow).where(ApiKeyRow.id == known.principal.key_id).values(last_used_at=now)
        async with self._db.write() as session:
            await session.execute(stmt)

    async def key_principal(self, key_id: str) -> Principal:
        """The principal of the key `key_id`, for a credential that stands for that key (a sandbox's access
        token stands for the key that created the sandbox); `AuthenticationError` once the key is revoked or its
        tenant disabled. Cached like `authenticate`, and invalidated with it."""
        cache_key = f"id:{key_id}"
        known = self._principals.get(cache_key)
        if known is MISSING:
            token = self._principals.token()
            async with self._db.read() as session:
                row = await session.get(ApiKeyRow, key_id)
                tenant = await session.get(TenantRow, row.tenant_id) if row is not None else None
            if row is None or row.revoked_at is not None:
                raise AuthenticationError("the API key this credential stands for was revoked")
            if tenant is None or tenant.disabled:
                raise AuthenticationError("this credential's tenant is disabled")
            known = _KnownKey(Principal(tenant_id=row.tenant_id, key_id=row.id, role=Role(row.role)), None)
            self._principals.put(cache_key, known, token)
        return known.principal

    async def bootstrap_admin(self, explicit_key: str | None) -> str | None:
        """Give a store without keys its first admin key; return the path of a generated key file.

        With `explicit_key` (the server passes `CORRAL_ADMIN_KEY`), that key becomes the admin key and None is
        returned. Without it, a key is generated and written 0600 to `<home>/admin.key`, whose path is
        returned for the server to print. A store that has keys is left alone (None).
        """
        if explicit_key is not None:
            validate_key(explicit_key, "CORRAL_ADMIN_KEY")
        async with self._db.read() as session:
            if await session.scalar(select(func.count()).select_from(ApiKeyRow)):
                return None
        raw = explicit_key.strip() if explicit_key is not None else generate_key()
        path = None if explicit_key is not None else self._write_key_file(raw)
        tenant = await self._admin_tenant()
        await self._add_key(tenant.id, Role.ADMIN, "bootstrap", raw)
        return str(path) if path is not None else None

    async def _admin_tenant(self) -> Tenant:
        try:
            return await self.tenant_by_name(ADMIN_TENANT)
        except NotFoundError:
            return await self.create_tenant(ADMIN_TENANT)

    def _write_key_file(self, raw: str) -> Path:
        """Write the key before it is stored: a crash in between leaves a useless file, never an unknown key."""
        self.home.mkdir(parents=True, exist_ok=True)
        path = self.home / ADMIN_KEY_FILE
        tmp = path.with_name(f".{ADMIN_KEY_FILE}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, (raw + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path

    # -- sandboxes --------------------------------------------------------------------------------------------

    async def reserve_sandbox(self, principal: Principal, spec: SandboxSpec, *, sandbox_id: str | None = None,
                              owner: str | None = None, running: bool = False) -> SandboxRecord:
        """Check the tenant's quotas and record a sandbox in state `creating`, in one transaction; `owner` is the
        replica whose backend will run it (docs/replicas.md).

        Create it in the engine next, then `mark_running` (or `mark_destroyed(failed=True)` if that fails). With
        `running`, the engine has it already (a warm pool's member, adopted): it is recorded `running` at once.
        """
        authorize(principal, Action.SANDBOX_CREATE, principal.tenant_id)
        now = self._now()
        row = SandboxRow(id=sandbox_id or _new_id("sb"), tenant_id=principal.tenant_id, key_id=principal.key_id,
                         template=spec.template, spec=_stored_spec(spec), metadata_=dict(spec.metadata),
                         memory_bytes=spec.limits.memory, cpus=spec.limits.cpus, disk_bytes=spec.limits.disk,
                         state=(SandboxStatus.RUNNING if running else SandboxStatus.CREATING).value, created_at=now,
                         expires_at=now + timedelta(seconds=spec.timeout), destroyed_at=None, owner=owner)
        async with self._create_lock:
            try:
                async with self._db.write() as session:
                    # FOR UPDATE serialises creates of one tenant on PostgreSQL; SQLite compiles it away (its
                    # BEGIN IMMEDIATE already holds the only write lock).
                    tenant = await session.scalar(
                        select(TenantRow).where(TenantRow.id == principal.tenant_id).with_for_update())
                    if tenant is None:
                        raise NotFoundError(f"no tenant {principal.tenant_id!r}")
                    _check_per_sandbox(tenant, row)
                    await _check_totals(session, tenant, row)
                    session.add(row)
            except IntegrityError:
                raise ConflictError(f"a sandbox {row.id!r} already exists") from None
        return sandbox_from_row(row)

    async def mark_running(self, sandbox_id: str, *, engine_id: str | None = None,
                           expires_at: datetime | None = None) -> SandboxRecord:
        """The engine created it: record its state, and its engine id if that differs from the reservation's."""
        try:
            async with self._db.write() as session:
                row = await _live_sandbox_row(session, sandbox_id)
                row.state = SandboxStatus.RUNNING.value
                if engine_id is not None:
                    row.id = engine_id
                if expires_at is not None:
                    row.expires_at = expires_at
        finally:
            self._sandboxes.invalidate(sandbox_id)
            if engine_id is not None:
                self._sandboxes.invalidate(engine_id)
        return sandbox_from_row(row)

    async def set_sandbox_state(self, sandbox_id: str, state: SandboxStatus) -> SandboxRecord:
        """Running or paused; use `mark_destroyed` to end a sandbox."""
        if state not in (SandboxStatus.RUNNING, SandboxStatus.PAUSED):
            raise InvalidRequestError(f"use mark_destroyed for state {state.value!r}")
        try:
            async with self._db.write() as session:
                row = await _live_sandbox_row(session, sandbox_id)
                row.state = state.value
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def set_sandbox_timeout(self, sandbox_id: str, seconds: float) -> SandboxRecord:
        """Expire `seconds` from now (paused to disk: `seconds` after it resumes), within the tenant's
        `max_sandbox_timeout`."""
        if not seconds >= 0:
            raise InvalidRequestError("timeout must be 0 (end now) or a positive number of seconds")
        try:
            async with self._db.write() as session:
                row = await _live_sandbox_row(session, sandbox_id)
                tenant = await _tenant_row(session, row.tenant_id)
                _check_limit(tenant, "max_sandbox_timeout", tenant.max_sandbox_timeout, seconds,
                             "a sandbox timeout", unit="s")
                if row.paused_to_disk:
                    row.ttl_left = seconds
                else:
                    row.expires_at = self._now() + timedelta(seconds=seconds)
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def pause_to_disk(self, sandbox_id: str) -> SandboxRecord:
        """Record a sandbox as paused to disk, within the tenant's `max_paused`; its timeout's clock stops.

        Call it before the engine stops the sandbox (it reserves the paused slot); `resumed` undoes it."""
        try:
            async with self._db.write() as session:
                row = await _live_sandbox_row(session, sandbox_id)
                if row.paused_to_disk:
                    raise ConflictError(f"sandbox {sandbox_id} is paused to disk already")
                tenant = await _tenant_row(session, row.tenant_id)
                paused = await session.scalar(select(func.count()).where(
                    SandboxRow.tenant_id == tenant.id, SandboxRow.destroyed_at.is_(None),
                    SandboxRow.paused_to_disk.is_(True)))
                _check_limit(tenant, "max_paused", tenant.max_paused, int(paused or 0) + 1,
                             "sandboxes paused to disk", current=int(paused or 0))
                now = self._now()
                row.ttl_left = max(1.0, (row.expires_at - now).total_seconds())
                row.state, row.paused_to_disk, row.paused_at = SandboxStatus.PAUSED.value, True, now
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def resumed(self, sandbox_id: str) -> SandboxRecord:
        """Record a sandbox paused to disk as running again, within the tenant's running totals (it takes memory
        again); its timeout runs on from what it had left. Call it before the engine boots the sandbox."""
        try:
            async with self._db.write() as session:
                row = await _live_sandbox_row(session, sandbox_id)
                if row.paused_to_disk:
                    tenant = await session.scalar(
                        select(TenantRow).where(TenantRow.id == row.tenant_id).with_for_update())
                    if tenant is None:
                        raise NotFoundError(f"no tenant {row.tenant_id!r}")
                    await _check_totals(session, tenant, row)
                if row.ttl_left is not None:  # its clock stood still while it was paused
                    row.expires_at = self._now() + timedelta(seconds=row.ttl_left or 1.0)
                row.state, row.paused_to_disk, row.paused_at, row.ttl_left = \
                    SandboxStatus.RUNNING.value, False, None, None
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def auto_paused(self, sandbox_id: str) -> SandboxRecord:
        """Record a sandbox frozen in place because its TTL ended (`on_timeout="pause_memory"`): its clock stops
        (it resumes with its whole timeout) and `max_paused_seconds` starts, as for a pause to disk."""
        try:
            async with self._db.write() as session:
                row = await _live_sandbox_row(session, sandbox_id)
                row.state, row.paused_at = SandboxStatus.PAUSED.value, self._now()
                row.ttl_left = float(row.spec.get("timeout") or 300.0)
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def forgotten_paused(self, owner: str | None = None) -> list[SandboxRecord]:
        """Sandboxes paused (to disk, or in place by their timeout) for longer than their tenant's
        `max_paused_seconds` (default 7 days); with `owner`, only that replica's (as `expired_sandboxes`)."""
        stmt = (select(SandboxRow, TenantRow.max_paused_seconds)
                .join(TenantRow, TenantRow.id == SandboxRow.tenant_id)
                .where(SandboxRow.destroyed_at.is_(None), SandboxRow.paused_at.is_not(None)))
        if owner is not None:
            stmt = stmt.where(or_(SandboxRow.owner == owner, SandboxRow.owner.is_(None)))
        now = self._now()
        async with self._db.read() as session:
            rows = (await session.execute(stmt)).all()
        return [sandbox_from_row(row) for row, limit in rows
                if row.paused_at is not None
                and (now - row.paused_at).total_seconds() > (DEFAULT_MAX_PAUSED_SECONDS if limit is None else limit)]

    async def mark_destroyed(self, sandbox_id: str, *, failed: bool = False) -> SandboxRecord:
        """The sandbox is gone (or never came up, `failed=True`): it stops counting against quotas."""
        try:
            async with self._db.write() as session:
                row = await _sandbox_row(session, sandbox_id)
                if row.destroyed_at is None:
                    row.destroyed_at = self._now()
                    row.state = (SandboxStatus.FAILED if failed else SandboxStatus.DESTROYED).value
                    await mark_sandbox_deleted(session, sandbox_id, row.destroyed_at)  # they went with its disk
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    async def set_sandbox_network(self, sandbox_id: str, network: str | list[str]) -> SandboxRecord:
        """Record a live sandbox's new egress policy (the engine and proxy apply it; this keeps the record true)."""
        try:
            async with self._db.write() as session:
                row = await _live_sandbox_row(session, sandbox_id)
                row.spec = {**row.spec, "network": network if isinstance(network, str) else list(network)}
        finally:
            self._sandboxes.invalidate(sandbox_id)
        return sandbox_from_row(row)

    # -- egress settings of tenants ------------------------------------------------------------------------

    async def tenant_settings(self, tenant_id: str) -> tuple[Tenant, TenantEgress]:
        """The tenant and its egress settings in one read (what every create needs)."""
        async with self._db.read() as session:
            tenant = tenant_from_row(await _tenant_row(session, tenant_id))
            row = await session.get(TenantEgressRow, tenant_id)
            granted = await granted_destinations(session, tenant_id)
        return tenant, _tenant_egress(row, granted)

    async def tenant_egress(self, tenant_id: str) -> TenantEgress:
        """The tenant's settings; `private` holds only the pairs that are still granted (`store.grants`)."""
        async with self._db.read() as session:
            row = await session.get(TenantEgressRow, tenant_id)
            return _tenant_egress(row, await granted_destinations(session, tenant_id))

    async def set_tenant_egress(self, tenant_id: str, egress: TenantEgress) -> TenantEgress:
        """Replace the tenant's egress settings (validate them first: this stores what it is given)."""
        async with self._db.write() as session:
            await _tenant_row(session, tenant_id)
            row = await session.get(TenantEgressRow, tenant_id)
            if row is None:
                session.add(TenantEgressRow(tenant_id=tenant_id, ceiling=egress.ceiling, private=egress.private))
            else:
                row.ceiling, row.private = egress.ceiling, list(egress.private)
        return egress

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord:
        async with self._db.read() as session:
            return sandbox_from_row(await _sandbox_row(session, sandbox_id))

    async def sandbox_for(self, principal: Principal, sandbox_id: str, action: Action, *,
                          include_destroyed: bool = False) -> SandboxRecord:
        """The sandbox if `principal` may do `action` on it; another tenant's is `NotFoundError`, like a
        missing one (checked before the role, so nothing about it leaks).

        Served from memory for `cache_ttl` seconds (see the module docstring); the record is shared between
        callers, so treat its `spec` and `metadata` as read-only.
        """
        record = await self._cached_sandbox(sandbox_id)
        if record is not None and not record.live and not include_destroyed:
            record = None
        require_sandbox(principal, action, sandbox_id, record.tenant_id if record is not None else None)
        assert record is not None
        return record

    async def find_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox's record (live or not) without authorizing anybody, served from the same cache as
        `sandbox_for`; None if there is no such sandbox. For credentials that name the sandbox themselves."""
        return await self._cached_sandbox(sandbox_id)

    async def _cached_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        record = self._sandboxes.get(sandbox_id)
        if record is not MISSING:
            return record
        token = self._sandboxes.token()
        async with self._db.read() as session:
            row = await session.get(SandboxRow, sandbox_id)
        if row is None:
            return None  # not cached: it may be created by another replica any moment
        found = sandbox_from_row(row)
        self._sandboxes.put(sandbox_id, found, token)
        return found

    async def list_sandboxes(self, tenant_id: str | None, *, key_id: str | None = None,
                             metadata: dict[str, str] | None = None,
                             include_destroyed: bool = False) -> list[SandboxRecord]:
        """Sandboxes of a tenant (None: all tenants), optionally of one key, whose metadata has these pairs."""
        query = SandboxQuery(metadata=metadata or {})
        return await self.query_sandboxes(tenant_id, query, key_id=key_id, include_destroyed=include_destroyed)

    async def query_sandboxes(self, tenant_id: str | None, query: SandboxQuery, *, key_id: str | None = None,
                              include_destroyed: bool = False) -> list[SandboxRecord]:
        """The sandboxes `query` selects, in its order, at most `query.limit` of them.

        The metadata filter runs here, not in SQL: matching inside JSON differs between SQLite and PostgreSQL;
        rows are read in order and filtered until the page is full.
        """
        stmt = select(SandboxRow).where(*_query_conditions(query))
        order = (SandboxRow.created_at.desc(), SandboxRow.id.desc()) if query.newest_first else \
            (SandboxRow.created_at, SandboxRow.id)
        stmt = stmt.order_by(*order)
        if tenant_id is not None:
            stmt = stmt.where(SandboxRow.tenant_id == tenant_id)
        if key_id is not None:
            stmt = stmt.where(SandboxRow.key_id == key_id)
        if not include_destroyed:
            stmt = stmt.where(SandboxRow.destroyed_at.is_(None))
        wanted = query.metadata.items()
        found: list[SandboxRecord] = []
        async with self._db.read() as session:
            for row in await session.scalars(stmt):
                if all(row.metadata_.get(k) == v for k, v in wanted):
                    found.append(sandbox_from_row(row))
                    if query.limit is not None and len(found) >= query.limit:
                        break
        return found

    async def expired_sandboxes(self, owner: str | None = None) -> list[SandboxRecord]:
        """Live sandboxes past their timeout, for the reaper (paused to disk: their clock stands still); with
        `owner`, only those that replica runs (and those made before replicas, which the one server ran). Lost
        ones are left to `replicas.expired_lost`: no backend here can end them."""
        stmt = select(SandboxRow).where(SandboxRow.destroyed_at.is_(None), SandboxRow.expires_at <= self._now(),
                                        SandboxRow.paused_to_disk.is_not(True), SandboxRow.paused_at.is_(None),
                                        SandboxRow.state != SandboxStatus.LOST.value)
        if owner is not None:
            stmt = stmt.where(or_(SandboxRow.owner == owner, SandboxRow.owner.is_(None)))
        async with self._db.read() as session:
            return [sandbox_from_row(r) for r in (await session.scalars(stmt.order_by(SandboxRow.expires_at))).all()]

    async def count_sandboxes(self, owner: str | None = None) -> dict[tuple[str, str], int]:
        """Live sandboxes per (tenant id, state), counted by the database in one grouped query (what a metrics
        scrape reads: its cost grows with tenants times states, not with sandboxes); with `owner`, only those
        that replica runs (and those made before replicas, as `expired_sandboxes`)."""
        stmt = select(SandboxRow.tenant_id, SandboxRow.state, func.count()).where(SandboxRow.destroyed_at.is_(None))
        if owner is not None:
            stmt = stmt.where(or_(SandboxRow.owner == owner, SandboxRow.owner.is_(None)))
        stmt = stmt.group_by(SandboxRow.tenant_id, SandboxRow.state)
        async with self._db.read() as session:
            return {(tenant, state): int(n) for tenant, state, n in (await session.execute(stmt)).all()}

    # -- snapshots -------------------------------------------------------------------------------------------

    async def check_snapshot_quota(self, tenant_id: str) -> None:
        """Refuse before the copy when the tenant has no snapshot left (`add_snapshot` checks again, with the size)."""
        async with self._db.read() as session:
            tenant = await _tenant_row(session, tenant_id)
            await _check_snapshot_totals(session, tenant, 0, exclusive=True)

    async def add_snapshot(self, principal: Principal, record: SnapshotRecord) -> SnapshotRecord:
        """Record a snapshot the engine made, within the tenant's `max_snapshots` and `max_snapshot_bytes`; a name
        is unique among the tenant's snapshots (ConflictError)."""
        async with self._create_lock, self._db.write() as session:
            tenant = await session.scalar(select(TenantRow).where(TenantRow.id == record.tenant_id).with_for_update())
            if tenant is None:
                raise NotFoundError(f"no tenant {record.tenant_id!r}")
            if record.name is not None and await self._snapshot_named(session, record.tenant_id, record.name):
                raise ConflictError(f"a snapshot named {record.name!r} exists already; delete it or choose another "
                                    "name", details={"name": record.name})
            await _check_snapshot_totals(session, tenant, record.size_bytes, exclusive=False)
            session.add(SnapshotRow(id=record.id, tenant_id=record.tenant_id, key_id=principal.key_id,
                                    name=record.name, sandbox_id=record.sandbox_id, template=record.template,
                                    backend=record.backend, size_bytes=record.size_bytes, artifact=record.artifact,
                                    created_at=record.created_at, deleted_at=None))
        return record

    @staticmethod
    async def _snapshot_named(session: AsyncSession, tenant_id: str, name: str) -> SnapshotRow | None:
        return await session.scalar(select(SnapshotRow).where(
            SnapshotRow.tenant_id == tenant_id, SnapshotRow.name == name, SnapshotRow.deleted_at.is_(None)))

    async def get_snapshot(self, tenant_id: str, snapshot: str) -> SnapshotRecord:
        """The tenant's live snapshot with this id or name; another tenant's is as unknown as a missing one."""
        async with self._db.read() as session:
            row = await session.get(SnapshotRow, snapshot)
            if row is None or row.tenant_id != tenant_id or row.deleted_at is not None:
                row = await self._snapshot_named(session, tenant_id, snapshot)
        if row is None:
            raise NotFoundError(f"no snapshot {snapshot!r}", details={"snapshot": snapshot})
        return snapshot_from_row(row)

    async def list_snapshots(self, tenant_id: str) -> list[SnapshotRecord]:
        stmt = (select(SnapshotRow).where(SnapshotRow.tenant_id == tenant_id, SnapshotRow.deleted_at.is_(None))
                .order_by(SnapshotRow.created_at, SnapshotRow.id))
        async with self._db.read() as session:
            return [snapshot_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def mark_snapshot_deleted(self, snapshot_id: str) -> SnapshotRecord:
        async with self._db.write() as session:
            row = await session.get(SnapshotRow, snapshot_id)
            if row is None:
                raise NotFoundError(f"no snapshot {snapshot_id!r}")
            if row.deleted_at is None:
                row.deleted_at = self._now()
        return snapshot_from_row(row)

    # -- volumes (docs/volumes.md) ---------------------------------------------------------------------------------

    async def create_volume(self, principal: Principal, name: str, size_bytes: int, *, backend: str,
                            volume_id: str | None = None) -> VolumeRecord:
        """Record a volume of the caller's tenant within its `max_volumes` and `max_volume_bytes`, in one
        transaction; a name is unique among the tenant's live volumes (ConflictError). Create it in the engine
        next, and `mark_volume_deleted` if that fails."""
        authorize(principal, Action.VOLUME_CREATE, principal.tenant_id)
        row = VolumeRow(id=volume_id or _new_id("vol"), tenant_id=principal.tenant_id, name=name,
                        size_bytes=size_bytes, backend=backend, created_at=self._now(), deleted_at=None)
        taken = ConflictError(f"a volume named {name!r} exists already; delete it or choose another name",
                              details={"name": name})
        async with self._create_lock:
            try:
                async with self._db.write() as session:
                    tenant = await session.scalar(
                        select(TenantRow).where(TenantRow.id == principal.tenant_id).with_for_update())
                    if tenant is None:
                        raise NotFoundError(f"no tenant {principal.tenant_id!r}")
                    if await self._volume_named(session, tenant.id, name) is not None:
                        raise taken
                    await self._check_volume_totals(session, tenant, size_bytes)
                    session.add(row)
            except IntegrityError:  # another replica took the name meanwhile (the partial unique index)
                raise taken from None
        return volume_from_row(row)

    @staticmethod
    async def _volume_named(session: AsyncSession, tenant_id: str, name: str) -> VolumeRow | None:
        return await session.scalar(select(VolumeRow).where(
            VolumeRow.tenant_id == tenant_id, VolumeRow.name == name, VolumeRow.deleted_at.is_(None)))

    @staticmethod
    async def _check_volume_totals(session: AsyncSession, tenant: TenantRow, size_bytes: int) -> None:
        live = (VolumeRow.tenant_id == tenant.id, VolumeRow.deleted_at.is_(None))
        totals = (await session.execute(select(func.count(), func.coalesce(func.sum(VolumeRow.size_bytes), 0))
                                        .where(*live))).one()
        count, total = int(totals[0]), int(totals[1])
        _check_limit(tenant, "max_volumes", tenant.max_volumes, count + 1, "volumes", current=count)
        _check_limit(tenant, "max_volume_bytes", tenant.max_volume_bytes, total + size_bytes,
                     "the total size of volumes", current=total, unit=" bytes")

    async def get_volume_by_name(self, tenant_id: str, name: str) -> VolumeRecord:
        """The tenant's live volume of this name; another tenant's is as unknown as a missing one."""
        async with self._db.read() as session:
            row = await self._volume_named(session, tenant_id, name)
        if row is None:
            raise NotFoundError(f"no volume named {name!r}", details={"volume": name})
        return volume_from_row(row)

    async def list_volumes(self, tenant_id: str) -> list[VolumeRecord]:
        """The tenant's live volumes, by name."""
        stmt = (select(VolumeRow).where(VolumeRow.tenant_id == tenant_id, VolumeRow.deleted_at.is_(None))
                .order_by(VolumeRow.name))
        async with self._db.read() as session:
            return [volume_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def mark_volume_deleted(self, volume_id: str) -> VolumeRecord:
        """The volume is gone (or never came up): its name is free and it stops counting against quotas."""
        async with self._db.write() as session:
            row = await session.get(VolumeRow, volume_id)
            if row is None:
                raise NotFoundError(f"no volume {volume_id!r}")
            if row.deleted_at is None:
                row.deleted_at = self._now()
        return volume_from_row(row)

    # -- stored secrets (docs/secrets.md): values sealed by the caller, never returned but to make a sandbox -----

    async def put_secret(self, tenant_id: str, name: str, hosts: list[str], body: bool, sealed: str) -> StoredSecret:
        """Store (or replace) the tenant's secret `name`; `sealed` is the value already sealed."""
        now = self._now()
        async with self._db.write() as session:
            await _tenant_row(session, tenant_id)
            row = await self._secret_named(session, tenant_id, name)
            if row is None:
                row = SecretRow(id=_new_id("sec"), tenant_id=tenant_id, name=name, created_at=now)
                session.add(row)
            row.hosts, row.body, row.sealed, row.updated_at = list(hosts), body, sealed, now
        return secret_from_row(row)

    async def get_secret(self, tenant_id: str, name: str) -> StoredSecret:
        """The tenant's secret `name` with its sealed value (for a sandbox being made with it)."""
        async with self._db.read() as session:
            row = await self._secret_named(session, tenant_id, name)
        if row is None:
            raise NotFoundError(f"no stored secret named {name!r}", details={"secret": name})
        return secret_from_row(row, sealed=True)

    async def list_secrets(self, tenant_id: str) -> list[StoredSecret]:
        stmt = select(SecretRow).where(SecretRow.tenant_id == tenant_id).order_by(SecretRow.name)
        async with self._db.read() as session:
            return [secret_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def delete_secret(self, tenant_id: str, name: str) -> None:
        async with self._db.write() as session:
            row = await self._secret_named(session, tenant_id, name)
            if row is None:
                raise NotFoundError(f"no stored secret named {name!r}", details={"secret": name})
            await session.delete(row)

    async def reseal_secrets(self, keyring: Resealer) -> Resealed:
        """Every tenant's stored values sealed again with the keyring's newest key (`corral secret reseal`), so that
        older keys can leave the keyring. All are opened before any is written: one that no key opens is refused,
        naming it, and nothing changes. A value replaced meanwhile (a `put`) is kept as its `put` sealed it."""
        async with self._db.read() as session:
            rows = (await session.execute(select(SecretRow.id, SecretRow.tenant_id, SecretRow.name,
                                                 SecretRow.sealed))).all()
        fresh: list[tuple[str, str, str]] = []
        unopened: list[str] = []
        for row_id, tenant_id, name, sealed in rows:
            if keyring.current(sealed):
                continue
            try:
                fresh.append((row_id, sealed, keyring.reseal(sealed)))
            except ServerError:
                unopened.append(f"{name} of tenant {tenant_id}")
        if unopened:
            raise ServerError(f"no key in the keyring opens the stored secret(s) {', '.join(sorted(unopened))}: "
                              "put the key that sealed them back after the newest one; nothing was resealed")
        changed = 0
        async with self._db.write() as session:
            for row_id, old, new in fresh:  # compare-and-swap: a concurrent `put` wins
                done = await session.execute(update(SecretRow).where(SecretRow.id == row_id, SecretRow.sealed == old)
                                             .values(sealed=new))
                changed += int(done.rowcount)  # type: ignore[attr-defined]
        return Resealed(resealed=changed, current=len(rows) - len(fresh))

    @staticmethod
    async def _secret_named(session: AsyncSession, tenant_id: str, name: str) -> SecretRow | None:
        stmt = select(SecretRow).where(SecretRow.tenant_id == tenant_id, SecretRow.name == name)
        return (await session.scalars(stmt)).first()


# -- helpers -----------------------------------------------------------------------------------------------------


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidRequestError(f"no role {role!r}; roles are {', '.join(r.value for r in Role)}") from None


def _stored_spec(spec: SandboxSpec) -> dict[str, Any]:
    """The spec as recorded: environment values are left out (they often carry secrets), names kept."""
    data = spec.model_dump(mode="json", exclude={"env"})
    data["env_names"] = sorted(spec.env)
    return data


async def _tenant_row(session: AsyncSession, tenant_id: str) -> TenantRow:
    row = await session.get(TenantRow, tenant_id)
    if row is None:
        raise NotFoundError(f"no tenant {tenant_id!r}")
    return row


async def _key_row(session: AsyncSession, key_id: str) -> ApiKeyRow:
    row = await session.get(ApiKeyRow, key_id)
    if row is None:
        raise NotFoundError(f"no API key {key_id!r}")
    return row


async def _sandbox_row(session: AsyncSession, sandbox_id: str) -> SandboxRow:
    row = await session.get(SandboxRow, sandbox_id)
    if row is None:
        raise NotFoundError(f"no sandbox {sandbox_id!r}")
    return row


async def _live_sandbox_row(session: AsyncSession, sandbox_id: str) -> SandboxRow:
    row = await _sandbox_row(session, sandbox_id)
    if row.destroyed_at is not None:
        raise NotFoundError(f"no sandbox {sandbox_id!r}")
    return row


def _check_limit(tenant: TenantRow, limit_name: str, limit: float | None, value: float, what: str, *,
                 current: float | None = None, unit: str = "") -> None:
    """Raise if `value` (the total after this request, or one sandbox's figure) is over `limit`."""
    if limit is None or value <= limit + _CPU_EPSILON:
        return
    in_use = f" ({_fmt(current, unit)} in use)" if current is not None else ""
    raise QuotaExceededError(
        f"tenant {tenant.name!r} quota exceeded: {what} would be {_fmt(value, unit)}, over {limit_name} = "
        f"{_fmt(limit, unit)}{in_use}",
        details={"tenant": tenant.name, "tenant_id": tenant.id, "limit": limit_name, "max": limit,
                 "requested": value, "current": current},
    )


def _fmt(value: float, unit: str) -> str:
    return f"{value:g}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _check_per_sandbox(tenant: TenantRow, row: SandboxRow) -> None:
    timeout = (row.expires_at - row.created_at).total_seconds()
    _check_limit(tenant, "max_sandbox_memory_bytes", tenant.max_sandbox_memory_bytes, row.memory_bytes,
                 "this sandbox's memory", unit=" bytes")
    _check_limit(tenant, "max_sandbox_cpus", tenant.max_sandbox_cpus, row.cpus, "this sandbox's cpus")
    _check_limit(tenant, "max_sandbox_disk_bytes", tenant.max_sandbox_disk_bytes, row.disk_bytes,
                 "this sandbox's disk", unit=" bytes")
    _check_limit(tenant, "max_sandbox_timeout", tenant.max_sandbox_timeout, timeout, "a sandbox timeout", unit="s")


def _tenant_egress(row: TenantEgressRow | None, granted: frozenset[str]) -> TenantEgress:
    """A tenant's egress settings from its row (none: the defaults), its private pairs cut to the granted ones."""
    if row is None:
        return TenantEgress()
    return TenantEgress(ceiling=row.ceiling, private=[p for p in row.private or [] if p in granted])


async def _check_totals(session: AsyncSession, tenant: TenantRow, row: SandboxRow) -> None:
    if tenant.max_sandboxes is None and tenant.max_memory_bytes is None and tenant.max_cpus is None:
        return  # no total to keep: not a query on every create of an unlimited tenant
    # A sandbox paused to disk holds no memory nor CPU: it counts against `max_paused` instead.
    live = (SandboxRow.tenant_id == tenant.id, SandboxRow.destroyed_at.is_(None),
            SandboxRow.paused_to_disk.is_not(True), SandboxRow.id != row.id)
    totals = (await session.execute(select(func.count(), func.coalesce(func.sum(SandboxRow.memory_bytes), 0),
                                           func.coalesce(func.sum(SandboxRow.cpus), 0.0)).where(*live))).one()
    count, memory, cpus = int(totals[0]), int(totals[1]), float(totals[2])
    _check_limit(tenant, "max_sandboxes", tenant.max_sandboxes, count + 1, "concurrent sandboxes", current=count)
    _check_limit(tenant, "max_memory_bytes", tenant.max_memory_bytes, memory + row.memory_bytes,
                 "total memory", current=memory, unit=" bytes")
    _check_limit(tenant, "max_cpus", tenant.max_cpus, cpus + row.cpus, "total cpus", current=cpus)


async def _check_snapshot_totals(session: AsyncSession, tenant: TenantRow, size: int, *, exclusive: bool) -> None:
    """`exclusive`: is there room for one more at all (before its size is known)?"""
    live = (SnapshotRow.tenant_id == tenant.id, SnapshotRow.deleted_at.is_(None))
    totals = (await session.execute(select(func.count(), func.coalesce(func.sum(SnapshotRow.size_bytes), 0))
                                    .where(*live))).one()
    count, used = int(totals[0]), int(totals[1])
    _check_limit(tenant, "max_snapshots", tenant.max_snapshots, count + 1, "snapshots", current=count)
    if tenant.max_snapshot_bytes is not None:  # the tenant's checkpoints count against the same bytes
        used += await live_checkpoint_bytes(session, tenant.id)
    if exclusive:
        if tenant.max_snapshot_bytes is not None and used >= tenant.max_snapshot_bytes:
            _check_limit(tenant, "max_snapshot_bytes", tenant.max_snapshot_bytes, used + 1,
                         "total snapshot size", current=used, unit=" bytes")
        return
    _check_limit(tenant, "max_snapshot_bytes", tenant.max_snapshot_bytes, used + size, "total snapshot size",
                 current=used, unit=" bytes")


async def _check_checkpoint_bytes(session: AsyncSession, tenant: TenantRow, size: int) -> None:
    """A checkpoint of `size` more bytes within the tenant's `max_snapshot_bytes` (snapshots and checkpoints)."""
    if tenant.max_snapshot_bytes is None:
        return
    live = (SnapshotRow.tenant_id == tenant.id, SnapshotRow.deleted_at.is_(None))
    used = int(await session.scalar(select(func.coalesce(func.sum(SnapshotRow.size_bytes), 0)).where(*live)) or 0)
    used += await live_checkpoint_bytes(session, tenant.id)
    _check_limit(tenant, "max_snapshot_bytes", tenant.max_snapshot_bytes, used + size,
                 "total snapshot and checkpoint size", current=used, unit=" bytes")


def _query_conditions(query: SandboxQuery) -> list[ColumnElement[bool]]:
    """The SQL side of a sandbox query: state, template, creation time and where the last page ended."""
    conditions: list[ColumnElement[bool]] = []
    if query.states is not None:
        conditions.append(SandboxRow.state.in_(sorted(state.value for state in query.states)))
    if query.template is not None:
        conditions.append(SandboxRow.template == query.template)
    if query.created_after is not None:
        conditions.append(SandboxRow.created_at >= query.created_after)
    if query.after is not None:
        at, last_id = query.after
        same_time = SandboxRow.created_at == at
        if query.newest_first:
            conditions.append(or_(SandboxRow.created_at < at, and_(same_time, SandboxRow.id < last_id)))
        else:
            conditions.append(or_(SandboxRow.created_at > at, and_(same_time, SandboxRow.id > last_id)))
    return conditions
