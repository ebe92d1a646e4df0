"""What `corral.service.ControlPlane` counts as the deployment's own (never grantable as a private destination):
its listeners, on their address or on every address of a wildcard, its replicas, its database."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.control import ControlStore
from corral.egress._addresses import host_addresses
from corral.service import ControlPlane

pytestmark = pytest.mark.anyio


async def test_listeners_replicas_and_the_database_are_the_control_planes(tmp_path: Path) -> None:
    async with ControlStore(home=tmp_path) as store:
        plane = ControlPlane(store, "http://127.0.0.1:7770")
        assert "API" in (await plane.owner("127.0.0.1:7770") or "")
        assert await plane.owner("127.0.0.9:7770") is not None  # any loopback address reaches a loopback listener
        assert await plane.owner("127.0.0.1:7771") is None
        assert await plane.owner("10.0.0.5:7770") is None  # another machine's port 7770 is not ours
        plane.add_listener("0.0.0.0", 9100, "the control plane's metrics port")
        own = sorted(str(ip) for ip in host_addresses() if not ip.is_loopback and ip.version == 4)
        for ip in [*own[:1], "127.0.0.1", "0.0.0.0"]:
            assert await plane.owner(f"{ip}:9100") == "the control plane's metrics port", ip
        await store.replicas.heartbeat("r-b", "http://10.9.9.9:7771")
        assert "replica 'r-b'" in (await plane.owner("10.9.9.9:7771") or "")
        assert await plane.owner("[::ffff:10.9.9.9]:7771") is not None  # the mapped form is the same address
        store.url = "postgresql+asyncpg://corral@10.1.2.3:6543/corral"  # as if the database were there
        assert await plane.owner("10.1.2.3:6543") == "the control plane's database"
        store.url = "postgresql+asyncpg://corral@10.1.2.4/corral"
        assert await plane.owner("10.1.2.4:5432") == "the control plane's database"  # PostgreSQL's default port
