"""This server as one replica among several on one database (docs/replicas.md).

A replica has an id (stable across its restarts: `--replica-id`, else kept in `<home>/replica.id`) and a URL the
others reach it at (`--advertise-url`). It writes a heartbeat every `ttl / 3` seconds; a replica whose heartbeat
is older than `ttl` has stopped answering. Each sandbox record names its owner, the replica whose backend runs it:
a request for it that reaches another replica is forwarded there (the front end's job, `route`), and what the
service does to it locally is refused with `ReplicaUnavailableError` unless this replica owns it (`check_local`).

Forwarded requests carry a signature of the replica that sent them (HMAC-SHA256 of the request's method, target,
the original client's address and a timestamp, with a secret every replica shares: `CORRAL_REPLICA_SECRET`, else
one kept in the database). The caller's own credentials travel unchanged and the owner authenticates and authorizes
them again: the signature only vouches for the client address the audit trail records.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from .._atomic import write_atomic
from .._exceptions import ConflictError, ReplicaUnavailableError
from ..backends import SandboxState
from ..control import Action, AuditEvent, ReplicaInfo, SandboxRecord
from ._background import cancel

if TYPE_CHECKING:
    from ..control import ControlStore
    from ..engine import Engine

__all__ = ["DEFAULT_REPLICA_TTL", "REPLICA_ID", "Replica", "ReplicaConfig"]

logger = logging.getLogger("corral.service")

DEFAULT_REPLICA_TTL = 15.0  # seconds without a heartbeat after which a replica counts as stopped
REPLICA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SIGNATURE_MAX_AGE = 60.0  # seconds a forwarded request's signature stays valid (the replicas' clocks agree)
_ID_FILE = "replica.id"
# What a replica may still do to a sandbox another replica runs: read its record, and end it (the record ends
# here; the owner's orphan check removes what its backend still runs when it comes back).
_ANYWHERE = frozenset({Action.SANDBOX_READ, Action.SANDBOX_KILL})


@dataclass(frozen=True)
class ReplicaConfig:
    """**id** - None: the one kept in `<home>/replica.id` (made on first start). **url** - where the other
    replicas reach this one. **secret** - None: the database's. **ttl** - seconds a heartbeat counts."""

    id: str | None = None
    url: str = "http://127.0.0.1:7770"
    secret: str | None = None
    ttl: float = DEFAULT_REPLICA_TTL

    def __post_init__(self) -> None:
        if self.id is not None and not REPLICA_ID.fullmatch(self.id):
            raise ValueError(f"replica id {self.id!r}: use 1 to 64 letters, digits, '.', '_' or '-'")
        if not self.ttl > 0:
            raise ValueError("the replica TTL must be a positive number of seconds")


