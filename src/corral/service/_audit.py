"""Reading the audit trail: query, export, follow, verify, head.

Reading is authorized but not itself recorded: an auditor tailing the log would otherwise add a record for every
record it reads. Admins see every tenant's records (or one's); everyone else only their own tenant's.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from datetime import datetime

from .._exceptions import NotFoundError
from ..control import Action, AuditEntry, ChainHead, ControlStore, Principal, Role, VerifyResult, authorize

__all__ = ["AuditFilter", "AuditTrail"]

_EXPORT_BATCH = 1000


class AuditFilter:
    """Which records: a tenant (name or id), a sandbox, an action, a time range, the key that made them."""

    def __init__(self, tenant: str | None = None, sandbox: str | None = None, action: str | None = None,
                 since: datetime | None = None, until: datetime | None = None, key: str | None = None) -> None:
        self.tenant, self.sandbox, self.action, self.since, self.until = tenant, sandbox, action, since, until
        self.key = key


class AuditTrail:
    def __init__(self, store: ControlStore) -> None:
        self._store = store

    async def query(self, principal: Principal, where: AuditFilter, *, limit: int,
                    newest_first: bool = False) -> builtins.list[AuditEntry]:
        """The first `limit` matching records, oldest first; or the last `limit`, newest first."""
        tenant_id = await self._tenant(principal, where.tenant)
        return await self._store.audit.query(tenant=tenant_id, sandbox=where.sandbox, action=where.action,
                                                 since=where.since, until=where.until, limit=limit, key=where.key,
                                                 newest_first=newest_first)

    async def export(self, principal: Principal, where: AuditFilter) -> AsyncIterator[builtins.list[AuditEntry]]:
        """Matching records, a page per read transaction, so a long log never sits in memory. Authorized before
        the first page is asked for."""
        tenant_id = await self._tenant(principal, where.tenant)
        return self._pages(tenant_id, where)

    async def _pages(self, tenant_id: str | None, where: AuditFilter) -> AsyncIterator[builtins.list[AuditEntry]]:
        after = 0
        while True:
            page = await self._store.audit.query(after=after, limit=_EXPORT_BATCH, tenant=tenant_id,
                                                     sandbox=where.sandbox, action=where.action,
                                                     since=where.since, until=where.until, key=where.key)
            if page:
                yield page
                after = page[-1].seq
            if len(page) < _EXPORT_BATCH:
                return

    async def follow(self, principal: Principal, where: AuditFilter, *,
                     after: int | None = None) -> AsyncIterator[AuditEntry]:
        """New records as they are appended; from now unless `after` (the position is taken before returning,
        so none is missed)."""
        tenant_id = await self._tenant(principal, where.tenant)
        if after is None:
            after = (await self._store.audit.head()).seq
        return self._store.audit.follow(after=after, tenant=tenant_id, sandbox=where.sandbox,
                                            action=where.action, key=where.key)

    async def verify(self, principal: Principal, head: str | None = None) -> VerifyResult:
        authorize(principal, Action.AUDIT_READ, principal.tenant_id)
        expected = ChainHead.parse(head) if head else None
        return await self._store.audit.verify(expected)

    async def head(self, principal: Principal) -> ChainHead:
        authorize(principal, Action.AUDIT_READ, principal.tenant_id)
        return await self._store.audit.head()

    async def _tenant(self, principal: Principal, tenant: str | None) -> str | None:
        """The tenant id to filter on: admins see any (or all); others only their own."""
        tenant_id: str | None = None
        if tenant:
            try:
                tenant_id = (await self._store.tenant_by_name(tenant)).id
            except NotFoundError:
                tenant_id = tenant  # an id
        if principal.role is Role.ADMIN:
            authorize(principal, Action.AUDIT_READ)
            return tenant_id
        authorize(principal, Action.AUDIT_READ, tenant_id or principal.tenant_id)
        return principal.tenant_id
