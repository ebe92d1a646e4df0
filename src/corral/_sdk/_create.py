"""The body of `POST /v1/sandboxes` as `Sandbox.create` and `AsyncSandbox.create` send it."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Any

from .._exceptions import InvalidRequestError

__all__ = ["create_body"]


def create_body(
    template: str,
    timeout: float,
    network: str | Sequence[str],
    limits: Mapping[str, Any] | None,
    env: Mapping[str, str] | None,
    metadata: Mapping[str, str] | None,
    file_roots: Sequence[str] | None = None,
    runtime: str | None = None,
    *,
    on_timeout: str = "kill",
    auto_resume: bool = False,
    volumes: Mapping[str, str] | None = None,
    public_ports: bool = False,
    root: bool = False,
    secrets: Mapping[str, Mapping[str, Any]] | None = None,
    checkpoints: str | None = None,
    checkpoint_keep: int | None = None,
) -> dict[str, Any]:
    if isinstance(file_roots, str):
        raise TypeError("file_roots is a list of directories, not one string")
    if timeout is None:  # the type says so too; checked here because the server would only say "null"
        raise InvalidRequestError("timeout must be a number of seconds: every sandbox has a time to live "
                                  "(at most 7 days; extend it later with set_timeout())")
    body = {
        "template": template,
        "timeout": timeout,
        "network": network if isinstance(network, str) else builtins.list(network),
        "limits": dict(limits or {}),
        "env": dict(env or {}),
        "metadata": dict(metadata or {}),
    }
    if runtime is not None:
        body["runtime"] = runtime
    # Sent only when asked for, so that a server older than these options still takes the plain create.
    if on_timeout != "kill":
        body["on_timeout"] = on_timeout
    if auto_resume:
        body["auto_resume"] = True
    if volumes:
        body["volumes"] = dict(volumes)
    if public_ports:
        body["public_ports"] = True
    if root:
        body["root"] = True
    if secrets:
        body["secrets"] = {name: dict(secret) for name, secret in secrets.items()}
    if checkpoints is not None:
        body["checkpoints"] = checkpoints
    if checkpoint_keep is not None:
        body["checkpoint_keep"] = checkpoint_keep
    return body if file_roots is None else {**body, "file_roots": builtins.list(file_roots)}
