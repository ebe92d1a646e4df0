"""Bounds on what a request may carry (issue 29 items 5 and 6, docs/api.md "Sizes and ranges"): bodies parsed
whole have a limit answered with 413 before they are buffered, metadata and env have sizes, numbers have ranges
(a 400 naming the field, never a 500 from SQLite or asyncio), and audit records keep sizes and digests.

Over a temp ControlStore and tests/test_server_api.py's `api` fixture (the fake engine, or a real runc sandbox for
the tests marked `runc`: uploads and removals), in-process; the chunked body over a real loopback socket.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from corral.server._body_limit import JSON_BODY_LIMIT

from .conftest import TEMPLATE
from .test_server_api import Api, create, error_code
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b
from .test_server_api import live_url as live_url

pytestmark = [pytest.mark.anyio]

MIB = 2**20


def _problem_text(r: httpx.Response) -> str:
    return json.dumps(r.json())


async def test_a_body_over_the_limit_is_a_413_naming_it_and_changes_nothing(api: Api) -> None:
    metadata = {f"k{i}": "x" * MIB for i in range(60)}  # the 60 MiB of metadata
    async with api.client("a_dev") as c:
        r = await c.post("/v1/sandboxes", json={"template": TEMPLATE, "metadata": metadata})
        listed = (await c.get("/v1/sandboxes")).json()
    assert r.status_code == 413 and error_code(r) == "invalid_request"
    assert r.json()["error"]["details"]["limit"] == JSON_BODY_LIMIT and str(JSON_BODY_LIMIT) in r.text
    assert listed["sandboxes"] == []
    assert await api.store.audit.query(action="sandbox.create") == []


async def test_a_declared_length_over_the_limit_is_refused_before_a_byte_is_read(api: Api) -> None:
    read: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        read.append(1)
        yield b"{}"

    async with api.client("a_dev", **{"Content-Length": str(JSON_BODY_LIMIT + 1),
                                      "Content-Type": "application/json"}) as c:
        r = await c.post("/v1/sandboxes", content=body())
    assert r.status_code == 413 and r.json()["error"]["details"]["limit"] == JSON_BODY_LIMIT


async def test_a_chunked_body_over_the_limit_is_a_413_over_a_real_socket(api: Api, live_url: str) -> None:
    async def pieces() -> AsyncIterator[bytes]:  # no length: the request goes chunked
        yield b'{"template": "default", "metadata": {"a": "'
        for _ in range(JSON_BODY_LIMIT // MIB + 1):
            yield b"x" * MIB

    headers = {"Authorization": f"Bearer {api.keys['a_dev']}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=live_url, headers=headers, timeout=60, trust_env=False) as c:
        try:
            r = await c.post("/v1/sandboxes", content=pieces())
        except httpx.WriteError:  # the server answered and closed while the client still sent
            r = None
        listed = (await c.get("/v1/sandboxes")).json()
    assert r is None or (r.status_code == 413 and r.json()["error"]["details"]["limit"] == JSON_BODY_LIMIT)
    assert listed["sandboxes"] == []


@pytest.mark.runc
async def test_file_uploads_are_not_limited(api: Api) -> None:
    data = b"y" * (JSON_BODY_LIMIT + 3 * MIB)
    async with api.client("a_dev") as c:
        sandbox = await create(c)
        r = await c.put(f"/v1/sandboxes/{sandbox['id']}/files", params={"path": "/workspace/big"}, content=data)
        assert r.status_code == 200, r.text
        got = await c.get(f"/v1/sandboxes/{sandbox['id']}/files", params={"path": "/workspace/big"})
        await c.delete(f"/v1/sandboxes/{sandbox['id']}")
    assert hashlib.sha256(got.content).digest() == hashlib.sha256(data).digest()


@pytest.mark.parametrize(("body", "field", "bound"), [
    ({"limits": {"disk": 1e20}}, "disk", "at most"),
    ({"limits": {"memory": 1e20}}, "memory", "at most"),
    ({"limits": {"disk": 2**70}}, "disk", "at most"),
    ({"limits": {"memory": "99999999999T"}}, "memory", "at most"),
    ({"timeout": 1e300}, "timeout", "604800"),
    ({"metadata": {f"k{i}": "v" for i in range(65)}}, "metadata", "64"),
    ({"metadata": {"k": "v" * 4097}}, "metadata", "4096"),
    ({"env": {"BIG": "x" * 200_000}}, "env", "130816"),
])
async def test_create_out_of_range_is_a_400_naming_the_field(api: Api, body: dict[str, Any], field: str,
                                                             bound: str) -> None:
    async with api.client("a_dev") as c:
        r = await c.post("/v1/sandboxes", json={"template": TEMPLATE, **body})
        listed = (await c.get("/v1/sandboxes")).json()
    assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
    assert field in _problem_text(r) and bound in _problem_text(r)
    assert listed["sandboxes"] == []


@pytest.mark.parametrize(("body", "field", "bound"), [
    ({"timeout": 1e300}, "timeout", "604800"),
    ({"max_output": 2**70}, "max_output", str(2**40)),
    ({"env": {"BIG": "x" * (10 * MIB)}}, "env", "130816"),
    ({"env": {f"V{i}": "x" * 100_000 for i in range(12)}}, "env", str(MIB)),
])
async def test_exec_out_of_range_is_a_400_naming_the_field(api: Api, body: dict[str, Any], field: str,
                                                           bound: str) -> None:
    async with api.client("a_dev") as c:
        sandbox = await create(c)
        try:
            r = await c.post(f"/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "true", **body})
            started = await c.post(f"/v1/sandboxes/{sandbox['id']}/processes", json={"cmd": "true", **body})
        finally:
            await c.delete(f"/v1/sandboxes/{sandbox['id']}")
    for answer in (r, started):
        assert answer.status_code == 400, answer.text
        assert field in _problem_text(answer) and bound in _problem_text(answer)


@pytest.mark.parametrize("value", [2**70, 2**63, 1e300])
async def test_a_quota_out_of_range_is_a_400_naming_it(api: Api, value: float) -> None:
    async with api.client("admin") as c:
        r = await c.patch("/v1/tenants/a", json={"quotas": {"max_memory_bytes": value, "max_cpus": 1e300}})
        tenants = (await c.get("/v1/tenants")).json()["tenants"]
    assert r.status_code == 400, r.text
    assert "max_memory_bytes" in _problem_text(r) and "max_cpus" in _problem_text(r)
    assert isinstance(value, float) or str(2**63 - 1) in _problem_text(r)  # 1e300 is no integer at all
    assert [t["quotas"]["max_memory_bytes"] for t in tenants if t["name"] == "a"] != [value]


async def test_audit_records_keep_sizes_and_digests_not_megabytes(api: Api) -> None:
    metadata = {f"k{i}": chr(97 + i % 26) * 4096 for i in range(64)}  # the most metadata a sandbox may have
    async with api.client("a_dev") as c:
        sandbox = await create(c, metadata=metadata)
        await c.delete(f"/v1/sandboxes/{sandbox['id']}")
    [record] = await api.store.audit.query(action="sandbox.create")
    kept = record.params["metadata"]
    raw = json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert kept["entries"] == 64 and kept["bytes"] == len(raw) and kept["sha256"] == hashlib.sha256(raw).hexdigest()
    assert len(json.dumps(record.params)) < 8192


@pytest.mark.runc
async def test_a_recursive_delete_of_what_cannot_go_removes_nothing(api: Api) -> None:
    """DELETE /workspace (a mount point, in a root-owned /) is refused before anything inside it is removed;
    what is inside goes when it is named (issue 29 item 7)."""
    async with api.client("a_dev") as c:
        sandbox = await create(c)
        files = f"/v1/sandboxes/{sandbox['id']}/files"
        try:
            for path in ("/workspace/keep/a.txt", "/tmp/other/b.txt"):
                assert (await c.put(files, params={"path": path}, content=b"x")).status_code == 200
            r = await c.delete(files, params={"path": "/workspace", "recursive": "true"})
            kept = await c.get(files, params={"path": "/workspace/keep/a.txt"})
            emptied = await c.delete(files, params={"path": "/workspace/keep"})
            gone = await c.get(files, params={"path": "/workspace/keep/a.txt"})
            in_tmp = await c.delete(files, params={"path": "/tmp/other"})  # the user's own, in sticky /tmp
        finally:
            await c.delete(f"/v1/sandboxes/{sandbox['id']}")
    assert r.status_code == 403 and "nothing was removed" in r.text, r.text
    assert kept.status_code == 200 and kept.content == b"x"
    assert emptied.status_code == 204 and gone.status_code == 404 and in_tmp.status_code == 204


@pytest.mark.runc
@pytest.mark.parametrize("path", ["/dev/stdout", "/dev/stderr", "/dev/fd/1", "/home/user/log"])
async def test_the_agents_own_output_is_never_read_through_the_file_api(api: Api, path: str) -> None:
    """`/dev/stdout` is `/proc/self/fd/1`: through the agent it would be the agent's log on the host (issue 29
    item 7). With `file_roots: ["/"]` (E2B's envd too) every such path is refused, a link to one too."""
    async with api.client("a_dev") as c:
        sandbox = await create(c, file_roots=["/"])
        files = f"/v1/sandboxes/{sandbox['id']}/files"
        try:
            linked = await c.post(f"/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": "ln -s /dev/stdout ~/log"})
            assert linked.status_code == 200 and linked.json()["exit_code"] == 0, linked.text
            r = await c.get(files, params={"path": path})
            hostname = await c.get(files, params={"path": "/proc/sys/kernel/hostname"})
        finally:
            await c.delete(f"/v1/sandboxes/{sandbox['id']}")
    assert r.status_code == 403 and "leads through /proc/self" in r.text, (r.status_code, r.text[:300])
    assert hostname.status_code == 200  # /proc/sys stays readable
