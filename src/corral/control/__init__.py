"""The control plane's state: tenants, API keys and roles, sandbox records with quotas, and the audit trail.

```python
async with ControlStore() as store:                   # sqlite+aiosqlite:///<CORRAL_HOME>/corral.db
    key_file = await store.bootstrap_admin(admin_key)  # a fresh store gets its first admin key
    principal = await store.authenticate(bearer_key)   # AuthenticationError
    authorize(principal, Action.TENANT_CREATE)         # PermissionDeniedError
    record = await store.sandbox_for(principal, sandbox_id, Action.SANDBOX_EXEC)  # other tenants': NotFoundError
    await store.audit.append(AuditEvent.by(principal, Action.SANDBOX_EXEC, sandbox_id, params={"cmd": cmd}))
    await store.auth_denials.record(Denial(client, method, path, key_prefix, reason))  # 401s, per address
```

`ControlStore(url)` takes any SQLAlchemy async URL: SQLite by default, `postgresql+asyncpg://...` for several
replicas on one database.
"""

from ._audit import (
    GENESIS_HASH,
    AuditEntry,
    AuditEvent,
    AuditLog,
    ChainChecker,
    ChainHead,
    ChainProblem,
    VerifyResult,
    canonical_json,
    verify_chain,
)
from ._auditkeys import (
    AUDIT_KEY_FILE,
    AuditKeyring,
    audit_key_id,
    load_audit_keys,
    read_key_file,
    rotate_audit_key_file,
)
from ._checkpoints import CheckpointRecord
from ._db import default_url
from ._denials import AUTH_DENIED, AuthDenials, Denial
from ._grants import PrivateGrants
from ._keys import KEY_FORMAT, generate_key, hash_key, parse_key
from ._models import (
    DEFAULT_EGRESS_CEILING,
    DEFAULT_MAX_PAUSED_SECONDS,
    SCHEMA_VERSION,
    ApiKey,
    NewApiKey,
    PrivateGrant,
    Quotas,
    ReplicaInfo,
    Resealed,
    Resealer,
    SandboxQuery,
    SandboxRecord,
    SandboxStatus,
    SnapshotRecord,
    StoredSecret,
    Tenant,
    TenantEgress,
    VolumeRecord,
)
from ._rbac import PERMISSIONS, Action, Principal, Role, authorize, is_allowed, require_sandbox
from ._replicas import ReplicaRegistry
from ._store import ADMIN_KEY_FILE, ADMIN_TENANT, CACHE_TTL, ControlStore

__all__ = [
    "ADMIN_KEY_FILE",
    "ADMIN_TENANT",
    "AUDIT_KEY_FILE",
    "AUTH_DENIED",
    "CACHE_TTL",
    "DEFAULT_EGRESS_CEILING",
    "DEFAULT_MAX_PAUSED_SECONDS",
    "GENESIS_HASH",
    "KEY_FORMAT",
    "PERMISSIONS",
    "SCHEMA_VERSION",
    "Action",
    "ApiKey",
    "AuditEntry",
    "AuditEvent",
    "AuditKeyring",
    "AuditLog",
    "AuthDenials",
    "ChainChecker",
    "ChainHead",
    "ChainProblem",
    "CheckpointRecord",
    "ControlStore",
    "Denial",
    "NewApiKey",
    "Principal",
    "PrivateGrant",
    "PrivateGrants",
    "Quotas",
    "ReplicaInfo",
    "ReplicaRegistry",
    "Resealed",
    "Resealer",
    "Role",
    "SandboxQuery",
    "SandboxRecord",
    "SandboxStatus",
    "SnapshotRecord",
    "StoredSecret",
    "Tenant",
    "TenantEgress",
    "VerifyResult",
    "VolumeRecord",
    "audit_key_id",
    "authorize",
    "canonical_json",
    "default_url",
    "generate_key",
    "hash_key",
    "is_allowed",
    "load_audit_keys",
    "parse_key",
    "read_key_file",
    "require_sandbox",
    "rotate_audit_key_file",
    "verify_chain",
]
