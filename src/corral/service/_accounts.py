"""Tenants and API keys (admins), through the service: authorized, audited, one method per operation."""

from __future__ import annotations

import builtins
import dataclasses
import enum
from typing import Any, Final

from .._exceptions import InvalidRequestError, NotFoundError
from ..control import Action, ApiKey, ControlStore, NewApiKey, Principal, Role, Tenant, authorize
from ._audited import Auditor

__all__ = ["KEEP", "REQUIRED_RUNTIMES", "Keep", "Keys", "Tenants"]

# What a tenant's `required_runtime` may be (docs/security.md): a policy may only raise isolation, so "runc" is no
# choice; None (no requirement) lets each create pick.
REQUIRED_RUNTIMES: Final = ("runsc",)


class Keep(enum.Enum):
    """An argument left out of `Tenants.update`: the setting keeps its value (None would clear it)."""

    KEEP = "keep"


KEEP: Final = Keep.KEEP


def _required_runtime(value: str | None) -> str | None:
    if value is not None and value not in REQUIRED_RUNTIMES:
        raise InvalidRequestError(f"required_runtime {value!r} is not valid: use one of "
                                  f"{', '.join(REQUIRED_RUNTIMES)}, or null for none",
                                  details={"required_runtime": value})
    return value


class Tenants:
    def __init__(self, store: ControlStore, audited: Auditor) -> None:
        self._store = store
        self._audited = audited

    async def create(self, principal: Principal, name: str, *, required_runtime: str | None = None) -> Tenant:
        params: dict[str, Any] = {"name": name}
        if required_runtime is not None:
            params["required_runtime"] = required_runtime
        async with self._audited(principal, "tenant.create", name[:256], params=params, status=201):
            authorize(principal, Action.TENANT_CREATE)
            return await self._store.create_tenant(name, required_runtime=_required_runtime(required_runtime))

    async def list(self, principal: Principal) -> builtins.list[Tenant]:
        async with self._audited(principal, "tenant.list", None):
            authorize(principal, Action.TENANT_READ)
            return await self._store.list_tenants()

    async def update(self, principal: Principal, name_or_id: str, *, quotas: dict[str, Any] | None = None,
                     disabled: bool | None = None, required_runtime: str | Keep | None = KEEP,
                     default_checkpoints: str | Keep | None = KEEP, params: dict[str, Any] | None = None) -> Tenant:
        """Change some quotas (a key left out keeps its value; None removes the limit), disable it, and/or set the
        runtime all its sandboxes must run on (`KEEP`: unchanged; None: no requirement), and/or the checkpoints its
        creates get when they do not say ("auto", "manual"; None: "manual"). All checked first: a bad value
        changes nothing."""
        async with self._audited(principal, "tenant.update", name_or_id[:256], params=params) as audit:
            authorize(principal, Action.TENANT_UPDATE)
            tenant = await self.find(name_or_id)
            audit.target = tenant.id
            if disabled and tenant.id == principal.tenant_id:
                # The caller's own keys would stop working: nobody could undo it through the API.
                raise InvalidRequestError("refusing to disable the caller's own tenant",
                                          details={"tenant": tenant.name})
            if not isinstance(required_runtime, Keep):
                wanted = _required_runtime(required_runtime)
                audit.outcome["required_runtime"] = {"old": tenant.required_runtime, "new": wanted}
            if not isinstance(default_checkpoints, Keep) and default_checkpoints not in (None, "auto", "manual"):
                raise InvalidRequestError(f"default_checkpoints {default_checkpoints!r} is not valid: use 'auto', "
                                          "'manual' or null", details={"default_checkpoints": default_checkpoints})
            if quotas is not None:
                tenant = await self._store.set_quotas(tenant.id, dataclasses.replace(tenant.quotas, **quotas))
            if disabled is not None:
                tenant = await self._store.set_tenant_disabled(tenant.id, disabled)
            if not isinstance(required_runtime, Keep):
                tenant = await self._store.set_required_runtime(tenant.id, wanted)
            if not isinstance(default_checkpoints, Keep):
                tenant = await self._store.set_default_checkpoints(tenant.id, default_checkpoints)
            return tenant

    async def visible(self, principal: Principal, name_or_id: str, action: Action) -> Tenant:
        """The tenant named (by name or id) if `principal` may do `action` on it. The role is checked first; then,
        for anyone but an admin, another tenant is as unknown as one that never existed (a 404, nothing leaks)."""
        authorize(principal, action, None if principal.role is Role.ADMIN else principal.tenant_id)
        try:
            tenant = await self.find(name_or_id)
        except NotFoundError:
            tenant = None
        if tenant is None or (principal.role is not Role.ADMIN and tenant.id != principal.tenant_id):
            raise NotFoundError(f"no tenant {name_or_id!r}", details={"tenant": name_or_id})
        return tenant

    async def find(self, name_or_id: str) -> Tenant:
        """By name, else by id (no authorization: callers have checked the role)."""
        try:
            return await self._store.tenant_by_name(name_or_id)
        except NotFoundError:
            pass
        try:
            return await self._store.get_tenant(name_or_id)
        except NotFoundError:
            raise NotFoundError(f"no tenant {name_or_id!r}", details={"tenant": name_or_id}) from None


class Keys:
    def __init__(self, store: ControlStore, audited: Auditor, tenants: Tenants) -> None:
        self._store = store
        self._audited = audited
        self._tenants = tenants

    async def list(self, principal: Principal, tenant: str | None = None
                   ) -> builtins.list[tuple[ApiKey, str | None]]:
        """Keys (of one tenant, or all) with their tenant's name; secrets are not stored, so cannot leak."""
        async with self._audited(principal, "key.list", None, params={"tenant": tenant}):
            authorize(principal, Action.KEY_READ)
            found = await self._tenants.find(tenant) if tenant else None
            keys = await self._store.list_keys(found.id if found else None)
            names = {t.id: t.name for t in ([found] if found else await self._store.list_tenants())}
            return [(k, names.get(k.tenant_id)) for k in keys]

    async def create(self, principal: Principal, tenant: str, role: str, name: str = "") -> tuple[NewApiKey, Tenant]:
        params = {"tenant": tenant, "role": role, "name": name}
        async with self._audited(principal, "key.create", None, params=params, status=201) as audit:
            authorize(principal, Action.KEY_CREATE)
            try:
                found = await self._store.tenant_by_name(tenant)
            except NotFoundError as exc:
                raise InvalidRequestError(exc.message, details={"tenant": tenant}) from None
            new = await self._store.create_key(found.id, role, name)
            audit.target = new.info.id
            return new, found

    async def revoke(self, principal: Principal, key_id: str) -> None:
        async with self._audited(principal, "key.revoke", key_id[:256], status=204):
            authorize(principal, Action.KEY_REVOKE)
            await self._store.revoke_key(key_id)
