"""The dashboard (`/ui`, docs/dashboard.md).

In process: the pages and files are served under a Content-Security-Policy, the script never parses API data as
HTML nor keeps the key beyond the tab's session, and the API additions it relies on (the caller in `/v1/info`,
the audit trail by key, the eval runs, the PTY key as a WebSocket subprotocol).

In a real browser (Debian's Chromium driven by Playwright) against a real `corral serve` with runc sandboxes:
sign in, see a sandbox made with the SDK, type into its terminal, upload and download a binary file byte for
byte, verify the audit trail (and see where a tampered one breaks), a wrong key sees nothing, an auditor gets no
terminal. With `CORRAL_SCREENSHOTS=docs/images` the browser tests save a screenshot of each page there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.sync.client

from corral import Admin, Sandbox
from corral.control import ControlStore, Role, generate_key
from corral.engine import Engine
from corral.eval._report import write_report
from corral.server import ServerProcess, create_app
from corral.server._pty import _subprotocol_key
from corral.server._ui import CSP
from corral.ui import STATIC

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME, TEST_HOME
from .test_eval_report import sample_run

CHROMIUM = "/usr/bin/chromium"
HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'  # shown as text, never run
SCREENSHOTS = os.environ.get("CORRAL_SCREENSHOTS")


# -- in process ------------------------------------------------------------------------------------------------


@dataclass
class Served:
    app: Any
    store: ControlStore
    admin_key: str
    home: Path

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://corral.test",
                                 headers=headers)

    async def key(self, tenant: str, role: Role) -> tuple[str, str]:
        try:
            found = await self.store.tenant_by_name(tenant)
        except Exception:
            found = await self.store.create_tenant(tenant)
        new = await self.store.create_key(found.id, role)
        return new.key, new.info.id


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """The app over a store only: the engine is never started (none of these requests reach it)."""
    store = ControlStore(home=tmp_path)
    await store.start()
    try:
        admin_key = generate_key()
        await store.bootstrap_admin(admin_key)
        yield Served(create_app(Engine(tmp_path / "engine"), store), store, admin_key, tmp_path / "engine")
    finally:
        await store.close()


@pytest.mark.anyio
async def test_every_page_is_the_same_document_under_a_csp(served: Served) -> None:
    async with served.client() as c:
        root = await c.get("/ui")
        assert root.status_code == 308 and root.headers["location"].endswith("/ui/")
        index = STATIC.joinpath("index.html").read_bytes()
        for page in ("/ui/", "/ui/audit", "/ui/eval", "/ui/admin", "/ui/sandboxes/sb-123"):
            r = await c.get(page)
            assert r.status_code == 200 and r.content == index, page
            assert r.headers["content-type"].startswith("text/html")
            assert r.headers["content-security-policy"] == CSP
            assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
        for asset in ("/ui/static/js/app.js", "/ui/static/vendor/xterm.js", "/ui/static/vendor/addon-fit.js",
                      "/ui/static/app.css"):
            r = await c.get(asset)
            assert r.status_code == 200 and r.headers["content-security-policy"] == CSP, asset
        assert (await c.get("/ui/static/js/app.js")).headers["content-type"].startswith("text/javascript")
        assert (await c.get("/ui/nowhere")).status_code == 404
        assert (await c.get("/ui/static/../../_app.py")).status_code == 404


def test_the_csp_allows_no_inline_or_foreign_script() -> None:
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'none'"
    assert directives["connect-src"] == "'self'" and directives["frame-ancestors"] == "'none'"
    html = STATIC.joinpath("index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", html), "inline script"
    assert " on" not in re.sub(r"<script[^>]*>", "", html).split("<body>")[1].split("<noscript>")[0].lower()


def test_the_script_never_parses_api_data_as_html_nor_keeps_the_key() -> None:
    sources = {p.relative_to(STATIC): p.read_text() for p in STATIC.joinpath("js").rglob("*.js")}
    assert len(sources) >= 8
    for path, text in sources.items():
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in text, f"{path} uses {sink}"
        assert "localStorage." not in text and "document.cookie" not in text, path
    assert "sessionStorage" in sources[Path("js/api.js")]


def test_the_vendored_files_are_the_pinned_ones() -> None:
    vendor = STATIC / "vendor"
    versions = vendor.joinpath("VERSIONS").read_text().splitlines()
    assert [v.split()[0] for v in versions] == ["@xterm/xterm@5.5.0", "@xterm/addon-fit@0.10.0"]
    script = Path(__file__).resolve().parents[1] / "scripts" / "vendor-ui"
    for line in versions:
        assert line.split()[1] in script.read_text()  # the integrity the script checks is the one recorded
    for name in ("xterm.js", "xterm.css", "addon-fit.js", "xterm.LICENSE", "addon-fit.LICENSE"):
        assert vendor.joinpath(name).stat().st_size > 0
    assert "MIT" in vendor.joinpath("xterm.LICENSE").read_text()


@pytest.mark.anyio
async def test_info_names_the_caller(served: Served) -> None:
    key, key_id = await served.key("acme", Role.AUDITOR)
    async with served.client(key) as c:
        caller = (await c.get("/v1/info")).json()["caller"]
    tenant = await served.store.tenant_by_name("acme")
    assert caller == {"key_id": key_id, "tenant_id": tenant.id, "tenant": "acme", "role": "auditor"}


@pytest.mark.anyio
async def test_the_audit_trail_filters_by_key_and_reads_newest_first(served: Served) -> None:
    dev, dev_id = await served.key("acme", Role.DEVELOPER)
    operator, operator_id = await served.key("acme", Role.OPERATOR)
    for key in (dev, operator, dev):
        async with served.client(key) as c:
            assert (await c.get("/v1/volumes")).status_code == 200
    async with served.client(operator) as c:
        mine = (await c.get("/v1/audit", params={"key": dev_id})).json()["records"]
        assert [r["key_id"] for r in mine] == [dev_id, dev_id] and {r["action"] for r in mine} == {"volume.list"}
        exported = (await c.get("/v1/audit/export", params={"key": operator_id})).text.splitlines()
        assert [json.loads(line)["key_id"] for line in exported] == [operator_id]
        assert (await c.get("/v1/audit", params={"key": "key_nobody"})).json()["records"] == []
        newest = (await c.get("/v1/audit", params={"key": dev_id, "order": "desc", "limit": 1})).json()["records"]
        assert [r["seq"] for r in newest] == [mine[-1]["seq"]]
        oldest = (await c.get("/v1/audit", params={"key": dev_id, "limit": 1})).json()["records"]
        assert [r["seq"] for r in oldest] == [mine[0]["seq"]]
        backwards = (await c.get("/v1/audit", params={"order": "desc"})).json()["records"]
        assert [r["seq"] for r in backwards] == sorted((r["seq"] for r in backwards), reverse=True)
        assert (await c.get("/v1/audit", params={"order": "sideways"})).status_code == 400


def _write_run(home: Path, name: str) -> None:
    write_report(sample_run(), home / "eval" / name, formats=("html", "json"))


@pytest.mark.anyio
async def test_eval_runs_are_read_from_the_server_home(served: Served) -> None:
    _write_run(served.home, "nightly-1")
    (served.home / "eval" / "broken").mkdir()
    (served.home / "eval" / "broken" / "report.json").write_text("{nope")
    (served.home / "eval" / "empty").mkdir()  # no report: not a run
    auditor, _ = await served.key("acme", Role.AUDITOR)
    async with served.client(auditor) as c:
        runs = (await c.get("/v1/eval/runs")).json()["runs"]
        assert [r["name"] for r in runs] == ["nightly-1", "broken"]
        assert runs[0]["adapter"] == "corral" and runs[0]["html"] is True and runs[0]["complete"] is True
        assert runs[0]["totals"]["passed"] + runs[0]["totals"]["failed"] == runs[0]["totals"]["ran"]
        assert runs[1]["error"].startswith("report.json is unreadable") and runs[1]["html"] is False
        page = await c.get("/v1/eval/runs/nightly-1/report.html")
        assert page.status_code == 200 and page.text.lower().startswith("<!doctype html>")
        assert "sandbox" in page.headers["content-security-policy"]
        assert (await c.get("/v1/eval/runs/broken/report.html")).json()["error"]["code"] == "not_found"
        assert (await c.get("/v1/eval/runs/..%2f..%2fx/report.html")).status_code in (400, 404)
        assert (await c.get("/v1/eval/runs/.hidden/report.html")).json()["error"]["code"] == "invalid_request"
    for role in (Role.DEVELOPER, Role.OPERATOR):
        key, _ = await served.key("acme", role)
        async with served.client(key) as c:
            r = await c.get("/v1/eval/runs")
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
            assert (await c.get("/v1/eval/runs/nightly-1/report.html")).status_code == 403
    async with served.client(served.admin_key) as c:
        assert [r["name"] for r in (await c.get("/v1/eval/runs")).json()["runs"]] == ["nightly-1", "broken"]
    async with served.client(generate_key()) as c:
        assert (await c.get("/v1/eval/runs")).status_code == 401


def test_the_pty_key_subprotocol() -> None:
    assert _subprotocol_key(["corral.pty", "corral.key.ck_abc_def"]) == "ck_abc_def"
    assert _subprotocol_key(["corral.pty"]) is None and _subprotocol_key([]) is None
    for bad in (["corral.key."], ["corral.key.a", "corral.key.b"]):
        with pytest.raises(Exception, match="subprotocol"):
            _subprotocol_key(bad)


# -- in a real browser, against a real server ------------------------------------------------------------------

_BROWSER_MARKS = [
    pytest.mark.runc, pytest.mark.slow,
    pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (scripts/install)"),
]


def browser_test(fn: Any) -> Any:
    for mark in _BROWSER_MARKS:
        fn = mark(fn)
    return fn


@dataclass
class Deployment:
    server: ServerProcess
    dev_key: str
    dev_key_id: str
    auditor_key: str
    sandbox: Sandbox


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    home = TEST_HOME / "dashboard"
    shutil.rmtree(home, ignore_errors=True)
    with ServerProcess(home, template_home=TEMPLATE_HOME) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("acme")
            dev = admin.keys.create("acme", "developer", name="ci")
            auditor = admin.keys.create("acme", "auditor").key
        sandbox = Sandbox.create(template=TEMPLATE, timeout=600, api_key=dev.key, base_url=server.url,
                                 metadata={"purpose": "dashboard", "agent": "coder"})
        try:
            yield Deployment(server, dev.key, dev.id, auditor, sandbox)
        finally:
            sandbox.kill()
            sandbox.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" and "status of 40" not in m.text
           else None)
    tab.on("dialog", lambda dialog: dialog.accept())
    try:
        yield tab
    finally:
        context.close()
    assert not [e for e in errors if "Content Security Policy" in e or "Refused" in e], errors


def sign_in(page: Any, url: str, key: str, path: str = "/ui/") -> None:
    page.goto(url + path)
    page.fill("#api-key", key)
    page.click("#sign-in button[type=submit]")
    page.wait_for_selector("#sign-out")


def screenshot(page: Any, name: str, *, full_page: bool = False) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / f"dashboard-{name}.png"), full_page=full_page)


def terminal_text(page: Any) -> str:
    return str(page.inner_text("#terminal .xterm-rows"))


def wait_until(page: Any, check: Any, timeout: float = 20.0, what: str = "") -> None:
    """Poll from here: the page's CSP forbids the string evaluation `wait_for_function` would do there."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        page.wait_for_timeout(100)


