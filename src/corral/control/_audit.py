"""The tamper-evident audit trail: a keyed hash chain of records in the `audit` table.

Each record's `hash` is HMAC-SHA256, with the server's audit key, over the canonical JSON of its fields (seq,
time, tenant, key, role, action, target, params, outcome, the request id when it has one, the audit key's id)
and the previous record's hash; the first record chains to 64 zeros. The key lives outside the database
(`_auditkeys`: `CORRAL_AUDIT_KEY` or `<CORRAL_HOME>/audit.key`), so someone who can rewrite the database but
not read the key cannot recompute the hashes after a record they edit. Each record names the key that signed
it (`hmac_key_id`, 8 hex digits of the key's SHA-256): after a rotation, older records verify with the older
keys, and a record signed with a key the verifier does not hold is a failure that names that key.

Records written by versions before the key (`hmac_key_id` NULL) are plain SHA-256 and still verify, but only
as the start of the chain, up to the seq the keys' `unkeyed-until` gives (the head when the server made its key
file): an unkeyed record after that, or after a keyed one, is a record re-hashed without the key. (A verifier
holding no key cannot tell, and says how many records it took unkeyed.) The
request id and the key id joined the record later, each hashed only when set: a record without them hashes
exactly as before they existed. Editing a record breaks its hash; deleting or inserting one breaks the links
around it; deleting the newest records is caught by comparing with a head (seq, hash) exported earlier, so
export the head regularly to a place the database's owner cannot write. Whoever holds the key as well as the
database can still rewrite history: keep the key from the database's other readers (backups, replicas' hosts).

What goes in a record is the caller's: commands verbatim in `params`; file writes as path, size and sha256
(never the contents); the outcome (status, exit code, timed out, OOM) in `outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

from sqlalchemy import Select, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from .._exceptions import ConflictError, InvalidRequestError, ServerError
from ._auditkeys import AuditKeyring
from ._db import Database
from ._models import AuditRow
from ._rbac import Principal

GENESIS_HASH = "0" * 64
_APPEND_ATTEMPTS = 20
_BATCH = 1000
_ACTION_MAX = 64  # column widths of audit.action, audit.target and audit.request_id
_TARGET_MAX = 256
_REQUEST_ID_MAX = 128
_AUDIT_TABLE = AuditRow.metadata.tables[AuditRow.__tablename__]
_APPEND_LOCK = 0x636F7272616C + 1  # the PostgreSQL advisory lock appenders take (any constant of our own)


class SupportsWriteStr(Protocol):
    def write(self, text: str, /) -> object: ...


@dataclass(frozen=True)
class AuditEvent:
    """What to record; the log adds seq, time and the hashes."""

    action: str
    target: str | None = None
    tenant_id: str | None = None
    key_id: str | None = None
    role: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    outcome: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None  # the HTTP request that caused it (`X-Request-Id`), if one did

    @classmethod
    def by(cls, principal: Principal, action: str, target: str | None = None, *,
           params: dict[str, Any] | None = None, outcome: dict[str, Any] | None = None,
           request_id: str | None = None) -> AuditEvent:
        """An event attributed to the caller `principal`."""
        return cls(action=str(action), target=target, tenant_id=principal.tenant_id, key_id=principal.key_id,
                   role=principal.role.value, params=params or {}, outcome=outcome or {}, request_id=request_id)


@dataclass(frozen=True)
class AuditEntry:
    """One stored record of the chain."""

    seq: int
    time: datetime
    tenant_id: str | None
    key_id: str | None
    role: str | None
    action: str
    target: str | None
    params: dict[str, Any]
    outcome: dict[str, Any]
    prev_hash: str
    hash: str
    request_id: str | None = None
    hmac_key_id: str | None = None  # the audit key that signed it; None: a plain SHA-256 record from before keys

    def to_dict(self) -> dict[str, Any]:
        return {**self._hashed_fields(), "hash": self.hash}

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditEntry:
        return cls(seq=data["seq"], time=datetime.fromisoformat(data["time"]), tenant_id=data["tenant_id"],
                   key_id=data["key_id"], role=data["role"], action=data["action"], target=data["target"],
                   params=data["params"], outcome=data["outcome"], prev_hash=data["prev_hash"], hash=data["hash"],
                   request_id=data.get("request_id"), hmac_key_id=data.get("hmac_key_id"))

    @classmethod
    def from_json(cls, line: str) -> AuditEntry:
        return cls.from_dict(json.loads(line))

    def computed_hash(self) -> str:
        """The plain SHA-256 of this record's fields: the hash of a record from before audit keys."""
        return hashlib.sha256(self.message()).hexdigest()

    def keyed_hash(self, keys: AuditKeyring) -> str | None:
        """The hash this record's fields call for (equal to `hash` unless someone edited it): the HMAC with the key
        it names, or plain SHA-256 for an unkeyed record; None if `keys` lacks the key it names."""
        if self.hmac_key_id is None:
            return self.computed_hash()
        if keys.get(self.hmac_key_id) is None:
            return None
        return keys.sign(self.hmac_key_id, self.message())

    def message(self) -> bytes:
        """The bytes its hash covers: the canonical JSON of its hashed fields."""
        return canonical_json(self._hashed_fields()).encode("ascii")

    def _hashed_fields(self) -> dict[str, Any]:
        fields = {"seq": self.seq, "time": _iso(self.time), "tenant_id": self.tenant_id, "key_id": self.key_id,
                  "role": self.role, "action": self.action, "target": self.target, "params": self.params,
                  "outcome": self.outcome, "prev_hash": self.prev_hash}
        if self.request_id is not None:  # absent, not null, when unset: older records keep their hashes
            fields["request_id"] = self.request_id
        if self.hmac_key_id is not None:  # likewise: records from before audit keys keep their hashes
            fields["hmac_key_id"] = self.hmac_key_id
        return fields


