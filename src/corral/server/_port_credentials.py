"""What of a client's credentials a sandbox's port never gets (docs/ports.md, "Credentials").

A request relayed to a sandbox's app loses, whatever the sandbox's `public_ports`:

* every header Corral or E2B's SDKs carry a credential in: `X-API-Key` (E2B's control plane key),
  `X-Access-Token` (envd's access token), `E2B-Traffic-Access-Token` (the ports' traffic token),
  `X-Supabase-Token` (E2B's CLI user token); `Authorization` too, unless the service said it may go on (a public
  sandbox, where the app may use the header for itself);
* any other header whose value holds a Corral key (`corral_<prefix>_<secret>`), or one of the sandbox's own
  access tokens, in clear, percent-encoded, or inside `Basic` credentials;
* of `Cookie`, each cookie whose value holds one (the app's other cookies stay).

The list of E2B's headers is what its Python SDK sends (`e2b` 2.x: `X-API-KEY`, `X-Access-Token`,
`E2B-Traffic-Access-Token`, `Authorization`) and what E2B's CLI sends (`X-Supabase-Token`).
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.parse
from collections.abc import Iterable, Sequence

__all__ = ["CREDENTIAL_HEADERS", "strip_credentials"]

CREDENTIAL_HEADERS = frozenset({b"x-api-key", b"x-access-token", b"e2b-traffic-access-token", b"x-supabase-token"})
# A Corral key anywhere in a value (control/_keys.py's shape, not anchored): its characters need no escaping.
_CORRAL_KEY = re.compile(rb"corral_[a-z0-9]{8}_[A-Za-z0-9_-]{43}")
_BASIC = re.compile(rb"\s*basic\s+([A-Za-z0-9+/=]+)\s*$", re.IGNORECASE)


def strip_credentials(headers: Iterable[tuple[bytes, bytes]], tokens: Sequence[str], *,
                      keep_authorization: bool) -> list[tuple[bytes, bytes]]:
    """`headers` (lower-case names) without the credentials above; `tokens`: the sandbox's own access tokens."""
    secrets = [t.encode() for t in tokens if t]
    out: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name in CREDENTIAL_HEADERS or (name == b"authorization" and not keep_authorization):
            continue
        if name == b"cookie":
            kept = [c for c in value.split(b";") if c.strip() and not _holds_credential(c, secrets)]
            if kept:
                out.append((name, b";".join(kept).strip()))
            continue
        if not _holds_credential(value, secrets):
            out.append((name, value))
    return out


def _holds_credential(value: bytes, secrets: Sequence[bytes]) -> bool:
    forms = [value, urllib.parse.unquote_to_bytes(value)]
    basic = _BASIC.match(value)
    if basic is not None:
        try:
            forms.append(base64.b64decode(basic.group(1), validate=True))
        except (binascii.Error, ValueError):
            pass
    return any(_CORRAL_KEY.search(form) or any(s in form for s in secrets) for form in forms)