@browser_test
def test_sign_in_lists_the_sdk_sandbox_and_sign_out_forgets_the_key(deployment: Deployment, page: Any) -> None:
    url, sb = deployment.server.url, deployment.sandbox
    page.goto(url + "/ui")
    screenshot(page, "sign-in")
    sign_in(page, url, deployment.dev_key)
    row = page.wait_for_selector(f'tr[data-sandbox="{sb.id}"]')
    assert "running" in row.inner_text() and TEMPLATE in row.inner_text() and "purpose=dashboard" in row.inner_text()
    wait_until(page, lambda: "%" in page.inner_text(f'tr[data-sandbox="{sb.id}"] .cpu'), what="CPU figures")
    assert "MiB" in page.inner_text(f'tr[data-sandbox="{sb.id}"] .memory')
    assert page.evaluate("sessionStorage.getItem('corral.key')") == deployment.dev_key
    assert page.evaluate("localStorage.length") == 0
    assert page.query_selector("#kill-switch") is None  # a developer has no kill switch
    page.fill("#filter", "no-such-thing")
    page.wait_for_selector("text=No sandbox matches the filter.")
    page.fill("#filter", "")
    page.wait_for_selector(f'tr[data-sandbox="{sb.id}"]')
    screenshot(page, "sandboxes")
    # What the API returns is shown as text, never parsed: a sandbox whose metadata is HTML runs nothing.
    hostile = Sandbox.create(template=TEMPLATE, timeout=120, api_key=deployment.dev_key, base_url=url,
                             metadata={"note": HOSTILE})
    try:
        page.click("text=Refresh")
        shown = page.wait_for_selector(f'tr[data-sandbox="{hostile.id}"]').inner_text()
        assert f"note={HOSTILE}" in shown and page.evaluate("window.pwned") is None
        assert page.query_selector("#sandbox-list img, #sandbox-list script") is None
    finally:
        hostile.kill()
    sb.files.write("/workspace/README.md", b"# scratch\n")
    sb.files.write("/workspace/data.csv", b"x,y\n" + b"1,2\n" * 5000)
    page.goto(url + f"/ui/sandboxes/{sb.id}")
    page.wait_for_selector("#terminal-status.ok", timeout=30_000)
    page.keyboard.type("ls -la /workspace; python3 -c 'print(sum(range(10**6)))'\n")
    page.wait_for_selector("#files-list table")
    page.click("#process-refresh")
    page.wait_for_selector("#process-list table")
    wait_until(page, lambda: "% of 1" in page.inner_text("#usage"), what="the sandbox's usage")
    assert "memory" in page.inner_text("#usage") and "MiB" in page.inner_text("#usage")
    screenshot(page, "sandbox", full_page=True)
    page.click("#sign-out")
    page.wait_for_selector("#sign-in")
    assert page.evaluate("sessionStorage.getItem('corral.key')") is None
    page.reload()
    page.wait_for_selector("#sign-in")


