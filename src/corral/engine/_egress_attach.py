"""A sandbox's way out: the egress proxy attached to it, the CA trust files, the secrets' keyring, its environment.

Every sandbox reaches out only through the egress proxy (docs/egress.md). On the local and Docker backends the
proxy runs in this process and listens on a socket beside each sandbox (`Backend.egress_endpoint`); a
`RemoteEgress` backend's sandboxes reach a proxy of their own platform, which records its refusals elsewhere
(`remote_denials`: the service's shared audit trail). The environment itself is `compose_env` (pure).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .._atomic import write_atomic
from .._exceptions import CorralError, InvalidRequestError
from ..backends import Backend, BackendRecord, RemoteEgress
from ._environment import TRUST_BUNDLE, TRUST_CA, compose_env, grants_packages
from ._sandbox import LiveSandbox

if TYPE_CHECKING:
    from ..egress import EgressEvent, EgressPolicy, EgressProxy
    from ..egress._keyring import SecretKeyring
    from ._models import SandboxSpec

logger = logging.getLogger("corral.engine")

DenialSource = Callable[[str, float], Awaitable[Sequence["EgressEvent"]]]  # (sandbox id, since) -> refusals

_HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


@functools.lru_cache(maxsize=1)
def _host_bundle() -> bytes:
    """The host's trust store (Debian's path first), which the sandbox's bundle extends."""
    for path in _HOST_BUNDLES:
        with contextlib.suppress(OSError):
            return Path(path).read_bytes()
    return b""


class EgressAttachment:
    """Attaches sandboxes to the egress proxy (`proxy`; None: nothing leaves a sandbox at all) and composes their
    environment."""

    def __init__(self, home: Path, backend: Backend, proxy: EgressProxy | None,
                 keyring: SecretKeyring | None = None) -> None:
        self._home = home
        self._backend = backend
        self.proxy = proxy
        self._keyring = keyring
        # Asked once: every exec builds an environment, and a Protocol's isinstance costs ~8 us.
        self.remote = backend if isinstance(backend, RemoteEgress) else None
        self.remote_denials: DenialSource | None = None

    @property
    def keyring(self) -> SecretKeyring:
        """What seals and opens secret values (`CORRAL_SECRETS_KEY`, else `<home>/secrets.key`)."""
        if self._keyring is None:
            from ..egress._keyring import SecretKeyring  # `cryptography` loads only where secrets are used

            self._keyring = SecretKeyring.from_environment(self._home)
        return self._keyring

    def policy(self, spec: SandboxSpec) -> EgressPolicy:
        return spec.egress_policy(self.keyring if spec.secrets else None)

    def check_secrets_supported(self) -> None:
        """Refuse secrets where no proxy of ours could put them in (the Kubernetes backend's, for now)."""
        if self.proxy is None or self.proxy.ca is None or self.remote is not None:
            raise InvalidRequestError(f"secrets need the egress proxy of the local or docker backend, with its CA; "
                                      f"the {self._backend.name} backend here has none (docs/secrets.md)")

    async def attach(self, sandbox_id: str, record: BackendRecord, spec: SandboxSpec) -> None:
        # A backend whose sandboxes reach a proxy of their own platform (`RemoteEgress`) has no socket here.
        if self.proxy is not None and self.remote is None:
            endpoint = self._backend.egress_endpoint(record)
            await self.proxy.attach(sandbox_id, Path(endpoint.path), self.policy(spec))
            self.write_trust(record, spec)

    async def detach(self, sandbox_id: str) -> None:
        if self.proxy is not None:
            await self.proxy.detach(sandbox_id)

    def apply(self, sandbox_id: str, record: BackendRecord, spec: SandboxSpec) -> None:
        """A live sandbox's new spec (a claimed pool member's, a changed network): policy and trust files now."""
        if self.proxy is not None:
            self.proxy.set_policy(sandbox_id, self.policy(spec))
            self.write_trust(record, spec)

    def write_trust(self, record: BackendRecord, spec: SandboxSpec) -> None:
        """The deployment's CA where the sandbox reads it (`/.corral/egress`, beside the proxy's socket): alone,
        and after the host's trust store. Rewritten at every attach, so a rotated CA reaches live sandboxes."""
        ca = self.proxy.ca if self.proxy is not None else None
        if not spec.secrets or ca is None or self.remote is not None:
            return
        directory = Path(self._backend.egress_endpoint(record).path).parent
        write_atomic(directory / TRUST_CA, ca.pem, mode=0o644, durable=False)
        write_atomic(directory / TRUST_BUNDLE, _host_bundle() + b"\n" + ca.pem, mode=0o644, durable=False)

    def env(self, sb: LiveSandbox, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment every process of the sandbox starts with."""
        proxy_env = None
        if self.remote is not None:
            packages = grants_packages(sb.spec.network, sb.spec.network_private)
            proxy_env = self.remote.egress_env(sb.record, packages=packages)
        return compose_env(sb.spec, sb.template_env, proxy_env=proxy_env, extra=extra)

    async def denials(self, sandbox_id: str, since: float) -> Sequence[EgressEvent]:
        """The proxy's refusals of the sandbox's connections since `since` (a remote proxy recorded them first)."""
        if self.remote is not None:
            return await self._remote_denials(sandbox_id, since)
        if self.proxy is not None:
            return self.proxy.denials(sandbox_id, since)
        return ()

    async def _remote_denials(self, sandbox_id: str, since: float) -> Sequence[EgressEvent]:
        if self.remote_denials is None:
            return ()
        try:
            return await self.remote_denials(sandbox_id, since)
        except CorralError as exc:  # the command ran; only the notice of its refusals is lost
            logger.warning("egress refusals of sandbox %s unavailable: %s", sandbox_id, exc.message)
            return ()
