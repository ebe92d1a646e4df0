"""The keyed audit chain (checklist item 39): HMACs with keys kept outside the database, legacy records, rotation.

Tampering here is the attack the key exists for: rewrite a middle record and re-hash it and every later record
so that every link holds, with plain SHA-256 or with a key that is not the server's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import io
import itertools
import os
import secrets
import sqlite3
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral import InvalidRequestError
from corral.cli import app
from corral.control import (
    AUDIT_KEY_FILE,
    AuditEntry,
    AuditKeyring,
    ControlStore,
    audit_key_id,
    load_audit_keys,
    rotate_audit_key_file,
    verify_chain,
)

from .test_control_audit import Clock, db, event, insert_raw

pytestmark = pytest.mark.anyio

N = 20
VICTIM = 10
Forge = Callable[[AuditEntry], AuditEntry]  # gives a record (with its new prev_hash) a hash that fits its fields


def plain_sha256(entry: AuditEntry) -> AuditEntry:
    """Re-hashed the way records were before keys: the forger marks them unkeyed."""
    unkeyed = dataclasses.replace(entry, hmac_key_id=None)
    return dataclasses.replace(unkeyed, hash=unkeyed.computed_hash())


def wrong_key(keep_id: bool) -> Forge:
    """Re-hashed with a key the forger made up, naming the server's key id (`keep_id`) or its own."""
    key = secrets.token_hex(32).encode()
    ring = AuditKeyring([key])

    def forge(entry: AuditEntry) -> AuditEntry:
        if keep_id:  # the server's key id, the forger's key
            return dataclasses.replace(entry, hash=hmac.new(key, entry.message(), hashlib.sha256).hexdigest())
        named = dataclasses.replace(entry, hmac_key_id=audit_key_id(key))
        digest = named.keyed_hash(ring)
        assert digest is not None
        return dataclasses.replace(named, hash=digest)

    return forge


def rewritten(entries: list[AuditEntry], victim: int, forge: Forge) -> list[AuditEntry]:
    """`entries` with record `victim` edited, and it and every later record re-hashed and re-linked by `forge`."""
    out, prev = [], None
    for entry in entries:
        if entry.seq >= victim:
            if entry.seq == victim:
                entry = dataclasses.replace(entry, params={"cmd": "echo innocent"})
            entry = forge(dataclasses.replace(entry, prev_hash=prev.hash if prev else entry.prev_hash))
        out.append(entry)
        prev = entry
    return out


async def keyed_chain(store: ControlStore, n: int = N) -> list[AuditEntry]:
    for i in range(n):
        await store.audit.append(event(i))
    return await store.audit.query(limit=None)


def replace_rows(store: ControlStore, entries: list[AuditEntry], from_seq: int) -> None:
    with db(store) as con:
        con.execute("DELETE FROM audit WHERE seq >= ?", (from_seq,))
        for entry in entries:
            if entry.seq >= from_seq:
                insert_raw(con, entry)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ControlStore]:
    s = ControlStore(home=tmp_path, clock=Clock())
    await s.start()
    try:
        yield s
    finally:
        await s.close()


# -- checklist item 39: a rewrite without the key fails ------------------------------------------------------------


@pytest.mark.parametrize("forge, kind, says", [
    (plain_sha256, "edited", "re-hashed without the"),
    (wrong_key(keep_id=True), "edited", "do not match its hash"),
    (wrong_key(keep_id=False), "unknown-key", "which this verifier does not hold"),
], ids=["plain-sha256", "wrong-key-same-id", "wrong-key-own-id"])
async def test_a_middle_record_rewritten_and_rehashed_without_the_key_fails(store: ControlStore, forge: Forge,
                                                                             kind: str, says: str) -> None:
    entries = await keyed_chain(store)
    forged = rewritten(entries, VICTIM, forge)
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(forged))  # every link holds
    replace_rows(store, forged, VICTIM)
    result = await store.audit.verify()
    assert not result.ok and result.problem is not None
    assert (result.problem.seq, result.problem.kind) == (VICTIM, kind), result.problem
    assert says in result.problem.message and result.checked == VICTIM - 1
    # The same forgery in an export fails offline with the server's key too.
    offline = verify_chain(forged, keys=store.audit.keys)
    assert offline.problem is not None and (offline.problem.seq, offline.problem.kind) == (VICTIM, kind)


async def test_a_rewrite_with_the_key_links_but_is_what_the_key_protects(store: ControlStore) -> None:
    """The control: the same rewrite done by someone holding the key verifies (the key is the secret)."""
    entries = await keyed_chain(store)
    keys = store.audit.keys

    def with_key(entry: AuditEntry) -> AuditEntry:
        digest = entry.keyed_hash(keys)
        assert digest is not None
        return dataclasses.replace(entry, hash=digest)

    assert verify_chain(rewritten(entries, VICTIM, with_key), keys=keys).ok


