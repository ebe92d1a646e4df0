"""Roles, actions and the one permission table.

Every check goes through `authorize`: a role may do an action if the table says so, and only inside its own
tenant unless it is `admin`. Sandboxes of other tenants do not exist for the caller: `require_sandbox` answers
"not found" for them, exactly as for an id that was never created, so ids cannot be probed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from .._exceptions import NotFoundError, PermissionDeniedError


class Role(StrEnum):
    ADMIN = "admin"  # tenants and keys; everything, in every tenant
    OPERATOR = "operator"  # everything in its tenant, including the kill switch
    DEVELOPER = "developer"  # create and use its own tenant's sandboxes
    AUDITOR = "auditor"  # read the audit log only


class Action(StrEnum):
    TENANT_CREATE = "tenant.create"
    TENANT_READ = "tenant.read"
    TENANT_UPDATE = "tenant.update"  # quotas, disable, egress ceiling
    TENANT_EGRESS = "tenant.egress"  # read the egress settings; allow private ip:port pairs
    KEY_CREATE = "key.create"
    KEY_READ = "key.read"
    KEY_REVOKE = "key.revoke"
    SANDBOX_CREATE = "sandbox.create"
    SANDBOX_READ = "sandbox.read"  # get, list
    SANDBOX_EXEC = "sandbox.exec"  # commands, processes, PTY, code
    SANDBOX_FILES_READ = "sandbox.files.read"
    SANDBOX_FILES_WRITE = "sandbox.files.write"
    SANDBOX_UPDATE = "sandbox.update"  # set_timeout, pause, resume
    SANDBOX_KILL = "sandbox.kill"
    # A sandbox's checkpoints (docs/lifecycle.md): auditors see them and what changed; restoring changes files.
    CHECKPOINT_READ = "checkpoint.read"  # list, get, changes
    CHECKPOINT_WRITE = "checkpoint.write"  # create, delete, restore
    SANDBOX_KILL_ALL = "sandbox.kill_all"  # the kill switch: every sandbox of a tenant or of one key
    AUDIT_READ = "audit.read"  # query, export, tail, verify
    EVAL_READ = "eval.read"  # the evaluation runs the server keeps, and their reports (docs/eval.md)
    VOLUME_CREATE = "volume.create"
    VOLUME_READ = "volume.read"  # get, list, and mount one in a new sandbox (docs/volumes.md)
    VOLUME_DELETE = "volume.delete"
    # A tenant's stored secrets (docs/secrets.md): names and hosts are read by whoever makes sandboxes with them;
    # values are written by operators, and read by nobody.
    SECRET_READ = "secret.read"  # noqa: S105 - an action's name, not a password
    SECRET_WRITE = "secret.write"  # noqa: S105
    # The server's Prometheus metrics: every tenant's counts, so the operator's alone (docs/operations.md).
    METRICS_READ = "metrics.read"


_A, _O, _D, _U = Role.ADMIN, Role.OPERATOR, Role.DEVELOPER, Role.AUDITOR
_SANDBOX_USERS = frozenset({_A, _O, _D})

PERMISSIONS: Mapping[Action, frozenset[Role]] = MappingProxyType({
    Action.TENANT_CREATE: frozenset({_A}),
    Action.TENANT_READ: frozenset({_A}),
    Action.TENANT_UPDATE: frozenset({_A}),
    Action.TENANT_EGRESS: frozenset({_A, _O}),
    Action.KEY_CREATE: frozenset({_A}),
    Action.KEY_READ: frozenset({_A}),
    Action.KEY_REVOKE: frozenset({_A}),
    Action.SANDBOX_CREATE: _SANDBOX_USERS,
    Action.SANDBOX_READ: _SANDBOX_USERS,
    Action.SANDBOX_EXEC: _SANDBOX_USERS,
    Action.SANDBOX_FILES_READ: _SANDBOX_USERS,
    Action.SANDBOX_FILES_WRITE: _SANDBOX_USERS,
    Action.SANDBOX_UPDATE: _SANDBOX_USERS,
    Action.SANDBOX_KILL: _SANDBOX_USERS,
    Action.SANDBOX_KILL_ALL: frozenset({_A, _O}),
    Action.CHECKPOINT_READ: frozenset({_A, _O, _D, _U}),
    Action.CHECKPOINT_WRITE: _SANDBOX_USERS,
    Action.AUDIT_READ: frozenset({_A, _O, _U}),
    Action.EVAL_READ: frozenset({_A, _U}),
    Action.VOLUME_CREATE: _SANDBOX_USERS,
    Action.VOLUME_READ: _SANDBOX_USERS,
    Action.VOLUME_DELETE: _SANDBOX_USERS,
    Action.SECRET_READ: _SANDBOX_USERS,
    Action.SECRET_WRITE: frozenset({_A, _O}),
    Action.METRICS_READ: frozenset({_A}),
})


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant and key a request authenticated as, and the key's role."""

    tenant_id: str
    key_id: str
    role: Role


def is_allowed(role: Role, action: Action) -> bool:
    return role in PERMISSIONS[action]


def authorize(principal: Principal, action: Action, resource_tenant: str | None = None) -> None:
    """Raise `PermissionDeniedError` unless `principal` may do `action` on something of `resource_tenant`.

    `resource_tenant=None` means the action is not about one tenant's resource (creating a tenant, listing all).
    """
    if not is_allowed(principal.role, action):
        raise PermissionDeniedError(
            f"role {principal.role.value!r} may not {action.value}",
            details={"role": principal.role.value, "action": action.value},
        )
    if principal.role is Role.ADMIN:
        return
    if resource_tenant is None or resource_tenant != principal.tenant_id:
        raise PermissionDeniedError(
            f"{action.value} is limited to the caller's own tenant",
            details={"role": principal.role.value, "action": action.value},
        )


def require_sandbox(principal: Principal, action: Action, sandbox_id: str, sandbox_tenant: str | None) -> None:
    """Authorize an action on one sandbox; `sandbox_tenant=None` means there is no such sandbox.

    Visibility is checked before the role: a sandbox of another tenant gets the same `NotFoundError` (same
    message) as one that never existed, whatever the caller's role, so its existence leaks nowhere.
    """
    visible = sandbox_tenant is not None and (principal.role is Role.ADMIN or sandbox_tenant == principal.tenant_id)
    if not visible:
        raise NotFoundError(f"no sandbox {sandbox_id!r}", details={"sandbox_id": sandbox_id})
    authorize(principal, action, sandbox_tenant)
