"""API keys, authentication, the permission table, cross-tenant 404s and the admin bootstrap."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import re
import sqlite3
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from corral import AuthenticationError, InvalidRequestError, NotFoundError, PermissionDeniedError
from corral.control import (
    ADMIN_KEY_FILE,
    AUTH_DENIED,
    PERMISSIONS,
    Action,
    AuditEntry,
    AuthDenials,
    ControlStore,
    Denial,
    Principal,
    Role,
    authorize,
    default_url,
    generate_key,
    hash_key,
    parse_key,
    require_sandbox,
)
from corral.engine import SandboxSpec

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(tmp_path: Path, clock: Clock) -> AsyncIterator[ControlStore]:
    async with ControlStore(home=tmp_path, clock=clock) as s:
        yield s


# -- key format and hashing ----------------------------------------------------------------------------------


def test_generated_keys_have_the_documented_format() -> None:
    keys = {generate_key() for _ in range(50)}
    assert len(keys) == 50
    for key in keys:
        scheme, prefix, secret = key.split("_", 2)
        assert scheme == "corral"
        assert re.fullmatch(r"[a-z0-9]{8}", prefix)
        assert len(secret) >= 43  # 32 random bytes, URL-safe base64
        assert parse_key(key) == (prefix, secret)


@pytest.mark.parametrize("bad", ["", "corral_", "corral_abcdefgh_short", "sk_abcdefgh_" + "a" * 43,
                                 "corral_ABCDEFGH_" + "a" * 43, "corral_abcdefg_" + "a" * 43,
                                 "corral_abcdefgh_" + "a" * 42 + "!"])
def test_malformed_keys_are_refused(bad: str) -> None:
    with pytest.raises(AuthenticationError, match="malformed"):
        parse_key(bad)


def test_hash_is_sha256_of_the_whole_key() -> None:
    key = generate_key()
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()


async def test_only_the_hash_is_stored(store: ControlStore, tmp_path: Path) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.DEVELOPER, "ci")
    assert new.key not in repr(new)
    with sqlite3.connect(tmp_path / "corral.db") as con:
        dump = "\n".join(con.iterdump())
    assert parse_key(new.key).secret not in dump
    assert hash_key(new.key) in dump
    assert new.info.prefix == parse_key(new.key).prefix


# -- authentication ------------------------------------------------------------------------------------------------


async def test_authenticate_returns_the_principal(store: ControlStore) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, "operator")
    principal = await store.authenticate(new.key)
    assert principal == Principal(tenant_id=tenant.id, key_id=new.info.id, role=Role.OPERATOR)


async def test_wrong_secret_with_a_known_prefix_is_refused(store: ControlStore) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.DEVELOPER)
    forged = f"corral_{new.info.prefix}_{generate_key().split('_', 2)[2]}"
    with pytest.raises(AuthenticationError, match="invalid API key"):
        await store.authenticate(forged)
    with pytest.raises(AuthenticationError, match="invalid API key"):
        await store.authenticate(generate_key())  # unknown prefix


async def test_revoked_key_stops_working(store: ControlStore, clock: Clock) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.DEVELOPER)
    other = await store.create_key(tenant.id, Role.DEVELOPER)
    await store.authenticate(new.key)
    revoked = await store.revoke_key(new.info.id)
    assert revoked.revoked and revoked.revoked_at == clock.now
    with pytest.raises(AuthenticationError, match="revoked"):
        await store.authenticate(new.key)
    clock.advance(10)
    again = await store.revoke_key(new.info.id)
    assert again.revoked_at == revoked.revoked_at  # idempotent, first time kept
    assert (await store.authenticate(other.key)).key_id == other.info.id  # other keys unaffected
    with pytest.raises(NotFoundError):
        await store.revoke_key("key_nope")


async def test_last_used_is_recorded_and_throttled(store: ControlStore, clock: Clock) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.DEVELOPER)
    assert (await store.get_key(new.info.id)).last_used_at is None
    first = clock.now
    await store.authenticate(new.key)
    assert (await store.get_key(new.info.id)).last_used_at == first
    clock.advance(30)
    await store.authenticate(new.key)
    assert (await store.get_key(new.info.id)).last_used_at == first  # within the resolution: no write
    clock.advance(31)
    await store.authenticate(new.key)
    assert (await store.get_key(new.info.id)).last_used_at == clock.now


async def test_disabled_tenant_cannot_authenticate(store: ControlStore) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.OPERATOR)
    await store.set_tenant_disabled(tenant.id, True)
    with pytest.raises(AuthenticationError, match="disabled"):
        await store.authenticate(new.key)
    await store.set_tenant_disabled(tenant.id, False)
    await store.authenticate(new.key)


async def test_key_creation_validates_role_and_tenant(store: ControlStore) -> None:
    tenant = await store.create_tenant("acme")
    with pytest.raises(InvalidRequestError, match="no role 'root'"):
        await store.create_key(tenant.id, "root")
    with pytest.raises(NotFoundError):
        await store.create_key("tn_missing", Role.DEVELOPER)
    with pytest.raises(InvalidRequestError, match="longer than 128"):
        await store.create_key(tenant.id, Role.DEVELOPER, "n" * 129)
    assert await store.list_keys(tenant.id) == []


async def test_list_keys_by_tenant(store: ControlStore) -> None:
    a = await store.create_tenant("a")
    b = await store.create_tenant("b")
    ka = await store.create_key(a.id, Role.DEVELOPER)
    kb = await store.create_key(b.id, Role.AUDITOR)
    assert [k.id for k in await store.list_keys(a.id)] == [ka.info.id]
    assert {k.id for k in await store.list_keys()} == {ka.info.id, kb.info.id}


# -- the permission table -------------------------------------------------------------------------------------

# Written out independently of PERMISSIONS, from the role descriptions.
_SANDBOX_USE = {Action.SANDBOX_CREATE, Action.SANDBOX_READ, Action.SANDBOX_EXEC, Action.SANDBOX_FILES_READ,
                Action.SANDBOX_FILES_WRITE, Action.SANDBOX_UPDATE, Action.SANDBOX_KILL}
_SANDBOX_USE |= {Action.VOLUME_CREATE, Action.VOLUME_READ, Action.VOLUME_DELETE}  # a tenant's storage
_SANDBOX_USE |= {Action.SECRET_READ}  # a tenant's stored secrets: names and hosts, to make sandboxes with them
_SANDBOX_USE |= {Action.CHECKPOINT_READ, Action.CHECKPOINT_WRITE}  # issue 26: checkpoints, restore, changes
EXPECTED: dict[Role, set[Action]] = {
    Role.ADMIN: set(Action),
    Role.OPERATOR: _SANDBOX_USE | {Action.SANDBOX_KILL_ALL, Action.AUDIT_READ, Action.TENANT_EGRESS,
                                   Action.SECRET_WRITE},  # only operators store values
    Role.DEVELOPER: set(_SANDBOX_USE),
    # eval reports: the server's own runs; checkpoints and what changed, never a restore (issue 26)
    Role.AUDITOR: {Action.AUDIT_READ, Action.EVAL_READ, Action.CHECKPOINT_READ},
}


def test_every_action_is_in_the_table() -> None:
    assert set(PERMISSIONS) == set(Action)


@pytest.mark.parametrize(("role", "action"), list(itertools.product(Role, Action)))
def test_permission_table(role: Role, action: Action) -> None:
    principal = Principal(tenant_id="tn_a", key_id="key_a", role=role)
    if action in EXPECTED[role]:
        authorize(principal, action, "tn_a")
    else:
        with pytest.raises(PermissionDeniedError, match=f"{role.value}.*{action.value}"):
            authorize(principal, action, "tn_a")


@pytest.mark.parametrize(("role", "action"), list(itertools.product(Role, Action)))
def test_only_admin_reaches_other_tenants(role: Role, action: Action) -> None:
    principal = Principal(tenant_id="tn_a", key_id="key_a", role=role)
    if role is Role.ADMIN:
        authorize(principal, action, "tn_b")
        authorize(principal, action, None)
    else:
        with pytest.raises(PermissionDeniedError):
            authorize(principal, action, "tn_b")


# -- other tenants' sandboxes do not exist ------------------------------------------------------------------------


@pytest.mark.parametrize("role", list(Role))
def test_foreign_sandbox_looks_missing(role: Role) -> None:
    principal = Principal(tenant_id="tn_a", key_id="key_a", role=role)
    with pytest.raises(NotFoundError) as missing:
        require_sandbox(principal, Action.SANDBOX_EXEC, "sb_1", None)
    if role is Role.ADMIN:
        require_sandbox(principal, Action.SANDBOX_EXEC, "sb_1", "tn_b")
        return
    with pytest.raises(NotFoundError) as foreign:
        require_sandbox(principal, Action.SANDBOX_EXEC, "sb_1", "tn_b")
    assert foreign.value.to_dict() == missing.value.to_dict()  # indistinguishable


def test_own_sandbox_still_checks_the_role() -> None:
    auditor = Principal(tenant_id="tn_a", key_id="key_a", role=Role.AUDITOR)
    with pytest.raises(PermissionDeniedError):
        require_sandbox(auditor, Action.SANDBOX_EXEC, "sb_1", "tn_a")
    developer = Principal(tenant_id="tn_a", key_id="key_a", role=Role.DEVELOPER)
    require_sandbox(developer, Action.SANDBOX_EXEC, "sb_1", "tn_a")


async def test_store_hides_other_tenants_sandboxes(store: ControlStore) -> None:
    a = await store.create_tenant("a")
    b = await store.create_tenant("b")
    dev_a = await store.authenticate((await store.create_key(a.id, Role.DEVELOPER)).key)
    dev_b = await store.authenticate((await store.create_key(b.id, Role.DEVELOPER)).key)
    op_b = await store.authenticate((await store.create_key(b.id, Role.OPERATOR)).key)
    sb = await store.reserve_sandbox(dev_a, SandboxSpec())
    assert (await store.sandbox_for(dev_a, sb.id, Action.SANDBOX_EXEC)).id == sb.id
    for outsider in (dev_b, op_b):
        with pytest.raises(NotFoundError, match=f"no sandbox '{sb.id}'"):
            await store.sandbox_for(outsider, sb.id, Action.SANDBOX_READ)
    await store.mark_destroyed(sb.id)
    with pytest.raises(NotFoundError):
        await store.sandbox_for(dev_a, sb.id, Action.SANDBOX_EXEC)
    assert (await store.sandbox_for(dev_a, sb.id, Action.SANDBOX_READ, include_destroyed=True)).id == sb.id


async def test_reserve_needs_the_create_permission(store: ControlStore) -> None:
    a = await store.create_tenant("a")
    auditor = await store.authenticate((await store.create_key(a.id, Role.AUDITOR)).key)
    with pytest.raises(PermissionDeniedError):
        await store.reserve_sandbox(auditor, SandboxSpec())
    assert await store.list_sandboxes(a.id) == []


# -- bootstrap -------------------------------------------------------------------------------------------------------


async def test_bootstrap_generates_a_0600_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("CORRAL_HOME", str(home))
    monkeypatch.delenv("CORRAL_ADMIN_KEY", raising=False)
    async with ControlStore() as store:  # home and database from CORRAL_HOME
        assert store.url == default_url(home) == f"sqlite+aiosqlite:///{home}/corral.db"
        path = await store.bootstrap_admin(None)
        assert path == str(home / ADMIN_KEY_FILE)
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
        key = Path(path).read_text().strip()
        principal = await store.authenticate(key)
        assert principal.role is Role.ADMIN
        assert (await store.get_tenant(principal.tenant_id)).name == "admin"
        assert await store.bootstrap_admin(None) is None  # not empty any more: nothing new
        assert len(await store.list_keys()) == 1
    assert (home / "corral.db").exists()
    assert sorted(p.name for p in home.iterdir() if p.name.startswith(".admin")) == []  # no temp file left


async def test_bootstrap_takes_corral_admin_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = generate_key()
    monkeypatch.setenv("CORRAL_ADMIN_KEY", key)
    async with ControlStore(home=tmp_path) as store:
        assert await store.bootstrap_admin(os.environ["CORRAL_ADMIN_KEY"]) is None
        assert not (tmp_path / ADMIN_KEY_FILE).exists()
        assert (await store.authenticate(key)).role is Role.ADMIN
        assert await store.bootstrap_admin(generate_key()) is None  # a store with keys is left alone
        assert len(await store.list_keys()) == 1


async def test_bootstrap_refuses_a_malformed_admin_key(store: ControlStore, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="CORRAL_ADMIN_KEY"):
        await store.bootstrap_admin("hunter2")
    assert await store.list_tenants() == []
    assert not (tmp_path / ADMIN_KEY_FILE).exists()


async def test_bootstrap_overwrites_a_stale_key_file_with_0600(tmp_path: Path) -> None:
    stale = tmp_path / ADMIN_KEY_FILE
    stale.write_text("old\n")
    stale.chmod(0o644)
    async with ControlStore(home=tmp_path) as store:
        path = await store.bootstrap_admin(None)
    assert path is not None
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    assert Path(path).read_text().startswith("corral_")


# -- the principal cache ---------------------------------------------------------------------------------------------


def no_database(store: ControlStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every read or write of `store`'s database fail, to prove what is served from memory."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the database was used")

    monkeypatch.setattr(store._db, "read", refuse)
    monkeypatch.setattr(store._db, "write", refuse)


async def test_authentication_is_served_from_memory(store: ControlStore, clock: Clock,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.DEVELOPER)
    principal = await store.authenticate(new.key)
    with monkeypatch.context() as patched:
        no_database(store, patched)
        for _ in range(100):
            clock.advance(0.01)  # within the TTL and LAST_USED_RESOLUTION: no read, no write
            assert await store.authenticate(new.key) == principal
    with pytest.raises(AuthenticationError, match="invalid API key"):
        # a wrong secret with the same prefix is no cache hit (entries are keyed by the whole key's hash)
        await store.authenticate(f"corral_{new.info.prefix}_{generate_key().split('_', 2)[2]}")


async def test_cached_principals_expire_after_the_ttl(tmp_path: Path, clock: Clock) -> None:
    """Another process's revocation (here: a second store on the same database) is seen within the TTL."""
    async with ControlStore(home=tmp_path, clock=clock, cache_ttl=5) as one, \
            ControlStore(home=tmp_path, clock=clock, cache_ttl=5) as two:
        tenant = await one.create_tenant("acme")
        new = await one.create_key(tenant.id, Role.DEVELOPER)
        await two.authenticate(new.key)
        await one.revoke_key(new.info.id)
        clock.advance(4.9)
        await two.authenticate(new.key)  # still cached by the other store
        clock.advance(0.1)
        with pytest.raises(AuthenticationError, match="revoked"):
            await two.authenticate(new.key)