class ChainHead(NamedTuple):
    """The newest record's seq and hash; (0, 64 zeros) for an empty log. Text form: `<seq>:<hash>`."""

    seq: int
    hash: str

    def __str__(self) -> str:
        return f"{self.seq}:{self.hash}"

    @classmethod
    def parse(cls, text: str) -> ChainHead:
        seq, sep, digest = text.strip().partition(":")
        if not sep or not seq.isdigit() or len(digest) != 64:
            raise InvalidRequestError(f"{text!r} is not an audit chain head; expected <seq>:<64 hex digits>")
        return cls(int(seq), digest.lower())


@dataclass(frozen=True)
class ChainProblem:
    """The first thing wrong with the chain: which record (`seq`) and what happened to it (`kind`)."""

    seq: int
    kind: str  # "edited" | "inserted" | "deleted" | "unknown-key" (signed with a key the verifier lacks)
    message: str


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    checked: int  # records verified before the problem (all of them when ok)
    head: ChainHead  # the last verified record
    problem: ChainProblem | None = None
    unkeyed: int = 0  # of `checked`: records from before audit keys (plain SHA-256)
    unchecked: int = 0  # of `checked`: keyed records whose HMAC was not checked (links only, no key given)


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, ASCII only (lone surrogates in commands survive), no NaN: one text per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _iso(time: datetime) -> str:
    return time.astimezone(UTC).isoformat(timespec="microseconds")


def _plain_json(value: dict[str, Any], what: str) -> dict[str, Any]:
    """The value as it will read back from the database (tuples become lists), so the hash stays valid, and
    bounded (`bounded_params`)."""
    try:
        result: dict[str, Any] = json.loads(canonical_json(value))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"audit {what} must be JSON data: {exc}") from exc
    return {k: _bounded(v) for k, v in result.items()}


_PARAM_TEXT = 1024  # characters of one string kept in a record
_PARAM_PART = 16 * 1024  # bytes of one list or object kept in a record, as JSON


def _bounded(value: Any) -> Any:
    """`value` as a record keeps it: a string longer than `_PARAM_TEXT`, or a list or object whose JSON is longer
    than `_PARAM_PART`, becomes its size and digest (`{"bytes", "sha256"}`, with `entries` for containers), so a
    request with megabytes in it leaves a record of a few hundred bytes that still tells whether two were alike."""
    if isinstance(value, str):
        return value if len(value) <= _PARAM_TEXT else _digest(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, list | dict):
        raw = canonical_json(value).encode("utf-8", "surrogatepass")
        if len(raw) > _PARAM_PART:
            return {**_digest(raw), "entries": len(value)}
        if isinstance(value, list):
            return [_bounded(v) for v in value]
        return {k: _bounded(v) for k, v in value.items()}
    return value