@browser_test
def test_the_terminal_runs_what_is_typed_and_follows_resizes(deployment: Deployment, page: Any) -> None:
    url, sb = deployment.server.url, deployment.sandbox
    sign_in(page, url, deployment.dev_key, f"/ui/sandboxes/{sb.id}")
    page.wait_for_selector("#terminal-status.ok", timeout=30_000)
    page.click("#terminal")
    page.keyboard.type("echo dash-$((6*7)) > /workspace/typed.txt; echo dash-$((6*7))\n")
    wait_until(page, lambda: re.search(r"^dash-42\s*$", terminal_text(page), re.M), what="the command's output")
    assert sb.files.read("/workspace/typed.txt") == b"dash-42\n"
    page.keyboard.type("echo before-$(stty size | tr ' ' x)\n")
    wait_until(page, lambda: re.search(r"^before-\d+x\d+", terminal_text(page), re.M), what="stty size")
    before = re.findall(r"^before-(\d+)x(\d+)", terminal_text(page), re.M)[-1]
    page.set_viewport_size({"width": 900, "height": 900})
    page.wait_for_timeout(500)
    page.keyboard.type("echo after-$(stty size | tr ' ' x)\n")
    wait_until(page, lambda: re.search(r"^after-\d+x\d+", terminal_text(page), re.M), what="stty size again")
    after = re.findall(r"^after-(\d+)x(\d+)", terminal_text(page), re.M)[-1]
    assert int(after[1]) < int(before[1]), (before, after)  # a narrower window, fewer columns


