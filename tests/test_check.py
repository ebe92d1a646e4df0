"""`corral check`: the checklist against a real deployment (runc), and proof that its items really fail when the
property is broken: a fake deployment (httpx MockTransport) that answers 200 where 404 or 403 is due, a tampered
audit export, and the aggregation of task results into items."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from corral import Admin
from corral.check import (
    ITEMS,
    CheckContext,
    CheckReport,
    Deployment,
    ItemResult,
    Target,
    Verdict,
    checklist_tasks,
    combine,
    provision,
    report_json,
    run_check,
    task_verdicts,
)
from corral.check._audit import item_34_audit_tamper_evident, item_35_audit_complete, item_39_audit_keyed
from corral.check._model import Status
from corral.check._probes import PROBES, Probe, run_probe
from corral.check._tenancy import item_32_tenants_isolated, item_33_roles_hold
from corral.cli import _check
from corral.control import AuditEntry, AuditKeyring
from corral.eval import TaskFailure, TaskResult
from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, TEMPLATE_HOME

URL = "http://corral.test"
ADMIN = "admin-secret"

# -- a fake deployment --------------------------------------------------------------------------------------------

SANDBOX_ROUTES = [
    ("get", ""), ("delete", ""), ("post", "/exec"), ("post", "/processes"), ("get", "/processes"),
    ("get", "/processes/{process_id}"), ("post", "/processes/{process_id}/kill"), ("post", "/code"),
    ("post", "/timeout"), ("put", "/network"), ("post", "/pause"), ("post", "/resume"), ("get", "/files"),
    ("put", "/files"), ("delete", "/files"), ("get", "/files/list"), ("get", "/files/stat"),
    ("post", "/files/mkdir"), ("post", "/files/rename"), ("get", "/archive"), ("put", "/archive"),
]


def _error(status: int, code: str, message: str = "") -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message or code, "details": {}}})


def _chain(n: int, keys: AuditKeyring | None = None) -> list[str]:
    """`n` audit records, correctly hash-chained, as an export's lines: signed with the first of `keys`, else
    unkeyed (as before audit keys)."""
    lines, prev = [], "0" * 64
    for seq in range(1, n + 1):
        entry = AuditEntry(seq=seq, time=datetime(2030, 1, 1, tzinfo=UTC), tenant_id="t", key_id="k",
                           role="admin", action="tenant.create", target=None, params={"n": seq}, outcome={},
                           prev_hash=prev, hash="", hmac_key_id=keys.signing_id if keys else None)
        entry = dataclasses.replace(entry, hash=entry.keyed_hash(keys or AuditKeyring()) or "")
        lines.append(entry.to_json())
        prev = entry.hash
    return lines


@dataclass
class FakeCorral:
    """Just enough of Corral's API for the item functions and the setup/teardown, with holes to order:
    `leaky_route` ignores the tenant on one route, `auditor_may_exec` lets auditors run commands, `audit_lines`
    is what an export returns."""

    leaky_route: str | None = None
    auditor_may_exec: bool = False
    info: dict[str, Any] | None = None  # GET /v1/info; None: a server from before that route (404)
    audits_egress: bool = True
    audit_lines: list[str] = field(default_factory=lambda: _chain(12))
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    keys: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        ADMIN: {"id": "k0", "tenant": "admin", "role": "admin", "revoked_at": None}})
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)

    def record(self, key: dict[str, Any], action: str, sid: str, params: dict[str, Any] | None = None,
               outcome: dict[str, Any] | None = None, role: str | None = "") -> None:
        self.records.append({"seq": len(self.records) + 1, "time": "2030-01-01T00:00:00+00:00", "action": action,
                             "tenant_id": key["tenant"], "key_id": key["id"],
                             "role": key["role"] if role == "" else role, "target": sid,
                             "params": params or {}, "outcome": outcome or {}})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        self.calls.append(f"{method} {path}")
        if path == "/openapi.json":
            return httpx.Response(200, json={"paths": self._openapi()})
        key = self.keys.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if key is None or key["revoked_at"] or self.tenants.get(key["tenant"], {}).get("disabled"):
            return _error(401, "unauthenticated")
        body = json.loads(request.content) if request.content and "json" in request.headers.get(
            "content-type", "") else {}
        if path.startswith("/v1/sandboxes"):
            return self._sandboxes(key, method, path, body, request.url.params)
        if path.startswith("/v1/audit"):
            return self._audit(key, path, request.url.params)
        if path == "/v1/info" and self.info is not None:
            return httpx.Response(200, json=self.info)
        return self._admin(key, method, path, body, request.url.params)

    def _openapi(self) -> dict[str, Any]:
        paths: dict[str, Any] = {"/v1/sandboxes": {"get": {}, "post": {}}}
        for method, suffix in SANDBOX_ROUTES:
            paths.setdefault(f"/v1/sandboxes/{{sandbox_id}}{suffix}", {})[method] = {}
        return paths

    def _admin(self, key: dict[str, Any], method: str, path: str, body: dict[str, Any],
               params: httpx.QueryParams) -> httpx.Response:
        if path == "/v1/kill":
            if key["role"] not in ("admin", "operator"):
                return _error(403, "permission_denied")
            killed = [sid for sid, sb in self.sandboxes.items() if sb["tenant"] == body["tenant"]
                      and sb["state"] == "running"]
            for sid in killed:
                self.sandboxes[sid]["state"] = "killed"
            return httpx.Response(200, json={"killed": killed, "failed": {}, "revoked": False})
        if key["role"] != "admin":
            return _error(403, "permission_denied")
        if method == "POST" and path == "/v1/tenants":
            self.tenants[body["name"]] = {"id": body["name"], "name": body["name"], "disabled": False}
            return httpx.Response(201, json=self.tenants[body["name"]])
        if method == "PATCH" and path.startswith("/v1/tenants/"):
            tenant = self.tenants[path.rsplit("/", 1)[1]]
            tenant["disabled"] = bool(body.get("disabled", tenant["disabled"]))
            return httpx.Response(200, json=tenant)
        if method == "PUT" and path.endswith("/egress"):
            return httpx.Response(200, json={})
        if method == "POST" and path == "/v1/keys":
            secret = f"key-{len(self.keys)}"
            self.keys[secret] = {"id": f"k{len(self.keys)}", "tenant": body["tenant"], "role": body["role"],
                                 "revoked_at": None}
            return httpx.Response(201, json={"id": self.keys[secret]["id"], "key": secret, **body})
        if method == "GET" and path == "/v1/keys":
            tenant = params.get("tenant")
            return httpx.Response(200, json={"keys": [
                {"id": k["id"], "tenant_id": k["tenant"], "role": k["role"], "revoked_at": k["revoked_at"]}
                for k in self.keys.values() if tenant in (None, k["tenant"])]})
        if method == "DELETE" and path.startswith("/v1/keys/"):
            for k in self.keys.values():
                if k["id"] == path.rsplit("/", 1)[1]:
                    k["revoked_at"] = "now"
            return httpx.Response(204)
        return _error(404, "not_found")

    def _audit(self, key: dict[str, Any], path: str, params: httpx.QueryParams) -> httpx.Response:
        if key["role"] == "developer":
            return _error(403, "permission_denied")
        if key["role"] != "admin" and params.get("tenant") not in (None, key["tenant"]):
            return _error(403, "permission_denied")
        last = json.loads(self.audit_lines[-1])
        if path == "/v1/audit/export":
            return httpx.Response(200, text="".join(line + "\n" for line in self.audit_lines))
        if path == "/v1/audit/head":
            return httpx.Response(200, json={"seq": last["seq"], "hash": last["hash"]})
        if path == "/v1/audit/verify":
            return httpx.Response(200, json={"ok": True, "checked": len(self.audit_lines),
                                             "head": f"{last['seq']}:{last['hash']}", "problem": None})
        sandbox = params.get("sandbox")
        return httpx.Response(200, json={"records": [r for r in self.records if sandbox in (None, r["target"])]})

    def _exec(self, key: dict[str, Any], sid: str, cmd: Any) -> httpx.Response:
        """Commands as the item functions send them: what they print, and how they end (timeout, OOM)."""
        files = self.sandboxes[sid]["files"]
        if isinstance(cmd, str) and cmd.startswith("echo s >"):
            files["secret"] = b"s\n"
        out = "".join(f"{name}\n" for name in sorted(files)).encode() if cmd == "ls /workspace" else b""
        result: dict[str, Any] = {"exit_code": 0, "stdout_b64": base64.b64encode(out).decode(), "stderr_b64": ""}
        if cmd == "sleep 30":
            result.update(exit_code=None, signal=9, timed_out=True)
        if isinstance(cmd, list) and "256 << 20" in cmd[-1]:
            result.update(exit_code=None, signal=9, oom_killed=True)
        outcome = {k: result[k] for k in ("timed_out", "oom_killed") if k in result}
        self.record(key, "sandbox.exec", sid, {"cmd": cmd}, outcome)
        if isinstance(cmd, str) and "127.0.0.1:3128" in cmd and self.audits_egress:
            self.record(key, "egress.http", sid, {"host": "example.com"}, {"allowed": False}, role=None)
        return httpx.Response(200, json=result)

    def _sandboxes(self, key: dict[str, Any], method: str, path: str, body: dict[str, Any],
                   params: httpx.QueryParams) -> httpx.Response:
        parts = path.split("/")  # '', 'v1', 'sandboxes', id, rest...
        if key["role"] == "auditor" and not (self.auditor_may_exec and path.endswith("/exec")):
            return _error(403, "permission_denied")
        if len(parts) == 3:
            if method == "POST":
                sid = f"sb-{len(self.sandboxes) + 1}"
                self.sandboxes[sid] = {"tenant": key["tenant"], "state": "running", "files": {}}
                self.record(key, "sandbox.create", sid)
                return httpx.Response(201, json={"id": sid, "state": "running", "template": "default"})
            return httpx.Response(200, json={"sandboxes": [
                {"id": s, "state": sb["state"]} for s, sb in self.sandboxes.items() if sb["tenant"] == key["tenant"]]})
        sid, rest = parts[3], "/" + "/".join(parts[4:]) if len(parts) > 4 else ""
        sb = self.sandboxes.get(sid)
        if sb is None or sb["state"] != "running":
            return _error(404, "not_found")
        if sb["tenant"] != key["tenant"] and key["role"] != "admin" and rest != self.leaky_route:
            return _error(404, "not_found")
        if rest == "/exec":
            return self._exec(key, sid, body.get("cmd"))
        if rest == "/files" and method == "PUT":
            self.record(key, "files.write", sid, {"path": params.get("path"), "size": 4})
            return httpx.Response(200, json={"path": params.get("path"), "size": 4})
        if method == "DELETE" and rest == "":
            sb["state"] = "killed"
            self.record(key, "sandbox.kill", sid)
            return httpx.Response(204)
        if rest == "":
            return httpx.Response(200, json={"id": sid, "state": sb["state"]})
        return httpx.Response(200, json={})


def _context(fake: FakeCorral, deployment: Deployment | None = None, **target: Any) -> CheckContext:
    """The check's tenants and keys on the fake, as `provision` would make them."""
    fake.tenants.update({t: {"id": t, "name": t, "disabled": False} for t in ("ours", "theirs")})
    keys = {"admin": ADMIN}
    for who, tenant, role in (("developer", "ours", "developer"), ("auditor", "ours", "auditor"),
                              ("operator", "ours", "operator"), ("other", "theirs", "developer")):
        keys[who] = f"key-{who}"
        fake.keys[keys[who]] = {"id": f"id-{who}", "tenant": tenant, "role": role, "revoked_at": None}
    deployment = deployment or Deployment()
    return CheckContext(Target(URL, ADMIN, transport=fake.transport(), **target), "ours", "theirs", keys,
                        {w: f"id-{w}" for w in keys}, deployment=deployment)


