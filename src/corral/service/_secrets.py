"""Secrets a sandbox is created with (docs/secrets.md): checked, bound to hosts, sealed before anything stores them.

`SecretRequest` is what a caller sends per name: a value and its hosts (`{"value": ..., "hosts": [...]}`), or the
name of one of the tenant's stored secrets (`{"stored": "github"}`, optionally narrowed to some of its hosts);
`seal_secrets` turns those into the spec's `SealedSecret`s, each with a placeholder of its own. `StoredSecrets` keeps
a tenant's secrets (operators put them, anyone who makes sandboxes lists their names and hosts; no one reads a
value back). Values never reach the audit trail, logs or the sandbox: the audit keeps names and hosts only.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .._exceptions import InvalidRequestError, NotFoundError
from ..backends._spec import MAX_SECRETS, SealedSecret
from ..control import Action, ControlStore, Principal, StoredSecret, authorize
from ..egress._hosts import Rule
from ..egress._keyring import SecretKeyring
from ..egress._secrets import new_placeholder
from ..engine import Engine
from ._audited import Auditor
from ._public_suffix import is_public_suffix

__all__ = ["MAX_VALUE", "SecretRequest", "StoredSecrets", "audit_secrets", "check_secret_name", "seal_secrets"]

MAX_VALUE = 8192  # characters: tokens and keys, not files
MAX_HOSTS = 16


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def check_secret_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidRequestError(f"secret name {name[:80]!r} is not valid: an environment variable name (letters, "
                                  "digits and '_', not starting with a digit), at most 64 characters")
    return name


class SecretRequest(BaseModel):
    """One secret: its value and the hosts it may be sent to, written as network rules are (`*.example.com` for the
    subdomains, `host:port` for one port alone), or `stored`, the name of one of the tenant's stored secrets (whose
    hosts `hosts` may narrow, never widen)."""

    model_config = ConfigDict(extra="forbid")

    value: str | None = Field(default=None, repr=False)
    hosts: list[str] | None = None
    body: bool = False  # also put into request bodies (read whole, up to 8 MiB), not only the line and headers
    stored: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> SecretRequest:
        if (self.value is None) == (self.stored is None):
            raise ValueError("give a secret either a value (with its hosts) or the name of a stored secret")
        if self.value is not None and self.hosts is None:
            raise ValueError("a secret with a value needs its hosts")
        return self

    @field_validator("value")
    @classmethod
    def _value(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value:
            raise ValueError("a secret's value is empty")
        if len(value) > MAX_VALUE:
            raise ValueError(f"a secret's value is at most {MAX_VALUE} characters")
        if any(c in value for c in "\x00\r\n"):
            raise ValueError("a secret's value may not contain NUL, CR or LF (it goes into HTTP headers)")
        return value

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, hosts: list[str] | None) -> list[str] | None:
        if hosts is None:
            return None
        if not hosts:
            raise ValueError("a secret is bound to at least one host")
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"a secret is bound to at most {MAX_HOSTS} hosts")
        return [_host(h) for h in hosts]


def _host(text: str) -> str:
    """A host as network rules write it (`egress._hosts.Rule`, the same parser), in its canonical form: a name, an
    IP literal or `*.suffix`, with an optional port (the secret then goes only to that port). A wildcard over a
    public suffix (`*.com`) is refused: the secret would go to every site under it."""
    try:
        rule = Rule.parse(text, what="secret host")
    except InvalidRequestError as exc:
        raise ValueError(exc.message) from None
    if rule.wildcard and is_public_suffix(rule.host):
        raise ValueError(f"host {text!r}: {rule.host!r} is a public suffix, and the secret would go to every site "
                         "under it; bind it to the exact hosts, or to '*.' a domain of its own")
    return str(rule)


def _narrower(name: str, hosts: tuple[str, ...], stored: StoredSecret) -> None:
    """A stored secret's hosts narrowed, never widened: each host asked for is within one of the stored ones
    (`api.example.com:443` is within `api.example.com`, `a.example.com` within `*.example.com`)."""
    theirs = [Rule.parse(h, what="secret host") for h in stored.hosts]
    wider = [h for h in hosts if not any(r.covers(Rule.parse(h, what="secret host")) for r in theirs)]
    if wider:
        raise InvalidRequestError(f"secret {name}: the stored secret {stored.name!r} is bound to "
                                  f"{', '.join(stored.hosts)}; {', '.join(wider)} is not among them")


def seal_secrets(requests: dict[str, SecretRequest], env: dict[str, str], keyring: SecretKeyring,
                 stored: dict[str, StoredSecret] | None = None) -> tuple[SealedSecret, ...]:
    """The spec's secrets: values sealed now, stored ones as they were sealed (`stored`: by stored name)."""
    if len(requests) > MAX_SECRETS:
        raise InvalidRequestError(f"a sandbox has at most {MAX_SECRETS} secrets")
    clash = sorted(set(requests) & set(env))
    if clash:
        raise InvalidRequestError(f"{', '.join(clash)}: named both in env and in secrets; a secret's name is the "
                                  "variable that holds its placeholder")
    try:
        return tuple(_sealed(name, r, keyring, stored or {}) for name, r in requests.items())
    except ValueError as exc:  # a name that is no variable name
        raise InvalidRequestError(f"invalid secrets: {exc}") from None


