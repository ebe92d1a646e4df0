"""Row lookups the store's parts share: a tenant, key or sandbox row by id, or NotFoundError; and new ids.

Beside the store rather than in it so that its mixins (`_sandbox_records`, `_holdings`) and the quota checks
(`_quotas`) read rows the same way without importing the store.
"""

from __future__ import annotations

import secrets

from sqlalchemy.ext.asyncio import AsyncSession

from .._exceptions import NotFoundError
from ._models import ApiKeyRow, SandboxRow, TenantRow


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(8)}"


async def tenant_row(session: AsyncSession, tenant_id: str) -> TenantRow:
    row = await session.get(TenantRow, tenant_id)
    if row is None:
        raise NotFoundError(f"no tenant {tenant_id!r}")
    return row


async def key_row(session: AsyncSession, key_id: str) -> ApiKeyRow:
    row = await session.get(ApiKeyRow, key_id)
    if row is None:
        raise NotFoundError(f"no API key {key_id!r}")
    return row


async def sandbox_row(session: AsyncSession, sandbox_id: str) -> SandboxRow:
    row = await session.get(SandboxRow, sandbox_id)
    if row is None:
        raise NotFoundError(f"no sandbox {sandbox_id!r}")
    return row


async def live_sandbox_row(session: AsyncSession, sandbox_id: str) -> SandboxRow:
    row = await sandbox_row(session, sandbox_id)
    if row.destroyed_at is not None:
        raise NotFoundError(f"no sandbox {sandbox_id!r}")
    return row
