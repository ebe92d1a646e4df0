"""What this server runs sandboxes on: its backend, the runtimes it can run, and what of the isolation it cannot
give, each with the reason (`GET /v1/info`; `corral check` marks those items not applicable, saying why).

Any valid key may read it (it names no tenant's data); it is not audited, as `/v1/health` is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..backends import Backend, backend_limitations, backend_runtimes, supports_root
from ..control import ControlStore, Principal
from ._replicas import Replica

__all__ = ["Caller", "Info", "ServerInfo"]


@dataclass(frozen=True)
class ServerInfo:
    backend: str  # the backend's name (`corral serve --backend`)
    runtimes: tuple[str, ...]  # the runtimes a sandbox may ask for here
    limitations: Mapping[str, str]  # key -> reason (docs/backends.md); empty when nothing is missing
    domain: str = "localhost"  # sandboxes' ports are served at `<port>-<sandbox id>.<domain>` (docs/ports.md)
    root: bool = True  # whether sandboxes may be created with root (`CreateSandbox.root`, docs/security.md)
    replica: str = ""  # the replica that answered, among several on one database (docs/replicas.md)


@dataclass(frozen=True)
class Caller:
    """Who a key is: its id, its tenant (id and name) and its role (what a front end may offer it)."""

    key_id: str
    tenant_id: str
    tenant: str
    role: str


class Info:
    def __init__(self, store: ControlStore, backend: Backend, replica: Replica, domain: str) -> None:
        self._store = store
        self._backend = backend
        self._replica = replica  # its id is known once it started
        self._domain = domain

    @property
    def root(self) -> bool:
        """Whether this deployment's sandboxes may be created with root (a front end's default may follow it)."""
        return supports_root(self._backend)

    async def get(self, principal: Principal) -> ServerInfo:
        """The server's backend as its engine has it; `principal` is any authenticated caller."""
        backend = self._backend
        return ServerInfo(backend=backend.name, runtimes=tuple(rt.value for rt in backend_runtimes(backend)),
                          limitations=backend_limitations(backend), domain=self._domain,
                          root=supports_root(backend), replica=self._replica.id)

    async def caller(self, principal: Principal) -> Caller:
        """The calling key itself (`GET /v1/info`'s `caller`): any authenticated caller may know who it is."""
        tenant = await self._store.get_tenant(principal.tenant_id)
        return Caller(key_id=principal.key_id, tenant_id=tenant.id, tenant=tenant.name, role=principal.role.value)