async def test_cache_ttl_zero_reads_every_time(tmp_path: Path, clock: Clock) -> None:
    async with ControlStore(home=tmp_path, clock=clock, cache_ttl=0) as one, ControlStore(home=tmp_path) as two:
        tenant = await one.create_tenant("acme")
        new = await one.create_key(tenant.id, Role.DEVELOPER)
        await one.authenticate(new.key)
        await two.revoke_key(new.info.id)
        with pytest.raises(AuthenticationError, match="revoked"):
            await one.authenticate(new.key)


async def test_disabling_a_tenant_drops_its_cached_principals(store: ControlStore) -> None:
    a = await store.create_tenant("a")
    b = await store.create_tenant("b")
    key_a = (await store.create_key(a.id, Role.OPERATOR)).key
    key_b = (await store.create_key(b.id, Role.OPERATOR)).key
    await store.authenticate(key_a)
    await store.authenticate(key_b)
    await store.set_tenant_disabled(a.id, True)
    with pytest.raises(AuthenticationError, match="disabled"):
        await store.authenticate(key_a)  # at once, though it was cached
    await store.authenticate(key_b)


async def test_a_revocation_during_a_lookup_is_not_undone_by_the_cache(store: ControlStore,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that read the key before the revocation committed must not cache what it read."""
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.DEVELOPER)
    original = store._authenticate_in_db
    revoked = asyncio.Event()

    async def slow_lookup(prefix: str, digest: str) -> object:
        found = await original(prefix, digest)  # read while the key is still valid...
        await revoked.wait()  # ...and return only after the revocation
        return found

    monkeypatch.setattr(store, "_authenticate_in_db", slow_lookup)
    lookup = asyncio.create_task(store.authenticate(new.key))
    await asyncio.sleep(0.01)
    await store.revoke_key(new.info.id)
    revoked.set()
    await lookup  # the request that raced the revocation still passes (it started before it)...
    monkeypatch.setattr(store, "_authenticate_in_db", original)
    with pytest.raises(AuthenticationError, match="revoked"):
        await store.authenticate(new.key)  # ...but nothing after it does


async def test_last_used_is_written_once_per_resolution(store: ControlStore, clock: Clock,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = await store.create_tenant("acme")
    new = await store.create_key(tenant.id, Role.DEVELOPER)
    writes = 0
    original = store._db.write

    def counting_write() -> Any:
        nonlocal writes
        writes += 1
        return original()

    monkeypatch.setattr(store._db, "write", counting_write)
    for _ in range(200):  # 200 requests over 100 seconds: two writes (t=0 and t=60)
        await store.authenticate(new.key)
        clock.advance(0.5)
    assert writes == 2


# -- auth.denied records ---------------------------------------------------------------------------------------------


def denial(client: str | None = "10.0.0.1", prefix: str | None = "abcdefgh", path: str = "/v1/sandboxes") -> Denial:
    return Denial(client=client, method="GET", path=path, key_prefix=prefix, reason="invalid API key")


async def denied_records(store: ControlStore) -> list[AuditEntry]:
    return await store.audit.query(action=AUTH_DENIED, limit=None)


async def test_first_denial_per_address_is_recorded_at_once(store: ControlStore) -> None:
    await store.auth_denials.record(denial())
    await store.auth_denials.record(denial(client="10.0.0.2", prefix=None))
    first, second = await denied_records(store)
    assert first.params == {"client": "10.0.0.1", "method": "GET", "path": "/v1/sandboxes", "key_prefix": "abcdefgh",
                            "count": 1, "key_prefixes": ["abcdefgh"]}
    assert first.outcome == {"status": 401, "error": "unauthenticated", "reason": "invalid API key",
                             "aggregated": False}
    assert first.tenant_id is None and first.key_id is None
    assert second.params["client"] == "10.0.0.2" and second.params["key_prefix"] is None


async def test_a_flood_from_one_address_is_one_record_and_one_summary(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as store:
        store.auth_denials = AuthDenials(store.audit, window=0.2)
        for i in range(500):
            await store.auth_denials.record(denial(prefix=f"{i % 3:08d}", path=f"/v1/sandboxes/{i}"))
        assert len(await denied_records(store)) == 1  # the rest are being counted
        await asyncio.sleep(0.4)  # the window ends: its summary is written
        first, summary = await denied_records(store)
        assert summary.params["count"] == 499 and summary.outcome["aggregated"] is True
        assert summary.params["key_prefixes"] == ["00000000", "00000001", "00000002"]
        assert summary.params["path"] == "/v1/sandboxes/499"  # the last one
        assert first.params["count"] + summary.params["count"] == 500
        await store.auth_denials.record(denial())  # a new window: recorded at once again
        assert len(await denied_records(store)) == 3
        assert (await store.audit.verify()).ok


async def test_open_windows_are_summed_up_when_the_store_closes(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as store:
        for _ in range(3):
            await store.auth_denials.record(denial())
    async with ControlStore(home=tmp_path) as again:
        assert [r.params["count"] for r in await denied_records(again)] == [1, 2]


async def test_addresses_past_the_limit_share_one_bucket(store: ControlStore) -> None:
    store.auth_denials = AuthDenials(store.audit, max_clients=2)
    for client in ["a", "b", "c", "d", "e", "a"]:
        await store.auth_denials.record(denial(client=client))
    await store.auth_denials.flush()
    records = await denied_records(store)
    assert [r.params["client"] for r in records if not r.outcome["aggregated"]] == ["a", "b", "*"]  # c opened "*"
    summed = {r.params["client"]: r.params["count"] for r in records if r.outcome["aggregated"]}
    assert summed == {"a": 1, "*": 2}  # d and e went to "*"
