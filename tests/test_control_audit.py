"""The audit trail: a hash chain that survives concurrent appends and reports exactly what was tampered with."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import itertools
import json
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from corral import InvalidRequestError
from corral.control import (
    GENESIS_HASH,
    Action,
    AuditEntry,
    AuditEvent,
    AuditKeyring,
    ChainHead,
    ControlStore,
    Principal,
    Role,
    load_audit_keys,
    verify_chain,
)

pytestmark = pytest.mark.anyio

N = 200
T0 = datetime(2030, 1, 1, tzinfo=UTC)


class Clock:
    """Each reading is one second after the previous one, so record times are distinct and predictable."""

    def __init__(self) -> None:
        self.now = T0 - timedelta(seconds=1)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ControlStore]:
    async with ControlStore(home=tmp_path, clock=Clock()) as s:
        yield s


@pytest.fixture
async def chain(store: ControlStore) -> ControlStore:
    """N records appended concurrently."""
    await asyncio.gather(*(store.audit.append(event(i)) for i in range(N)))
    return store


def event(i: int) -> AuditEvent:
    return AuditEvent(action="sandbox.exec", target=f"sb_{i % 4}", tenant_id=f"tn_{i % 2}", key_id="key_1",
                      role="developer", params={"cmd": f"echo {i}"}, outcome={"exit_code": 0})


def db(store: ControlStore) -> sqlite3.Connection:
    return sqlite3.connect(store.home / "corral.db", isolation_level=None)


def insert_raw(con: sqlite3.Connection, entry: AuditEntry) -> None:
    con.execute(
        "INSERT INTO audit (seq, time, tenant_id, key_id, role, action, target, params, outcome, prev_hash, hash, "
        "hmac_key_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (entry.seq, entry.time.replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds"), entry.tenant_id,
         entry.key_id, entry.role, entry.action, entry.target, json.dumps(entry.params),
         json.dumps(entry.outcome), entry.prev_hash, entry.hash, entry.hmac_key_id))


def shift_up_from(con: sqlite3.Connection, seq: int) -> None:
    """Renumber records seq.. to seq+1.. (in two steps: the primary key is checked row by row)."""
    con.execute("UPDATE audit SET seq = -seq WHERE seq >= ?", (seq,))
    con.execute("UPDATE audit SET seq = 1 - seq WHERE seq < 0")


# -- an intact chain -----------------------------------------------------------------------------------------------


async def test_concurrent_appends_make_one_chain(chain: ControlStore) -> None:
    result = await chain.audit.verify()
    assert result.ok and result.problem is None and result.checked == N
    entries = await chain.audit.query(limit=None)
    assert [e.seq for e in entries] == list(range(1, N + 1))
    assert entries[0].prev_hash == GENESIS_HASH
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(entries))
    assert sorted(e.params["cmd"] for e in entries) == sorted(f"echo {i}" for i in range(N))
    assert result.head == await chain.audit.head() == (N, entries[-1].hash)


async def test_two_stores_on_one_database_do_not_fork_the_chain(tmp_path: Path) -> None:
    """Two stores stand in for two server processes: their in-process locks do not see each other."""
    async with ControlStore(home=tmp_path) as one, ControlStore(home=tmp_path) as two:
        await asyncio.gather(*(s.audit.append(event(i)) for i in range(50) for s in (one, two)))
        result = await one.audit.verify()
        assert result.ok and result.checked == 100


async def test_empty_log(store: ControlStore) -> None:
    assert await store.audit.head() == ChainHead(0, GENESIS_HASH)
    result = await store.audit.verify(expected_head=ChainHead(0, GENESIS_HASH))
    assert result.ok and result.checked == 0


async def test_hash_covers_every_field(store: ControlStore) -> None:
    entry = await store.audit.append(event(1))
    assert entry.keyed_hash(store.audit.keys) == entry.hash and entry.hmac_key_id
    changes: list[tuple[str, Any]] = [
        ("seq", 2), ("time", T0 + timedelta(microseconds=1)), ("tenant_id", "tn_x"), ("key_id", "key_x"),
        ("role", "admin"), ("action", "sandbox.kill"), ("target", "sb_x"), ("params", {"cmd": "echo 2"}),
        ("outcome", {"exit_code": 1}), ("prev_hash", "1" * 64), ("request_id", "req-1"),
        ("hmac_key_id", None), ("hmac_key_id", "0" * 8),
    ]
    for name, value in changes:
        assert dataclasses.replace(entry, **{name: value}).keyed_hash(store.audit.keys) != entry.hash, name
    with_id = await store.audit.append(dataclasses.replace(event(2), request_id="req-1"))
    assert with_id.request_id == "req-1" and with_id.keyed_hash(store.audit.keys) == with_id.hash
    for changed in ("req-2", None):  # edited, or removed: both break the hash
        assert dataclasses.replace(with_id, request_id=changed).keyed_hash(store.audit.keys) != with_id.hash


async def test_records_keep_commands_verbatim_and_file_digests(store: ControlStore) -> None:
    principal = Principal(tenant_id="tn_a", key_id="key_a", role=Role.DEVELOPER)
    # A lone surrogate is what os.fsdecode makes of a non-UTF-8 byte; it must survive too.
    cmd = "printf '\\x00' | tee \"a b\" && echo ünïcødé 😀 \udc80 \t$HOME"
    await store.audit.append(AuditEvent.by(principal, Action.SANDBOX_EXEC, "sb_1", params={"cmd": cmd},
                                           outcome={"exit_code": 0, "timed_out": False, "oom_killed": False}))
    write = {"path": "/workspace/a.bin", "size": 3, "sha256": "ab" * 32}
    await store.audit.append(AuditEvent.by(principal, Action.SANDBOX_FILES_WRITE, "sb_1", params=write))
    first, second = await store.audit.query(sandbox="sb_1")
    assert first.params == {"cmd": cmd} and first.role == "developer" and first.key_id == "key_a"
    assert first.action == "sandbox.exec" and first.outcome["exit_code"] == 0
    assert second.params == write
    assert (await store.audit.verify()).ok


async def test_params_are_stored_as_they_read_back(store: ControlStore) -> None:
    entry = await store.audit.append(AuditEvent(action="x", params={"argv": ("ls", "-l")}))
    assert entry.params == {"argv": ["ls", "-l"]}
    assert (await store.audit.verify()).ok
    with pytest.raises(InvalidRequestError, match="JSON"):
        await store.audit.append(AuditEvent(action="x", params={"data": b"bytes"}))
    with pytest.raises(InvalidRequestError, match="JSON"):
        await store.audit.append(AuditEvent(action="x", outcome={"t": float("nan")}))
    with pytest.raises(InvalidRequestError, match="too long"):
        await store.audit.append(AuditEvent(action="x", target="t" * 257))
    assert (await store.audit.head()).seq == 1


# -- tampering -----------------------------------------------------------------------------------------------------


async def test_edited_params_are_reported(chain: ControlStore) -> None:
    with db(chain) as con:
        con.execute("""UPDATE audit SET params = '{"cmd": "echo innocent"}' WHERE seq = 100""")
    result = await chain.audit.verify()
    assert not result.ok and result.problem is not None
    assert (result.problem.seq, result.problem.kind) == (100, "edited")
    assert "record 100" in result.problem.message and result.checked == 99


async def test_edited_and_rehashed_record_is_reported(chain: ControlStore) -> None:
    (victim,) = await chain.audit.query(after=99, limit=1)
    forged = dataclasses.replace(victim, params={"cmd": "echo innocent"})
    forged = dataclasses.replace(forged, hash=forged.keyed_hash(chain.audit.keys) or "")  # even with the key
    with db(chain) as con:
        con.execute("DELETE FROM audit WHERE seq = 100")
        insert_raw(con, forged)
    problem = (await chain.audit.verify()).problem
    assert problem is not None and (problem.seq, problem.kind) == (100, "edited")


async def test_deleted_middle_record_is_reported(chain: ControlStore) -> None:
    with db(chain) as con:
        con.execute("DELETE FROM audit WHERE seq = 100")
    problem = (await chain.audit.verify()).problem
    assert problem is not None and (problem.seq, problem.kind) == (100, "deleted")
    assert "record 100 deleted" in problem.message


async def test_deleted_range_is_reported(chain: ControlStore) -> None:
    with db(chain) as con:
        con.execute("DELETE FROM audit WHERE seq BETWEEN 50 AND 52")
    problem = (await chain.audit.verify()).problem
    assert problem is not None and (problem.seq, problem.kind) == (50, "deleted")
    assert "records 50..52" in problem.message


async def test_deleted_first_record_is_reported(chain: ControlStore) -> None:
    with db(chain) as con:
        con.execute("DELETE FROM audit WHERE seq = 1")
    problem = (await chain.audit.verify()).problem
    assert problem is not None and (problem.seq, problem.kind) == (1, "deleted")


async def test_forged_record_with_a_valid_hash_is_reported(chain: ControlStore) -> None:
    """The strongest insert: renumber the rest and forge a record that links and hashes correctly."""
    (before,) = await chain.audit.query(after=98, limit=1)
    forged = AuditEntry(seq=100, time=before.time, tenant_id="tn_0", key_id="key_1", role="admin",
                        action="key.create", target=None, params={}, outcome={}, prev_hash=before.hash, hash="",
                        hmac_key_id=before.hmac_key_id)
    forged = dataclasses.replace(forged, hash=forged.keyed_hash(chain.audit.keys) or "")  # even with the key
    with db(chain) as con:
        shift_up_from(con, 100)
        insert_raw(con, forged)
    result = await chain.audit.verify()
    assert result.problem is not None and (result.problem.seq, result.problem.kind) == (100, "inserted")
    assert result.checked == 99


async def test_crude_forged_record_is_reported(chain: ControlStore) -> None:
    forged = AuditEntry(seq=100, time=T0, tenant_id=None, key_id=None, role=None, action="x", target=None,
                        params={}, outcome={}, prev_hash="f" * 64, hash="e" * 64)
    with db(chain) as con:
        shift_up_from(con, 100)
        insert_raw(con, forged)
    problem = (await chain.audit.verify()).problem
    assert problem is not None and (problem.seq, problem.kind) == (100, "inserted")


async def test_deleted_newest_records_are_caught_by_the_exported_head(chain: ControlStore) -> None:
    head = ChainHead.parse(str(await chain.audit.head()))
    assert head.seq == N
    assert (await chain.audit.verify(expected_head=head)).ok
    with db(chain) as con:
        con.execute("DELETE FROM audit WHERE seq > ?", (N - 2,))
    assert (await chain.audit.verify()).ok  # the chain alone cannot tell
    result = await chain.audit.verify(expected_head=head)
    assert result.problem is not None and (result.problem.seq, result.problem.kind) == (N - 1, "deleted")
    assert f"records {N - 1}..{N}" in result.problem.message


async def test_replaced_newest_records_are_caught_by_the_exported_head(chain: ControlStore) -> None:
    head = await chain.audit.head()
    with db(chain) as con:
        con.execute("DELETE FROM audit WHERE seq > ?", (N - 2,))
    # The attacker appends valid records over the gap, from a process of their own (this store's head is the
    # deleted record's: its next append would leave a gap that verify reports on its own).
    async with ControlStore(home=chain.home, clock=Clock()) as attacker:
        for i in range(3):
            await attacker.audit.append(event(i))
    assert (await chain.audit.verify()).ok
    result = await chain.audit.verify(expected_head=(head.seq, head.hash))
    assert result.problem is not None and (result.problem.seq, result.problem.kind) == (N, "edited")


def test_chain_head_text_form() -> None:
    head = ChainHead(7, "a" * 64)
    assert str(head) == f"7:{'a' * 64}" and ChainHead.parse(str(head)) == head
    for bad in ["7", "x:" + "a" * 64, "7:abc"]:
        with pytest.raises(InvalidRequestError):
            ChainHead.parse(bad)


# -- query, export, follow -----------------------------------------------------------------------------------------


async def test_query_filters(chain: ControlStore) -> None:
    audit = chain.audit
    assert len(await audit.query(limit=None)) == N
    assert len(await audit.query()) == N  # default limit is above N
    assert len(await audit.query(limit=10)) == 10
    by_tenant = await audit.query(tenant="tn_1", limit=None)
    assert len(by_tenant) == N // 2 and {e.tenant_id for e in by_tenant} == {"tn_1"}
    by_sandbox = await audit.query(sandbox="sb_3", limit=None)
    assert len(by_sandbox) == N // 4 and {e.target for e in by_sandbox} == {"sb_3"}
    await audit.append(AuditEvent(action="sandbox.kill", target="sb_3", tenant_id="tn_1"))
    assert [e.seq for e in await audit.query(action="sandbox.kill")] == [N + 1]
    assert [e.seq for e in await audit.query(action="sandbox.kill", tenant="tn_0")] == []
    times = {e.seq: e.time for e in await audit.query(limit=None)}  # one clock second apart
    window = await audit.query(since=times[11], until=times[21], limit=None)
    assert [e.seq for e in window] == list(range(11, 21))
    window = await audit.query(since=times[11] - timedelta(microseconds=1), until=times[21] + timedelta(seconds=0.5),
                               limit=None)
    assert [e.seq for e in window] == list(range(11, 22))
    assert [e.seq for e in await audit.query(after=N - 3, limit=None)] == [N - 2, N - 1, N, N + 1]


async def test_export_jsonl_round_trip(chain: ControlStore) -> None:
    stream = io.StringIO()
    assert await chain.audit.export_jsonl(stream) == N
    lines = stream.getvalue().splitlines()
    assert len(lines) == N
    exported = [AuditEntry.from_json(line) for line in lines]
    assert exported == await chain.audit.query(limit=None)
    assert json.loads(lines[0])["prev_hash"] == GENESIS_HASH
    head = await chain.audit.head()
    keys = chain.audit.keys
    assert verify_chain(exported, expected_head=head, keys=keys).ok  # an export verifies offline, with the key
    exported[10] = dataclasses.replace(exported[10], outcome={"exit_code": 1})
    problem = verify_chain(exported, keys=keys).problem
    assert problem is not None and (problem.seq, problem.kind) == (11, "edited")


async def test_export_filters(chain: ControlStore) -> None:
    stream = io.StringIO()
    assert await chain.audit.export_jsonl(stream, tenant="tn_0", sandbox="sb_0") == N // 4
    assert {json.loads(line)["target"] for line in stream.getvalue().splitlines()} == {"sb_0"}


async def test_follow_yields_new_records(store: ControlStore) -> None:
    await store.audit.append(event(0))  # before following: not yielded
    received: list[AuditEntry] = []

    async def tail() -> None:
        async for entry in store.audit.follow(tenant="tn_1", poll_interval=30):
            received.append(entry)
            if len(received) == 2:
                return

    task = asyncio.create_task(tail())
    await asyncio.sleep(0.05)
    for i in range(1, 5):  # tn_1, tn_0, tn_1, tn_0
        await store.audit.append(event(i))
    await asyncio.wait_for(task, 5)  # well under poll_interval: appends wake the follower
    assert [e.seq for e in received] == [2, 4]


async def test_follow_from_a_seq(chain: ControlStore) -> None:
    follower = chain.audit.follow(after=N - 2)
    got = [await anext(follower), await anext(follower)]
    await follower.aclose()  # type: ignore[attr-defined]
    assert [e.seq for e in got] == [N - 1, N]


# -- the fast append path (SQLite) ---------------------------------------------------------------------------------


async def test_fast_appends_store_records_exactly_like_careful_ones(store: ControlStore) -> None:
    """The first append reads the head in a transaction; the next ones go straight to the driver."""
    entries = [await store.audit.append(event(0)), await store.audit.append(event(1))]
    with db(store) as con:
        rows = con.execute("SELECT time, params, outcome, typeof(time), typeof(params) FROM audit ORDER BY seq")
        careful, fast = rows.fetchall()
    stored = [e.time.replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds") for e in entries]
    assert [careful[0], fast[0]] == stored
    assert careful[3:] == fast[3:] == ("text", "text")
    assert json.loads(careful[1]) == {"cmd": "echo 0"} and careful[2] == fast[2] == '{"exit_code": 0}'
    assert (await store.audit.verify()).ok


async def test_a_stale_head_falls_back_to_the_careful_path(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as one, ControlStore(home=tmp_path) as two:
        await one.audit.append(event(0))
        await one.audit.append(event(1))  # `one` now holds head 2 in memory
        await two.audit.append(event(2))  # seq 3, behind `one`'s back
        entry = await one.audit.append(event(3))  # `one` tries seq 3, collides, re-reads: seq 4
        assert entry.seq == 4
        assert (await one.audit.verify()).ok


async def test_an_append_while_another_process_writes_waits_for_it_and_lands_after(store: ControlStore) -> None:
    """The inline insert never waits for the write lock: held elsewhere, the append waits on aiosqlite's thread
    (the loop goes on meanwhile: here it is this very thread that holds the lock) and lands once the other writer
    commits, chained after it."""
    await store.audit.append(event(0))
    await store.audit.append(event(1))  # the fast path from here on
    with db(store) as con:
        con.execute("BEGIN IMMEDIATE")  # another process's write transaction
        append = asyncio.create_task(store.audit.append(event(2)))
        for _ in range(20):  # the loop runs while the append waits
            await asyncio.sleep(0.005)
        assert not append.done()
        con.execute("INSERT INTO tenants (id, name, created_at, disabled) VALUES ('tn_w', 'w', '2030-01-01', 0)")
        con.execute("COMMIT")
    entry = await append
    assert entry.seq == 3
    assert (await store.audit.verify()).ok


async def test_inline_appends_are_checkpointed_so_the_wal_stays_bounded(store: ControlStore) -> None:
    """Inline inserts never checkpoint (a checkpoint fsyncs); every so often an append waits for one off the loop,
    so the WAL is reused instead of growing by every record (about 28 KiB each)."""
    n = 1000
    for i in range(n):
        await store.audit.append(event(i))
    wal = store.home / "corral.db-wal"
    assert wal.stat().st_size < n * 28 * 1024 / 2
    assert (await store.audit.verify()).checked == n


async def test_records_deleted_behind_the_logs_back_leave_a_visible_gap(chain: ControlStore) -> None:
    with db(chain) as con:
        con.execute("DELETE FROM audit WHERE seq > ?", (N - 2,))
    await chain.audit.append(event(0))  # chained to the in-memory head, record N, which is gone
    result = await chain.audit.verify()
    assert result.problem is not None and result.problem.kind == "deleted"


# -- records from before request ids -------------------------------------------------------------------------------


def _hash_before_request_ids(entry: AuditEntry) -> str:
    """The hash as Corral computed it before records had a request id, written out independently."""
    fields = {"seq": entry.seq, "time": entry.time.astimezone(UTC).isoformat(timespec="microseconds"),
              "tenant_id": entry.tenant_id, "key_id": entry.key_id, "role": entry.role, "action": entry.action,
              "target": entry.target, "params": entry.params, "outcome": entry.outcome, "prev_hash": entry.prev_hash}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


async def test_a_chain_from_before_request_ids_still_verifies_and_goes_on_with_them(tmp_path: Path) -> None:
    """A database of the old schema (no request_id column), its records hashed the old way: the new server adds
    the column, verifies the old records, appends records with ids after them, and the whole chain verifies
    (in the database, and exported)."""
    async with ControlStore(home=tmp_path, clock=Clock(), audit_keys=AuditKeyring()) as old:  # unkeyed, as then
        for i in range(5):
            await old.audit.append(event(i))
        old_entries = await old.audit.query(limit=None)
    with sqlite3.connect(tmp_path / "corral.db") as con:
        con.execute("ALTER TABLE audit DROP COLUMN request_id")  # the table as older versions made it
        con.execute("ALTER TABLE audit DROP COLUMN hmac_key_id")
    assert all(e.hash == _hash_before_request_ids(e) for e in old_entries)

    async with ControlStore(home=tmp_path) as new:
        assert await new.audit.query(limit=None) == old_entries  # read back with no request id
        await new.audit.append(dataclasses.replace(event(5), request_id="req-after-upgrade"))
        await new.audit.append(event(6))  # one no request caused (the reconciler's, say)
        result = await new.audit.verify()
        assert result.ok and result.checked == 7, result.problem
        stream = io.StringIO()
        await new.audit.export_jsonl(stream)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert ["request_id" in line for line in lines] == [False] * 5 + [True, False]  # absent, not null, if unset
    assert verify_chain((AuditEntry.from_dict(line) for line in lines), keys=load_audit_keys(tmp_path)).ok