class Replica:
    def __init__(self, store: ControlStore, engine: Engine, config: ReplicaConfig) -> None:
        self._store = store
        self._engine = engine  # what this replica's backend runs
        self.config = config
        self.id = config.id or ""
        self.url = config.url.rstrip("/")
        self.ttl = timedelta(seconds=config.ttl)
        self._secret = (config.secret or "").encode()
        self._peers: dict[str, ReplicaInfo] = {}
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """After the engine (it reconciles what the engine runs with the records this replica owns)."""
        self.id = self.config.id or _stored_id(self._store.home)
        await self._check_unique()
        if not self._secret:
            self._secret = (await self._store.replicas.secret()).encode()
        await self._beat()
        await self._recover(startup=True)
        self._task = asyncio.create_task(self._run(), name="corral-heartbeat")

    async def _check_unique(self) -> None:
        """Two live servers under one id would each take the other's sandboxes for their own (and fail its
        creates at start): refuse to start as a replica that answers at another URL. The same URL is this
        server restarting (after a SIGKILL its heartbeat is still fresh)."""
        known = await self._store.replicas.get(self.id, self.ttl)
        if known is not None and known.alive and known.url != self.url:
            raise ConflictError(f"replica id {self.id!r} is in use by a live replica at {known.url} (heartbeat "
                                f"at {known.heartbeat_at.isoformat(timespec='seconds')}): give this server "
                                "another --replica-id, or stop that one first", details={"replica": self.id})

    async def close(self) -> None:
        await cancel(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl.total_seconds() / 3)
            try:
                await self._beat()
                # Marked lost while this replica was alive after all (its heartbeat was late, or raced its start):
                # what the engine still runs is taken back at once.
                await self._recover(startup=False)
            except Exception:  # the database is away for a moment: the next beat tries again
                logger.exception("replica.heartbeat_failed", extra={"replica": self.id})

    async def _beat(self) -> None:
        registry = self._store.replicas
        await registry.heartbeat(self.id, self.url)
        self._peers = {info.id: info for info in await registry.all(self.ttl)}

    async def _recover(self, *, startup: bool) -> None:
        """What this replica's last life left (`startup`): creates it never finished are failed (their callers
        got no sandbox; the engine's half of one is an orphan the reconciler removes), lost sandboxes it still
        runs are running again, lost ones it does not run have ended, and records made before replicas are
        claimed. Later, only lost sandboxes it still runs are taken back."""
        store, running = self._store, {info.id for info in self._engine.list()}
        if startup:
            await store.replicas.claim_unowned(sorted(running), self.id)
        states = (SandboxState.CREATING, SandboxState.LOST) if startup else (SandboxState.LOST,)
        for record in await store.replicas.owned(self.id, states):
            if record.state is SandboxState.LOST and record.id in running:
                if await store.replicas.recovered(record.id, self.id) is not None:
                    await self._audit(record, "sandbox.recovered", "running", "its replica is back")
                continue
            if not startup:
                continue  # not in the engine now: perhaps being destroyed; the next start settles it
            await store.mark_destroyed(record.id, failed=record.state is SandboxState.CREATING)
            why = "its replica restarted " + ("while creating it" if record.state is SandboxState.CREATING
                                              else "and no longer runs it")
            await self._audit(record, "sandbox.lost", "failed", why)

    async def _audit(self, record: SandboxRecord, action: str, status: str, reason: str) -> None:
        await self._store.audit.append(AuditEvent(
            action=action, target=record.id, tenant_id=record.tenant_id,
            outcome={"status": status, "reason": reason, "replica": self.id}))

    # -- where a sandbox is served ---------------------------------------------------------------------------

    async def route(self, sandbox_id: str) -> str | None:
        """The URL of the live replica that runs `sandbox_id` if that is another one; None to serve it here
        (this replica's, unknown, ended, lost, or its replica stopped answering: the service says which)."""
        record = await self._store.find_sandbox(sandbox_id)
        if record is None or not record.live or record.owner in (None, self.id) \
                or record.state is SandboxState.LOST:
            return None
        peer = self._peers.get(record.owner)
        if peer is None or not self._alive(peer):  # as of this replica's last beat: it may have (re)started since
            peer = await self._store.replicas.get(record.owner, self.ttl)
            if peer is not None:
                self._peers[peer.id] = peer
        return peer.url if peer is not None and self._alive(peer) else None

    def _alive(self, peer: ReplicaInfo) -> bool:
        return peer.alive and time.time() - peer.heartbeat_at.timestamp() < self.ttl.total_seconds()

    def check_local(self, record: SandboxRecord, action: Action) -> None:
        """Refuse to act here on a sandbox another replica runs (the request reached this one because that
        replica does not answer), or on a lost one, with the reason; reading and killing are fine anywhere."""
        if action in _ANYWHERE:
            return
        details = {"sandbox": record.id, "replica": record.owner, "state": record.state.value}
        if record.state is SandboxState.LOST:
            raise ReplicaUnavailableError(f"sandbox {record.id} is lost: {record.reason}", details=details)
        if record.owner not in (None, self.id):
            raise ReplicaUnavailableError(
                f"sandbox {record.id} runs on replica {record.owner}, and this request could not be served there: "
                f"that replica does not answer (if it does not come back within {self.ttl.total_seconds():g} s the "
                "sandbox is marked lost), or the request named its sandbox in a way replicas do not forward "
                "(docs/replicas.md)", details=details)

    # -- signatures of forwarded requests --------------------------------------------------------------------

    def sign(self, method: str, target: str, client: str) -> str:
        """`<replica id>;<unix time>;<hex HMAC>` for the request `method target` of `client`."""
        stamp = str(int(time.time()))
        return f"{self.id};{stamp};{self._mac(self.id, stamp, method, target, client)}"

    def verify(self, signature: str, method: str, target: str, client: str) -> str | None:
        """The sending replica's id if `signature` is a valid, recent one for this request; else None."""
        sender, _, rest = signature.partition(";")
        stamp, _, mac = rest.partition(";")
        if not self._secret or not stamp.isdigit() or abs(time.time() - int(stamp)) > SIGNATURE_MAX_AGE:
            return None
        expected = self._mac(sender, stamp, method, target, client)
        return sender if hmac.compare_digest(expected, mac) else None

    def _mac(self, sender: str, stamp: str, method: str, target: str, client: str) -> str:
        message = "\n".join((sender, stamp, method.upper(), target, client)).encode("utf-8", "surrogateescape")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


def _stored_id(home: Path) -> str:
    """This home's replica id, made once: a restart of the same server is the same replica."""
    path = home / _ID_FILE
    with contextlib.suppress(OSError):
        found = path.read_text().strip()
        if REPLICA_ID.fullmatch(found):
            return found
    made = f"r-{secrets.token_hex(4)}"
    home.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (made + "\n").encode())
    return made
