"""The dashboard's timeline of a sandbox's checkpoints (docs/dashboard.md, "Checkpoints"), in Debian's Chromium
driven by Playwright (the browser fixtures of tests/test_dashboard.py): a developer sees each checkpoint with the
command it preceded, what that command changed, and restores the files in place; an auditor sees the same
timeline and no restore button.

Twice: against the whole server over the fake engine (the page's own behaviour; its backend's checkpoints copy
the fake sandbox's files), and against a real `corral serve` with runc sandboxes (marked `runc`)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import Admin, NotFoundError, Sandbox
from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME, TEST_HOME
from .live_front import threaded_front
from .test_dashboard import CHROMIUM, screenshot, sign_in
from .test_dashboard import browser as browser  # the fixtures: Chromium, and a page
from .test_dashboard import page as page

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (scripts/install)"),
]
REAL = pytest.param("real", marks=[
    pytest.mark.runc,
    pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs")])
DESTRUCTIVE = "rm /workspace/notes.txt && echo scratch > /workspace/new.txt"


@dataclass
class Front:
    url: str
    dev_key: str
    auditor_key: str


@pytest.fixture(scope="module", params=["fake", REAL])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    if request.param == "real":
        yield from _real_front()
        return
    with threaded_front(tmp_path_factory.mktemp("dashboard-checkpoints")) as served:
        yield Front(served.url, served.keys["a_dev"], served.keys["a_aud"])


def _real_front() -> Iterator[Front]:
    """A `corral serve` of its own (runc sandboxes). Stopped from a thread of its own: this module's browser may
    have started after it, and Playwright's event loop (in this thread) is then still running."""
    home = TEST_HOME / "dashboard-checkpoints"
    shutil.rmtree(home, ignore_errors=True)
    server = ServerProcess(home, template_home=TEMPLATE_HOME)
    server.start()
    try:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("acme")
            dev = admin.keys.create("acme", "developer").key
            auditor = admin.keys.create("acme", "auditor").key
        yield Front(server.url, dev, auditor)
    finally:
        def down() -> None:
            server.stop()
            server.destroy_leftovers()

        cleanup = threading.Thread(target=down)
        cleanup.start()
        cleanup.join()


@pytest.fixture(scope="module")
def undone(front: Front) -> Iterator[Sandbox]:
    """A sandbox with automatic checkpoints: a file written, a named checkpoint, then a command that deletes it."""
    auth = {"Authorization": f"Bearer {front.dev_key}"}
    made = httpx.post(f"{front.url}/v1/sandboxes", json={"template": TEMPLATE, "timeout": 600,
                                                         "checkpoints": "auto"}, headers=auth, timeout=120)
    assert made.status_code == 201, made.text
    sb = Sandbox.connect(made.json()["id"], api_key=front.dev_key, base_url=front.url)
    try:
        sb.files.write("/workspace/notes.txt", b"keep me\n" * 100)
        named = httpx.post(f"{front.url}/v1/sandboxes/{sb.id}/checkpoints", json={"name": "good"}, headers=auth,
                           timeout=120)
        assert named.status_code == 201, named.text
        assert sb.commands.run(DESTRUCTIVE).exit_code == 0
        yield sb
    finally:
        sb.kill()
        sb.close()


def _row(page: Any, text: str) -> Any:
    return page.locator("#checkpoint-list tr[data-checkpoint]", has_text=text).first


def test_a_developer_sees_what_a_command_changed_and_restores(front: Front, undone: Sandbox, page: Any) -> None:
    sign_in(page, front.url, front.dev_key, f"/ui/sandboxes/{undone.id}")
    page.wait_for_selector("#checkpoint-list tr[data-checkpoint]")
    timeline = page.inner_text("#checkpoint-list")
    assert "good" in timeline and DESTRUCTIVE in timeline and "write /workspace/notes.txt" in timeline, timeline
    # The automatic checkpoint taken before the destructive command: what changed from it is what that command did.
    _row(page, DESTRUCTIVE).click()
    page.wait_for_selector('#checkpoint-changes tr[data-path="/workspace/notes.txt"]')
    changed = {tr.get_attribute("data-path"): tr.inner_text()
               for tr in page.query_selector_all("#checkpoint-changes tr[data-path]")}
    assert set(changed) == {"/workspace/notes.txt", "/workspace/new.txt"}, changed
    assert "deleted" in changed["/workspace/notes.txt"] and "added" in changed["/workspace/new.txt"], changed
    screenshot(page, "checkpoints", full_page=True)
    _row(page, "good").locator("button.restore").click()  # the page's dialogs are accepted
    page.wait_for_selector("#restore-done")
    assert "Restored every file to good" in page.inner_text("#restore-done")
    assert undone.files.read("/workspace/notes.txt") == b"keep me\n" * 100
    with pytest.raises(NotFoundError):
        undone.files.read("/workspace/new.txt")
    assert undone.get_info().state == "running"  # the same sandbox, in place


def test_an_auditor_sees_the_timeline_but_no_restore(front: Front, undone: Sandbox, page: Any) -> None:
    sign_in(page, front.url, front.auditor_key, f"/ui/sandboxes/{undone.id}")
    page.wait_for_selector("#checkpoint-list tr[data-checkpoint]")
    assert "good" in page.inner_text("#checkpoint-list")
    _row(page, "good").click()
    page.wait_for_selector("#checkpoint-changes h3")  # the changes are the auditor's to read (a refusal has none)
    assert page.query_selector("#checkpoint-list button.restore") is None
    assert page.query_selector("#checkpoint-take") is None
    # the API refuses the auditor a restore anyway
    refused = httpx.post(f"{front.url}/v1/sandboxes/{undone.id}/restore", json={"checkpoint": "good"},
                         headers={"Authorization": f"Bearer {front.auditor_key}"}, timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
