"""End to end over a real socket: `corral serve` as a subprocess, the SDK as a user would use it, and a
SIGKILL restart that must keep sandboxes and their files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from corral import Sandbox
from corral.control import generate_key

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME

pytestmark = [
    pytest.mark.runc,
    pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store, not a bare rootfs"),
]

CORRAL = str(Path(sys.executable).parent / "corral")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, home: Path, admin_key: str) -> None:
        self.home = home
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_key = admin_key
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "CORRAL_HOME": str(self.home), "CORRAL_ADMIN_KEY": self.admin_key}
        self.proc = subprocess.Popen([CORRAL, "serve", "--port", str(self.port)], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.proc.stdout.read().decode() if self.proc.stdout else ''}")
            time.sleep(0.1)
        raise AssertionError("server did not become healthy within 60 s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def admin(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        r = httpx.request(method, f"{self.url}/v1{path}", headers={"Authorization": f"Bearer {self.admin_key}"},
                          timeout=30, **kwargs)  # type: ignore[arg-type]
        r.raise_for_status()
        return r


@pytest.fixture
def server(test_home: Path, unique: str) -> Iterator[Server]:
    home = test_home / f"e2e-{unique}"
    home.mkdir()
    (home / "templates").symlink_to(TEMPLATE_HOME / "templates")
    srv = Server(home, generate_key())
    srv.start()
    try:
        yield srv
    finally:
        srv.kill(signal.SIGTERM)
        _kill_leftovers(home)


def _kill_leftovers(home: Path) -> None:
    """Sandboxes outlive their server by design: a failed test must still not leave any behind."""
    env = {**os.environ, "CORRAL_HOME": str(home)}
    listed = subprocess.run([CORRAL, "sandbox", "ls", "--json"], env=env, capture_output=True, text=True)
    ids = [s["id"] for s in json.loads(listed.stdout or "[]")]
    if ids:
        subprocess.run([CORRAL, "sandbox", "kill", *ids], env=env, capture_output=True)


def test_sdk_against_a_real_server_and_a_sigkill_restart(server: Server) -> None:
    server.admin("POST", "/tenants", json={"name": "acme"})
    key = server.admin("POST", "/keys", json={"tenant": "acme", "role": "developer"}).json()["key"]

    sb = Sandbox.create(template=TEMPLATE, timeout=300, api_key=key, base_url=server.url,
                        metadata={"purpose": "e2e"})
    chunks: list[bytes] = []
    r = sb.commands.run(r"printf 'a\x00b\xff'; echo; sleep 0.2; echo done", on_stdout=chunks.append)
    assert r.exit_code == 0 and r.stdout_bytes == b"a\x00b\xff\ndone\n" and b"".join(chunks) == r.stdout_bytes
    data = os.urandom(3 * 2**20) + b"\x00" * 10
    sb.files.write("/workspace/blob.bin", data)
    assert sb.files.read("/workspace/blob.bin") == data

    sb.close()  # the connection only; the sandbox keeps running
    server.kill(signal.SIGKILL)  # no chance to clean up
    server.start()

    again = Sandbox.connect(sb.id, api_key=key, base_url=server.url)
    assert again.files.read("/workspace/blob.bin") == data
    assert again.commands.run("echo alive").stdout == "alive\n"
    assert [s.id for s in Sandbox.list(api_key=key, base_url=server.url)] == [sb.id]
    again.kill()
    assert Sandbox.list(api_key=key, base_url=server.url) == []
    verify = server.admin("GET", "/audit/verify").json()
    assert verify["ok"] is True and verify["checked"] > 5
