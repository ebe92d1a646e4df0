"""Private destinations are the deployment's to grant (docs/egress.md), through a real `corral serve`, its egress
proxy and a real runc sandbox: the control plane stays unreachable whoever tries to open it, and a granted
loopback server of this test's own is reachable under `host.corral.internal`."""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from corral import Admin, InvalidRequestError, PermissionDeniedError, Sandbox
from corral.server import ServerProcess

from .conftest import DEV_ROOTFS, TEMPLATE, TEMPLATE_HOME, TEST_HOME

pytestmark = [pytest.mark.runc,
              pytest.mark.skipif(bool(DEV_ROOTFS), reason="the server needs a built template store")]

BODY = b"the test's own service"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def own_service() -> Iterator[int]:
    """A loopback HTTP server of the test's own (not the control plane's): its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@dataclass
class Deployment:
    server: ServerProcess
    op_key: str
    dev_key: str


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    home = TEST_HOME / "private-grants"
    shutil.rmtree(home, ignore_errors=True)
    with ServerProcess(home, template_home=TEMPLATE_HOME) as server:
        with Admin(api_key=server.admin_key, base_url=server.url) as admin:
            admin.tenants.create("acme")
            op = admin.keys.create("acme", "operator").key
            dev = admin.keys.create("acme", "developer").key
        yield Deployment(server, op, dev)


def _curl(sb: Sandbox, url: str) -> str:
    r = sb.commands.run(f"curl -sS --max-time 20 {url} ; echo \" rc=$?\"", timeout=60)
    return r.stdout + r.stderr


def test_the_control_plane_stays_closed_and_a_granted_service_opens(deployment: Deployment,
                                                                    own_service: int) -> None:
    server = deployment.server
    control = f"127.0.0.1:{server.port}"
    with Admin(api_key=server.admin_key, base_url=server.url) as admin, \
            Admin(api_key=deployment.op_key, base_url=server.url) as op:
        with pytest.raises(InvalidRequestError, match="control plane"):
            admin.tenants.grant_private("acme", control)
        with pytest.raises(InvalidRequestError, match="control plane"):
            admin.tenants.set_egress("acme", private=[control])
        with pytest.raises(InvalidRequestError, match="control plane"):
            op.tenants.set_egress("acme", private=[control])
        with pytest.raises(PermissionDeniedError, match="not granted"):
            op.tenants.set_egress("acme", private=[f"127.0.0.1:{own_service}"])
        granted = admin.tenants.grant_private("acme", f"127.0.0.1:{own_service}")
        assert [g["destination"] for g in granted] == [f"127.0.0.1:{own_service}"]
        assert op.tenants.set_egress("acme", private=[f"127.0.0.1:{own_service}"])["private"] \
            == [f"127.0.0.1:{own_service}"]
        try:
            with Sandbox.create(template=TEMPLATE, network=["host.corral.internal", "127.0.0.1"],
                                api_key=deployment.dev_key, base_url=server.url) as sb:
                assert BODY.decode() in _curl(sb, f"http://host.corral.internal:{own_service}/")
                out = _curl(sb, f"http://host.corral.internal:{server.port}/v1/info")
                # the proxy's refusal (naming why), never the control plane's 401
                assert "Corral egress denied" in out and "authentication" not in out.lower(), out
                # through the proxy: refused, naming why; straight at the sandbox's own loopback: nothing there
                out = _curl(sb, f'--proxy "$http_proxy" --noproxy "" http://{control}/v1/info')
                assert "Corral egress denied" in out and "authentication" not in out.lower(), out
                out = _curl(sb, f"--noproxy '*' http://{control}/v1/info")
                assert "rc=0" not in out and "authentication" not in out.lower(), out
                sb.kill()
        finally:
            admin.tenants.revoke_private("acme", f"127.0.0.1:{own_service}")


def test_the_cli_grants_lists_and_revokes(deployment: Deployment) -> None:
    from .test_cli import Cli

    server = deployment.server
    cli = Cli(server.url, server.admin_key)
    out = json.loads(cli.ok("tenants", "grant-private", "acme", "10.0.0.9:5432", "--json"))
    assert [g["destination"] for g in out] == ["10.0.0.9:5432"]
    assert "10.0.0.9:5432" in cli.ok("tenants", "grants", "acme").decode()
    refused = cli.run("tenants", "grant-private", "acme", f"127.0.0.1:{server.port}")
    assert refused.returncode != 0 and "control plane" in refused.stderr.decode(), refused
    by_operator = cli.run("tenants", "grant-private", "acme", "10.0.0.8:80", key=deployment.op_key)
    assert by_operator.returncode != 0 and "may not" in by_operator.stderr.decode(), by_operator
    assert json.loads(cli.ok("tenants", "revoke-private", "acme", "10.0.0.9:5432", "--json")) == []