def _digest(raw: bytes) -> dict[str, Any]:
    return {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


# -- verification (no I/O: also checks an exported JSONL file) -------------------------------------------


class ChainChecker:
    """Walks records in seq order, one behind, so each record is judged knowing the next one.

    `keys` are the audit keys to check HMACs with; a record signed with a key not among them is an "unknown-key"
    problem, unless `links_only` (then its HMAC is skipped and counted in `unchecked`: only the links are checked).
    """

    def __init__(self, expected_head: ChainHead | None = None, keys: AuditKeyring | None = None, *,
                 links_only: bool = False) -> None:
        self._expected_head = expected_head
        self._keys = keys if keys is not None else AuditKeyring()
        self._links_only = links_only
        self._keyed_seen = False
        self.unkeyed = 0
        self.unchecked = 0
        self._prev: AuditEntry | None = None
        self._pending: AuditEntry | None = None
        self._hash_at_expected: str | None = None
        self.checked = 0
        self.problem: ChainProblem | None = None

    def feed(self, entry: AuditEntry) -> bool:
        """Take the next record; False once a problem is found (feed no more)."""
        if self._pending is not None:
            self._accept_or_fail(self._pending, entry)
        self._pending = entry
        return self.problem is None

    def finish(self) -> VerifyResult:
        if self.problem is None and self._pending is not None:
            self._accept_or_fail(self._pending, None)
        if self.problem is None:
            self.problem = self._check_head()
        prev = self._prev
        head = ChainHead(prev.seq, prev.hash) if prev else ChainHead(0, GENESIS_HASH)
        return VerifyResult(ok=self.problem is None, checked=self.checked, head=head, problem=self.problem,
                            unkeyed=self.unkeyed, unchecked=self.unchecked)

    def _accept_or_fail(self, entry: AuditEntry, following: AuditEntry | None) -> None:
        self.problem = self._judge(entry, following)
        if self.problem is None:
            self._prev = entry
            self.checked += 1
            self._count_kind(entry)
            if self._expected_head is not None and entry.seq == self._expected_head.seq:
                self._hash_at_expected = entry.hash

    def _judge(self, entry: AuditEntry, following: AuditEntry | None) -> ChainProblem | None:
        prev = self._prev
        want_prev = prev.hash if prev else GENESIS_HASH
        want_seq = prev.seq + 1 if prev else 1
        before = f"record {prev.seq}" if prev else "the start of the chain"
        if following is not None and following.prev_hash == want_prev:
            # The next record links straight to the one before: this one was slipped in between.
            return ChainProblem(entry.seq, "inserted", f"record {entry.seq} was inserted: record {following.seq} "
                                                       f"chains directly to {before}")
        if entry.prev_hash == want_prev and entry.seq == want_seq:
            return self._own_problem(entry)
        return self._broken_link(entry, prev, want_prev, want_seq)

    def _count_kind(self, entry: AuditEntry) -> None:
        if entry.hmac_key_id is None:
            self.unkeyed += 1
            return
        self._keyed_seen = True
        if self._keys.get(entry.hmac_key_id) is None:
            self.unchecked += 1  # accepted without its key only in links-only mode

    def _hash_state(self, entry: AuditEntry) -> str:
        """"ok", "bad" (fields and hash disagree), "unknown-key" or "unchecked" (links only, key not held)."""
        want = entry.keyed_hash(self._keys)
        if want is None:
            return "unchecked" if self._links_only else "unknown-key"
        return "ok" if hmac.compare_digest(want, entry.hash) else "bad"

    def _own_problem(self, entry: AuditEntry) -> ChainProblem | None:
        """What is wrong with a record that links correctly: its hash, its key, or an unkeyed record after keys."""
        limit = self._keys.unkeyed_until
        if entry.hmac_key_id is None and self._keys and entry.seq > limit:
            # A verifier without keys cannot tell; one with them knows which records predate the key.
            return ChainProblem(entry.seq, "edited", f"record {entry.seq} was edited: it is unkeyed (plain "
                                                     f"SHA-256), but only records up to {limit} predate the "
                                                     f"audit key ({self._keys.source}: unkeyed-until), so it "
                                                     f"was re-hashed without the key")
        if entry.hmac_key_id is None and self._keyed_seen:
            # Keyed servers never write unkeyed records: this one was rewritten and re-hashed without the key.
            return ChainProblem(entry.seq, "edited", f"record {entry.seq} was edited: it is unkeyed (plain "
                                                     f"SHA-256) but follows keyed records, so it was re-hashed "
                                                     f"without the audit key")
        state = self._hash_state(entry)
        if state == "bad":
            return ChainProblem(entry.seq, "edited", f"record {entry.seq} was edited: its fields do not "
                                                     f"match its hash")
        if state == "unknown-key":
            held = ", ".join(self._keys.ids) or "none"
            return ChainProblem(entry.seq, "unknown-key", f"record {entry.seq} is signed with audit key "
                                                          f"{entry.hmac_key_id}, which this verifier does not "
                                                          f"hold (it holds: {held})")
        return None

    def _broken_link(self, entry: AuditEntry, prev: AuditEntry | None, want_prev: str,
                     want_seq: int) -> ChainProblem:
        if entry.seq > want_seq and entry.prev_hash != want_prev:
            missing = f"record {want_seq}" if entry.seq == want_seq + 1 else f"records {want_seq}..{entry.seq - 1}"
            return ChainProblem(want_seq, "deleted", f"{missing} deleted: record {entry.seq} chains to a record "
                                                     f"that is gone")
        if entry.seq > want_seq:
            return ChainProblem(entry.seq, "edited", f"record {entry.seq} was edited: its seq was changed "
                                                     f"(it chains to record {want_seq - 1})")
        if prev is not None and self._hash_state(entry) in ("ok", "unchecked"):
            # This record is intact but was chained to a different hash: the record before it was rewritten
            # and re-hashed (or records between were deleted and this one re-hashed and renumbered).
            return ChainProblem(prev.seq, "edited", f"record {prev.seq} was edited and re-hashed: record "
                                                    f"{entry.seq} was chained to a different hash")
        if prev is None:
            return ChainProblem(entry.seq, "deleted", f"record {entry.seq} does not start from the genesis hash: "
                                                      f"the first records were deleted")
        return ChainProblem(entry.seq, "edited", f"record {entry.seq} was edited: it neither chains to record "
                                                 f"{prev.seq} nor matches its own hash (or records before it "
                                                 f"were deleted and the rest renumbered)")

    def _check_head(self) -> ChainProblem | None:
        expected = self._expected_head
        if expected is None or expected.seq == 0:
            return None
        last_seq = self._prev.seq if self._prev else 0
        if last_seq < expected.seq:
            missing = f"record {expected.seq}" if last_seq + 1 == expected.seq else \
                f"records {last_seq + 1}..{expected.seq}"
            return ChainProblem(last_seq + 1, "deleted", f"{missing} deleted: the chain ends at {last_seq} but the "
                                                         f"exported head is record {expected.seq}")
        if self._hash_at_expected != expected.hash:
            return ChainProblem(expected.seq, "edited", f"record {expected.seq} does not match the exported head: "
                                                        f"the newest records were replaced")
        return None


def verify_chain(entries: Iterable[AuditEntry], expected_head: ChainHead | None = None,
                 keys: AuditKeyring | None = None, *, links_only: bool = False) -> VerifyResult:
    """Verify records in seq order (from the database or an exported JSONL file) with the audit `keys`."""
    checker = ChainChecker(expected_head, keys, links_only=links_only)
    for entry in entries:
        if not checker.feed(entry):
            break
    return checker.finish()


# -- the log ----------------------------------------------------------------------------------------------


_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(AuditEntry))


