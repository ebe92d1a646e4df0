"""`EgressDirectory`: who a credential on the standalone egress proxy belongs to, and that sandbox's policy now.

`corral egress-proxy` (docs/kubernetes-backend.md) serves sandboxes it does not run: Pods, which present
`<sandbox id>:<credential>` with every request. The credential is checked with the shared key alone (`verify`, no
lookup); the policy comes from the shared database, like everything replicas share: the sandbox's `network` and
its tenant's private pairs, cached for `cache_ttl` seconds, so that a policy change (`PUT /network`, a tenant's
egress settings) reaches the proxy within that time, and a busy sandbox costs one query per TTL, not per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._exceptions import AuthenticationError, NotFoundError
from ..control import ControlStore
from ..egress import EgressEvent, EgressPolicy
from ._egress import egress_audit_event
from ._telemetry import EgressMetrics

__all__ = ["EgressDirectory"]

_CACHED_MAX = 10_000  # sandboxes whose policy is kept: more than any one proxy serves at once


@dataclass(frozen=True)
class _Cached:
    policy: EgressPolicy
    until: float  # time.monotonic()


class EgressDirectory:
    """**store** - the shared control store. **verify** - `(sandbox id, credential) -> bool` with the shared key
    (the Kubernetes backend's `TokenKey.verify_egress`). **cache_ttl** - seconds a policy is reused.
    **metrics** - where each attempt is also counted (`corral egress-proxy --metrics-port`)."""

    def __init__(self, store: ControlStore, verify: Callable[[str, str], bool], *, cache_ttl: float = 2.0,
                 metrics: EgressMetrics | None = None) -> None:
        self.store = store
        self._verify = verify
        self.cache_ttl = cache_ttl
        self._metrics = metrics
        self._cache: dict[str, _Cached] = {}
        self._loading: dict[str, asyncio.Future[EgressPolicy]] = {}

    async def policy(self, sandbox_id: str, credential: str) -> EgressPolicy:
        """The proxy's `Identify`: the sandbox's policy if `credential` is its own and it is live."""
        if not self._verify(sandbox_id, credential):
            raise AuthenticationError(f"the credential is not sandbox {sandbox_id[:64]!r}'s")
        cached = self._cache.get(sandbox_id)
        if cached is not None and cached.until > time.monotonic():
            return cached.policy
        loading = self._loading.get(sandbox_id)
        if loading is None:  # one query for a burst of a sandbox's connections, not one each
            loading = asyncio.ensure_future(self._load(sandbox_id))
            self._loading[sandbox_id] = loading
            loading.add_done_callback(lambda _: self._loading.pop(sandbox_id, None))
        return await asyncio.shield(loading)

    async def record(self, event: EgressEvent) -> None:
        """The proxy's `on_event`: the same audit record the server's own proxy writes, and the same counts."""
        tenant_id = await egress_audit_event(self.store, event)
        if self._metrics is not None:
            self._metrics.observe(tenant_id, event)

    async def _load(self, sandbox_id: str) -> EgressPolicy:
        try:
            record = await self.store.get_sandbox(sandbox_id)
        except NotFoundError:
            raise AuthenticationError(f"sandbox {sandbox_id} does not exist") from None
        if not record.live:
            self._cache.pop(sandbox_id, None)
            raise AuthenticationError(f"sandbox {sandbox_id} was destroyed")
        private = (await self.store.tenant_egress(record.tenant_id)).private
        policy = record.spec.model_copy(update={"network_private": tuple(private)}).egress_policy()
        if len(self._cache) >= _CACHED_MAX:
            self._forget_expired()
        self._cache[sandbox_id] = _Cached(policy, time.monotonic() + self.cache_ttl)
        return policy

    def _forget_expired(self) -> None:
        """Drop expired entries; if none has expired, the oldest tenth (dicts keep insertion order)."""
        now = time.monotonic()
        stale = [k for k, v in self._cache.items() if v.until <= now] or list(self._cache)[:_CACHED_MAX // 10]
        for sandbox_id in stale:
            del self._cache[sandbox_id]