async def _verdict(fn: Any, ctx: CheckContext) -> Verdict:
    return await run_probe(Probe(0, fn), ctx)


# -- 32 and 33 really fail -----------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_32_passes_on_a_deployment_that_isolates_tenants() -> None:
    verdict = await _verdict(item_32_tenants_isolated, _context(FakeCorral()))
    assert verdict.status == "PASS", verdict.detail
    assert f"all {len(SANDBOX_ROUTES)} sandbox routes" in verdict.detail


@pytest.mark.anyio
@pytest.mark.parametrize("route", ["/files", "/exec", ""])
async def test_32_fails_when_one_route_answers_another_tenant(route: str) -> None:
    verdict = await _verdict(item_32_tenants_isolated, _context(FakeCorral(leaky_route=route)))
    assert verdict.status == "FAIL"
    assert f"/v1/sandboxes/{{sandbox_id}}{route} -> " in verdict.detail, verdict.detail
    assert "another tenant's sandbox was reachable" in verdict.detail


@pytest.mark.anyio
async def test_33_passes_when_roles_hold() -> None:
    verdict = await _verdict(item_33_roles_hold, _context(FakeCorral()))
    assert verdict.status == "PASS", verdict.detail


@pytest.mark.anyio
async def test_33_fails_when_an_auditor_can_exec() -> None:
    verdict = await _verdict(item_33_roles_hold, _context(FakeCorral(auditor_may_exec=True)))
    assert verdict.status == "FAIL"
    assert "auditor exec -> 200" in verdict.detail and "developer" not in verdict.detail, verdict.detail