def _row(entry: AuditEntry) -> dict[str, Any]:
    """The record's columns, its params and outcome as they are (`dataclasses.asdict` deep-copies them: a
    tenth of a millisecond per request for nothing, the insert only reads them)."""
    return {name: getattr(entry, name) for name in _ROW_FIELDS}


def _entry(row: AuditRow) -> AuditEntry:
    return AuditEntry(seq=row.seq, time=row.time, tenant_id=row.tenant_id, key_id=row.key_id, role=row.role,
                      action=row.action, target=row.target, params=row.params, outcome=row.outcome,
                      prev_hash=row.prev_hash, hash=row.hash, request_id=row.request_id,
                      hmac_key_id=row.hmac_key_id)


class AuditLog:
    """Append, verify, query, export and follow the audit chain of one database.

    **Appending fast, and still correctly.** Each append needs the chain's head (the last seq and hash).

    * On a SQLite file the head is kept in memory, under the append lock, instead of being read before every
      insert, and the record goes in as one autocommitted INSERT (`Database.insert_now`: one hop to the
      driver's thread instead of twelve). The in-memory head is only a guess when another process writes the
      same file: the database checks it, because `seq` is the primary key and the appender assigns it, so a
      stale head makes the INSERT collide with the record the other process appended at that seq. The record
      is then appended the careful way below, which cannot collide again.
    * The careful way, and always on PostgreSQL (where several replicas append to one chain and an in-memory
      head would often be stale): a write transaction that excludes other appenders in every process
      (`Database.exclusive_write`: SQLite's BEGIN IMMEDIATE, a PostgreSQL advisory lock), reads the head and
      inserts. Optimistic retries alone starve there: the replica that just won holds the right head and wins
      again while the others re-read.

    Either way the chain never forks. After any other failure the in-memory head is forgotten and read again,
    since whether the insert landed is unknown.
    """

    def __init__(self, db: Database, clock: Callable[[], datetime], keys: AuditKeyring | None = None,
                 reload_keys: Callable[[], AuditKeyring] | None = None) -> None:
        self._db = db
        self._clock = clock
        # Signs new records (the first key; none: plain SHA-256, as before keys). `reload_keys` re-reads them
        # for `verify`, so a key rotated in by `corral audit rotate-key` verifies before this server restarts.
        self.keys = keys if keys is not None else AuditKeyring()
        self._reload_keys = reload_keys
        self._lock = asyncio.Lock()  # one append at a time in this process (see the class docstring for others)
        self._head: ChainHead | None = None  # SQLite: the newest record this process knows of; None: read it
        self._appended = asyncio.Event()

    async def append(self, event: AuditEvent) -> AuditEntry:
        """Write one record at the end of the chain and return it."""
        if len(event.action) > _ACTION_MAX or len(event.target or "") > _TARGET_MAX or \
                len(event.request_id or "") > _REQUEST_ID_MAX:
            # The column widths; SQLite would not enforce them and PostgreSQL would fail the append.
            raise InvalidRequestError(f"audit action, target or request id too long (max {_ACTION_MAX}, "
                                      f"{_TARGET_MAX} and {_REQUEST_ID_MAX})")
        params = _plain_json(event.params, "params")
        outcome = _plain_json(event.outcome, "outcome")
        async with self._lock:
            try:
                entry = await self._append_fast(event, params, outcome)
                if entry is None:
                    entry = await self._append_exclusive(event, params, outcome)
            except BaseException:
                self._head = None  # unknown whether it landed (cancelled, connection lost): read it next time
                raise
            if self._db.is_file_sqlite:
                self._head = ChainHead(entry.seq, entry.hash)
        self._wake_followers()
        return entry

    async def _append_fast(self, event: AuditEvent, params: dict[str, Any],
                           outcome: dict[str, Any]) -> AuditEntry | None:
        """SQLite: chain to the in-memory head in one INSERT; None if there is no head or it was stale."""
        if self._head is None or not self._db.is_file_sqlite:
            return None
        entry = self._chained(event, params, outcome, self._head)
        try:
            await self._db.insert_now(_AUDIT_TABLE, _row(entry))
        except ConflictError:
            return None  # another process appended this seq first
        return entry

    async def _append_exclusive(self, event: AuditEvent, params: dict[str, Any],
                                outcome: dict[str, Any]) -> AuditEntry:
        for _ in range(_APPEND_ATTEMPTS):
            try:
                async with self._db.exclusive_write(_APPEND_LOCK) as session:
                    entry = self._chained(event, params, outcome, await _read_head(session))
                    await session.execute(insert(AuditRow).values(**dataclasses.asdict(entry)))
                return entry
            except IntegrityError:
                # Only a writer that skips the lock can get here (an older Corral on the same database).
                continue
        raise ServerError("could not append to the audit log: other writers kept taking the next seq")

    def _chained(self, event: AuditEvent, params: dict[str, Any], outcome: dict[str, Any],
                 head: ChainHead) -> AuditEntry:
        time: datetime = self._clock().astimezone(UTC)
        signing = self.keys.signing_id
        draft = AuditEntry(seq=head.seq + 1, time=time, tenant_id=event.tenant_id, key_id=event.key_id,
                           role=event.role, action=event.action, target=event.target, params=params,
                           outcome=outcome, prev_hash=head.hash, hash="", request_id=event.request_id,
                           hmac_key_id=signing)
        digest = draft.keyed_hash(self.keys)
        assert digest is not None  # signed with a key it holds
        return dataclasses.replace(draft, hash=digest)

    def _wake_followers(self) -> None:
        self._appended.set()
        self._appended = asyncio.Event()

    async def head(self) -> ChainHead:
        """The newest record's (seq, hash): export it to detect later deletion of the newest records."""
        async with self._db.read() as session:
            return await _read_head(session)

    async def verify(self, expected_head: ChainHead | tuple[int, str] | None = None) -> VerifyResult:
        """Walk the whole chain with every audit key this server holds; the result names the first edited,
        inserted or deleted record, or one signed with a key it does not hold."""
        keys = self._reload_keys() if self._reload_keys is not None else self.keys
        checker = ChainChecker(ChainHead(*expected_head) if expected_head is not None else None, keys)
        async for entry in self._scan(select(AuditRow)):
            if not checker.feed(entry):
                break
        return checker.finish()

    async def query(self, *, tenant: str | None = None, sandbox: str | None = None, action: str | None = None,
                    since: datetime | None = None, until: datetime | None = None, after: int | None = None,
                    limit: int | None = 1000, key: str | None = None,
                    newest_first: bool = False) -> list[AuditEntry]:
        """Records in seq order (the newest `limit` of them, newest first, with `newest_first`). `sandbox` matches
        the target, `key` the caller's key id; `since` is inclusive, `until` exclusive; `after` is a seq to
        continue from (paging, tailing)."""
        stmt = _filtered(tenant=tenant, sandbox=sandbox, action=action, since=since, until=until, key=key)
        if after is not None:
            stmt = stmt.where(AuditRow.seq > after)
        stmt = stmt.order_by(AuditRow.seq.desc() if newest_first else AuditRow.seq)
        if limit is not None:
            stmt = stmt.limit(limit)
        async with self._db.read() as session:
            return [_entry(row) for row in (await session.scalars(stmt)).all()]

    async def export_jsonl(self, stream: SupportsWriteStr, *, tenant: str | None = None, sandbox: str | None = None,
                           action: str | None = None, since: datetime | None = None,
                           until: datetime | None = None) -> int:
        """Write matching records to `stream`, one JSON object per line, oldest first; return how many."""
        count = 0
        stmt = _filtered(tenant=tenant, sandbox=sandbox, action=action, since=since, until=until)
        async for entry in self._scan(stmt):
            stream.write(entry.to_json() + "\n")
            count += 1
        return count

    async def follow(self, *, after: int | None = None, tenant: str | None = None, sandbox: str | None = None,
                     action: str | None = None, poll_interval: float = 1.0,
                     key: str | None = None) -> AsyncIterator[AuditEntry]:
        """New records as they are appended (after `after`, default the current head), forever.

        Appends in this process wake it at once; other processes' appends are seen within `poll_interval`.
        """
        last = (await self.head()).seq if after is None else after
        while True:
            appended = self._appended  # taken before the query, so an append during it is not missed
            batch = await self.query(tenant=tenant, sandbox=sandbox, action=action, after=last, limit=_BATCH,
                                     key=key)
            for entry in batch:
                last = entry.seq
                yield entry
            if len(batch) < _BATCH:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll_interval):
                        await appended.wait()

    async def _scan(self, stmt: Select[AuditRow]) -> AsyncIterator[AuditEntry]:
        """All matching records in seq order, a batch per transaction, so memory stays flat on long logs."""
        last = 0
        while True:
            page = stmt.where(AuditRow.seq > last).order_by(AuditRow.seq).limit(_BATCH)
            async with self._db.read() as session:
                rows = (await session.scalars(page)).all()
            for row in rows:
                yield _entry(row)
            if len(rows) < _BATCH:
                return
            last = rows[-1].seq


async def _read_head(session: AsyncSession) -> ChainHead:
    last = (await session.execute(select(AuditRow.seq, AuditRow.hash).order_by(AuditRow.seq.desc()).limit(1))).first()
    return ChainHead(last[0], last[1]) if last else ChainHead(0, GENESIS_HASH)


def _filtered(*, tenant: str | None, sandbox: str | None, action: str | None, since: datetime | None,
              until: datetime | None, key: str | None = None) -> Select[AuditRow]:
    stmt = select(AuditRow)
    if tenant is not None:
        stmt = stmt.where(AuditRow.tenant_id == tenant)
    if key is not None:
        stmt = stmt.where(AuditRow.key_id == key)
    if sandbox is not None:
        stmt = stmt.where(AuditRow.target == sandbox)
    if action is not None:
        stmt = stmt.where(AuditRow.action == action)
    if since is not None:
        stmt = stmt.where(AuditRow.time >= since)
    if until is not None:
        stmt = stmt.where(AuditRow.time < until)
    return stmt
