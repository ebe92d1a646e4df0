"""Fixtures for the E2B API tests: a real `corral serve` (one per session, started on first use), tenants with keys,
and the three environment variables an E2B user sets, so that E2B's own SDKs (`e2b`, `e2b-code-interpreter` from
PyPI) are driven exactly as a user drives them. Sandboxes made by a test are killed when it ends."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.server import ServerProcess

from .conftest import TEMPLATE_HOME, TEST_HOME


@dataclass
class E2BServer:
    server: ServerProcess
    keys: dict[str, str]  # "a_dev", "a_aud", "b_dev" -> raw key

    @property
    def url(self) -> str:
        return self.server.url

    def env(self, who: str = "a_dev") -> dict[str, str]:
        """What an E2B user exports to use Corral instead of E2B's cloud."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.keys[who],
                "E2B_VALIDATE_API_KEY": "false"}


@dataclass
class Cleanup:
    """Sandbox ids to kill when the test ends, whatever happened (through the admin's /v1 API)."""

    server: E2BServer
    ids: list[str] = field(default_factory=list)

    def add(self, sandbox: Any) -> Any:
        self.ids.append(sandbox.sandbox_id)
        return sandbox


def _admin(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.admin_key}"}, timeout=60)


@pytest.fixture(scope="session")
def e2b_server() -> Iterator[E2BServer]:
    TEST_HOME.mkdir(parents=True, exist_ok=True)
    # Not pytest's 0700 tmp_path: sandboxes must reach it. Not under TEST_HOME either: the server's warm pool keeps
    # sandboxes for the whole session, which the leak checks of other tests' homes must not count as theirs.
    home = Path(f"{TEST_HOME}-e2b-{uuid.uuid4().hex[:8]}")
    # A warm pool of the root sandboxes E2B creates: the whole E2B suite runs on claimed members (docs/performance.md).
    with ServerProcess(home, template_home=TEMPLATE_HOME, args=["--pool", "default/root=2"]) as server, \
            _admin(server) as admin:
        keys = {}
        for tenant in ("a", "b"):
            assert admin.post("/v1/tenants", json={"name": tenant}).status_code == 201
        for who, tenant, role in (("a_dev", "a", "developer"), ("a_aud", "a", "auditor"), ("b_dev", "b", "developer")):
            r = admin.post("/v1/keys", json={"tenant": tenant, "role": role, "name": who})
            assert r.status_code == 201, r.text
            keys[who] = r.json()["key"]
        yield E2BServer(server, keys)
    shutil.rmtree(home, ignore_errors=True)


@dataclass
class _FakeServer:
    """What the fixtures read of a `ServerProcess`, for the whole app over the fake engine."""

    url: str
    port: int
    admin_key: str


@pytest.fixture(scope="module")
def e2b_fake_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2BServer]:
    """The whole app (E2B's API beside /v1) over the fake engine, served from a thread: the fast tier's server for
    what is the E2B front's own (wire shapes, tenancy, roles, refusals, timeouts as records)."""
    from .live_front import threaded_front

    with threaded_front(tmp_path_factory.mktemp("e2b")) as front:
        port = int(front.url.rsplit(":", 1)[1])
        yield E2BServer(_FakeServer(front.url, port, front.admin_key), dict(front.keys))  # type: ignore[arg-type]


@pytest.fixture
def e2b_front(request: pytest.FixtureRequest) -> E2BServer:
    """The server a test drives: the real `corral serve` for a test marked runc, else the fake one."""
    real = request.node.get_closest_marker("runc") is not None
    server: E2BServer = request.getfixturevalue("e2b_server" if real else "e2b_fake_server")
    return server


@pytest.fixture
def e2b_env(e2b_front: E2BServer, monkeypatch: pytest.MonkeyPatch) -> E2BServer:
    """The E2B variables set for tenant a's developer, and E2B's own ones that would point elsewhere unset."""
    for name in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in e2b_front.env().items():
        monkeypatch.setenv(name, value)
    return e2b_front


@pytest.fixture
def cleanup(e2b_front: E2BServer) -> Iterator[Cleanup]:
    found = Cleanup(e2b_front)
    yield found
    with _admin(e2b_front.server) as admin:
        for sandbox_id in found.ids:
            admin.delete(f"/v1/sandboxes/{sandbox_id}")