@pytest.mark.anyio
async def test_33_fails_when_a_developer_reads_the_audit_trail() -> None:
    fake = FakeCorral()
    original = fake._audit

    def lenient(key: dict[str, Any], path: str, params: httpx.QueryParams) -> httpx.Response:
        return original({**key, "role": "auditor"}, path, params)  # every role may read: the hole

    fake._audit = lenient  # type: ignore[method-assign]
    verdict = await _verdict(item_33_roles_hold, _context(fake))
    assert verdict.status == "FAIL"
    assert "developer audit query -> 200" in verdict.detail and "developer audit export -> 200" in verdict.detail


# -- 34 really fails -----------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_34_fails_on_an_export_with_a_deleted_middle_record() -> None:
    lines = _chain(12)
    del lines[6]  # record 7
    verdict = await _verdict(item_34_audit_tamper_evident, _context(FakeCorral(audit_lines=lines)))
    assert verdict.status == "FAIL"
    assert "does not verify: record 7 (deleted)" in verdict.detail, verdict.detail


@pytest.mark.anyio
async def test_34_fails_on_an_export_with_an_edited_record() -> None:
    lines = _chain(12)
    record = json.loads(lines[3])
    record["action"] = "sandbox.exec"  # the hash no longer matches
    lines[3] = json.dumps(record)
    verdict = await _verdict(item_34_audit_tamper_evident, _context(FakeCorral(audit_lines=lines)))
    assert verdict.status == "FAIL"
    assert "record 4 (edited)" in verdict.detail, verdict.detail