@browser_test
def test_upload_and_download_are_byte_exact(deployment: Deployment, page: Any, tmp_path: Path) -> None:
    url, sb = deployment.server.url, deployment.sandbox
    data = bytes(range(256)) * 64 + os.urandom(100_000) + b"\x00\xff\r\n"
    local = tmp_path / "blob.bin"
    local.write_bytes(data)
    sign_in(page, url, deployment.dev_key, f"/ui/sandboxes/{sb.id}")
    page.wait_for_selector("#files-list table, #files-list p")
    page.set_input_files("#files-upload", str(local))
    page.wait_for_selector("#files-note .ok")
    assert sb.files.read("/workspace/blob.bin") == data
    other = os.urandom(70_000) + b"\r\n\x00"
    sb.files.write("/workspace/other.bin", other)
    page.fill("#files-path", "/workspace")
    page.press("#files-path", "Enter")
    with page.expect_download() as info:
        page.click('tr[data-file="other.bin"] button.download')
    download = info.value
    assert download.suggested_filename == "other.bin"
    assert Path(download.path()).read_bytes() == other


@browser_test
def test_the_audit_page_filters_by_key_and_verifies_the_chain(deployment: Deployment, page: Any) -> None:
    url = deployment.server.url
    deployment.sandbox.commands.run("echo audited")
    refused = deployment.sandbox.commands.run("curl -sS --max-time 20 https://pypi.org/simple/six/")
    assert [d.host for d in refused.egress_denials] == ["pypi.org"]  # its policy is "none"
    sign_in(page, url, deployment.server.admin_key, "/ui/audit")
    page.wait_for_selector("#audit-list table")
    page.fill("#key", deployment.dev_key_id)
    page.click("form.toolbar button[type=submit]")

    def keys() -> set[str]:
        cells = page.eval_on_selector_all("#audit-list tbody tr td:nth-child(4)", "tds => tds.map(t => t.innerText)")
        return set(cells)

    wait_until(page, lambda: keys() == {deployment.dev_key_id}, what="only the developer's records")
    assert "sandbox.exec" in page.inner_text("#audit-list")
    with Admin(api_key=deployment.server.admin_key, base_url=url) as admin:  # the SDK reads the same way
        by_key = admin.audit.query(key=deployment.dev_key_id, limit=10_000)
        (newest,) = admin.audit.query(key=deployment.dev_key_id, order="desc", limit=1)
    assert newest.seq == by_key[-1].seq
    assert {r.key_id for r in by_key} == {deployment.dev_key_id}
    assert len(by_key) >= len(page.query_selector_all("#audit-list tbody tr"))
    page.click("#verify")
    page.wait_for_selector("#verify-ok")
    assert "The chain is intact" in page.inner_text("#verify-result")
    assert "every one signed with the audit key (HMAC)" in page.inner_text("#verify-result")  # a new deployment
    screenshot(page, "audit")
    # The sandbox page shows the commands recorded for it (to roles that may read the trail).
    page.goto(url + f"/ui/sandboxes/{deployment.sandbox.id}")
    wait_until(page, lambda: "echo audited" in page.inner_text("#activity"), what="the sandbox's activity")
    assert re.search(r"egress\.\w+\s+CONNECT pypi\.org:443\s+denied", page.inner_text("#activity")), \
        page.inner_text("#activity")
    screenshot(page, "sandbox-activity", full_page=True)


