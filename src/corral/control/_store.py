"""`ControlStore`: tenants, API keys, sandbox records with quotas, and the audit log, in one database.

Every API request authenticates, looks up the sandbox it names and appends an audit record. The first two are
served from memory (`_cache.TTLCache`): principals by key hash, sandbox records by id, each for `cache_ttl`
seconds (default 5). Changes made through this store invalidate its caches at once (revoking a key, disabling a
tenant, every sandbox state, timeout or destroy). Changes made by another process or replica on the same
database reach this one within `cache_ttl`: a key revoked on replica A still authenticates on replica B for up
to 5 seconds, and a sandbox destroyed through A may still look live on B for as long.

The store is in parts: tenants, keys and authentication here; sandbox records in `_sandbox_records`, snapshots,
volumes and stored secrets in `_holdings` (mixins of `ControlStore`); quota checks in `_quotas`, row lookups in
`_rows`; checkpoints in `_checkpoints` (`store.checkpoints`).
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

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from .._exceptions import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
)
from .._settings import corral_home
from ._audit import AuditLog
from ._auditkeys import AuditKeyring, load_audit_keys
from ._cache import MISSING, TTLCache
from ._checkpoints import CheckpointStore
from ._db import Database, default_url
from ._denials import AuthDenials
from ._grants import PrivateGrants, granted_destinations
from ._holdings import TenantHoldings
from ._keys import generate_key, hash_key, parse_key, same_hash, validate_key
from ._models import (
    ApiKey,
    ApiKeyRow,
    NewApiKey,
    Quotas,
    SandboxRecord,
    Tenant,
    TenantEgress,
    TenantEgressRow,
    TenantRow,
    key_from_row,
    tenant_from_row,
)
from ._quotas import check_checkpoint_bytes
from ._rbac import Principal, Role
from ._replicas import ReplicaRegistry
from ._rows import key_row, new_id, tenant_row
from ._sandbox_records import SandboxRecords

ADMIN_TENANT = "admin"
ADMIN_KEY_FILE = "admin.key"
# last_used_at is a hint for humans ("is this key still in use?"); writing it on every request would turn
# every read into a write, so it is refreshed at most this often.
LAST_USED_RESOLUTION = timedelta(minutes=1)
CACHE_TTL = 5.0  # seconds a principal or sandbox record is served from memory (see the module docstring)
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NAME_MAX = 128
# Hashed when a presented prefix is unknown, so a miss costs the same comparison as a hit.
_NO_SUCH_HASH = "0" * 64


def _utcnow() -> datetime:
    return datetime.now(UTC)



@dataclass
class _KnownKey:
    """A cached authentication: the principal, and when its key's last use was last written."""

    principal: Principal
    last_used: datetime | None


class ControlStore(SandboxRecords, TenantHoldings):
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
        self.checkpoints = CheckpointStore(self._db, self._now, check_checkpoint_bytes)  # docs/lifecycle.md
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
        row = TenantRow(id=new_id("tn"), name=name, created_at=self._now(), disabled=False,
                        required_runtime=required_runtime, **asdict(quotas or Quotas()))
        try:
            async with self._db.write() as session:
                session.add(row)
        except IntegrityError:
            raise ConflictError(f"a tenant named {name!r} already exists") from None
        return tenant_from_row(row)

    async def get_tenant(self, tenant_id: str) -> Tenant:
        async with self._db.read() as session:
            return tenant_from_row(await tenant_row(session, tenant_id))

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
            row = await tenant_row(session, tenant_id)
            for name, value in asdict(quotas).items():
                setattr(row, name, value)
        return tenant_from_row(row)

    async def set_required_runtime(self, tenant_id: str, runtime: str | None) -> Tenant:
        """The runtime every sandbox of the tenant must run on (None: whatever each create asks)."""
        async with self._db.write() as session:
            row = await tenant_row(session, tenant_id)
            row.required_runtime = runtime
        return tenant_from_row(row)

    async def set_default_checkpoints(self, tenant_id: str, mode: str | None) -> Tenant:
        """What the tenant's creates that do not say get: "auto" or "manual" checkpoints (None: "manual")."""
        async with self._db.write() as session:
            row = await tenant_row(session, tenant_id)
            row.default_checkpoints = mode
        return tenant_from_row(row)

    async def set_tenant_disabled(self, tenant_id: str, disabled: bool) -> Tenant:
        """A disabled tenant's keys stop authenticating; its records stay."""
        async with self._db.write() as session:
            row = await tenant_row(session, tenant_id)
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
        row = ApiKeyRow(id=new_id("key"), tenant_id=tenant_id, role=role.value, name=name, hash=hash_key(raw),
                        prefix=prefix, created_at=self._now(), revoked_at=None, last_used_at=None)
        try:
            async with self._db.write() as session:
                await tenant_row(session, tenant_id)
                session.add(row)
        except IntegrityError:
            # A prefix collision (1 in 36**8 per existing key): the caller may simply try again.
            raise ConflictError(f"key prefix {prefix!r} is taken; create the key again") from None
        return NewApiKey(key=raw, info=key_from_row(row))

    async def get_key(self, key_id: str) -> ApiKey:
        async with self._db.read() as session:
            return key_from_row(await key_row(session, key_id))

    async def list_keys(self, tenant_id: str | None = None) -> list[ApiKey]:
        stmt = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        if tenant_id is not None:
            stmt = stmt.where(ApiKeyRow.tenant_id == tenant_id)
        async with self._db.read() as session:
            return [key_from_row(r) for r in (await session.scalars(stmt)).all()]

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key for good (idempotent: the first revocation time is kept)."""
        async with self._db.write() as session:
            row = await key_row(session, key_id)
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

    # -- egress settings of tenants ------------------------------------------------------------------------

    async def tenant_settings(self, tenant_id: str) -> tuple[Tenant, TenantEgress]:
        """The tenant and its egress settings in one read (what every create needs)."""
        async with self._db.read() as session:
            tenant = tenant_from_row(await tenant_row(session, tenant_id))
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
            await tenant_row(session, tenant_id)
            row = await session.get(TenantEgressRow, tenant_id)
            if row is None:
                session.add(TenantEgressRow(tenant_id=tenant_id, ceiling=egress.ceiling, private=egress.private))
            else:
                row.ceiling, row.private = egress.ceiling, list(egress.private)
        return egress



# -- helpers -----------------------------------------------------------------------------------------------------


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise InvalidRequestError(f"no role {role!r}; roles are {', '.join(r.value for r in Role)}") from None


def _tenant_egress(row: TenantEgressRow | None, granted: frozenset[str]) -> TenantEgress:
    """A tenant's egress settings from its row (none: the defaults), its private pairs cut to the granted ones."""
    if row is None:
        return TenantEgress()
    return TenantEgress(ceiling=row.ceiling, private=[p for p in row.private or [] if p in granted])
