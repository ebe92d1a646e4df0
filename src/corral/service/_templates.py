"""Templates as tenants see them: their names, and whether a name (or a snapshot of the caller's tenant) starts
sandboxes."""

from __future__ import annotations

from .._exceptions import NotFoundError
from ..control import Action, Principal, authorize
from ..templates import TemplateStore
from ._audited import Auditor
from ._snapshots import SNAPSHOT_ID, Snapshots

__all__ = ["Templates"]


class Templates:
    def __init__(self, templates: TemplateStore, snapshots: Snapshots, audited: Auditor) -> None:
        self._templates = templates
        self._snapshots = snapshots
        self._audited = audited

    async def names(self, principal: Principal) -> list[str]:
        """The deployment's named templates, sorted (what the dashboard's New sandbox form offers)."""
        async with self._audited(principal, "template.list", None):
            authorize(principal, Action.SANDBOX_CREATE, principal.tenant_id)
            return [t.name for t in self._templates.list()]

    async def exists(self, principal: Principal, name: str) -> bool:
        """Whether `name` is a template of this deployment, or a snapshot of the caller's tenant."""
        async with self._audited(principal, "template.get", name[:256]) as audit:
            authorize(principal, Action.SANDBOX_READ, principal.tenant_id)
            try:
                if SNAPSHOT_ID.fullmatch(name):
                    await self._snapshots.authorized(principal, name, Action.SANDBOX_READ)
                else:
                    self._templates.get(name)
                found = True
            except NotFoundError:
                found = False
            audit.outcome["exists"] = found
        return found
