"""The deployment under check (`Target`) and what a probe works with (`CheckContext`): the throwaway tenants'
keys, HTTP clients and sandboxes that are always killed, and small helpers for probes run inside a sandbox.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from .._exceptions import CorralError
from .._sdk import AsyncAdmin, AsyncSandbox, CommandResult
from ._model import ItemFailed

__all__ = ["CheckContext", "Deployment", "GiB", "MiB", "Target", "clip", "run_json", "run_ok"]

MiB = 1 << 20
GiB = 1 << 30
REQUEST_TIMEOUT = 60.0
SANDBOX_TTL = 300  # seconds: a sandbox the check could not kill ends by itself


@dataclass(frozen=True)
class Target:
    """A running Corral deployment.

    * **url**, **admin_key** - the API server and an admin's key (tenants and keys are made for the check).
    * **home** - the server's state directory when it runs on this machine and is readable here: enables the
      host-side probes (the agent socket, the server's memory, a host canary file, fail-closed).
    * **template** - the template the probes' sandboxes use.
    * **output_bytes** - how much output item 13 produces (5 GB, as the checklist says).
    * **transport** - an httpx transport for every HTTP call the item functions make (tests: a fake deployment).
    * **kube_namespace** - the namespace of the deployment's sandbox Pods, when this machine's Kubernetes
      configuration reaches its cluster (`corral check --backend kubernetes`): item 44 reads the Pods themselves.
    """

    url: str
    admin_key: str
    home: Path | None = None
    template: str = "default"
    output_bytes: int = 5 * GiB
    transport: httpx.AsyncBaseTransport | None = None
    kube_namespace: str | None = None

    @property
    def on_this_machine(self) -> bool:
        """The server runs here: its state directory was given, or its URL is a loopback address."""
        if self.home is not None:
            return True
        host = urlsplit(self.url).hostname or ""
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class Deployment:
    """What `GET /v1/info` says of the server: its backend, the runtimes a sandbox may ask for, and what of the
    isolation that backend cannot give (key: reason; docs/backends.md). The default is what a server from before
    that route ran: the local backend, both runtimes, nothing missing."""

    backend: str = "local"
    runtimes: tuple[str, ...] = ("runc", "runsc")
    limitations: Mapping[str, str] = field(default_factory=dict)


@dataclass
class CheckContext:
    """What item functions work with. Keys by role: `developer`, `auditor` and `operator` of the check's tenant,
    `other` (a developer of the second tenant) and `admin` (the caller's own). An item function that makes a
    tenant of its own (item 40) names it in `extra_tenants`, so that the teardown undoes it whatever happens."""

    target: Target
    tenant: str
    other_tenant: str
    keys: dict[str, str]
    key_ids: dict[str, str] = field(default_factory=dict)
    loopback: str | None = None  # the runner's loopback server, when the tenant may reach it
    echoes: Sequence[tuple[str, dict[str, str]]] = ()  # what its /echo/ route received (path, headers)
    deployment: Deployment = field(default_factory=Deployment)
    extra_tenants: list[str] = field(default_factory=list)  # made by item functions: torn down with the others

    @property
    def url(self) -> str:
        return self.target.url.rstrip("/")

    @property
    def home(self) -> Path | None:
        return self.target.home

    def http(self, who: str = "developer") -> httpx.AsyncClient:
        """A raw HTTP client as `who` (for requests the SDK has no method for, or must not pre-check)."""
        return httpx.AsyncClient(base_url=self.url, transport=self.target.transport, timeout=REQUEST_TIMEOUT,
                                 headers={"Authorization": f"Bearer {self.keys[who]}"})

    def admin(self, who: str = "admin") -> AsyncAdmin:
        return AsyncAdmin(api_key=self.keys[who], base_url=self.url, transport=self.target.transport,
                          request_timeout=REQUEST_TIMEOUT)

    @asynccontextmanager
    async def sandbox(self, who: str = "developer", **options: Any) -> AsyncIterator[AsyncSandbox]:
        """A sandbox of the check's tenant (as `who`), killed when the block ends whatever happened."""
        sb = await AsyncSandbox.create(self.target.template, api_key=self.keys[who], base_url=self.url,
                                       transport=self.target.transport, metadata={"corral-check": self.tenant},
                                       request_timeout=REQUEST_TIMEOUT, **{"timeout": SANDBOX_TTL, **options})
        try:
            yield sb
        finally:
            with suppress(CorralError, httpx.HTTPError):
                await sb.kill()


def clip(data: bytes | str, limit: int = 300) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def run_ok(sb: AsyncSandbox, cmd: str | list[str], *, timeout: float = 30, what: str = "",
                 cwd: str | None = None) -> CommandResult:
    """Run a probe command that must succeed; a failure of the probe itself fails the item, saying so."""
    r = await sb.commands.run(cmd, timeout=timeout, cwd=cwd)
    if r.exit_code != 0:
        label = what or (cmd if isinstance(cmd, str) else " ".join(cmd))[:80]
        flags = ", ".join(f for f in ("timed_out", "oom_killed") if getattr(r, f))
        raise ItemFailed(f"the probe ({label}) failed: exit {r.exit_code}{f' ({flags})' if flags else ''}; "
                         f"stderr: {clip(r.stderr_bytes)!r}")
    return r


async def run_json(sb: AsyncSandbox, code: str, *args: str, timeout: float = 30, what: str = "") -> Any:
    """Run a Python probe inside the sandbox; its last stdout line is JSON."""
    r = await run_ok(sb, ["python3", "-c", code, *args], timeout=timeout, what=what or "python probe")
    lines = r.stdout_bytes.decode(errors="replace").strip().splitlines()
    if not lines:
        raise ItemFailed(f"the probe ({what or 'python probe'}) printed nothing; stderr: {clip(r.stderr_bytes)!r}")
    try:
        return json.loads(lines[-1])
    except ValueError as exc:
        raise ItemFailed(f"the probe ({what or 'python probe'}) printed no JSON: {clip(lines[-1])!r}") from exc


def readable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.R_OK | os.X_OK)