@browser_test
def test_a_wrong_key_sees_nothing(deployment: Deployment, page: Any) -> None:
    url = deployment.server.url
    page.goto(url + "/ui/")
    page.fill("#api-key", generate_key())
    page.click("#sign-in button[type=submit]")
    page.wait_for_selector("#sign-in-error .error")
    assert "That key was refused" in page.inner_text("#sign-in-error") and "unauthenticated" in page.inner_text(
        "#sign-in-error")
    assert page.evaluate("sessionStorage.getItem('corral.key')") is None
    assert page.query_selector("#sandbox-list") is None and page.query_selector("#sign-out") is None
    page.goto(url + f"/ui/sandboxes/{deployment.sandbox.id}")
    page.wait_for_selector("#sign-in")
    assert deployment.sandbox.id not in page.content()


@browser_test
def test_an_auditor_cannot_open_a_terminal(deployment: Deployment, page: Any) -> None:
    url, sb = deployment.server.url, deployment.sandbox
    sign_in(page, url, deployment.auditor_key)
    page.wait_for_selector("#audit-list")  # an auditor lands on the trail: it may not list sandboxes
    assert "Sandboxes" not in page.inner_text("#nav")
    page.goto(url + f"/ui/sandboxes/{sb.id}")
    page.wait_for_selector("#terminal-status.error", timeout=20_000)
    assert "your role may not open a terminal" in page.inner_text("#terminal-status")
    assert "permission_denied" in page.inner_text("#sandbox-header")
    assert "Disk" not in page.inner_text("#sandbox-header")
    with Admin(api_key=deployment.server.admin_key, base_url=url) as admin:
        ptys = admin.audit.query(sandbox=sb.id, action="sandbox.pty")
    refused = [r for r in ptys if r.role == "auditor"]  # the refusal is on the record, as every refusal is
    assert refused and all(r.outcome["error"] == "permission_denied" for r in refused)


