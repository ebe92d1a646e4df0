"""The Kubernetes backend's credentials: each agent's token and each sandbox's egress credential, derived, not
stored.

Both are `HMAC-SHA256(key, label, identities...)`. The key is itself derived, with a label of its own, from the
server's access secret (`CORRAL_ACCESS_SECRET`, which replicas share), else from `<home>/k8s-agent.key` (made
0600 on first use): an agent token can never equal a sandbox access token made from the same secret.

* The agent token binds the sandbox and its Pod's identity (name and uid): a Pod made again under the same name
  has a new uid, hence a new token, and no token opens another sandbox's agent. A warm Pod is made before any
  sandbox id exists: its token binds the Pod alone (an empty sandbox id) and the sandbox's record keeps it.
* The egress credential binds the sandbox id alone (ids are never reused: `sb-` and 16 random hex digits): the
  egress proxy (a Service every sandbox reaches) knows a sandbox by `<sandbox id>:<credential>` in its proxy URL,
  never by its IP, which Pods reuse, and checks it with the key alone (`verify_egress`), no lookup.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

from ..._atomic import kept_secret
from ..._settings import access_secret

__all__ = ["KEY_FILE", "TokenKey"]

KEY_FILE = "k8s-agent.key"
_LABEL = b"corral/kubernetes-backend/v1"


class TokenKey:
    def __init__(self, key: bytes) -> None:
        self._key = hmac.new(key, _LABEL, hashlib.sha256).digest()

    @classmethod
    def load(cls, home: Path) -> TokenKey:
        configured = access_secret()
        return cls(configured.encode() if configured else kept_secret(home / KEY_FILE))

    def agent_token(self, sandbox_id: str, pod: str, uid: str) -> str:
        return self._mac("agent", sandbox_id, pod, uid)

    def egress_credential(self, sandbox_id: str) -> str:
        return self._mac("egress", sandbox_id)

    def verify_egress(self, sandbox_id: str, credential: str) -> bool:
        """The egress proxy's half: whether `credential` is `sandbox_id`'s (constant time)."""
        return hmac.compare_digest(self.egress_credential(sandbox_id).encode(), credential.encode())

    def _mac(self, *parts: str) -> str:
        mac = hmac.new(self._key, "\0".join(parts).encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")
