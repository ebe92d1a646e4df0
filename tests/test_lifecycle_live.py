"""Snapshots, fork, pause to disk, auto-pause, through the SDK, a real server and real runc sandboxes
(docs/lifecycle.md). Each test proves bytes, owners, state and quotas on the machine, not in a fake."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import (
    AsyncSandbox,
    AsyncSnapshot,
    AsyncVolume,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    RuntimeUnavailableError,
    Sandbox,
    Snapshot,
)
from corral.control import Quotas
from corral.engine import Adoption
from corral.server import create_app

from .conftest import CGROUP_PARENT, TEMPLATE, leaks, make_engine
from .test_server_api import Api
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url  # the same app over a real loopback socket

pytestmark = [pytest.mark.anyio, pytest.mark.runc]


def _opts(api: Api, url: str, who: str = "a_dev") -> dict[str, Any]:
    return {"api_key": api.keys[who], "base_url": url}


def _memory_cgroup(sandbox_id: str) -> Path:
    return next(Path("/sys/fs/cgroup").glob("memory")) / CGROUP_PARENT / sandbox_id


async def test_snapshot_starts_sandboxes_with_the_same_files_and_owners(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    async with await AsyncSandbox.create(TEMPLATE, **opts) as sb:
        data = bytes(range(256)) * 4096 + b"\x00end"
        await sb.files.write("/workspace/data.bin", data)
        r = await sb.commands.run("mkdir -p ~/.local/bin && printf '#!/bin/sh\\necho tool-ok\\n' > ~/.local/bin/tool"
                                  " && chmod 755 ~/.local/bin/tool && mkdir /workspace/gone"
                                  " && echo x > /workspace/gone/f")
        assert r.exit_code == 0, r.stderr
        snap = await sb.snapshot(name="base-files")
        assert snap.id.startswith("snap-") and snap.name == "base-files" and snap.size > len(data)
        await sb.files.write("/workspace/after.txt", b"written after the snapshot")
    try:
        async with await AsyncSandbox.create(snap.id, **opts) as child:
            assert child.info.template == snap.id
            assert await child.files.read("/workspace/data.bin") == data
            assert not await child.files.exists("/workspace/after.txt")
            r = await child.commands.run("tool && stat -c '%U:%G %a' ~/.local/bin/tool /workspace/data.bin"
                                         " && echo more >> /workspace/data.bin && rm -r /workspace/gone && id -un")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split("\n")[:3] == ["tool-ok", "user:user 755", "user:user 644"], r.stdout
            # A snapshot of a sandbox from a snapshot: the deletion (a whiteout over the layer below) holds too.
            grand = await child.snapshot()
        try:
            async with await AsyncSandbox.create(grand.id, **opts) as gc:
                r = await gc.commands.run("ls /workspace; tail -c 5 /workspace/data.bin")
                assert r.stdout == "data.bin\nmore\n", r.stdout
        finally:
            await grand.delete()
    finally:
        await snap.delete()
    with pytest.raises(NotFoundError):
        await AsyncSnapshot.get(snap.id, **opts)


async def test_snapshot_tenancy_names_and_deletion_while_in_use(api: Api, live_url: str) -> None:
    def body() -> None:
        opts, other = _opts(api, live_url), _opts(api, live_url, "b_dev")
        with Sandbox.create(TEMPLATE, **opts) as sb:
            sb.files.write("/workspace/a.txt", b"a")
            snap = sb.snapshot(name="tenancy")
            with pytest.raises(ConflictError, match="tenancy"):
                sb.snapshot(name="tenancy")
            with pytest.raises(InvalidRequestError, match="not valid"):
                sb.snapshot(name="bad name!")
        try:
            assert [s.id for s in Snapshot.list(**opts)] == [snap.id]
            assert Snapshot.get("tenancy", **opts).id == snap.id
            assert Snapshot.list(**other) == []
            with pytest.raises(NotFoundError):
                Snapshot.get(snap.id, **other)
            with pytest.raises(InvalidRequestError, match=snap.id):
                Sandbox.create(snap.id, **other)
            with Sandbox.create(snap.id, **opts) as child:
                snap.delete()  # the child keeps what it stands on
                assert child.files.read("/workspace/a.txt") == b"a"
                child.files.write("/workspace/b.txt", b"b")
                assert child.commands.run("cat /workspace/a.txt /workspace/b.txt").stdout == "ab"
            with pytest.raises(NotFoundError):
                Snapshot.get(snap.id, **opts)
            assert not [x for x in leaks(api.engine.home) if "layer" in x]
        finally:
            for s in Snapshot.list(**opts):
                s.delete()

    await asyncio.to_thread(body)



async def test_snapshot_quota(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    await api.store.set_quotas(api.tenants["a"], Quotas(max_snapshots=1))
    async with await AsyncSandbox.create(TEMPLATE, **opts) as sb:
        first = await sb.snapshot()
        try:
            with pytest.raises(QuotaExceededError, match="max_snapshots"):
                await sb.snapshot()
        finally:
            await first.delete()
        await api.store.set_quotas(api.tenants["a"], Quotas(max_snapshot_bytes=1))
        await sb.files.write("/workspace/big.bin", b"x" * 100_000)
        with pytest.raises(QuotaExceededError, match="max_snapshot_bytes"):
            await sb.snapshot()
    assert await AsyncSnapshot.list(**opts) == []
    assert not [x for x in leaks(api.engine.home) if "layer" in x]


async def test_forks_are_independent_and_keep_the_spec(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    async with await AsyncSandbox.create(TEMPLATE, env={"SECRET_ENV": "kept"}, metadata={"k": "parent"},
                                         **opts) as parent:
        await parent.files.write("/workspace/state.txt", b"v1")
        forks = [await parent.fork(metadata={"k": f"child{i}"}) for i in range(3)]
        try:
            await parent.files.write("/workspace/state.txt", b"v2-parent")
            for i, child in enumerate(forks):
                assert child.id != parent.id and child.info.metadata == {"k": f"child{i}"}
                assert await child.files.read("/workspace/state.txt") == b"v1"
                assert (await child.commands.run("echo $SECRET_ENV")).stdout == "kept\n"
                await child.files.write("/workspace/state.txt", f"child{i}".encode())
            assert await parent.files.read("/workspace/state.txt") == b"v2-parent"
            assert [await c.files.read("/workspace/state.txt") for c in forks] == [b"child0", b"child1", b"child2"]
            ids = {s.id for s in await AsyncSandbox.list(**opts)}
            assert {parent.id, *(c.id for c in forks)} <= ids
            batch = await parent.fork(count=3, timeout=120)  # one instant, three children
            forks += batch
            assert len({c.id for c in batch}) == 3
            for child in batch:
                assert await child.files.read("/workspace/state.txt") == b"v2-parent"
        finally:
            for child in forks:
                await child.kill()
    assert not [x for x in leaks(api.engine.home) if "layer" in x]


async def test_pause_to_disk_releases_memory_and_keeps_files_policy_ttl_metadata(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    sb = await AsyncSandbox.create(TEMPLATE, timeout=600, metadata={"who": "me"}, network=["pypi.org"], **opts)
    try:
        await sb.files.write("/workspace/w.bin", b"\x00disk\xff")
        await sb.files.write("/tmp/t.txt", b"in tmpfs")
        await sb.commands.run("sleep 1000 &")
        await sb.set_timeout(300)
        cgroup = _memory_cgroup(sb.id)
        assert cgroup.is_dir()
        info = await sb.pause(memory=False)
        assert info.state == "paused" and info.paused_to_disk
        assert not cgroup.exists()  # memory, processes and cgroup released
        assert not [m for m in leaks(api.engine.home) if sb.id in m and m.startswith(("mount", "runc", "process"))]
        listed = {s.id: s for s in await AsyncSandbox.list(**opts)}
        assert listed[sb.id].state == "paused" and listed[sb.id].paused_to_disk
        assert listed[sb.id].ttl_left is not None and 290 < listed[sb.id].ttl_left <= 300
        with pytest.raises(ConflictError, match="paused to disk"):
            await sb.commands.run("true")
        await asyncio.sleep(2)  # the timeout's clock stands still while it sleeps
        await sb.set_timeout(320)  # while paused: 320 s from when it resumes
        resumed = await sb.resume()
        assert resumed.state == "running" and not resumed.paused_to_disk
        left = (datetime.fromisoformat(resumed.expires_at or "") - datetime.now(UTC)).total_seconds()
        assert 310 < left <= 320, left
        assert resumed.metadata == {"who": "me"} and resumed.network == ("pypi.org",)
        assert api.engine.spec(sb.id).network == ("pypi.org",)
        assert await sb.files.read("/workspace/w.bin") == b"\x00disk\xff"
        assert await sb.files.read("/tmp/t.txt") == b"in tmpfs"
        assert (await sb.commands.run("pgrep -x sleep || echo none")).stdout == "none\n"  # processes ended
        assert _memory_cgroup(sb.id).is_dir()
    finally:
        await sb.kill()


async def test_connect_resumes_and_checkpoint_pause_is_refused_with_the_reason(api: Api, live_url: str) -> None:
    def body() -> None:
        opts = _opts(api, live_url)
        with Sandbox.create(TEMPLATE, **opts) as sb:
            sb.files.write("/workspace/f", b"kept")
            with pytest.raises(RuntimeUnavailableError, match="CRIU"):
                sb._client.request("POST", f"/v1/sandboxes/{sb.id}/pause", json={"memory": True, "to_disk": True})
            sb.pause(memory=False)
            again = Sandbox.connect(sb.id, **opts)
            try:
                assert again.info.state == "running"
                assert again.files.read("/workspace/f") == b"kept"
            finally:
                again.close()
            sb.pause()  # frozen in memory, then to disk from there
            assert sb.pause(memory=False).paused_to_disk
            assert sb.resume().state == "running"
            assert sb.commands.run("cat /workspace/f").stdout == "kept"

    await asyncio.to_thread(body)



async def test_paused_quota_and_forgotten_paused_sandboxes(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    await api.store.set_quotas(api.tenants["a"], Quotas(max_paused=1, max_paused_seconds=3600))
    a = await AsyncSandbox.create(TEMPLATE, **opts)
    b = await AsyncSandbox.create(TEMPLATE, **opts)
    try:
        await a.pause(memory=False)
        with pytest.raises(QuotaExceededError, match="max_paused"):
            await b.pause(memory=False)
        assert (await b.get_info()).state == "running"  # refused: nothing changed
        svc = api.app.state.corral
        assert await svc.reconciler.remove_forgotten() == []
        await api.store.set_quotas(api.tenants["a"], Quotas(max_paused_seconds=0))
        assert await svc.reconciler.remove_forgotten() == [a.id]
        with pytest.raises(NotFoundError):
            await a.get_info()
        trail = await api.store.audit.query(action="sandbox.expire", sandbox=a.id)
        assert "max_paused_seconds" in trail[-1].outcome["reason"]
    finally:
        for sb in (a, b):
            with contextlib.suppress(NotFoundError):
                await sb.kill()


async def test_auto_pause_at_the_end_of_the_ttl(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    sb = await AsyncSandbox.create(TEMPLATE, timeout=1, on_timeout="pause", **opts)
    plain = await AsyncSandbox.create(TEMPLATE, timeout=1, **opts)
    try:
        await sb.files.write("/workspace/kept.txt", b"through the timeout")
        await asyncio.sleep(1.5)
        ended = await api.app.state.corral.reconciler.expire()
        assert set(ended) == {sb.id, plain.id}
        info = await sb.get_info()
        assert info.state == "paused" and info.paused_to_disk and info.on_timeout == "pause"
        with pytest.raises(NotFoundError):
            await plain.get_info()
        trail = await api.store.audit.query(action="sandbox.auto_pause", sandbox=sb.id)
        assert trail and trail[-1].outcome["status"] == "paused"
        await sb.resume()
        assert await sb.files.read("/workspace/kept.txt") == b"through the timeout"
    finally:
        for one in (sb, plain):
            with contextlib.suppress(NotFoundError):
                await one.kill()


async def test_paused_to_disk_survives_a_server_restart(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    sb = await AsyncSandbox.create(TEMPLATE, **opts)
    await sb.files.write("/workspace/r.txt", b"across restarts")
    await sb.pause(memory=False)
    await sb.close()
    # The server stops (its engine closes, destroying nothing); a new one starts on the same state and store.
    await api.engine.close()
    engine = make_engine(api.engine.home)
    record = await api.store.get_sandbox(sb.id)  # what a server's start passes its engine (Sandboxes.recoverable)
    await engine.start(adopt={sb.id: Adoption(spec=record.spec, state=record.state, paused_to_disk=True)})
    try:
        assert engine.info(sb.id).paused_to_disk
        app = create_app(engine, api.store)
        headers = {"Authorization": f"Bearer {api.keys['a_dev']}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://corral",
                                     headers=headers, timeout=60) as client:
            listed = (await client.get("/v1/sandboxes")).json()["sandboxes"]
            assert [(s["id"], s["state"], s["paused_to_disk"]) for s in listed] == [(sb.id, "paused", True)]
            r = await client.post(f"/v1/sandboxes/{sb.id}/resume")
            assert r.status_code == 200 and r.json()["state"] == "running", r.text
            r = await client.get(f"/v1/sandboxes/{sb.id}/files", params={"path": "/workspace/r.txt"})
            assert r.content == b"across restarts", r.text
            assert (await client.delete(f"/v1/sandboxes/{sb.id}")).status_code == 204
    finally:
        await engine.close(destroy_all=True)
        await api.engine.start()  # the fixture's, which it closes again


async def test_bad_lifecycle_input_changes_nothing(api: Api, live_url: str) -> None:
    def body() -> None:
        opts = _opts(api, live_url)
        with pytest.raises(InvalidRequestError, match="on_timeout"):
            Sandbox.create(TEMPLATE, on_timeout="sleep", **opts)
        with pytest.raises(InvalidRequestError, match="snap-0000000000000000"):
            Sandbox.create("snap-0000000000000000", **opts)
        with Sandbox.create(TEMPLATE, **opts) as sb:
            with pytest.raises(NotFoundError):
                sb._client.request("POST", "/v1/sandboxes/sb-0000000000000000/fork")
            with pytest.raises(InvalidRequestError):
                sb.fork(timeout=-1)
            start = time.monotonic()
            assert len(Sandbox.list(**opts)) == 1 and time.monotonic() - start < 30


    await asyncio.to_thread(body)


async def test_volumes_through_pause_to_disk_fork_and_snapshot(api: Api, live_url: str) -> None:
    opts = _opts(api, live_url)
    vol = await AsyncVolume.create("lifecycle-vol", size="64M", **opts)
    try:
        sb = await AsyncSandbox.create(TEMPLATE, volumes={"/mnt/data": "lifecycle-vol"}, **opts)
        try:
            await sb.files.write("/workspace/own.txt", b"disk")
            assert (await sb.commands.run("echo shared > /mnt/data/v.txt")).exit_code == 0
            await sb.pause(memory=False)
            with pytest.raises(ConflictError, match=sb.id):  # still mounted by the sandbox asleep on disk
                await vol.delete()
            await sb.resume()
            r = await sb.commands.run("cat /mnt/data/v.txt && stat -c %U /mnt/data/v.txt")
            assert r.stdout == "shared\nuser\n", r.stderr
            child = await sb.fork()  # the fork mounts the same volume: one storage, two sandboxes
            try:
                assert (await child.commands.run("echo from-fork >> /mnt/data/v.txt")).exit_code == 0
                assert await sb.files.read("/workspace/own.txt") == b"disk"
                assert (await sb.commands.run("cat /mnt/data/v.txt")).stdout == "shared\nfrom-fork\n"
            finally:
                await child.kill()
            snap = await sb.snapshot()
            try:  # a snapshot keeps the sandbox's disk, not its volumes: a child without one sees none
                async with await AsyncSandbox.create(snap.id, **opts) as plain:
                    assert await plain.files.read("/workspace/own.txt") == b"disk"
                    assert (await plain.commands.run("ls /mnt/data 2>/dev/null | wc -l")).stdout == "0\n"
            finally:
                await snap.delete()
        finally:
            await sb.kill()
    finally:
        await vol.delete()