@browser_test
def test_the_pty_subprotocol_carries_the_key_and_is_never_echoed(deployment: Deployment) -> None:
    url = deployment.server.url.replace("http", "ws") + f"/v1/sandboxes/{deployment.sandbox.id}/pty"
    with websockets.sync.client.connect(url, subprotocols=["corral.pty", f"corral.key.{deployment.dev_key}"]) as ws:
        assert ws.subprotocol == "corral.pty"
        ws.send(json.dumps({"type": "start", "cmd": ["echo", "via-subprotocol"]}))
        assert json.loads(ws.recv())["type"] == "started"
        out = b""
        while True:
            frame = ws.recv()
            if isinstance(frame, str):
                assert json.loads(frame)["type"] == "exit"
                break
            out += frame
    assert b"via-subprotocol" in out
    with websockets.sync.client.connect(url, subprotocols=["corral.pty", f"corral.key.{generate_key()}"]) as ws:
        assert json.loads(ws.recv())["error"]["code"] == "unauthenticated"


@browser_test
def test_a_killed_sandbox_says_so(deployment: Deployment, page: Any) -> None:
    url = deployment.server.url
    doomed = Sandbox.create(template=TEMPLATE, timeout=300, api_key=deployment.dev_key, base_url=url)
    try:
        sign_in(page, url, deployment.dev_key, f"/ui/sandboxes/{doomed.id}")
        page.wait_for_selector("#terminal-status.ok", timeout=30_000)
    finally:
        doomed.kill()
        doomed.close()
    page.wait_for_selector("#terminal-status.error, #terminal-reconnect:not([hidden])", timeout=20_000)
    page.reload()
    page.wait_for_selector("#sandbox-header .error")
    assert "gone or was never yours" in page.inner_text("#sandbox-header")
    page.wait_for_selector("#terminal-status.error")
    assert "does not exist" in page.inner_text("#terminal-status")