def _sealed(name: str, request: SecretRequest, keyring: SecretKeyring,
            stored: dict[str, StoredSecret]) -> SealedSecret:
    if request.value is not None:
        return SealedSecret(name=name, placeholder=new_placeholder(), hosts=tuple(request.hosts or ()),
                            body=request.body, sealed=keyring.seal(request.value))
    found = stored[str(request.stored)]
    hosts = found.hosts if request.hosts is None else tuple(request.hosts)
    _narrower(name, hosts, found)
    # Under the newest key even when the stored value is not resealed yet: a new sandbox never needs an old key.
    sealed = found.sealed if keyring.current(found.sealed) else keyring.reseal(found.sealed)
    return SealedSecret(name=name, placeholder=new_placeholder(), hosts=hosts, body=found.body or request.body,
                        sealed=sealed)


def audit_secrets(requests: dict[str, SecretRequest]) -> dict[str, Any]:
    """What the audit keeps of a sandbox's secrets: names and hosts, never a value."""
    return {name: {"hosts": r.hosts, "body": r.body} if r.stored is None else
            {"stored": r.stored, **({"hosts": r.hosts} if r.hosts is not None else {})}
            for name, r in requests.items()}


class StoredSecrets:
    """A tenant's stored secrets: put (operators; the value sealed at once), list and delete, each audited."""

    def __init__(self, store: ControlStore, engine: Engine, audited: Auditor) -> None:
        self._store = store
        self._engine = engine
        self._audited = audited

    async def put(self, principal: Principal, name: str, request: SecretRequest) -> StoredSecret:
        params = {"name": name[:80], "hosts": request.hosts, "body": request.body}
        async with self._audited(principal, "secret.put", name[:80], params=params):
            authorize(principal, Action.SECRET_WRITE, principal.tenant_id)
            check_secret_name(name)
            if request.value is None or request.stored is not None:
                raise InvalidRequestError("a stored secret needs its value and hosts")
            self._engine.check_secrets_supported()
            return await self._store.put_secret(principal.tenant_id, name, list(request.hosts or ()),
                                                    request.body, self._engine.keyring.seal(request.value))

    async def list(self, principal: Principal) -> list[StoredSecret]:
        async with self._audited(principal, "secret.list", None):
            authorize(principal, Action.SECRET_READ, principal.tenant_id)
            return await self._store.list_secrets(principal.tenant_id)

    async def delete(self, principal: Principal, name: str) -> None:
        async with self._audited(principal, "secret.delete", name[:80], status=204):
            authorize(principal, Action.SECRET_WRITE, principal.tenant_id)
            await self._store.delete_secret(principal.tenant_id, name)

    async def for_sandbox(self, principal: Principal, requests: dict[str, SecretRequest]) -> dict[str, StoredSecret]:
        """The stored secrets a new sandbox asks for, by stored name, with their sealed values."""
        names = sorted({str(r.stored) for r in requests.values() if r.stored is not None})
        if names:
            authorize(principal, Action.SECRET_READ, principal.tenant_id)
        try:
            return {n: await self._store.get_secret(principal.tenant_id, n) for n in names}
        except NotFoundError as exc:  # a name in the request, as an unknown template is
            raise InvalidRequestError(exc.message, details=exc.details) from None