def test_34_tampering_a_good_export_is_named_where_it_happened(tmp_path: Path) -> None:
    from corral.check import ItemFailed
    from corral.check._audit import expect_broken, tampered_copy, verify_file

    export = tmp_path / "audit.jsonl"
    export.write_text("".join(line + "\n" for line in _chain(9)))
    assert verify_file(export).ok
    assert tampered_copy(export, tmp_path / "d.jsonl", 4, "delete") == 5
    assert "deleting record 5: record 5 deleted" in expect_broken(tmp_path / "d.jsonl", 5, "deleting", "deleted",
                                                                  (5, 6))
    assert tampered_copy(export, tmp_path / "e.jsonl", 4, "edit") == 5
    assert "record 5 was edited" in expect_broken(tmp_path / "e.jsonl", 5, "editing", "edited", (5,))
    with pytest.raises(ItemFailed, match="still verified"):
        expect_broken(export, 5, "deleting", "deleted", (5, 6))  # an untampered copy: "tampering" unnoticed


# -- 39 really fails -----------------------------------------------------------------------------------------------

AUDIT_KEY = "a" * 64


@pytest.mark.anyio
async def test_39_passes_when_a_rewrite_without_the_key_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_AUDIT_KEY", AUDIT_KEY)
    keys = AuditKeyring.parse(AUDIT_KEY, "test")
    verdict = await _verdict(item_39_audit_keyed, _context(FakeCorral(audit_lines=_chain(12, keys))))
    assert verdict.status == "PASS", verdict.detail
    assert "plain SHA-256: record 7 (edited)" in verdict.detail and "a key not the server's: record 7 (edited)" \
        in verdict.detail, verdict.detail


def test_34_checks_a_keyed_export_with_the_key(tmp_path: Path) -> None:
    from corral.check._audit import expect_broken, tampered_copy, verify_file

    keys = AuditKeyring.parse(AUDIT_KEY, "test")
    export = tmp_path / "audit.jsonl"
    export.write_text("".join(line + "\n" for line in _chain(9, keys)))
    assert verify_file(export, keys=keys).ok
    assert tampered_copy(export, tmp_path / "e.jsonl", 4, "edit") == 5
    assert "record 5 was edited" in expect_broken(tmp_path / "e.jsonl", 5, "editing", "edited", (5,), keys)
    problem = verify_file(tmp_path / "e.jsonl").problem  # without the key: named, not passed
    assert problem is not None and problem.kind == "unknown-key"


