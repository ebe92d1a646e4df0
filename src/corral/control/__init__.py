"""The control plane's state: tenants, API keys and roles, sandbox records with quotas, and the audit trail.

```python
async with ControlStore() as store:                   # sqlite+aiosqlite:///<CORRAL_HOME>/corral.db
    key_file = await store.bootstrap_admin(admin_key)  # a fresh store gets its first admin key
    principal = await store.authenticate(bearer_key)   # AuthenticationError
    authorize(principal, Action.TENANT_CREATE)         # PermissionDeniedError
    record = await store.sandbox_for(principal, sandbox_id, Action.SANDBOX_EXEC)  # other tenants': NotFoundError
    await store.audit.append(AuditEvent.by(principal, Action.SANDBOX_EXEC, sandbox_id, params={"cmd": cmd}))
```
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
from ._db import default_url
from ._keys import KEY_FORMAT, generate_key, hash_key, parse_key
from ._models import SCHEMA_VERSION, ApiKey, NewApiKey, Quotas, SandboxRecord, SandboxStatus, Tenant
from ._rbac import PERMISSIONS, Action, Principal, Role, authorize, is_allowed, require_sandbox
from ._store import ADMIN_KEY_FILE, ADMIN_TENANT, ControlStore

__all__ = [
    "ADMIN_KEY_FILE",
    "ADMIN_TENANT",
    "GENESIS_HASH",
    "KEY_FORMAT",
    "PERMISSIONS",
    "SCHEMA_VERSION",
    "Action",
    "ApiKey",
    "AuditEntry",
    "AuditEvent",
    "AuditLog",
    "ChainChecker",
    "ChainHead",
    "ChainProblem",
    "ControlStore",
    "NewApiKey",
    "Principal",
    "Quotas",
    "Role",
    "SandboxRecord",
    "SandboxStatus",
    "Tenant",
    "VerifyResult",
    "authorize",
    "canonical_json",
    "default_url",
    "generate_key",
    "hash_key",
    "is_allowed",
    "parse_key",
    "require_sandbox",
    "verify_chain",
]
