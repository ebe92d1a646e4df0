"""The private destinations an admin granted each tenant (docs/egress.md): `store.grants`.

```python
await store.grants.grant(tenant_id, "10.0.0.5:5432", key_id=admin.key_id)   # the deployment's call
await store.grants.list(tenant_id)                                          # [PrivateGrant(...)]
await store.grants.revoke(tenant_id, "10.0.0.5:5432")                       # switched off for the tenant too
```

A tenant's `private` pairs (`TenantEgress.private`) count only while granted: the store hands out the
intersection, so a revoked grant closes at once, and pairs stored before grants existed stay closed until an
admin grants them. Which destinations may be granted at all (never the control plane's own) is the service's
check (`corral.service.PrivateGrants`): the store keeps what it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from ._db import Database
from ._models import PrivateGrant, PrivateGrantRow, TenantEgressRow

__all__ = ["PrivateGrants", "granted_destinations"]


class PrivateGrants:
    def __init__(self, db: Database, clock: Callable[[], datetime]) -> None:
        self._db = db
        self._now = clock

    async def list(self, tenant_id: str) -> list[PrivateGrant]:
        async with self._db.read() as session:
            rows = (await session.scalars(select(PrivateGrantRow).where(PrivateGrantRow.tenant_id == tenant_id)
                                          .order_by(PrivateGrantRow.destination))).all()
        return [PrivateGrant(destination=r.destination, granted_at=r.granted_at, key_id=r.key_id) for r in rows]

    async def grant(self, tenant_id: str, destination: str, *, key_id: str | None = None) -> bool:
        """Grant `destination` (normalised `ip:port`); False if it already was (the first grant is kept)."""
        async with self._db.write() as session:
            if await session.get(PrivateGrantRow, (tenant_id, destination)) is not None:
                return False
            session.add(PrivateGrantRow(tenant_id=tenant_id, destination=destination, granted_at=self._now(),
                                        key_id=key_id))
        return True

    async def revoke(self, tenant_id: str, destination: str) -> bool:
        """Take the grant back and switch the destination off for the tenant; False if it was not granted."""
        async with self._db.write() as session:
            gone = await session.execute(delete(PrivateGrantRow).where(
                PrivateGrantRow.tenant_id == tenant_id, PrivateGrantRow.destination == destination))
            egress = await session.get(TenantEgressRow, tenant_id)
            if egress is not None and destination in (egress.private or []):
                egress.private = [p for p in egress.private if p != destination]
        return bool(getattr(gone, "rowcount", 0))


async def granted_destinations(session: AsyncSession, tenant_id: str) -> frozenset[str]:
    """The tenant's granted destinations, read in the caller's session (with its egress row)."""
    rows = await session.scalars(select(PrivateGrantRow.destination).where(PrivateGrantRow.tenant_id == tenant_id))
    return frozenset(rows.all())
