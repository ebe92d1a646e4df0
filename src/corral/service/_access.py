"""Sandbox access tokens: credentials for one sandbox that stand for the API key that created it.

Some clients reach a sandbox without the API key: E2B's SDKs send its envd an `X-Access-Token`, and its ports
(the code interpreter's among them) a traffic token, both handed out when the sandbox was created. A token here
is `HMAC-SHA256(secret, purpose, sandbox id)`: nothing is stored per sandbox, every replica that shares the
secret derives the same token, and a token names its sandbox, so it opens no other. It is only as good as the
key behind it: a call with a token runs as that key's principal, with its role and tenant, so revoking the key
(or disabling its tenant) ends the token too, and every operation is authorized and audited as if the key itself
had been sent.

The secret is `CORRAL_ACCESS_SECRET` if set (several replicas must share one), else `<CORRAL_HOME>/access.key`,
made on the first start (0600). Replacing it invalidates every token handed out before.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from .._atomic import kept_secret
from .._exceptions import AuthenticationError
from .._settings import access_secret
from ..control import Principal, SandboxRecord

if TYPE_CHECKING:
    from ..control import ControlStore
    from ..engine import Engine
    from ._callers import Callers, ClientInfo
    from ._replicas import Replica

__all__ = ["ACCESS_KEY_FILE", "SandboxAccess", "TokenPurpose"]

ACCESS_KEY_FILE = "access.key"
_SECRET_BYTES = 32


class TokenPurpose(StrEnum):
    """What a token opens: the whole sandbox (files, processes, code), or only its ports."""

    SANDBOX = "sandbox"
    PORTS = "ports"


class SandboxAccess:
    def __init__(self, store: ControlStore, engine: Engine, replica: Replica, callers: Callers,
                 secret: bytes | None = None) -> None:
        self._store = store
        self._engine = engine  # the sandboxes this node runs (signed URLs that name none)
        self._replica = replica
        self._callers = callers  # where refused tokens are recorded, like every refused credential
        self._secret = secret

    def start(self) -> None:
        """Load the secret (or make one); call before handing out or checking tokens."""
        if self._secret is not None:
            return
        configured = access_secret()
        key_file = self._store.home / ACCESS_KEY_FILE
        self._secret = configured.encode() if configured else kept_secret(key_file, _SECRET_BYTES)

    def token(self, sandbox_id: str, purpose: TokenPurpose = TokenPurpose.SANDBOX) -> str:
        if self._secret is None:  # a service used without start() (tests drive the app alone)
            self.start()
        assert self._secret is not None
        mac = hmac.new(self._secret, f"{purpose.value}\0{sandbox_id}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def matches(self, sandbox_id: str, token: str, purpose: TokenPurpose) -> bool:
        return hmac.compare_digest(self.token(sandbox_id, purpose).encode(), token.encode())

    async def authenticate(self, sandbox_id: str, token: str | None, client: ClientInfo, *,
                           purposes: tuple[TokenPurpose, ...] = (TokenPurpose.SANDBOX,)) -> Principal:
        """The principal `token` stands for on `sandbox_id`: the key that created the sandbox. A missing or
        wrong token, or a revoked key, is `AuthenticationError`, recorded like every refused credential."""
        try:
            if not token:
                raise AuthenticationError("missing access token for the sandbox")
            if not any(self.matches(sandbox_id, token, purpose) for purpose in purposes):
                raise AuthenticationError(f"wrong access token for sandbox {sandbox_id}")
            record = await self._store.find_sandbox(sandbox_id)
            if record is None:  # a token of a sandbox this deployment never made: its secret changed
                raise AuthenticationError(f"wrong access token for sandbox {sandbox_id}")
            return await self.creator(record)
        except AuthenticationError as exc:
            await self._callers.record_denial(client, exc, None)
            raise

    async def signed(self, sign: Callable[[str], str], signature: str, client: ClientInfo, *,
                     sandbox_id: str | None = None) -> tuple[str, Principal]:
        """The sandbox whose token made `signature` (`sign(token)` is what its token makes), and the principal the
        token stands for. For signed URLs that name no sandbox: the running sandboxes of this node are tried (one
        hash each), or only `sandbox_id` when the request names one. `AuthenticationError`, recorded, if none."""
        candidates = [sandbox_id] if sandbox_id else [info.id for info in self._engine.list()]
        try:
            for candidate in candidates:
                if self._signed_by(candidate, sign, signature):
                    record = await self._store.find_sandbox(candidate)
                    if record is not None:
                        return candidate, await self.creator(record)
            raise AuthenticationError("invalid signature")
        except AuthenticationError as exc:
            await self._callers.record_denial(client, exc, None)
            raise

    async def signer_elsewhere(self, sign: Callable[[str], str], signature: str) -> str | None:
        """The live sandbox of another replica whose token made `signature`, if one did and none of this node's
        did (one hash per sandbox): the replicas' middleware forwards such a signed URL to its owner."""
        if any(self._signed_by(info.id, sign, signature) for info in self._engine.list()):
            return None  # this node's own: served here
        mine = self._replica.id
        for record in await self._store.list_sandboxes(None):
            if record.owner not in (None, mine) and self._signed_by(record.id, sign, signature):
                return record.id
        return None

    def _signed_by(self, sandbox_id: str, sign: Callable[[str], str], signature: str) -> bool:
        """Whether `sandbox_id`'s token makes `signature` (constant time)."""
        return hmac.compare_digest(sign(self.token(sandbox_id)).encode(), signature.encode())

    async def creator(self, record: SandboxRecord) -> Principal:
        """The principal of the key that created `record`'s sandbox (`AuthenticationError` once revoked)."""
        return await self._store.key_principal(record.key_id)