async def test_every_record_names_its_key_and_is_an_hmac(store: ControlStore) -> None:
    entries = await keyed_chain(store, 3)
    (key_id,) = store.audit.keys.ids
    assert {e.hmac_key_id for e in entries} == {key_id}
    assert all(e.hash != e.computed_hash() for e in entries)  # not plain SHA-256
    key = (store.home / AUDIT_KEY_FILE).read_bytes().split()[0]
    assert key_id == hashlib.sha256(key).hexdigest()[:8]


# -- where the key lives --------------------------------------------------------------------------------------------


async def test_the_key_file_is_made_0600_once_and_kept(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as s:
        first = s.audit.keys.ids
    path = tmp_path / AUDIT_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key, mark = path.read_text().split()
    assert len(key) == 64 and mark == "unkeyed-until=0"  # 32 random bytes, hex; a new chain: no unkeyed records
    async with ControlStore(home=tmp_path) as s:
        assert s.audit.keys.ids == first


async def test_the_key_is_in_neither_the_database_nor_the_records(store: ControlStore) -> None:
    await keyed_chain(store)
    key = (store.home / AUDIT_KEY_FILE).read_bytes().split()[0]
    await store.close()
    stored = b"".join(p.read_bytes() for p in store.home.glob("corral.db*"))
    assert stored and key not in stored and bytes.fromhex(key.decode()) not in stored
    await store.start()
    stream = io.StringIO()
    await store.audit.export_jsonl(stream)
    assert key.decode() not in stream.getvalue()


async def test_the_environment_holds_several_keys_newest_first(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    new, old = secrets.token_hex(32), secrets.token_hex(32)
    monkeypatch.setenv("CORRAL_AUDIT_KEY", f"{new},{old}")
    async with ControlStore(home=tmp_path) as s:
        assert s.audit.keys.ids == [audit_key_id(new.encode()), audit_key_id(old.encode())]
        assert (await s.audit.append(event(0))).hmac_key_id == audit_key_id(new.encode())
    assert not (tmp_path / AUDIT_KEY_FILE).exists()  # the environment's keys: no file made
    monkeypatch.setenv("CORRAL_AUDIT_KEY", "short")
    with pytest.raises(InvalidRequestError, match="CORRAL_AUDIT_KEY is shorter than 32"):
        load_audit_keys(tmp_path)


# -- records from before keys ---------------------------------------------------------------------------------------


async def test_legacy_unkeyed_records_still_verify_and_the_chain_goes_on_keyed(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path, clock=Clock(), audit_keys=AuditKeyring()) as old:  # an older server
        legacy = await keyed_chain(old, 5)
    assert all(e.hmac_key_id is None and e.hash == e.computed_hash() for e in legacy)
    with sqlite3.connect(tmp_path / "corral.db") as con:
        con.execute("ALTER TABLE audit DROP COLUMN hmac_key_id")  # its schema
    async with ControlStore(home=tmp_path) as new:
        await new.audit.append(event(5))
        await new.audit.append(event(6))
        result = await new.audit.verify()
        assert result.ok and result.checked == 7 and result.unkeyed == 5, result.problem
        # An unkeyed record is accepted only before the first keyed one: a downgrade later on is a rewrite.
        entries = await new.audit.query(limit=None)
        downgraded = dataclasses.replace(entries[-1], hmac_key_id=None)
        downgraded = dataclasses.replace(downgraded, hash=downgraded.computed_hash())
        problem = verify_chain([*entries[:-1], downgraded], keys=new.audit.keys).problem
        assert problem is not None and (problem.seq, problem.kind) == (7, "edited")
        # Nor can the whole chain pass for pre-key history: the key file says only records up to 5 predate it.
        assert (new.home / AUDIT_KEY_FILE).read_text().split()[1] == "unkeyed-until=5"
        for victim in (2, 6):
            problem = verify_chain(rewritten(entries, victim, plain_sha256), keys=new.audit.keys).problem
            assert problem is not None and (problem.seq, problem.kind) == (6, "edited"), (victim, problem)
            assert "only records up to 5 predate the audit key" in problem.message


async def test_a_whole_chain_rewritten_unkeyed_fails(store: ControlStore) -> None:
    """The downgrade: every record from the first re-hashed with plain SHA-256, as if all predated the key."""
    forged = rewritten(await keyed_chain(store), 1, plain_sha256)
    problem = verify_chain(forged, keys=store.audit.keys).problem
    assert problem is not None and (problem.seq, problem.kind) == (1, "edited")
    assert verify_chain(forged).ok  # a verifier without the key cannot tell: why --file wants --key-file


# -- rotation --------------------------------------------------------------------------------------------------------


async def test_rotation_keeps_old_records_verifiable_and_needs_the_old_key(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as before:
        (old_id,) = before.audit.keys.ids
        await keyed_chain(before, 3)
    new_id, kept = rotate_audit_key_file(tmp_path / AUDIT_KEY_FILE)
    assert kept == [old_id] and new_id != old_id
    assert stat.S_IMODE((tmp_path / AUDIT_KEY_FILE).stat().st_mode) == 0o600
    async with ControlStore(home=tmp_path) as after:
        assert after.audit.keys.ids == [new_id, old_id]
        await after.audit.append(event(3))
        entries = await after.audit.query(limit=None)
        assert [e.hmac_key_id for e in entries] == [old_id] * 3 + [new_id]
        assert (await after.audit.verify()).ok  # both keys held
    lines = (tmp_path / AUDIT_KEY_FILE).read_text().split()
    only_new = AuditKeyring.parse(lines[0], "test")
    problem = verify_chain(entries, keys=only_new).problem  # the old key dropped
    assert problem is not None and (problem.seq, problem.kind) == (1, "unknown-key")
    assert old_id in problem.message
    links = verify_chain(entries, keys=only_new, links_only=True)
    assert links.ok and links.unchecked == 3


async def test_a_server_verifies_a_key_rotated_in_while_it_runs(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as running, ControlStore(home=tmp_path) as other:
        await running.audit.append(event(0))
        rotate_audit_key_file(tmp_path / AUDIT_KEY_FILE)
        other.audit.keys = load_audit_keys(tmp_path)  # as `corral audit rotate-key` does: signs with the new key
        await other.audit.append(event(1))
        result = await running.audit.verify()  # re-reads the key file: holds the new key without a restart
        assert result.ok and result.checked == 2, result.problem


def test_rotating_refuses_a_file_with_a_bad_key(tmp_path: Path) -> None:
    path = tmp_path / AUDIT_KEY_FILE
    path.write_text("tooshort\n")
    os.chmod(path, 0o600)
    with pytest.raises(InvalidRequestError, match="shorter than 32"):
        rotate_audit_key_file(path)
    assert path.read_text() == "tooshort\n"
    path.unlink()
    with pytest.raises(InvalidRequestError, match="no audit key file"):  # the server makes the first one
        rotate_audit_key_file(path)


def test_a_source_without_a_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Else the server would sign unkeyed."""
    monkeypatch.setenv("CORRAL_AUDIT_KEY", "unkeyed-until=5")
    with pytest.raises(InvalidRequestError, match="CORRAL_AUDIT_KEY holds no audit key"):
        load_audit_keys(tmp_path)


# -- the commands ----------------------------------------------------------------------------------------------------


def corral(home: Path, *args: str) -> tuple[int, str]:
    env = {k: None for k in os.environ if k.startswith("CORRAL_")} | {"CORRAL_HOME": str(home)}
    r = CliRunner().invoke(app, list(args), env=env)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout


def test_rotate_key_records_the_rotation_and_an_export_verifies_with_the_file(tmp_path: Path) -> None:
    old_id = asyncio.run(_start_a_chain(tmp_path))
    code, out = corral(tmp_path, "audit", "rotate-key")
    assert code == 0 and "audit.key_rotated as record 4" in out, out
    (new_id, kept_id) = load_audit_keys(tmp_path).ids
    assert kept_id == old_id
    rotation, export = asyncio.run(_rotation_and_export(tmp_path))
    assert rotation.hmac_key_id == new_id and rotation.params == {"key_id": new_id, "kept": [old_id]}
    code, out = corral(tmp_path, "audit", "verify", "--file", str(export), "--key-file", str(tmp_path / AUDIT_KEY_FILE))
    assert code == 0 and out.startswith("ok: 4 records verified"), out
    only_new = tmp_path / "new.key"
    only_new.write_text((tmp_path / AUDIT_KEY_FILE).read_text().split()[0] + "\n")
    code, out = corral(tmp_path, "audit", "verify", "--file", str(export), "--key-file", str(only_new))
    assert code == 1 and f"signed with audit key {old_id}" in out and "(unknown-key)" in out, out


async def _start_a_chain(home: Path) -> str:
    async with ControlStore(home=home) as s:
        await keyed_chain(s, 3)
        return s.audit.keys.ids[0]


async def _rotation_and_export(home: Path) -> tuple[AuditEntry, Path]:
    async with ControlStore(home=home) as s:
        (rotation,) = await s.audit.query(action="audit.key_rotated")
        export = home / "audit.jsonl"
        with open(export, "w", encoding="ascii") as f:
            await s.audit.export_jsonl(f)
    return rotation, export


def test_rotate_key_refuses_keys_from_the_environment(tmp_path: Path) -> None:
    env = {"CORRAL_HOME": str(tmp_path), "CORRAL_AUDIT_KEY": secrets.token_hex(32)}
    r = CliRunner().invoke(app, ["audit", "rotate-key"], env=env)
    assert r.exit_code == 1 and "CORRAL_AUDIT_KEY, which this command cannot change" in r.stderr, r.output
    assert not (tmp_path / AUDIT_KEY_FILE).exists()
