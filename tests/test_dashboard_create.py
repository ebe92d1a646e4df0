"""The dashboard's New sandbox form and its CPU/memory charts (docs/dashboard.md), in Debian's Chromium driven by
Playwright against a real `corral serve` with runc sandboxes (the fixtures of tests/test_dashboard.py)."""

from __future__ import annotations

from typing import Any

import httpx

from corral import Sandbox

from .conftest import TEMPLATE
from .test_dashboard import Deployment, browser_test, screenshot, sign_in, wait_until
from .test_dashboard import browser as browser  # the fixtures: Chromium, a page, the server
from .test_dashboard import deployment as deployment
from .test_dashboard import page as page


def _sandboxes(deployment: Deployment, key: str | None = None) -> list[dict[str, Any]]:
    r = httpx.get(deployment.server.url + "/v1/sandboxes",
                  headers={"Authorization": f"Bearer {key or deployment.dev_key}"}, timeout=30)
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["sandboxes"]
    return found


def _kill(deployment: Deployment, sandbox_id: str) -> None:
    httpx.delete(f"{deployment.server.url}/v1/sandboxes/{sandbox_id}",
                 headers={"Authorization": f"Bearer {deployment.dev_key}"}, timeout=60)


def _open_form(page: Any, deployment: Deployment) -> None:
    sign_in(page, deployment.server.url, deployment.dev_key)
    page.click("#new-sandbox")
    page.wait_for_selector(f'#ns-template option[value="{TEMPLATE}"]', state="attached")


@browser_test
def test_a_developer_creates_a_sandbox_from_the_form(deployment: Deployment, page: Any) -> None:
    _open_form(page, deployment)
    page.select_option("#ns-template", TEMPLATE)
    page.fill("#ns-memory", "256M")
    page.fill("#ns-cpus", "0.5")
    page.fill("#ns-pids", "128")
    page.fill("#ns-disk", "512M")
    page.fill("#ns-timeout", "120")
    page.select_option("#ns-network", "allowlist")
    page.fill("#ns-hosts", "pypi.org, *.example.com:443")
    page.fill(".ns-meta-key", "made-by")
    page.fill(".ns-meta-value", "the form")
    page.click("#ns-add-metadata")
    page.locator(".ns-meta-key").nth(1).fill("agent")
    page.locator(".ns-meta-value").nth(1).fill("coder")
    screenshot(page, "new-sandbox")
    page.click("#ns-create")
    created = page.wait_for_selector("#new-sandbox-created").inner_text()
    sandbox_id = created.removeprefix("Created ").rstrip(".")
    try:
        row = page.wait_for_selector(f'tr[data-sandbox="{sandbox_id}"]')
        assert "made-by=the form" in row.inner_text() and "agent=coder" in row.inner_text()
        made = next(s for s in _sandboxes(deployment) if s["id"] == sandbox_id)
        assert made["template"] == TEMPLATE and made["metadata"] == {"made-by": "the form", "agent": "coder"}
        assert made["limits"]["memory"] == 256 * 2**20 and made["limits"]["cpus"] == 0.5
        assert made["limits"]["pids"] == 128 and made["limits"]["disk"] == 512 * 2**20
        assert made["network"] == ["*.example.com:443", "pypi.org"]
    finally:
        _kill(deployment, sandbox_id)


@browser_test
def test_a_bad_memory_value_shows_the_servers_error_and_creates_nothing(deployment: Deployment, page: Any) -> None:
    before = {s["id"] for s in _sandboxes(deployment)}
    _open_form(page, deployment)
    page.fill("#ns-memory", "lots")
    page.click("#ns-create")
    error = page.wait_for_selector("#new-sandbox-error .error").inner_text()
    assert "invalid_request" in error and "memory" in error, error
    assert page.query_selector("#new-sandbox-created") is None
    assert {s["id"] for s in _sandboxes(deployment)} == before


@browser_test
def test_an_auditor_gets_no_button_and_the_api_refuses_it(deployment: Deployment, page: Any) -> None:
    sign_in(page, deployment.server.url, deployment.auditor_key)
    page.wait_for_selector("#audit-list")
    page.goto(deployment.server.url + "/ui/")
    page.wait_for_selector("#audit-list")
    assert page.query_selector("#new-sandbox") is None
    before = {s["id"] for s in _sandboxes(deployment)}
    r = httpx.post(deployment.server.url + "/v1/sandboxes", json={"template": TEMPLATE},
                   headers={"Authorization": f"Bearer {deployment.auditor_key}"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
    assert {s["id"] for s in _sandboxes(deployment)} == before  # nothing was made


@browser_test
def test_the_charts_show_the_cpu_work_and_the_memory(deployment: Deployment, page: Any) -> None:
    with Sandbox.create(template=TEMPLATE, timeout=300, api_key=deployment.dev_key,
                        base_url=deployment.server.url) as sb:
        try:
            # 12 s of one busy core: at least two samples (one per 5 s) see it
            sb.commands.run("timeout 12 sh -c 'while :; do :; done'; true", timeout=60)
            sign_in(page, deployment.server.url, deployment.dev_key, f"/ui/sandboxes/{sb.id}")

            def values(chart: str) -> list[float]:
                return [float(c.get_attribute("data-value"))
                        for c in page.query_selector_all(f"#{chart} circle.chart-point")]

            wait_until(page, lambda: len(values("cpu-chart")) >= 3 and max(values("cpu-chart")) > 20,
                       timeout=40, what="CPU samples of the busy loop")
            assert len(values("memory-chart")) >= 3 and min(values("memory-chart")) > 0
            assert page.query_selector("#cpu-chart polyline.chart-line") is not None
            assert "%" in page.inner_text("#cpu-chart") and "MiB" in page.inner_text("#memory-chart")
            screenshot(page, "charts")
        finally:
            sb.kill()
