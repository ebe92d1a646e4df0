"""Secrets a sandbox is created with (docs/secrets.md): checked, bound to hosts, sealed before anything stores them.

`SecretRequest` is what a caller sends per name (`secrets={"GITHUB_TOKEN": {"value": ..., "hosts": [...]}}`);
`seal_secrets` turns those into the spec's `SealedSecret`s, each with a placeholder of its own. Values never reach
the audit trail, logs or the sandbox: the audit keeps names and hosts only.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .._exceptions import InvalidRequestError
from ..backends._spec import MAX_SECRETS, SealedSecret
from ..egress._keyring import SecretKeyring
from ..egress._policy import normalize_host
from ..egress._secrets import new_placeholder

__all__ = ["MAX_VALUE", "SecretRequest", "audit_secrets", "seal_secrets"]

MAX_VALUE = 8192  # characters: tokens and keys, not files
MAX_HOSTS = 16


class SecretRequest(BaseModel):
    """One secret: its value, and the hosts it may be sent to (`*.example.com` for the subdomains)."""

    model_config = ConfigDict(extra="forbid")

    value: str = Field(repr=False)
    hosts: list[str]
    body: bool = False  # also put into request bodies (read whole, up to 8 MiB), not only the line and headers

    @field_validator("value")
    @classmethod
    def _value(cls, value: str) -> str:
        if not value:
            raise ValueError("a secret's value is empty")
        if len(value) > MAX_VALUE:
            raise ValueError(f"a secret's value is at most {MAX_VALUE} characters")
        if any(c in value for c in "\x00\r\n"):
            raise ValueError("a secret's value may not contain NUL, CR or LF (it goes into HTTP headers)")
        return value

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        if not hosts:
            raise ValueError("a secret is bound to at least one host")
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"a secret is bound to at most {MAX_HOSTS} hosts")
        return [_host(h) for h in hosts]


def _host(text: str) -> str:
    if not isinstance(text, str):
        raise ValueError("a host is a string")
    wildcard = text.startswith("*.")
    try:
        host = normalize_host(text[2:] if wildcard else text)
    except InvalidRequestError as exc:
        raise ValueError(exc.message) from None
    if "*" in host:
        raise ValueError(f"host {text!r}: only a leading '*.' is a wildcard")
    return f"*.{host}" if wildcard else host


def seal_secrets(requests: dict[str, SecretRequest], env: dict[str, str],
                 keyring: SecretKeyring) -> tuple[SealedSecret, ...]:
    if len(requests) > MAX_SECRETS:
        raise InvalidRequestError(f"a sandbox has at most {MAX_SECRETS} secrets")
    clash = sorted(set(requests) & set(env))
    if clash:
        raise InvalidRequestError(f"{', '.join(clash)}: named both in env and in secrets; a secret's name is the "
                                  "variable that holds its placeholder")
    try:
        return tuple(SealedSecret(name=name, placeholder=new_placeholder(), hosts=tuple(r.hosts), body=r.body,
                                  sealed=keyring.seal(r.value)) for name, r in requests.items())
    except ValueError as exc:  # a name that is no variable name
        raise InvalidRequestError(f"invalid secrets: {exc}") from None


def audit_secrets(requests: dict[str, SecretRequest]) -> dict[str, Any]:
    """What the audit keeps of a sandbox's secrets: names and hosts, never a value."""
    return {name: {"hosts": r.hosts, "body": r.body} for name, r in requests.items()}
