"""The sandbox checklist (CHECKLIST.md) items the API answers for: 16 and 32-35, against real runc sandboxes.

Items 17-20 (NUL bytes, symlinks, swap races, archives) are proved at the agent in tests/test_checklist.py and
through the API in tests/test_server_api.py; these tests add what only the control plane can get wrong.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest

from corral.check._tenancy import plausible_request

from .conftest import TEMPLATE
from .test_server_api import Api, create, error_code, run, unb64
from .test_server_api import api as api  # the fixture: real engine, temp ControlStore, tenants a and b

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

# -- 16: traversal rejected by the file API ------------------------------------------------------------------------

TRAVERSALS = ["../../etc/passwd", "/workspace/../../etc/passwd", "%2e%2e/%2e%2e/etc/passwd",
              "..%2f..%2fetc%2fpasswd", "/workspace/%2e%2e/etc/passwd", "/etc/passwd", "/root/.bashrc",
              "/workspace/./../etc/passwd", "....//....//etc/passwd", "/home/user/../../etc/shadow"]


async def _path_calls(c: httpx.AsyncClient, sid: str, path: str) -> dict[str, httpx.Response]:
    base = f"/v1/sandboxes/{sid}"
    return {
        "read": await c.get(f"{base}/files", params={"path": path}),
        "write": await c.put(f"{base}/files", params={"path": path}, content=b"pwned"),
        "list": await c.get(f"{base}/files/list", params={"path": path}),
        "stat": await c.get(f"{base}/files/stat", params={"path": path}),
        "remove": await c.delete(f"{base}/files", params={"path": path}),
        "mkdir": await c.post(f"{base}/files/mkdir", json={"path": path}),
        "rename": await c.post(f"{base}/files/rename", json={"src": "/workspace/keep", "dst": path}),
        "archive": await c.get(f"{base}/archive", params={"path": path}),
    }


@pytest.mark.parametrize("path", TRAVERSALS)
async def test_16_traversal_rejected_by_every_file_route(api: Api, path: str) -> None:
    async with api.client("a_dev") as c:
        sid = (await create(c))["id"]
        await run(c, sid, "echo keep > /workspace/keep")
        before = unb64((await run(c, sid, "sha256sum /etc/passwd /etc/shadow 2>&1; ls -A /"))["stdout_b64"])
        for what, r in (await _path_calls(c, sid, path)).items():
            if "%2" in path or path.startswith("...."):
                # Percent signs and dots are legal name characters: such a path is a harmless name inside the
                # roots (a 404 or a write there), never a way out. What matters is what happened below.
                assert r.status_code < 500, (what, r.text)
                continue
            assert 400 <= r.status_code < 500 and r.status_code != 404, (what, path, r.text)
            message = r.json()["error"]["message"]
            assert "outside" in message or ".." in message, (what, message)
        after = unb64((await run(c, sid, "sha256sum /etc/passwd /etc/shadow 2>&1; ls -A /"))["stdout_b64"])
        assert after == before
        assert unb64((await run(c, sid, "cat /workspace/keep"))["stdout_b64"]) == b"keep\n"


# -- 32: tenants are isolated, on every endpoint the API publishes -------------------------------------------------


_probe = plausible_request  # the same requests `corral check` sends (corral/check/_tenancy.py)


async def test_32_other_tenants_sandbox_is_404_on_every_published_route(api: Api) -> None:
    async with api.client("b_dev") as b, api.client("a_op") as a:
        paths = (await a.get("/openapi.json")).json()["paths"]
        sid = (await create(b))["id"]
        await run(b, sid, "echo s > /workspace/secret")
        probed = 0
        for template, methods in paths.items():
            if "{sandbox_id}" not in template:
                continue
            for method in methods:
                url = template.replace("{sandbox_id}", sid)
                url = url.replace("{process_id}", "p-1").replace("{pid}", "1").replace("{name}", "default")
                r = await a.request(method.upper(), url, **_probe(method.upper(), template))
                assert r.status_code == 404 and error_code(r) == "not_found", (method, template, r.text)
                probed += 1
        assert probed >= 16  # every sandbox route of the first slice, and whatever was added since
        out = await run(b, sid, "ls /workspace")
        assert unb64(out["stdout_b64"]) == b"secret\n"  # and nothing happened to it
        assert (await b.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


# -- 33: roles hold ----------------------------------------------------------------------------------------------


async def test_33_roles_hold(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("a_aud") as aud, api.client("b_dev") as other, \
            api.client("a_op") as op:
        sid = (await create(dev))["id"]
        theirs = (await create(other))["id"]
        forbidden = {
            "auditor exec": await aud.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "id"}),
            "auditor create": await aud.post("/v1/sandboxes", json={"template": TEMPLATE}),
            "auditor write": await aud.put(f"/v1/sandboxes/{sid}/files", params={"path": "x"}, content=b"x"),
            "auditor kill": await aud.delete(f"/v1/sandboxes/{sid}"),
            "developer audit": await dev.get("/v1/audit"),
            "developer audit export": await dev.get("/v1/audit/verify"),
            "developer kill switch": await dev.post("/v1/kill", json={"tenant": "a"}),
            "developer keys": await dev.post("/v1/keys", json={"tenant": "a", "role": "admin"}),
            "operator keys": await op.post("/v1/keys", json={"tenant": "a", "role": "admin"}),
            "operator other audit": await op.get("/v1/audit", params={"tenant": "b"}),
        }
        for what, r in forbidden.items():
            assert r.status_code == 403 and error_code(r) == "permission_denied", (what, r.text)
        for r in (await dev.delete(f"/v1/sandboxes/{theirs}"), await op.delete(f"/v1/sandboxes/{theirs}")):
            assert r.status_code == 404  # others' sandboxes: not even there to be refused
        assert (await other.get(f"/v1/sandboxes/{theirs}")).json()["state"] == "running"
        assert (await dev.get(f"/v1/sandboxes/{sid}")).json()["state"] == "running"


# -- 34: the audit log is tamper-evident and out of reach ----------------------------------------------------------


async def _session(c: httpx.AsyncClient) -> str:
    sid = (await create(c))["id"]
    for i in range(4):
        await run(c, sid, f"echo {i}")
    return sid


async def test_34_deleting_a_middle_record_is_detected_and_named(api: Api, tmp_path: Path) -> None:
    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        await _session(dev)
        db = sqlite3.connect(tmp_path / "corral.db")
        seqs = [row[0] for row in db.execute("SELECT seq FROM audit ORDER BY seq")]
        victim = seqs[len(seqs) // 2]
        db.execute("DELETE FROM audit WHERE seq = ?", (victim,))
        db.commit()
        db.close()
        verify = (await aud.get("/v1/audit/verify")).json()
    assert verify["ok"] is False
    assert verify["problem"]["seq"] in (victim, victim + 1), verify  # the gap is named where it is


async def test_34_deleting_the_newest_records_is_caught_by_an_exported_head(api: Api, tmp_path: Path) -> None:
    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        await _session(dev)
        head = (await aud.get("/v1/audit/head")).json()
        db = sqlite3.connect(tmp_path / "corral.db")
        db.execute("DELETE FROM audit WHERE seq >= ?", (head["seq"] - 1,))
        db.commit()
        db.close()
        alone = (await aud.get("/v1/audit/verify")).json()
        against = (await aud.get("/v1/audit/verify", params={"head": f"{head['seq']}:{head['hash']}"})).json()
    assert alone["ok"] is True  # a truncated chain is still a valid chain ...
    assert against["ok"] is False and against["problem"] is not None  # ... which the exported head exposes


async def test_34_no_sandbox_can_reach_the_log(api: Api, tmp_path: Path) -> None:
    db = tmp_path / "corral.db"
    assert db.exists()
    async with api.client("a_dev") as dev:
        sid = (await create(dev))["id"]
        probe = (f"ls -la {db} {tmp_path} 2>&1; find / -xdev -name 'corral.db*' 2>/dev/null; "
                 "python3 -c 'import socket; s=socket.socket(); s.settimeout(1); s.connect((\"127.0.0.1\", 7770))'")
        out = await run(dev, sid, probe)
    text = unb64(out["stdout_b64"]) + unb64(out["stderr_b64"])
    assert b"No such file or directory" in text and b"corral.db\n" not in text.replace(b"'corral.db*'", b"")
    assert b"ConnectionRefusedError" in text or b"OSError" in text  # the API is not reachable from inside
    assert out["exit_code"] != 0


# -- 35: the audit is complete -------------------------------------------------------------------------------------


async def test_35_a_scripted_session_leaves_every_record_with_its_actor(api: Api) -> None:
    async with api.client("a_dev") as dev, api.client("a_aud") as aud:
        sid = (await create(dev, limits={"memory": "64M"}))["id"]
        timed = await run(dev, sid, "sleep 30", timeout=0.5)
        assert timed["timed_out"] is True
        oom = await run(dev, sid, ["python3", "-c", "b = bytearray(256 * 2**20); print(len(b))"])
        assert oom["oom_killed"] is True
        assert (await dev.put(f"/v1/sandboxes/{sid}/files", params={"path": "r.txt"}, content=b"data")).is_success
        assert (await dev.delete(f"/v1/sandboxes/{sid}")).status_code == 204
        records = (await aud.get("/v1/audit", params={"sandbox": sid})).json()["records"]
    actions = [r["action"] for r in records]
    assert actions == ["sandbox.create", "sandbox.exec", "sandbox.exec", "files.write", "sandbox.kill"], actions
    assert all(r["key_id"] == api.key_ids["a_dev"] and r["role"] == "developer" for r in records)
    assert records[1]["params"]["cmd"] == "sleep 30" and records[1]["outcome"]["timed_out"] is True
    assert records[2]["outcome"]["oom_killed"] is True  # the limit hit is on record
    assert records[3]["params"]["path"] == "/workspace/r.txt" and records[3]["params"]["size"] == 4
    # Egress decisions join this session once egress control lands (issue 4).
