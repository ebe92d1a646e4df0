"""Egress from real runc sandboxes through the real proxy (docs/egress.md), and checklist items 24-27.

Traffic goes only to the package registries (PyPI, npm) or to servers these tests start on the host's
loopback, which sandboxes reach only through an explicit private allowance.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from corral import InvalidRequestError
from corral.egress import EgressEvent, EgressProxy, PackageMirror
from corral.engine import Engine, SandboxSpec

from .conftest import TEMPLATE, engine_behind

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

PYPI_HOSTS = ["pypi.org", "files.pythonhosted.org"]


# -- fixtures ------------------------------------------------------------------------------------------------------


class LoopbackFiles:
    """An HTTP server on the host's loopback serving a directory (only sandboxes allowed `127.0.0.1:port`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        handler = _quiet_handler(root)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    @property
    def allowance(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _quiet_handler(root: Path) -> type[http.server.SimpleHTTPRequestHandler]:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def files_server(tmp_path: Path) -> Iterator[LoopbackFiles]:
    root = tmp_path / "www"
    root.mkdir()
    (root / "hello.txt").write_bytes(b"hello from the host\n")
    (root / "blob.bin").write_bytes(os.urandom(2 * 2**20) + b"\x00\xff" * 10)
    server = LoopbackFiles(root)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def mirror_cache() -> Path:
    path = Path("/var/tmp/corral-test-mirror")  # kept across tests: the registries are slow and polite use matters
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
async def egress(test_home: Path, mirror_cache: Path) -> AsyncIterator[tuple[Engine, EgressProxy, list[EgressEvent]]]:
    events: list[EgressEvent] = []
    mirror = PackageMirror(mirror_cache)
    proxy = EgressProxy(on_event=events.append, mirror=mirror)
    try:
        async with engine_behind(test_home, proxy) as engine:
            yield engine, proxy, events
    finally:
        await mirror.close()


def spec(network: str | list[str] = "none", private: tuple[str, ...] = ()) -> SandboxSpec:
    return SandboxSpec(template=TEMPLATE, network=network if isinstance(network, str) else tuple(network),
                       network_private=private)


async def sh(sb: Any, cmd: str, timeout: float = 120, env: dict[str, str] | None = None) -> Any:
    return await sb.exec(cmd, timeout=timeout, env=env)


HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


async def host_ca_env(sb: Any) -> dict[str, str]:
    """Trust the host's CA bundle in `sb`: this CI inspects TLS with its own CA, which only the host trusts.

    (Through the package mirror the host makes the TLS connections, so only direct CONNECT tests need this.)
    """
    await sb.files.write("/tmp/host-ca.pem", HOST_CA.read_bytes())
    return {name: "/tmp/host-ca.pem" for name in ("SSL_CERT_FILE", "PIP_CERT", "CURL_CA_BUNDLE",
                                                    "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "NODE_EXTRA_CA_CERTS")}


def output(r: Any) -> str:
    return r.stdout + r.stderr


# -- the policy at work --------------------------------------------------------------------------------------------


async def test_none_refuses_with_the_reason_in_the_result(egress: Any) -> None:
    engine, _, events = egress
    async with await engine.create(spec()) as sb:
        r = await sh(sb, "curl -sS --max-time 20 https://pypi.org/simple/six/")
    assert r.exit_code != 0 and "403" in r.stderr, output(r)  # curl prints only "CONNECT tunnel failed, 403"
    assert [(d.host, d.port, d.allowed) for d in r.egress_denials] == [("pypi.org", 443, False)]
    assert "pypi.org" in r.egress_denials[0].reason and "none" in r.egress_denials[0].reason
    assert any(e.host == "pypi.org" and not e.allowed for e in events)  # and it is on record


async def test_allowlist_lets_pip_reach_pypi_directly(egress: Any) -> None:
    engine, _, events = egress
    async with await engine.create(spec(PYPI_HOSTS)) as sb:
        r = await sh(sb, "pip download --no-deps --no-cache-dir -d /tmp/w --index-url https://pypi.org/simple/ "
                         "six==1.16.0 && sha256sum /tmp/w/*.whl", env=await host_ca_env(sb))
        assert r.exit_code == 0, output(r)
        assert r.egress_denials == ()
        denied = await sh(sb, "curl -sS --max-time 20 https://registry.npmjs.org/")
        assert denied.exit_code != 0 and denied.egress_denials[0].host == "registry.npmjs.org"
    allowed = [e for e in events if e.allowed and e.host in PYPI_HOSTS]
    assert allowed and all(e.bytes_down > 0 for e in allowed)


async def test_pip_without_network_says_why_in_its_own_output(egress: Any) -> None:
    engine, _, _ = egress
    async with await engine.create(spec()) as sb:
        r = await sh(sb, "pip install --no-cache-dir --user --ignore-installed six==1.16.0")
    assert r.exit_code != 0
    # pip goes to pypi.org through the proxy, whose refused CONNECT reason pip prints in its retry warnings.
    assert "Corral egress denied: pypi.org" in output(r), output(r)
    assert "pypi.org" in output(r).split("Corral egress denied")[1]
    assert [d.host for d in r.egress_denials][:1] == ["pypi.org"]


async def test_packages_preset_installs_through_the_cache_under_none(egress: Any) -> None:
    engine, _, _ = egress
    timings = []
    for _ in range(2):
        async with await engine.create(spec(["@packages"])) as sb:
            started = time.monotonic()
            r = await sh(sb, "pip install --no-cache-dir --user --ignore-installed six==1.16.0 && "
                             "python3 -c 'import six; print(six.__version__)'")
            timings.append(time.monotonic() - started)
            assert r.exit_code == 0 and r.stdout.strip().endswith("1.16.0"), output(r)
            blocked = await sh(sb, "curl -sS --max-time 20 https://pypi.org/simple/")
            assert blocked.exit_code != 0  # only the mirror, not pypi.org itself
    # (the speedup is measured by `corral bench net`; here: the second install did not fail and used the cache)


async def test_dns_fails_at_once_and_says_why(egress: Any) -> None:
    engine, _, _ = egress
    async with await engine.create(spec("internet")) as sb:
        started = time.monotonic()
        r = await sh(sb, "python3 -c \"import socket; socket.getaddrinfo('example.com', 80)\"", timeout=30)
        took = time.monotonic() - started
    assert r.exit_code != 0 and took < 5, (took, output(r))
    assert "example.com" in [d.host for d in r.egress_denials if d.kind == "dns"], r.egress_denials
    assert "proxy" in next(d.reason for d in r.egress_denials if d.kind == "dns")


async def test_live_policy_change_applies_to_new_connections(egress: Any, files_server: LoopbackFiles) -> None:
    engine, _, _ = egress
    async with await engine.create(spec(private=(files_server.allowance,))) as sb:
        # 127.0.0.1 in a sandbox is its own loopback (NO_PROXY keeps it there); the host's is named via the proxy
        url = f"--noproxy '' {files_server.url('hello.txt')}"
        assert (await sh(sb, f"curl -fsS --max-time 10 {url}")).exit_code != 0  # private pairs need a policy
        engine.set_network(sb.id, ["127.0.0.1"], private=[files_server.allowance])  # that names the host too
        r = await sh(sb, f"curl -fsS --max-time 10 {url}")
        assert r.exit_code == 0 and r.stdout == "hello from the host\n", output(r)
        engine.set_network(sb.id, "none", private=[files_server.allowance])
        assert (await sh(sb, f"curl -fsS --max-time 10 {url}")).exit_code != 0


async def test_host_services_by_name_without_tricks(egress: Any, files_server: LoopbackFiles) -> None:
    """`host.corral.internal:<port>` is the tenant's host service on that port: no address, no `--noproxy`."""
    engine, _, _ = egress
    async with await engine.create(spec(["host.corral.internal"], private=(files_server.allowance,))) as sb:
        url = f"http://host.corral.internal:{files_server.port}/hello.txt"
        r = await sh(sb, f"curl -fsS --max-time 10 {url}")
        assert r.exit_code == 0 and r.stdout == "hello from the host\n", output(r)
        fetch = f"import urllib.request; print(urllib.request.urlopen('{url}').read().decode())"
        r = await sh(sb, f'python3 -c "{fetch}"')
        assert r.exit_code == 0 and r.stdout.startswith("hello from the host"), output(r)
        r = await sh(sb, f"curl -sS --max-time 10 http://host.corral.internal:{files_server.port + 1}/")
        assert "names no host service of this tenant" in r.stdout + r.stderr, output(r)


async def test_bad_policies_are_refused_at_create(egress: Any) -> None:
    engine, _, _ = egress
    for bad in (["a*.example.com"], ["@nope"], [""], ["host:99999"]):
        with pytest.raises((InvalidRequestError, ValueError)):
            await engine.create(spec(bad))
    assert engine.list() == []


async def test_50_sandboxes_download_through_the_proxy_byte_exact(egress: Any, files_server: LoopbackFiles) -> None:
    engine, _, _ = egress
    blob = files_server.url("blob.bin")
    expected = hashlib.sha256((files_server.root / "blob.bin").read_bytes()).hexdigest()
    sandboxes = await asyncio.gather(*(engine.create(spec(["127.0.0.1"], private=(files_server.allowance,)))
                                       for _ in range(50)))
    try:
        results = await asyncio.gather(*(sh(sb, f"curl -fsS --noproxy '' --max-time 120 {blob} | sha256sum",
                                            timeout=180)
                                         for sb in sandboxes))
    finally:
        await asyncio.gather(*(sb.destroy() for sb in sandboxes))
    assert [r.stdout.split()[0] if r.exit_code == 0 else output(r) for r in results] == [expected] * 50


# -- checklist 24-27 -----------------------------------------------------------------------------------------------


METADATA = ["http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/", "http://metadata.google.internal/"]


async def test_24_cloud_metadata_blocked(egress: Any) -> None:
    engine, _, _ = egress
    async with await engine.create(spec("internet")) as sb:
        for url in METADATA:
            started = time.monotonic()
            r = await sh(sb, f"curl -sS --max-time 10 {url}")
            assert time.monotonic() - started < 5, (url, output(r))  # at once, never a hang
            # curl prints a proxy's refusal body for plain HTTP: the reason is in its own output
            assert "Corral egress denied" in output(r) or "Corral egress" in output(r), (url, output(r))
            assert r.egress_denials and not any(d.allowed for d in r.egress_denials), (url, output(r))
            direct = await sh(sb, f"curl -sS --noproxy '*' --max-time 5 {url}")
            assert direct.exit_code != 0  # no route at all without the proxy


async def test_25_private_ranges_and_the_host_unreachable(egress: Any, files_server: LoopbackFiles) -> None:
    engine, _, _ = egress
    own = _host_address()
    async with await engine.create(spec("internet")) as sb, await engine.create(spec("internet")) as other:
        targets = ["http://10.0.0.1/", "http://172.16.0.1/", "http://192.168.1.1/", "http://100.64.0.1/",
                   f"http://127.0.0.1:{files_server.port}/hello.txt", f"http://localhost:{files_server.port}/",
                   "http://[::1]/", "http://[fe80::1]/", "http://0.0.0.0/", f"http://{own}:{files_server.port}/"]
        for url in targets:  # through the proxy even where NO_PROXY would keep curl on the sandbox's loopback
            r = await sh(sb, f"curl -sS --noproxy '' --max-time 10 {url}")
            assert "hello from the host" not in r.stdout, (url, output(r))
            assert "Corral egress" in output(r) and r.egress_denials, (url, output(r))
        # another sandbox: it has no address anyone can route to, and its own loopback is its own
        await other.exec("nohup python3 -m http.server --bind 127.0.0.1 8099 >/dev/null 2>&1 & sleep 1")
        assert (await sh(other, "curl -fsS --noproxy '*' --max-time 5 http://127.0.0.1:8099/")).exit_code == 0
        assert (await sh(sb, "curl -sS --noproxy '*' --max-time 5 http://127.0.0.1:8099/")).exit_code != 0


async def test_26_allowlist_enforced_with_a_reason(egress: Any) -> None:
    engine, _, _ = egress
    async with await engine.create(spec(["*.pythonhosted.org"])) as sb:
        for url, host in (("https://pypi.org/simple/", "pypi.org"),
                          ("https://pythonhosted.org.evil.net/", "pythonhosted.org.evil.net")):
            r = await sh(sb, f"curl -sS --max-time 10 {url}")
            assert r.exit_code != 0, output(r)
            denial = next(d for d in r.egress_denials if d.host == host)
            assert "allowlist" in denial.reason and "*.pythonhosted.org" in denial.reason, denial.reason
        ok = await sh(sb, "curl -sS -o /dev/null -w '%{http_code}' --max-time 20 https://files.pythonhosted.org/",
                      env=await host_ca_env(sb))
        assert ok.exit_code == 0 and ok.egress_denials == (), output(ok)


async def test_27_no_direct_dns_or_raw_exfiltration(egress: Any) -> None:
    engine, _, _ = egress
    async with await engine.create(spec("internet")) as sb:
        probe = r"""
import json, socket, time
out = {}
for name, server in (("udp 8.8.8.8", ("8.8.8.8", 53)), ("udp 1.1.1.1", ("1.1.1.1", 53))):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    t = time.monotonic()
    try:
        query = b"\x12\x34\x01\x00\x00\x01" + b"\x00" * 6 + b"\x04leak\x07example\x03com\x00\x00\x01\x00\x01"
        s.sendto(query, server)
        s.recvfrom(512); out[name] = "answered"
    except OSError as e:
        out[name] = f"{type(e).__name__} {time.monotonic() - t:.2f}s"
t = time.monotonic()
try:
    socket.getaddrinfo("leak.example.com", 80); out["resolver"] = "answered"
except OSError as e:
    out["resolver"] = f"{type(e).__name__} {time.monotonic() - t:.2f}s"
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW); out["raw"] = "opened"
except OSError as e:
    out["raw"] = type(e).__name__
print(json.dumps(out))
"""
        r = await sb.exec(["python3", "-c", probe], timeout=30)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["raw"] != "opened" and "answered" not in out.values(), out
    for key in ("udp 8.8.8.8", "udp 1.1.1.1", "resolver"):
        assert float(out[key].split()[-1].rstrip("s")) < 1.5, out  # at once, not after a timeout


def _host_address() -> str:
    """One of this host's own non-loopback addresses (its default route's source)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


# -- what real tools print when refused -----------------------------------------------------------------------------

TOOLS = {
    # tool: (command, whether the tool itself prints Corral's reason; when not, the result's notice carries it)
    "curl http": ("curl -sS --max-time 20 http://example.org/", True),
    "curl https": ("curl -sS --max-time 20 https://example.org/", False),  # "CONNECT tunnel failed, response 403"
    "python urllib": ("python3 -c \"import urllib.request; urllib.request.urlopen('https://example.org/')\"", True),
    "pip": ("pip install --no-cache-dir --user --ignore-installed --retries 1 six==1.16.0", True),
    "git clone": ("git clone -q https://example.org/repo.git /tmp/repo", False),
    "npm install": ("cd /tmp && npm install --no-audit --no-fund --fetch-retries=0 is-number@7.0.0", True),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
async def test_refused_tools_say_why(egress: Any, tool: str) -> None:
    engine, _, _ = egress
    command, prints_reason = TOOLS[tool]
    async with await engine.create(spec(["example.com"])) as sb:
        r = await sh(sb, command, timeout=180)
    text = output(r)
    assert r.exit_code != 0 or "Corral egress denied" in text, (tool, text)
    assert r.egress_denials, (tool, text)
    denial = r.egress_denials[0]
    assert "allowlist" in denial.reason and "example.com" in denial.reason  # names the policy and the fix
    if prints_reason:
        assert "Corral egress denied" in text, (tool, text)  # the tool's own output carries the reason
    else:
        assert "403" in text, (tool, text)  # the tool says only "403": the notice next to stderr says why