@pytest.mark.anyio
async def test_39_fails_on_a_chain_of_plain_sha256(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_AUDIT_KEY", f"{AUDIT_KEY},unkeyed-until=12")  # all 12 "predate" the key
    verdict = await _verdict(item_39_audit_keyed, _context(FakeCorral(audit_lines=_chain(12))))
    assert verdict.status == "FAIL" and "only 0 of the 12 exported records are keyed" in verdict.detail
    monkeypatch.setenv("CORRAL_AUDIT_KEY", AUDIT_KEY)  # none may: the whole chain is a rewrite
    verdict = await _verdict(item_39_audit_keyed, _context(FakeCorral(audit_lines=_chain(12))))
    assert verdict.status == "FAIL" and "record 1 (edited)" in verdict.detail, verdict.detail


@pytest.mark.anyio
async def test_39_fails_without_the_servers_key() -> None:
    keys = AuditKeyring.parse(AUDIT_KEY, "test")
    verdict = await _verdict(item_39_audit_keyed, _context(FakeCorral(audit_lines=_chain(12, keys))))
    assert verdict.status == "FAIL" and "not readable here" in verdict.detail and "CORRAL_AUDIT_KEY" in verdict.fix
    verdict = await _verdict(item_34_audit_tamper_evident, _context(FakeCorral(audit_lines=_chain(12, keys))))
    assert verdict.status == "FAIL" and "cannot be checked here" in verdict.detail, verdict.detail


# -- 35 really fails ----------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_35_passes_when_every_step_is_on_record_with_its_key() -> None:
    verdict = await _verdict(item_35_audit_complete, _context(FakeCorral()))
    assert verdict.status == "PASS", verdict.detail


@pytest.mark.anyio
async def test_35_fails_when_egress_decisions_are_not_audited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("corral.check._audit._AUDIT_WAIT", 0.2)
    verdict = await _verdict(item_35_audit_complete, _context(FakeCorral(audits_egress=False)))
    assert verdict.status == "FAIL"
    assert "no audit record of: egress refusal" in verdict.detail, verdict.detail


@pytest.mark.anyio
async def test_35_fails_when_a_record_names_another_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("corral.check._audit._AUDIT_WAIT", 0.2)
    fake = FakeCorral()
    honest = fake.record

    def anonymous_files(key: dict[str, Any], action: str, *args: Any, **kwargs: Any) -> None:
        honest({**key, "id": None} if action == "files.write" else key, action, *args, **kwargs)

    fake.record = anonymous_files  # type: ignore[method-assign]
    verdict = await _verdict(item_35_audit_complete, _context(fake))
    assert verdict.status == "FAIL"
    assert "no audit record of: file write" in verdict.detail, verdict.detail


# -- setup and teardown --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_teardown_disables_kills_and_revokes_even_when_the_check_crashes() -> None:
    fake = FakeCorral()
    target = Target(URL, ADMIN, transport=fake.transport())
    with pytest.raises(RuntimeError, match="boom"):
        async with provision(target) as ctx:
            async with ctx.http("developer") as dev:
                await dev.post("/v1/sandboxes", json={})
            fake.sandboxes["sb-elsewhere"] = {"tenant": "someone-else", "state": "running", "files": {}}
            raise RuntimeError("boom")
    ours = [t for t in fake.tenants if t.startswith("corral-check-")]
    assert len(ours) == 2 and all(fake.tenants[t]["disabled"] for t in ours)
    assert all(k["revoked_at"] for k in fake.keys.values() if k["tenant"] in ours)
    assert fake.sandboxes["sb-1"]["state"] == "killed"
    assert fake.sandboxes["sb-elsewhere"]["state"] == "running"  # never another tenant's
    assert not fake.keys[ADMIN]["revoked_at"]
    # disabled first (nothing new starts), then killed, then revoked
    first = ours[0]
    order = [c for c in fake.calls if c in (f"PATCH /v1/tenants/{first}", "POST /v1/kill", "GET /v1/keys")]
    assert order[:3] == [f"PATCH /v1/tenants/{first}", "POST /v1/kill", "GET /v1/keys"]


@pytest.mark.anyio
async def test_teardown_also_undoes_a_tenant_an_item_function_made() -> None:
    fake = FakeCorral()
    with pytest.raises(RuntimeError, match="boom"):
        async with provision(Target(URL, ADMIN, transport=fake.transport())) as ctx:
            async with ctx.admin() as admin:
                await admin.tenants.create(ctx.tenant + "-runsc")
                ctx.extra_tenants.append(ctx.tenant + "-runsc")
                await admin.keys.create(ctx.tenant + "-runsc", "developer")
            raise RuntimeError("boom")  # the item function never got to its own clean-up
    assert fake.tenants[ctx.tenant + "-runsc"]["disabled"]
    assert all(k["revoked_at"] for k in fake.keys.values() if k["tenant"] == ctx.tenant + "-runsc")


@pytest.mark.anyio
async def test_run_check_against_the_fake_reports_the_broken_items_only() -> None:
    from corral.check import CheckOptions

    fake = FakeCorral(leaky_route="/files")
    report = await run_check(Target(URL, ADMIN, transport=fake.transport()),
                             CheckOptions(items=frozenset({32, 33})), tasks=())
    status = {i.number: i.status for i in report.items}
    assert status == {32: "FAIL", 33: "PASS"}
    assert report.exit_code == 1 and report.cleanup_problems == []
    failed = report.items[0]
    assert "GET /v1/sandboxes/{sandbox_id}/files -> 200" in failed.detail and failed.fix == ITEMS[32].fix
    assert all(t["disabled"] for t in fake.tenants.values())


# -- aggregation ---------------------------------------------------------------------------------------------------


def _task(tid: str, status: str, items: tuple[int, ...] = (4,), **kw: Any) -> TaskResult:
    failures = (TaskFailure(1, "privilege_escalation", "CapEff is 0000003fffffffff"),) if status == "fail" else ()
    return TaskResult(id=tid, family=tid.split("/")[0], category="security", severity="critical",
                      status=status, duration=0.5, mode=failures[0].mode if failures else None,  # type: ignore[arg-type]
                      failures=failures, checklist=items, **kw)


def test_one_failing_task_fails_its_item_and_names_it() -> None:
    verdicts = task_verdicts([_task("sec.caps/a", "pass"), _task("sec.caps/b", "fail"), _task("sec.caps/c", "pass")])
    item = combine(4, verdicts[4], {4: "keep the seccomp profile"})
    assert item.status == "FAIL"
    assert "1 of 3 tasks failed" in item.detail and "task sec.caps/b (privilege_escalation at step 2)" in item.detail
    assert "CapEff is 0000003fffffffff" in item.detail
    assert item.fix == "keep the seccomp profile" and item.tasks == ("sec.caps/a", "sec.caps/b", "sec.caps/c")


def test_a_task_proving_two_items_counts_for_both() -> None:
    verdicts = task_verdicts([_task("sec.net/a", "fail", (24, 25))])
    assert {n: [v.status for v in vs] for n, vs in verdicts.items()} == {24: ["FAIL"], 25: ["FAIL"]}


def test_not_applicable_is_never_pass() -> None:
    skipped = task_verdicts([_task("sec.k8s/a", "skip", (23,), skip_reason="corral lacks kubernetes")])
    item = combine(23, skipped[23])
    assert item.status == "N/A" and "corral lacks kubernetes" in item.detail
    assert combine(36, [Verdict("N/A", "needs --home")]).status == "N/A"
    # a skipped part beside a passed one is named, not hidden
    mixed = task_verdicts([_task("sec.k8s/a", "skip", (23,), skip_reason="no cluster"), _task("sec.k8s/b", "pass",
                                                                                              (23,))])
    item = combine(23, mixed[23])
    assert item.status == "PASS" and "not applicable here: 1 tasks skipped (no cluster)" in item.detail


def test_an_item_nothing_probed_fails() -> None:
    item = combine(7, [])
    assert item.status == "FAIL" and "nothing probed this item" in item.detail


def test_a_failing_function_beside_passing_tasks_fails_the_item_with_its_own_fix() -> None:
    item = combine(2, [*task_verdicts([_task("sec.agent/a", "pass", (2,))])[2],
                       Verdict("FAIL", "listening on 0.0.0.0:22", fix="stop sshd in the template")])
    assert item.status == "FAIL" and item.detail == "listening on 0.0.0.0:22"
    assert item.fix == "stop sshd in the template"


@pytest.mark.anyio
async def test_a_probe_that_crashes_fails_its_item() -> None:
    async def broken(ctx: CheckContext) -> str:
        raise httpx.ConnectError("connection refused")

    verdict = await run_probe(Probe(32, broken), _context(FakeCorral()))
    assert verdict.status == "FAIL" and "could not run: ConnectError: connection refused" in verdict.detail


def test_only_loopback_addresses_count_as_loopback() -> None:
    from corral.check._host import _loopback

    assert _loopback("0100007F:1F90") and _loopback("0101017F:0035")  # 127.0.0.1, 127.1.1.1
    assert _loopback("00000000000000000000000001000000:0050")  # ::1
    assert _loopback("0000000000000000FFFF00000100007F:0050")  # ::ffff:127.0.0.1
    assert not _loopback("00000000:1F90")  # 0.0.0.0
    assert not _loopback("0A00000A:1F90")  # 10.0.0.10
    assert not _loopback("00000000000000000000000000000000:0050")  # ::


@pytest.mark.anyio
async def test_fail_closed_is_not_applicable_without_the_servers_state_directory() -> None:
    from corral.check._host import item_36_fail_closed

    verdict = await _verdict(item_36_fail_closed, _context(FakeCorral()))
    assert verdict.status == "N/A" and "--home" in verdict.detail


@pytest.mark.anyio
async def test_fail_closed_is_not_applicable_on_a_backend_it_cannot_take_the_runtime_from(tmp_path: Path) -> None:
    from corral.check._host import item_36_fail_closed

    (tmp_path / "templates").mkdir()
    ctx = _context(FakeCorral(), Deployment("kubernetes", ("runsc",)), home=tmp_path)
    verdict = await _verdict(item_36_fail_closed, ctx)
    assert verdict.status == "N/A" and "the server runs the kubernetes backend" in verdict.detail, verdict.detail


DOCKER_LIMITATIONS = {
    "user_namespace": "no per-sandbox user namespace: uid 1000 of the host too",
    "agent_socket": "the agent's socket is listed in /proc/net/unix",
    "runtime_runsc": "no gVisor: the Docker backend runs runc only",
    "time_travel": "a limitation this check has never heard of"}
DOCKER_INFO: dict[str, Any] = {"backend": "docker", "runtimes": ["runc"], "limitations": DOCKER_LIMITATIONS}


@pytest.mark.anyio
async def test_what_the_backend_cannot_give_is_not_applicable_with_its_reason() -> None:
    from corral.check import CheckOptions

    fake = FakeCorral(info=DOCKER_INFO)
    report = await run_check(Target(URL, ADMIN, transport=fake.transport()),
                             CheckOptions(items=frozenset({1, 3, 31, 32})), tasks=())
    found = {i.number: i for i in report.items}
    assert report.backend == "docker" and report.exit_code == 0, report.to_json()
    assert found[3].status == "N/A"
    assert found[3].detail == f"the docker backend: {DOCKER_LIMITATIONS['user_namespace']}"
    assert found[1].status == "N/A" and "/proc/net/unix" in found[1].detail
    assert found[31].status == "N/A" and "gVisor on the docker backend: no gVisor: the Docker backend runs runc only" \
        in found[31].detail
    assert found[32].status == "PASS"  # what the backend gives is still proved
    assert report.notes == ["the docker backend: time_travel: a limitation this check has never heard of"]
    assert "not proved by any item: the docker backend: time_travel" in _printed(report)
    assert "on the docker backend" in _printed(report)


def test_a_limitation_beside_a_passing_task_keeps_the_pass_and_names_what_was_not_proved() -> None:
    from corral.check._backend import limitation_verdicts

    deployment = Deployment("docker", ("runc",), DOCKER_LIMITATIONS)
    extra = limitation_verdicts(deployment, {1, 3})
    item = combine(3, [*task_verdicts([_task("security.non_root/id-u", "pass", (3,))])[3], *extra[3]])
    assert item.status == "PASS"
    assert item.detail == "1 tasks passed; not applicable here: the docker backend: no per-sandbox user namespace: " \
                          "uid 1000 of the host too"
    assert limitation_verdicts(Deployment(), {1, 3}) == {}  # the local backend gives everything
    assert sorted(limitation_verdicts(deployment, {3})) == [3]  # only the items checked


@pytest.mark.anyio
async def test_the_deployment_is_read_from_the_server_and_an_older_server_is_the_local_backend() -> None:
    from corral import AuthenticationError
    from corral.check._backend import fetch_deployment

    older = await fetch_deployment(Target(URL, ADMIN, transport=FakeCorral().transport()))
    assert older == Deployment("local", ("runc", "runsc"), {})
    docker = await fetch_deployment(Target(URL, ADMIN, transport=FakeCorral(info=DOCKER_INFO).transport()))
    assert (docker.backend, docker.runtimes, dict(docker.limitations)) == ("docker", ("runc",),
                                                                          DOCKER_LIMITATIONS)
    with pytest.raises(AuthenticationError, match=r"\(GET /v1/info\) answered 401: unauthenticated"):
        await fetch_deployment(Target(URL, "wrong-key", transport=FakeCorral().transport()))


@pytest.mark.anyio
async def test_gvisor_is_not_applicable_where_the_server_offers_no_runsc() -> None:
    from corral.check._backend import item_31_gvisor

    deployment = Deployment("docker", ("runc",), DOCKER_LIMITATIONS)
    verdict = await _verdict(item_31_gvisor, _context(FakeCorral(), deployment))
    assert verdict.status == "N/A" and "runs runc only" in verdict.detail
    bare = await _verdict(item_31_gvisor, _context(FakeCorral(), Deployment("other", ("runc",))))
    assert bare.status == "N/A" and "offers no runsc runtime" in bare.detail


def _printed(report: CheckReport) -> str:
    from io import StringIO

    from rich.console import Console

    from corral.check import print_report

    out = StringIO()
    print_report(report, Console(file=out, width=200))
    return out.getvalue()


def test_every_item_has_a_title_a_fix_and_at_most_one_function() -> None:
    assert sorted(ITEMS) == list(range(1, 47))
    assert all(i.title and i.fix for i in ITEMS.values())
    numbers = [p.number for p in PROBES]
    assert len(numbers) == len(set(numbers))


# -- the CLI: exit status and JSON ---------------------------------------------------------------------------------


def _report(*statuses: Status) -> CheckReport:
    items = [ItemResult(n, ITEMS[n].title, s, f"detail {n}", ITEMS[n].fix if s == "FAIL" else "", (f"t/{n}",), 1.5)
             for n, s in enumerate(statuses, 1)]
    return CheckReport(url=URL, started="2030-01-01T00:00:00+00:00", seconds=3.0, tenant="corral-check-x",
                       items=items)


def _cli(monkeypatch: pytest.MonkeyPatch, report: CheckReport, *args: str) -> Any:
    seen: dict[str, Any] = {}

    async def fake_run_check(target: Target, options: Any, *, progress: Any = None) -> CheckReport:
        seen.update(target=target, options=options)
        return report

    monkeypatch.setattr(_check, "run_check", fake_run_check)
    app = typer.Typer()
    app.command()(_check.check_command)
    result = CliRunner().invoke(app, list(args), env={"CORRAL_URL": URL, "CORRAL_API_KEY": ADMIN})
    return result, seen


def test_cli_exits_1_on_a_failed_item_and_prints_what_and_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = _cli(monkeypatch, _report("PASS", "FAIL", "N/A"))
    assert result.exit_code == 1, result.output
    assert "detail 2" in result.output and ITEMS[2].fix.split(";")[0] in re.sub(r"\s+", " ", result.output)
    assert "1 passed, 1 failed, 1 not applicable" in result.output
    assert seen["target"].url == URL and seen["target"].admin_key == ADMIN and seen["options"].items is None


def test_cli_exits_0_when_nothing_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _ = _cli(monkeypatch, _report("PASS", "N/A", "PASS"))
    assert result.exit_code == 0, result.output


def test_cli_json_document(monkeypatch: pytest.MonkeyPatch) -> None:
    result, seen = _cli(monkeypatch, _report("PASS", "FAIL"), "--json", "-i", "1", "-i", "2", "-c", "3")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["counts"] == {"PASS": 1, "FAIL": 1, "N/A": 0}
    assert doc["items"][1] == {"number": 2, "title": ITEMS[2].title, "status": "FAIL", "detail": "detail 2",
                               "fix": ITEMS[2].fix, "tasks": ["t/2"], "seconds": 1.5}
    assert seen["options"].items == frozenset({1, 2}) and seen["options"].concurrency == 3


def test_cli_rejects_an_unknown_item_and_a_missing_key(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _ = _cli(monkeypatch, _report("PASS"), "--item", "47")
    assert result.exit_code == 2 and "no checklist item 47" in result.output
    assert "items are 1-46" in " ".join(result.output.split())
    monkeypatch.setattr(_check, "run_check", None)
    app = typer.Typer()
    app.command()(_check.check_command)
    result = CliRunner().invoke(app, [], env={"CORRAL_URL": URL, "CORRAL_API_KEY": None})
    assert result.exit_code == 2 and "admin's API key is needed" in result.output


def test_report_json_round_trips_every_field() -> None:
    doc = json.loads(report_json(_report("N/A")))
    assert set(doc) == {"url", "started", "seconds", "tenant", "backend", "ok", "counts", "items", "notes",
                        "cleanup_problems"}
    assert doc["ok"] is True and doc["items"][0]["status"] == "N/A"


# -- live: the whole checklist against a real server ---------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    home = Path(tempfile.mkdtemp(prefix="corral-check-test-", dir="/var/tmp"))
    home.chmod(0o755)  # sandboxes' users traverse it
    try:
        with ServerProcess(home, template_home=TEMPLATE_HOME) as srv:
            yield srv
    finally:
        shutil.rmtree(home, ignore_errors=True)


needs_store = pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare "
                                                           "rootfs")


@pytest.mark.runc
@pytest.mark.slow
@pytest.mark.timeout(1200)
@needs_store
def test_the_whole_checklist_passes_on_a_local_deployment(server: ServerProcess) -> None:
    # The whole check, as `corral check --home` runs it: every checklist task of the corpus, 5 GB for item 13.
    tasks = list(checklist_tasks())
    target = Target(url=server.url, admin_key=server.admin_key, home=server.home)
    report = asyncio.run(run_check(target))
    problems = [f"{i.number} {i.title}: {i.status}: {i.detail} (fix: {i.fix})" for i in report.items
                if i.status == "FAIL" or (i.status == "N/A" and not i.detail)]
    assert problems == [], "\n".join(problems)
    assert [i.number for i in report.items] == list(range(1, 47))
    assert {t for i in report.items for t in i.tasks} == {t.id for t in tasks}  # every task ran, none skipped
    assert report.exit_code == 0 and report.cleanup_problems == []
    # The host-side parts ran (the server is on this machine), rather than being skipped.
    detail = {i.number: i.detail for i in report.items}
    assert "refused no token, a guessed one and another sandbox's" in detail[2]
    assert "the server's peak memory grew by" in detail[13]
    assert "with a host canary" in detail[19]
    assert "runtime_unavailable" in detail[36]
    assert "E2B's API: 17 calls on another tenant's sandbox (404) or by an auditor (403) were refused" in detail[43]
    assert "asked for runc and got gVisor" in detail[40] and "on the host its image took" in detail[42]
    # Its tenants (item 40 makes a third) are disabled with their keys revoked, and nothing of theirs runs any more.
    assert list((server.home / "sandboxes").iterdir()) == []
    assert list((server.home / "volumes").iterdir()) == []
    with Admin(api_key=server.admin_key, base_url=server.url) as admin:
        ours = [t for t in admin.tenants.list() if t.name.startswith(report.tenant)]
        assert len(ours) == 3 and all(t.disabled for t in ours)
        for tenant in ours:
            assert admin.kill_all(tenant=tenant.name).killed == []
            assert all(k.revoked for k in admin.keys.list(tenant.name))


@pytest.mark.runc
@needs_store
def test_the_cli_checks_chosen_items_of_a_local_deployment(server: ServerProcess) -> None:
    app = typer.Typer()
    app.command()(_check.check_command)
    env = {"CORRAL_URL": server.url, "CORRAL_API_KEY": server.admin_key}
    result = CliRunner().invoke(app, ["--home", str(server.home), "-i", "3", "-i", "32", "-i", "36", "-i", "43",
                                      "--json"], env=env)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(i["number"], i["status"]) for i in doc["items"]] == [(3, "PASS"), (32, "PASS"), (36, "PASS"),
                                                                   (43, "PASS")]
    assert len(doc["items"][0]["tasks"]) == sum(3 in t.checklist for t in checklist_tasks())
    assert doc["ok"] is True and doc["cleanup_problems"] == []
    assert list((server.home / "sandboxes").iterdir()) == []
