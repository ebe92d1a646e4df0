"""End to end over a real socket: `corral serve` as a subprocess, the SDK as a user would use it, and a
SIGKILL restart that must keep sandboxes and their files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Admin, CapacityError, Sandbox
from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME
from .test_control_postgres import Cluster
from .test_control_postgres import postgres as postgres  # the session's throwaway PostgreSQL cluster

pytestmark = [
    pytest.mark.runc,
    pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs"),
]


@pytest.fixture
def server(test_home: Path, unique: str) -> Iterator[ServerProcess]:
    # Stopped with SIGTERM at the end, then every sandbox it left behind is destroyed (they outlive servers).
    with ServerProcess(test_home / f"e2e-{unique}", template_home=TEMPLATE_HOME) as srv:
        yield srv


def test_sdk_against_a_real_server_and_a_sigkill_restart(server: ServerProcess) -> None:
    _session_survives_a_sigkill_restart(server)


def test_the_same_with_the_control_database_on_postgresql(postgres: Cluster, test_home: Path, unique: str) -> None:
    url = postgres.create_database(f"e2e_{unique.replace('-', '_')}")
    with ServerProcess(test_home / f"e2e-{unique}", template_home=TEMPLATE_HOME, args=["--db", url]) as server:
        _session_survives_a_sigkill_restart(server)
    assert not (test_home / f"e2e-{unique}" / "corral.db").exists()  # nothing went to SQLite


def test_a_full_machine_answers_503_and_the_sdk_raises_capacity_error(test_home: Path, unique: str) -> None:
    with ServerProcess(test_home / f"e2e-{unique}", template_home=TEMPLATE_HOME,
                       args=["--max-sandboxes", "1"]) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("acme")
            key = admin.keys.create("acme", "developer").key
        with Sandbox.create(template=TEMPLATE, api_key=key, base_url=server.url):
            with pytest.raises(CapacityError, match="at most 1 sandboxes") as info:
                Sandbox.create(template=TEMPLATE, api_key=key, base_url=server.url)
            assert int(info.value.details["retry_after"]) >= 1
        Sandbox.create(template=TEMPLATE, api_key=key, base_url=server.url).kill()  # room again


def _session_survives_a_sigkill_restart(server: ServerProcess) -> None:
    with Admin(api_key=server.admin_key, base_url=server.url) as admin:
        admin.tenants.create("acme")
        key = admin.keys.create("acme", "developer").key

    sb = Sandbox.create(template=TEMPLATE, timeout=300, api_key=key, base_url=server.url,
                        metadata={"purpose": "e2e"})
    chunks: list[bytes] = []
    r = sb.commands.run(r"printf 'a\x00b\xff'; echo; sleep 0.2; echo done", on_stdout=chunks.append)
    assert r.exit_code == 0 and r.stdout_bytes == b"a\x00b\xff\ndone\n" and b"".join(chunks) == r.stdout_bytes
    data = os.urandom(3 * 2**20) + b"\x00" * 10
    sb.files.write("/workspace/blob.bin", data)
    assert sb.files.read("/workspace/blob.bin") == data

    sb.close()  # the connection only; the sandbox keeps running
    server.kill()  # SIGKILL: no chance to clean up
    server.start()

    again = Sandbox.connect(sb.id, api_key=key, base_url=server.url)
    assert again.files.read("/workspace/blob.bin") == data
    assert again.commands.run("echo alive").stdout == "alive\n"
    assert [s.id for s in Sandbox.list(api_key=key, base_url=server.url)] == [sb.id]
    again.kill()
    assert Sandbox.list(api_key=key, base_url=server.url) == []
    with Admin(api_key=server.admin_key, base_url=server.url) as admin:
        verify = admin.audit.verify()
    assert verify.ok and verify.checked > 5
