"""The `corral` CLI's control plane as a user runs it (tenants, keys, quotas, sandboxes listed and killed, audit, the
admin SDK): the CLI in-process through typer's runner, or as a real subprocess, against the whole
server over the fake engine (tests/live_front.py's `threaded_front`): what is checked is the CLI's and the API's
own. What needs real sandboxes (exec bytes, cp, pause and fork, code, root) is in tests/test_cli.py, on runc."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Admin

from .conftest import TEMPLATE
from .live_front import LiveFront, threaded_front
from .test_cli import Cli, _tamper, one_error_line


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFront]:
    with threaded_front(tmp_path_factory.mktemp("cli-control")) as front:
        yield front


@pytest.fixture(scope="module")
def admin(server: LiveFront) -> Cli:
    return Cli(server.url, server.admin_key)


@pytest.fixture(scope="module")
def dev(admin: Cli) -> Cli:
    """A developer of tenant `cli`, made with the CLI itself."""
    return admin.developer("cli")


# -- tenants and keys ---------------------------------------------------------------------------------------------


def test_tenants_and_keys(admin: Cli) -> None:
    tenant_id = admin.ok("tenants", "create", "acme").decode().strip()
    assert tenant_id.startswith("tn_")
    out = admin.ok("keys", "create", "--tenant", "acme", "--role", "operator", "--name", "ci").decode()
    key = out.splitlines()[-1]
    assert key.startswith("corral_") and " " not in key
    created = json.loads(admin.ok("keys", "create", "--tenant", "acme", "--role", "auditor", "--json"))
    assert created["role"] == "auditor" and created["tenant"] == "acme" and created["key"].startswith("corral_")

    listed = admin.ok("keys", "ls", "--tenant", "acme", "--json")
    keys = json.loads(listed)
    assert {k["role"] for k in keys} == {"operator", "auditor"} and all(k["tenant"] == "acme" for k in keys)
    assert key.encode() not in listed and created["key"].encode() not in listed  # secrets are never listed
    assert [k["name"] for k in keys if k["role"] == "operator"] == ["ci"]
    assert b"acme" in admin.ok("tenants", "ls")
    assert json.loads(admin.ok("sandbox", "ls", "--json")) == []  # the admin's own tenant has none

    quotas = json.loads(admin.ok("tenants", "update", "acme", "--max-sandboxes", "0", "--max-memory", "1G",
                                 "--json"))["quotas"]
    assert quotas["max_sandboxes"] == 0 and quotas["max_memory_bytes"] == 2**30
    one_error_line(admin.run("sandbox", "create", key=key), "quota_exceeded")
    assert json.loads(admin.ok("tenants", "update", tenant_id, "--max-sandboxes", "none", "--json"))["quotas"][
        "max_sandboxes"] is None

    admin.ok("keys", "revoke", created["id"])
    one_error_line(admin.run("sandbox", "ls", key=created["key"]), "unauthenticated")
    admin.ok("tenants", "update", "acme", "--disable")
    one_error_line(admin.run("sandbox", "ls", key=key), "unauthenticated")


# -- sandboxes ----------------------------------------------------------------------------------------------------


def test_sandbox_create_ls_kill(dev: Cli, admin: Cli) -> None:
    info = json.loads(dev.ok("sandbox", "create", "--template", TEMPLATE, "--metadata", "job=cli-ls",
                             "--timeout", "120", "--json"))
    sid = info["id"]
    assert info["metadata"] == {"job": "cli-ls"} and info["state"] == "running"
    assert [s["id"] for s in json.loads(dev.ok("sandbox", "ls", "--metadata", "job=cli-ls", "--json"))] == [sid]
    assert json.loads(dev.ok("sandbox", "ls", "--metadata", "job=other", "--json")) == []
    assert sid.encode() in dev.ok("sandbox", "ls")  # the table, ids never cut
    dev.ok("sandbox", "kill", sid)
    assert sid not in [s["id"] for s in json.loads(dev.ok("sandbox", "ls", "--json"))]


def test_kill_switch_by_tenant(admin: Cli) -> None:
    admin.ok("tenants", "create", "runaway")
    key = admin.ok("keys", "create", "--tenant", "runaway", "--role", "developer").decode().splitlines()[-1]
    agent = Cli(admin.url, key)
    ids = {agent.ok("sandbox", "create", "--template", TEMPLATE).decode().strip() for _ in range(2)}
    killed = admin.ok("sandbox", "kill", "--tenant", "runaway").decode().split()
    assert set(killed) == ids
    assert json.loads(agent.ok("sandbox", "ls", "--json")) == []
    assert admin.run("sandbox", "kill").returncode == 2  # nothing to kill named: a usage error


# -- audit --------------------------------------------------------------------------------------------------------


def test_audit_verify_export_and_tampering(admin: Cli, dev: Cli, server: LiveFront, tmp_path: Path) -> None:
    dev.ok("sandbox", "ls")  # at least a few records
    r = admin.run("audit", "verify")
    assert r.returncode == 0 and r.stdout.startswith(b"ok: "), r.stdout
    head = admin.ok("audit", "head").decode().strip()
    assert json.loads(admin.ok("audit", "verify", "--head", head, "--json"))["ok"] is True

    out = tmp_path / "audit.jsonl"
    admin.ok("audit", "export", "--out", str(out))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1)) and len(records) >= int(head.split(":")[0])
    key_file = str(server.home / "audit.key")
    assert admin.run("audit", "verify", "--file", str(out), "--key-file", key_file).returncode == 0
    r = admin.run("audit", "verify", "--file", str(out))  # without the key the HMACs cannot be checked: no "ok"
    assert r.returncode == 1 and b"unknown-key" in r.stdout and b"--key-file" in r.stdout, r.stdout
    r = admin.run("audit", "verify", "--file", str(out), "--unkeyed")
    assert r.returncode == 0 and b"NOT checked" in r.stdout, r.stdout
    mine = [json.loads(line) for line in admin.ok("audit", "export", "--action", "sandbox.list").splitlines()]
    assert mine and all(r["action"] == "sandbox.list" for r in mine)

    original = _tamper(server.home / "corral.db", 2, '{"name": "innocent"}')
    try:
        r = admin.run("audit", "verify")
        assert r.returncode == 1 and b"record 2" in r.stdout and b"edited" in r.stdout, r.stdout
        assert json.loads(admin.run("audit", "verify", "--json").stdout)["problem"]["seq"] == 2
    finally:
        _tamper(server.home / "corral.db", 2, original)
    assert admin.run("audit", "verify").returncode == 0


def test_audit_tail_shows_new_records(admin: Cli) -> None:
    after = admin.ok("audit", "head").decode().split(":")[0]
    lines: list[bytes] = []
    with admin.popen("audit", "tail", "--json", "--action", "tenant.create", "--after", after) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")), daemon=True)
        reader.start()
        try:
            admin.ok("tenants", "create", "tailed")
            deadline = time.monotonic() + 20
            while not lines and time.monotonic() < deadline:
                time.sleep(0.05)
            assert lines, "audit tail printed nothing within 20 s"
            record = json.loads(lines[0])
            assert record["action"] == "tenant.create" and record["params"] == {"name": "tailed"}
        finally:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: how a tail ends
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()  # never hang the suite: the assertion below reports it
                proc.wait()
            reader.join(5)
        assert proc.returncode == 0 and b"Traceback" not in proc.stderr.read()


def test_admin_sdk_against_the_server(server: LiveFront) -> None:
    with Admin(api_key=server.admin_key, base_url=server.url) as admin:
        admin.tenants.create("sdk")
        new = admin.keys.create("sdk", "auditor", name="watcher")
        assert new.key not in repr(new)
        assert [k.id for k in admin.keys.list("sdk")] == [new.id]
        head = admin.audit.head()
        follow = admin.audit.follow(after=int(head.split(":")[0]), action="key.revoke")
        admin.keys.revoke(new.id)
        record = next(follow)
        follow.close()
        assert record.target == new.id and record.outcome["status"] == 204
        assert admin.keys.list("sdk")[0].revoked
        assert admin.audit.verify(head).ok
        assert admin.kill_all(tenant="sdk").killed == []
