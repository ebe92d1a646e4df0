"""Rotating the sealing key of stored secrets (docs/secrets.md, "Rotating"): `corral secret reseal` seals every
stored value again with the newest key, so that the old key can leave the keyring; a new sandbox's spec is sealed
with the newest key even before that. Real SQLite, real Fernet keys."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from typer.testing import CliRunner

from corral import ServerError
from corral.cli import app
from corral.control import ControlStore, Resealed
from corral.egress._keyring import SecretKeyring
from corral.service._secrets import SecretRequest, seal_secrets

pytestmark = pytest.mark.anyio

OLD, NEW, LOST = (Fernet.generate_key() for _ in range(3))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ControlStore]:
    async with ControlStore(f"sqlite+aiosqlite:///{tmp_path / 'corral.db'}", home=tmp_path) as s:
        yield s


async def _put(store: ControlStore, ring: SecretKeyring, tenant: str, name: str, value: str) -> None:
    await store.put_secret(tenant, name, ["api.example.com"], False, ring.seal(value))


async def _values(store: ControlStore, ring: SecretKeyring, tenant: str, *names: str) -> list[str]:
    return [ring.open((await store.get_secret(tenant, n)).sealed) for n in names]


async def test_reseal_puts_every_tenants_values_under_the_newest_key(store: ControlStore) -> None:
    acme, other = (await store.create_tenant("acme")).id, (await store.create_tenant("other")).id
    old = SecretKeyring([OLD])
    await _put(store, old, acme, "GH_TOKEN", "ghp-acme")
    await _put(store, old, other, "GH_TOKEN", "ghp-other")
    await _put(store, SecretKeyring([NEW]), acme, "NPM_TOKEN", "npm-acme")  # put after the servers had the new key

    assert await store.reseal_secrets(SecretKeyring([NEW, OLD])) == Resealed(resealed=2, current=1)
    only_new = SecretKeyring([NEW])  # the old key can go now
    assert await _values(store, only_new, acme, "GH_TOKEN", "NPM_TOKEN") == ["ghp-acme", "npm-acme"]
    assert await _values(store, only_new, other, "GH_TOKEN") == ["ghp-other"]
    assert await store.reseal_secrets(only_new) == Resealed(resealed=0, current=3)  # a second run changes nothing


async def test_a_value_no_key_opens_is_named_and_nothing_is_resealed(store: ControlStore) -> None:
    acme = (await store.create_tenant("acme")).id
    await _put(store, SecretKeyring([OLD]), acme, "KEPT", "kept")
    await _put(store, SecretKeyring([LOST]), acme, "ORPHAN", "orphan")
    before = {n: (await store.get_secret(acme, n)).sealed for n in ("KEPT", "ORPHAN")}

    with pytest.raises(ServerError, match=f"opens the stored secret\\(s\\) ORPHAN of tenant {acme}: put the key"):
        await store.reseal_secrets(SecretKeyring([NEW, OLD]))
    assert {n: (await store.get_secret(acme, n)).sealed for n in ("KEPT", "ORPHAN")} == before


async def test_a_value_put_during_the_reseal_is_kept_as_its_put_sealed_it(store: ControlStore, tmp_path: Path) -> None:
    acme = (await store.create_tenant("acme")).id
    old, new = SecretKeyring([OLD]), SecretKeyring([NEW, OLD])
    await _put(store, old, acme, "GH_TOKEN", "ghp-before")
    await _put(store, old, acme, "NPM_TOKEN", "npm-acme")
    put_meanwhile = new.seal("ghp-after")

    class PutDuringTheReseal:  # a server's `put` lands between the reseal's read and its write
        def current(self, sealed: str) -> bool:
            return new.current(sealed)

        def reseal(self, sealed: str) -> str:
            if old.open(sealed) == "ghp-before":
                with sqlite3.connect(tmp_path / "corral.db") as db:
                    db.execute("UPDATE secrets SET sealed = ? WHERE name = 'GH_TOKEN'", (put_meanwhile,))
            return new.reseal(sealed)

    assert await store.reseal_secrets(PutDuringTheReseal()) == Resealed(resealed=1, current=0)
    assert await _values(store, SecretKeyring([NEW]), acme, "GH_TOKEN", "NPM_TOKEN") == ["ghp-after", "npm-acme"]


async def test_a_new_sandbox_gets_a_stored_value_under_the_newest_key(store: ControlStore) -> None:
    acme = (await store.create_tenant("acme")).id
    await _put(store, SecretKeyring([OLD]), acme, "GH_TOKEN", "ghp-acme")  # not resealed yet
    stored = {"GH_TOKEN": await store.get_secret(acme, "GH_TOKEN")}

    (spec,) = seal_secrets({"TOKEN": SecretRequest(stored="GH_TOKEN")}, {}, SecretKeyring([NEW, OLD]), stored)
    assert spec.binding(SecretKeyring([NEW])).value == "ghp-acme"  # the sandbox never needs the old key
    with pytest.raises(ServerError, match="key that sealed it is missing"):
        SecretKeyring([OLD]).open(spec.sealed)


def _corral(home: Path, *args: str) -> tuple[int, str, str]:
    env = {k: None for k in os.environ if k.startswith("CORRAL_")} | {"CORRAL_HOME": str(home)}
    result = CliRunner().invoke(app, list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


async def _a_stored_secret_and_its_audit(home: Path, action: str) -> tuple[str, list[dict[str, object]]]:
    async with ControlStore(None, home=home) as store:
        tenant = (await store.tenant_by_name("acme")).id
        value = SecretKeyring([NEW]).open((await store.get_secret(tenant, "GH_TOKEN")).sealed)
        return value, [e.params for e in await store.audit.query(limit=None) if e.action == action]


async def _seed(home: Path) -> None:
    async with ControlStore(None, home=home) as store:
        acme = (await store.create_tenant("acme")).id
        await _put(store, SecretKeyring.from_environment(home), acme, "GH_TOKEN", "ghp-acme")  # makes secrets.key


def test_the_command_reseals_with_the_key_files_first_key_and_records_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_SECRETS_KEY", raising=False)
    asyncio.run(_seed(tmp_path))
    key_file = tmp_path / "secrets.key"
    key_file.write_bytes(NEW + b"\n" + key_file.read_bytes())  # the rotation: a new key first, the old kept

    code, out, _ = _corral(tmp_path, "secret", "reseal")
    assert code == 0 and "resealed 1 stored secret(s) with the newest key; 0 already were" in out, out
    value, records = asyncio.run(_a_stored_secret_and_its_audit(tmp_path, "secret.resealed"))
    assert value == "ghp-acme" and records == [{"resealed": 1, "current": 0}]
    assert "ghp-acme" not in (tmp_path / "corral.db").read_bytes().decode("latin-1")


def test_the_command_refuses_a_home_without_any_key(tmp_path: Path) -> None:
    code, _, err = _corral(tmp_path, "secret", "reseal")
    assert code == 1 and "no secrets key: CORRAL_SECRETS_KEY is not set" in err, err
    assert not (tmp_path / "secrets.key").exists() and not (tmp_path / "corral.db").exists()
