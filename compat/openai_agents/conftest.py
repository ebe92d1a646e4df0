"""Fixtures of the OpenAI Agents SDK tier (`.venv-openai-agents`, see scripts/install and scripts/test).

openai-agents pins a `websockets` older than Corral's server needs, so Corral is not installed in that environment:
the server runs from the main one (`$CORRAL_PYTHON`, default `.venv/bin/python`), a real `corral serve` on a free
loopback port through `corral.server.ServerProcess`, which also destroys every sandbox it leaves when the session
ends. The tests see it only as E2B's environment variables, as a user of the SDK would; nothing here needs the
internet or an OpenAI key (the sandbox client is driven directly, not by a model).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

_REPO = Path(__file__).resolve().parents[2]
_STARTUP = 120.0  # seconds for the server to answer, under a loaded CI machine
# Run by the main environment's interpreter: a server until this script's stdin is closed, then its cleanup.
_SERVE = """
import json, sys
from corral.server import ServerProcess
with ServerProcess(sys.argv[1], template_home=sys.argv[2]) as server:
    print(json.dumps({"url": server.url, "admin_key": server.admin_key}), flush=True)
    sys.stdin.read()
"""


@dataclass(frozen=True)
class Corral:
    url: str
    admin_key: str
    key: str  # a developer key of a tenant of its own

    def env(self) -> dict[str, str]:
        """What an E2B user exports to use Corral instead of E2B's cloud."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.key,
                "E2B_VALIDATE_API_KEY": "false"}

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=60)


def _first_line(proc: subprocess.Popen[str]) -> str:
    """The server's announcement, waited for at most `_STARTUP` seconds (a thread: a pipe has no timeout)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=_STARTUP)
    except queue.Empty:
        return ""


@pytest.fixture(scope="session")
def corral() -> Iterator[Corral]:
    python = os.environ.get("CORRAL_PYTHON", str(_REPO / ".venv" / "bin" / "python"))
    templates = os.environ.get("CORRAL_TEST_TEMPLATE_HOME", os.environ.get("CORRAL_HOME", "/var/lib/corral"))
    home = Path(f"/var/tmp/corral-agents-{uuid.uuid4().hex[:8]}")  # not 0700 tmp_path: sandboxes must reach it
    proc = subprocess.Popen([python, "-c", _SERVE, str(home), templates], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=_REPO)
    try:
        line = _first_line(proc)
        if not line:
            raise RuntimeError(f"corral serve did not start within {_STARTUP:g} s (status {proc.poll()})")
        started = json.loads(line)
        with httpx.Client(base_url=started["url"], headers={"Authorization": f"Bearer {started['admin_key']}"},
                          timeout=60) as admin:
            name = f"agents-{uuid.uuid4().hex[:6]}"
            assert admin.post("/v1/tenants", json={"name": name}).status_code == 201
            r = admin.post("/v1/keys", json={"tenant": name, "role": "developer", "name": "agents"})
            assert r.status_code == 201, r.text
        yield Corral(started["url"], started["admin_key"], r.json()["key"])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the server stops and its sandboxes are destroyed
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def e2b_env(corral: Corral, monkeypatch: pytest.MonkeyPatch) -> Corral:
    """E2B's variables pointing at the server, and E2B's own ones that would point elsewhere unset."""
    for name in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in corral.env().items():
        monkeypatch.setenv(name, value)
    return corral