@browser_test
def test_operator_pages_eval_and_admin(deployment: Deployment, page: Any) -> None:
    url, server = deployment.server.url, deployment.server
    _write_run(server.home, "2026-12-01-nightly")
    sign_in(page, url, server.admin_key, "/ui/eval")
    page.wait_for_selector('tr[data-run="2026-12-01-nightly"]')
    page.click('tr[data-run="2026-12-01-nightly"] button')
    frame = page.wait_for_selector("iframe.report")
    assert frame.get_attribute("sandbox") == ""
    page.frame_locator("iframe.report").locator("h1").first.wait_for()
    screenshot(page, "eval")
    page.goto(url + "/ui/admin")
    page.wait_for_selector('tr[data-tenant="acme"]')
    page.fill("#key-tenant", "acme")
    page.select_option("#key-role", "operator")
    page.fill("#key-name", "oncall")
    page.click("#key-name ~ button")
    secret = page.wait_for_selector("#new-key-secret").inner_text()
    page.wait_for_selector('tr[data-key] >> text=oncall')
    page.evaluate("document.getElementById('new-key-secret').textContent = 'corral_…'")  # no secret in the docs
    screenshot(page, "admin")
    # A tenant made here, its quotas set and then disabled, as the API (and the SDK) then see it.
    page.fill("#new-tenant", "beta")
    page.click("#new-tenant ~ button")
    page.click('tr[data-tenant="beta"] >> text=Quotas')
    page.fill('#quota-editor input[name="max_sandboxes"]', "5")
    page.fill('#quota-editor input[name="max_sandbox_timeout"]', "600")
    page.click("#quota-editor button[type=submit]")
    page.wait_for_selector("#quota-editor .ok")
    page.click('tr[data-tenant="beta"] >> text=Disable')
    page.wait_for_selector('tr[data-tenant="beta"] >> text=Enable')
    assert "sandboxes=5" in page.inner_text('tr[data-tenant="beta"]')
    with Admin(api_key=server.admin_key, base_url=url) as admin:
        (beta,) = [t for t in admin.tenants.list() if t.name == "beta"]
    assert beta.disabled and beta.quotas["max_sandboxes"] == 5 and beta.quotas["max_sandbox_timeout"] == 600
    # The new operator has the kill switch: every sandbox made with one key of its tenant, that key revoked.
    with Admin(api_key=server.admin_key, base_url=url) as admin:
        batch = admin.keys.create("acme", "developer", name="batch")
    spare = Sandbox.create(template=TEMPLATE, timeout=300, api_key=batch.key, base_url=url)
    try:
        page.click("#sign-out")
        sign_in(page, url, secret)
        page.wait_for_selector("#kill-switch")
        page.select_option("#kill-kind", "key")
        page.fill("#kill-target", batch.id)
        page.check("#kill-revoke")
        page.click("#kill-switch button.danger")
        page.wait_for_selector("#kill-result .ok")
        assert "Stopped 1 sandbox(es); key revoked." in page.inner_text("#kill-result")
        assert deployment.sandbox.get_info().state == "running"  # another key's
    finally:
        with Admin(api_key=server.admin_key, base_url=url) as admin:
            assert spare.id not in {s.id for s in Sandbox.list(api_key=deployment.dev_key, base_url=url)}
            assert [k.revoked for k in admin.keys.list("acme") if k.id == batch.id] == [True]
        spare.close()


@browser_test
def test_a_lost_connection_says_so(page: Any) -> None:
    """A server of its own, SIGKILLed under an open terminal: the page says the connection was lost."""
    home = TEST_HOME / "dashboard-lost"
    shutil.rmtree(home, ignore_errors=True)
    server = ServerProcess(home, template_home=TEMPLATE_HOME)
    server.start()
    try:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("acme")
            key = admin.keys.create("acme", "developer").key
        sandbox = Sandbox.create(template=TEMPLATE, timeout=300, api_key=key, base_url=server.url)
        sandbox.close()  # the connection only: the sandbox stays for the page (and goes with the leftovers)
        sandbox_id = sandbox.id
        sign_in(page, server.url, key, f"/ui/sandboxes/{sandbox_id}")
        page.wait_for_selector("#terminal-status.ok", timeout=30_000)
        server.kill()
        page.wait_for_selector("#terminal-status.error", timeout=20_000)
        assert "Connection lost" in page.inner_text("#terminal-status")
        assert page.is_visible("#terminal-reconnect")
        page.click("#process-refresh")
        page.wait_for_selector("#process-list .error")
        assert "the server did not answer" in page.inner_text("#process-list")
    finally:
        server.stop()
        # Playwright's loop runs in this thread: the leftovers' engine gets a thread (and a loop) of its own.
        cleanup = threading.Thread(target=server.destroy_leftovers)
        cleanup.start()
        cleanup.join()


@browser_test
def test_a_tampered_trail_shows_where_it_breaks(deployment: Deployment, page: Any) -> None:
    """Last in the module: it edits the server's database behind its back (the chain stays broken)."""
    url = deployment.server.url
    with Admin(api_key=deployment.server.admin_key, base_url=url) as admin:
        victim = admin.audit.query(action="sandbox.create")[0].seq
    with sqlite3.connect(deployment.server.home / "corral.db") as db:
        assert db.execute("UPDATE audit SET action = 'sandbox.get' WHERE seq = ?", (victim,)).rowcount == 1
    sign_in(page, url, deployment.server.admin_key, "/ui/audit")
    page.click("#verify")
    page.wait_for_selector("#verify-broken")
    assert f"The chain breaks at record {victim} " in page.inner_text("#verify-result")
    page.select_option("#limit", "10000")
    page.click("form.toolbar button[type=submit]")
    page.wait_for_selector(f'tr.broken[data-seq="{victim}"]')
