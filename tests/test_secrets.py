"""Secrets at egress (docs/secrets.md), with real clients inside real runc sandboxes (curl, Python's urllib and
requests, git, npm) against loopback servers the tests start, plain and TLS: the bound host receives the value,
another host the placeholder, a server that echoes the request back cannot hand the value to the sandbox, and the
value is nowhere inside the sandbox, in its stored spec, or in what the proxy reports.

The loopback servers are reached by two names: `host.corral.internal` (the tenant's host service, the name the
secrets are bound to) and `127.0.0.1` (the same server under a name no secret is bound to).
"""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import http.server
import ipaddress
import json
import random
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from corral import AsyncSecret, InvalidRequestError
from corral.control import ControlStore, Role
from corral.egress import CertificateAuthority, EgressEvent, EgressProxy, upstream_context
from corral.engine import Engine, SandboxSpec, WarmPool
from corral.server import create_app
from corral.service._secrets import SecretRequest, seal_secrets

from .conftest import TEMPLATE, engine_behind, make_engine, started_engine
from .test_server_api import BASE, Api, create, error_code, run

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

VALUE = "s3cr3t-Value-9f8e7d6c5b4a"  # what must never be seen inside
BLOB = random.Random(5).randbytes(24 * 2**20)  # for byte-exact transfers through the rewriting path
BOUND = "host.corral.internal"


# -- a loopback server that records requests and echoes them back ---------------------------------------------------


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Echo:
    """HTTP(S) on 127.0.0.1: records every request and answers with it (headers too, and in a header), gzipped
    under /gzip/; under /git/ it asks for Basic credentials first, as a git server does."""

    tls: ssl.SSLContext | None = None
    seen: list[Seen] = field(default_factory=list)
    server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> Echo:
        echo = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def _answer(self) -> None:
                body = self._body()
                echo.seen.append(Seen(self.path, dict(self.headers.items()), body))
                if self.path.startswith("/bytes/"):
                    self._send(200, BLOB[:int(self.path[7:])], [])
                    return
                if self.path.startswith("/sha256"):
                    self._send(200, hashlib.sha256(body).hexdigest().encode(), [])
                    return
                if self.path.startswith("/git/") and "Authorization" not in self.headers:
                    self._send(401, b"auth needed", [("WWW-Authenticate", 'Basic realm="git"')])
                    return
                data = json.dumps({"path": self.path, "headers": dict(self.headers.items()),
                                   "body": body.decode("latin-1")}).encode()
                extra = [("X-Echo-Auth", self.headers.get("Authorization", ""))]
                if self.path.startswith("/gzip/"):
                    data, extra = gzip.compress(data), [*extra, ("Content-Encoding", "gzip")]
                self._send(200, data, extra)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return b"".join(parts)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _send(self, status: int, data: bytes, headers: list[tuple[str, str]]) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.server_address[1])

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@dataclass
class UpstreamPki:
    ca_pem: Path
    server: ssl.SSLContext


def make_upstream_pki(directory: Path) -> UpstreamPki:
    """A CA of the test's own and a certificate for both of the server's names, as a real host would have."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral test upstream CA")])
    now = datetime.datetime.now(datetime.UTC)
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BOUND)])).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(BOUND),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem = directory / "upstream-ca.pem"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    chain = directory / "upstream-leaf.pem"
    chain.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()) + leaf.public_bytes(serialization.Encoding.PEM))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(chain)
    return UpstreamPki(ca_pem, context)


@pytest.fixture
def pki(tmp_path: Path) -> UpstreamPki:
    return make_upstream_pki(tmp_path)


@pytest.fixture
def plain() -> Iterator[Echo]:
    server = Echo().start()
    yield server
    server.close()


@pytest.fixture
def tls(pki: UpstreamPki) -> Iterator[Echo]:
    server = Echo(tls=pki.server).start()
    yield server
    server.close()


@pytest.fixture
async def egress(test_home: Path, tmp_path: Path,
                 pki: UpstreamPki) -> AsyncIterator[tuple[Engine, EgressProxy, list[EgressEvent]]]:
    events: list[EgressEvent] = []
    ca = CertificateAuthority.load_or_create(tmp_path / "egress-ca")
    proxy = EgressProxy(on_event=events.append, ca=ca, upstream_tls=upstream_context(pki.ca_pem))
    try:
        async with engine_behind(test_home, proxy) as engine:
            yield engine, proxy, events
    finally:
        ca.close()


def secret_spec(engine: Engine, *servers: Echo, body: bool = False, hosts: tuple[str, ...] = (BOUND,),
                **more: Any) -> SandboxSpec:
    private = tuple(f"127.0.0.1:{s.port}" for s in servers)
    sealed = seal_secrets({"TOKEN": SecretRequest(value=VALUE, hosts=list(hosts), body=body)}, {}, engine.keyring)
    return SandboxSpec(template=TEMPLATE, network=(BOUND, "127.0.0.1"), network_private=private, secrets=sealed,
                       **more)


async def sh(sb: Any, cmd: str) -> Any:
    r = await sb.exec(["bash", "-c", cmd], timeout=120)
    return r


def reflected(r: Any) -> dict[str, Any]:
    assert r.exit_code == 0, r.stdout + r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


# -- inside: a placeholder, never the value --------------------------------------------------------------------------


async def test_inside_the_sandbox_there_is_only_a_placeholder(egress: Any, plain: Echo, test_home: Path) -> None:
    engine, _, _ = egress
    async with await engine.create(secret_spec(engine, plain)) as sb:
        r = await sh(sb, 'echo "$TOKEN"')
        placeholder = r.stdout.strip()
        assert placeholder.startswith("corral-secret-") and VALUE not in placeholder
        # A background process, so there is more than the command's own environment to search.
        await sh(sb, "nohup sleep 60 >/dev/null 2>&1 &")
        # The value is given reversed and turned around in an unexported variable: no environment holds it.
        r = await sb.exec(["bash", "-c", 'V=$(rev <<< "$R"); grep -rlsF --binary-files=text -e "$V" '
                           "/proc/[0-9]*/environ /home /tmp /workspace /etc /.corral; echo done"],
                          env={"R": VALUE[::-1]}, timeout=60)
        assert r.stdout.strip() == "done", r.stdout
        state = (test_home / "engine" / f"{sb.id}.json").read_bytes()
        # The recovery record keeps no spec: the sealed form is the store's (the adoption brings it back)
        assert VALUE.encode() not in state


# -- plain HTTP --------------------------------------------------------------------------------------------------------


async def test_plain_http_the_bound_host_gets_the_value_and_its_echo_is_scrubbed(egress: Any, plain: Echo) -> None:
    engine, _, events = egress
    async with await engine.create(secret_spec(engine, plain)) as sb:
        placeholder = (await sh(sb, 'echo -n "$TOKEN"')).stdout
        r = await sh(sb, f'curl -sS -D /tmp/h -H "Authorization: Bearer $TOKEN" '
                         f'"http://{BOUND}:{plain.port}/echo?token=$TOKEN"')
        echoed = reflected(r)
        assert plain.seen[-1].headers["Authorization"] == f"Bearer {VALUE}"
        assert plain.seen[-1].path == f"/echo?token={VALUE}"
        assert echoed["headers"]["Authorization"] == f"Bearer {placeholder}"  # the server echoed the value
        assert VALUE not in r.stdout and VALUE not in (await sh(sb, "cat /tmp/h")).stdout
        # The same server under another name: not bound, the placeholder goes as it is.
        r = await sh(sb, f'curl -sS --noproxy "" -H "Authorization: Bearer $TOKEN" http://127.0.0.1:{plain.port}/x')
        assert r.exit_code == 0 and plain.seen[-1].headers["Authorization"] == f"Bearer {placeholder}"
    injected = [e for e in events if e.secrets]
    assert injected and all(e.host == BOUND and e.secrets == ("TOKEN",) for e in injected)
    assert not any(VALUE in repr(e) for e in events)


async def test_python_urllib_and_gzip_answers(egress: Any, plain: Echo) -> None:
    engine, _, _ = egress
    async with await engine.create(secret_spec(engine, plain)) as sb:
        code = ("import os, urllib.request; r = urllib.request.Request("
                f"'http://{BOUND}:{plain.port}/gzip/x', headers={{'X-Api-Key': os.environ['TOKEN'], "
                "'Accept-Encoding': 'gzip'}); print(urllib.request.urlopen(r).read().decode())")
        r = await sb.exec(["python3", "-c", code], timeout=60)
        assert r.exit_code == 0, r.stderr
        assert plain.seen[-1].headers["X-Api-Key"] == VALUE
        assert plain.seen[-1].headers["Accept-Encoding"] == "identity"  # asked for plain bytes, got gzip anyway
        assert VALUE not in r.stdout and "corral-secret-" in r.stdout  # decompressed, then scrubbed


@pytest.mark.parametrize("body", [False, True])
async def test_bodies_only_when_the_secret_opts_in(egress: Any, plain: Echo, body: bool) -> None:
    engine, _, _ = egress
    async with await engine.create(secret_spec(engine, plain, body=body)) as sb:
        r = await sh(sb, f'curl -sS -d "{{\\"key\\": \\"$TOKEN\\"}}" http://{BOUND}:{plain.port}/post')
        echoed = reflected(r)
        assert (VALUE in plain.seen[-1].body.decode()) is body
        assert VALUE not in json.dumps(echoed)


# -- HTTPS: intercepted with the deployment's CA, the real certificate checked by the proxy ----------------------------


async def test_https_curl_python_git_and_npm(egress: Any, tls: Echo) -> None:
    engine, _, events = egress
    async with await engine.create(secret_spec(engine, tls)) as sb:
        base = f"https://{BOUND}:{tls.port}"
        r = await sh(sb, f'curl -sS -H "Authorization: token $TOKEN" {base}/curl')
        assert reflected(r)["headers"]["Authorization"].startswith("token corral-secret-")
        assert tls.seen[-1].headers["Authorization"] == f"token {VALUE}"
        code = ("import os, urllib.request; r = urllib.request.Request("
                f"'{base}/py', headers={{'Authorization': 'Bearer ' + os.environ['TOKEN']}});"
                "print(urllib.request.urlopen(r).read().decode())")
        r = await sb.exec(["python3", "-c", code], timeout=60)
        assert r.exit_code == 0 and VALUE not in r.stdout, r.stderr
        assert tls.seen[-1].headers["Authorization"] == f"Bearer {VALUE}"
        # requests (pip's own copy: the template has no other), which trusts REQUESTS_CA_BUNDLE, not the system store
        code = ("import os; from pip._vendor import requests; print(requests.get("
                f"'{base}/requests', headers={{'X-Token': os.environ['TOKEN']}}, timeout=30).text)")
        r = await sb.exec(["python3", "-c", code], timeout=60)
        assert r.exit_code == 0 and VALUE not in r.stdout and "corral-secret-" in r.stdout, r.stderr
        assert tls.seen[-1].headers["X-Token"] == VALUE
        # git puts URL credentials in Authorization: Basic, after the server's 401
        r = await sh(sb, f'git ls-remote "https://x-access-token:$TOKEN@{BOUND}:{tls.port}/git/repo.git" 2>&1; true')
        basic = [s.headers["Authorization"] for s in tls.seen if s.path.startswith("/git/") and
                 "Authorization" in s.headers]
        assert basic, r.stdout
        assert base64.b64decode(basic[-1].split()[1]).decode() == f"x-access-token:{VALUE}"
        assert VALUE not in r.stdout
        # npm with a token in .npmrc, as a private registry is used
        npmrc = f"//{BOUND}:{tls.port}/:_authToken=${{TOKEN}}\n"
        await sb.files.write("/home/user/.npmrc", npmrc.encode())
        r = await sh(sb, f"cd /tmp && timeout 60 npm view left-pad --registry {base}/npm/ 2>&1; true")
        npm = [s for s in tls.seen if s.path.startswith("/npm/")]
        sent = {k.lower(): v for k, v in npm[-1].headers.items()} if npm else {}
        assert sent.get("authorization") == f"Bearer {VALUE}", r.stdout
        assert VALUE not in r.stdout
    assert any(e.kind == "connect" and e.secrets == ("TOKEN",) for e in events)
    assert not any(VALUE in repr(e) for e in events)


async def test_a_warm_pool_member_claimed_with_secrets_gets_placeholders_trust_and_the_value_at_egress(
        test_home: Path, tmp_path: Path, pki: UpstreamPki, tls: Echo) -> None:
    # A member is started before anyone asked for secrets: its env, the CA's trust files and the proxy's bindings
    # all come at the claim (docs/performance.md, "Warm pools").
    events: list[EgressEvent] = []
    ca = CertificateAuthority.load_or_create(tmp_path / "egress-ca")
    proxy = EgressProxy(on_event=events.append, ca=ca, upstream_tls=upstream_context(pki.ca_pem))
    await proxy.start()
    try:
        async with started_engine(test_home, egress=proxy, pools=[WarmPool(SandboxSpec(template=TEMPLATE), 1)]) \
                as engine:
            await _pool_filled(engine)
            members = set(engine.pool.ready)
            async with await engine.create(secret_spec(engine, tls)) as sb:
                assert sb.id in members  # served from the pool
                placeholder = (await sh(sb, 'echo -n "$TOKEN"')).stdout
                assert placeholder.startswith("corral-secret-")
                code = ("import os, urllib.request; r = urllib.request.Request("
                        f"'https://{BOUND}:{tls.port}/py', "
                        "headers={'Authorization': 'Bearer ' + os.environ['TOKEN']});"
                        "print(urllib.request.urlopen(r).read().decode())")
                r = await sb.exec(["python3", "-c", code], timeout=60)
                assert r.exit_code == 0 and VALUE not in r.stdout and placeholder in r.stdout, r.stderr
                assert tls.seen[-1].headers["Authorization"] == f"Bearer {VALUE}"
                r = await sh(sb, f'curl -sS -H "X-Token: $TOKEN" https://{BOUND}:{tls.port}/curl')
                assert reflected(r)["headers"]["X-Token"] == placeholder and tls.seen[-1].headers["X-Token"] == VALUE
    finally:
        await proxy.close()
        ca.close()
    assert any(e.secrets == ("TOKEN",) for e in events) and not any(VALUE in repr(e) for e in events)


async def _pool_filled(engine: Engine, *, wait: float = 60.0) -> None:
    deadline = anyio.current_time() + wait
    while engine.pool_ready < 1:
        assert anyio.current_time() < deadline, "the pool never filled"
        await anyio.sleep(0.05)


async def test_other_hosts_stay_end_to_end_tls(egress: Any, tls: Echo, pki: UpstreamPki) -> None:
    """Not bound: the tunnel is spliced, the sandbox sees the server's own certificate and sends the placeholder."""
    engine, _, _ = egress
    async with await engine.create(secret_spec(engine, tls)) as sb:
        await sb.files.write("/tmp/up.pem", pki.ca_pem.read_bytes())
        r = await sh(sb, f'curl -sS --noproxy "" --cacert /tmp/up.pem -H "Authorization: t $TOKEN" '
                         f'https://127.0.0.1:{tls.port}/other')
        assert r.exit_code == 0, r.stderr
        assert tls.seen[-1].headers["Authorization"].startswith("t corral-secret-")


# -- a binding with a port: that host on that port alone --------------------------------------------------------------


async def test_a_secret_bound_to_a_port_goes_to_that_port_alone(egress: Any, plain: Echo) -> None:
    """`127.0.0.1:<port>`, as a network rule is written: the value goes to that port; the same address on another
    port (another server) gets the placeholder, and its answers are not rewritten."""
    engine, _, events = egress
    other = Echo().start()
    try:
        spec = secret_spec(engine, plain, other, hosts=(f"127.0.0.1:{plain.port}",))
        assert spec.secrets[0].hosts == (f"127.0.0.1:{plain.port}",)
        async with await engine.create(spec) as sb:
            placeholder = (await sh(sb, 'echo -n "$TOKEN"')).stdout
            curl = 'curl -sS --noproxy "" -H "Authorization: Bearer $TOKEN"'
            echoed = reflected(await sh(sb, f"{curl} http://127.0.0.1:{plain.port}/bound"))
            assert plain.seen[-1].headers["Authorization"] == f"Bearer {VALUE}"
            assert echoed["headers"]["Authorization"] == f"Bearer {placeholder}"  # scrubbed on its way back
            echoed = reflected(await sh(sb, f"{curl} http://127.0.0.1:{other.port}/other"))
            assert other.seen[-1].headers["Authorization"] == f"Bearer {placeholder}"
            assert echoed["headers"]["Authorization"] == f"Bearer {placeholder}"
            # The bound name on any port is not the binding either: only 127.0.0.1 on plain's port is.
            reflected(await sh(sb, f"{curl} http://{BOUND}:{plain.port}/by-name"))
            assert plain.seen[-1].path == "/by-name"
            assert plain.seen[-1].headers["Authorization"] == f"Bearer {placeholder}"
    finally:
        other.close()
    injected = [e for e in events if e.secrets]
    assert injected and all((e.host, e.port) == ("127.0.0.1", plain.port) for e in injected)
    assert not any(VALUE in repr(e) for e in events)


async def test_a_tls_connection_is_intercepted_for_a_secret_only_on_its_port(egress: Any, tls: Echo,
                                                                             pki: UpstreamPki) -> None:
    """CONNECT to the bound host and port: intercepted (the sandbox trusts the deployment's CA) and the value put
    in; the same host on another port: spliced end to end, the server's own certificate, the placeholder."""
    engine, _, _ = egress
    other = Echo(tls=pki.server).start()
    try:
        async with await engine.create(secret_spec(engine, tls, other, hosts=(f"127.0.0.1:{tls.port}",))) as sb:
            curl = 'curl -sS --noproxy "" -H "Authorization: t $TOKEN"'
            r = await sh(sb, f"{curl} https://127.0.0.1:{tls.port}/bound")
            assert r.exit_code == 0, r.stderr
            assert tls.seen[-1].headers["Authorization"] == f"t {VALUE}" and VALUE not in r.stdout
            r = await sh(sb, f"{curl} https://127.0.0.1:{other.port}/other")
            assert r.exit_code != 0 and not other.seen  # not intercepted: the sandbox does not know that CA
            await sb.files.write("/tmp/up.pem", pki.ca_pem.read_bytes())
            r = await sh(sb, f"{curl} --cacert /tmp/up.pem https://127.0.0.1:{other.port}/other")
            assert r.exit_code == 0, r.stderr
            assert other.seen[-1].headers["Authorization"].startswith("t corral-secret-")
    finally:
        other.close()


async def test_an_untrusted_upstream_is_refused_naming_the_option(egress: Any, tls: Echo) -> None:
    engine, proxy, _ = egress
    proxy.upstream_tls = upstream_context()  # the host's store only: the test server's CA is unknown
    async with await engine.create(secret_spec(engine, tls)) as sb:
        r = await sh(sb, f'curl -sS -o /dev/null -w "%{{http_code}}" https://{BOUND}:{tls.port}/x; true')
        assert "502" in r.stdout + r.stderr or "CONNECT" in r.stderr, r.stdout + r.stderr
        assert not tls.seen or all(VALUE not in json.dumps(s.headers) for s in tls.seen)
        notices = [e.reason for e in r.egress_denials]
        assert any("--upstream-ca" in n for n in notices), notices


# -- bad input ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("secret, words", [
    ({"value": "", "hosts": ["a.example"]}, "empty"),
    ({"value": "x", "hosts": []}, "at least one host"),
    ({"value": "x\ny", "hosts": ["a.example"]}, "CR or LF"),
    ({"value": "x", "hosts": ["a b"]}, "invalid secret host .a b.: a host may not contain"),
    ({"value": "x", "hosts": ["a.*.example"]}, "wildcard"),
    ({"value": "x", "hosts": ["a.example:0"]}, "bad port"),
    ({"value": "x" * 9000, "hosts": ["a.example"]}, "at most"),
    ({"value": "x", "hosts": ["*.com"]}, "public suffix"),  # every .com site would get it
    ({"value": "x", "hosts": ["a.example", "*.CO.UK."]}, "public suffix"),
    ({"value": "x", "hosts": ["*.github.io"]}, "public suffix"),
])
def test_bad_secrets_are_refused(secret: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SecretRequest.model_validate(secret)


def test_wildcards_over_a_domain_of_its_own_are_kept() -> None:
    hosts = ["*.example.org", "*.api.github.com", "*.mine.github.io", "*.example.co.uk"]
    assert SecretRequest.model_validate({"value": "x", "hosts": hosts}).hosts == hosts


async def test_a_secret_name_clashing_with_env_is_refused(egress: Any) -> None:
    engine, _, _ = egress
    with pytest.raises(InvalidRequestError, match="both in env and in secrets"):
        seal_secrets({"TOKEN": SecretRequest(value="v", hosts=["a.example"])}, {"TOKEN": "x"}, engine.keyring)


# -- through the API: sealed in the database, names and hosts in the audit, never the value ---------------------------


@pytest.fixture
async def api(test_home: Path, tmp_path: Path, pki: UpstreamPki) -> AsyncIterator[Api]:
    ca = CertificateAuthority.load_or_create(tmp_path / "egress-ca")
    proxy = EgressProxy(ca=ca, upstream_tls=upstream_context(pki.ca_pem))
    engine = make_engine(test_home, egress=proxy)
    store = ControlStore(home=tmp_path)
    app = create_app(engine, store)
    async with app.router.lifespan_context(app):
        await store.bootstrap_admin(None)
        tenant = (await store.create_tenant("a")).id
        new = await store.create_key(tenant, Role.DEVELOPER, "dev")
        op = await store.create_key(tenant, Role.OPERATOR, "op")
        try:
            yield Api(app, store, engine, {"a_dev": new.key, "a_op": op.key},
                      {"a_dev": new.info.id, "a_op": op.info.id}, {"a": tenant})
        finally:
            for sb in engine.list():
                await engine.destroy(sb.id)
            ca.close()


async def test_through_the_api_the_value_is_sealed_and_never_audited(api: Api, tls: Echo, tmp_path: Path) -> None:
    async with api.client("a_op") as op, api.client("a_dev") as dev:
        await api.store.grants.grant(api.tenants["a"], f"127.0.0.1:{tls.port}")  # an admin's grant (docs/egress.md)
        r = await op.put("/v1/tenants/a/egress", json={"private": [f"127.0.0.1:{tls.port}"]})
        assert r.status_code == 200, r.text
        sb = await create(dev, network=[BOUND], secrets={"TOKEN": {"value": VALUE, "hosts": [BOUND]}})
        out = await run(dev, sb["id"], f'curl -sS -H "Authorization: Bearer $TOKEN" https://{BOUND}:{tls.port}/api')
        stdout = base64.b64decode(out["stdout_b64"])
        assert out["exit_code"] == 0 and b"corral-secret-" in stdout and VALUE.encode() not in stdout, out
        assert tls.seen[-1].headers["Authorization"] == f"Bearer {VALUE}"
        injected = await _injected_records(api)  # the tunnel's record is written when curl's connection ends
        records = await api.store.audit.query()
        created = next(r for r in records if r.action == "sandbox.create")
        assert created.params["secrets"] == {"TOKEN": {"hosts": [BOUND], "body": False}}
        assert injected and injected[-1].outcome["secrets_injected"] == ["TOKEN"]
        assert injected[-1].params["host"] == BOUND and injected[-1].target == sb["id"]
        assert not any(VALUE in json.dumps([r.params, r.outcome]) for r in records)
    database = b"".join(p.read_bytes() for p in tmp_path.glob("corral.db*"))
    assert database and VALUE.encode() not in database


async def _injected_records(api: Api) -> list[Any]:
    for _ in range(100):  # bounded: 10 s
        records = await api.store.audit.query(action="egress.connect")
        found = [r for r in records if r.outcome.get("secrets_injected")]
        if found:
            return found
        await anyio.sleep(0.1)
    return []


@pytest.mark.parametrize("secrets, words", [
    ({"TOKEN": {"value": "v", "hosts": ["a b"]}}, "invalid secret host"),
    ({"TOKEN": {"value": "v"}}, "hosts"),
    ({"1BAD": {"value": "v", "hosts": ["a.example"]}}, "not a valid environment variable name"),
    ({"TOKEN": {"value": "v", "hosts": ["a.example"], "extra": 1}}, "extra"),
    ({"HOME": {"value": "v", "hosts": ["a.example"]}}, "both in env and in secrets"),
])
async def test_bad_secrets_are_400_and_create_nothing(api: Api, secrets: dict[str, Any], words: str) -> None:
    async with api.client("a_dev") as dev:
        r = await dev.post("/v1/sandboxes", json={"template": TEMPLATE, "secrets": secrets, "env": {"HOME": "/x"}})
        assert r.status_code == 400 and error_code(r) == "invalid_request", r.text
        assert words in r.text and "\"v\"" not in r.text
        assert (await dev.get("/v1/sandboxes")).json()["sandboxes"] == []


# -- the rewriting path keeps bytes exact: big answers, chunked and big request bodies, several requests a connection --


@pytest.mark.parametrize("body", [False, True])
async def test_rewritten_connections_keep_bytes_exact(egress: Any, tls: Echo, plain: Echo, body: bool) -> None:
    engine, _, _ = egress
    mib = 2**20
    async with await engine.create(secret_spec(engine, tls, plain, body=body)) as sb:
        await sb.files.write("/tmp/body.bin", BLOB[:3 * mib])
        await sh(sb, 'printf "%s" "$TOKEN" >> /tmp/body.bin')
        sent = BLOB[:3 * mib] + (VALUE.encode() if body else (await sh(sb, 'printf "%s" "$TOKEN"')).stdout.encode())
        for base in (f"https://{BOUND}:{tls.port}", f"http://{BOUND}:{plain.port}"):
            # two requests on one connection (curl reuses it), each a 24 MiB answer
            r = await sh(sb, f"curl -sS {base}/bytes/{len(BLOB)} {base}/bytes/{len(BLOB)} | sha256sum")
            assert r.stdout.split()[0] == hashlib.sha256(BLOB + BLOB).hexdigest(), r.stderr
            # a 3 MiB body (curl sends Expect: 100-continue): the placeholder at its end is the value only if opted in
            r = await sh(sb, f"curl -sS --data-binary @/tmp/body.bin {base}/sha256")
            assert r.stdout == hashlib.sha256(sent).hexdigest(), r.stdout + r.stderr
            # chunked, as a client streaming its upload sends it
            r = await sh(sb, f'curl -sS -H "Transfer-Encoding: chunked" --data-binary @/tmp/body.bin {base}/sha256')
            assert r.stdout == hashlib.sha256(sent).hexdigest(), r.stdout + r.stderr
            # 24 MiB streamed through; bodies opted in are read whole, bounded: a clear 413 past 8 MiB
            r = await sh(sb, f'head -c {len(BLOB)} /dev/zero | curl -sS -H "Transfer-Encoding: chunked" '
                             f'--data-binary @- {base}/sha256')
            if body:
                # The proxy answers 413 and closes while curl still sends: on a loaded machine curl can meet the
                # close ("Send failure: Broken pipe", exit 55) before it reads the answer. The refusal's reason
                # reaches the command's result either way.
                reasons = " ".join(d.reason for d in r.egress_denials)
                assert "larger than 8388608 bytes" in r.stdout + reasons, r.stdout + r.stderr
                assert ("413" in r.stdout) or r.exit_code == 55, r.stdout + r.stderr
            else:
                assert r.stdout == hashlib.sha256(bytes(len(BLOB))).hexdigest(), r.stdout + r.stderr


# -- stored secrets: an operator stores a value once, sandboxes ask for it by name ---------------------------------


async def test_stored_secrets_by_name(api: Api, tls: Echo, tmp_path: Path) -> None:
    transport = httpx.ASGITransport(app=api.app)
    async with api.client("a_op") as op, api.client("a_dev") as dev:
        await api.store.grants.grant(api.tenants["a"], f"127.0.0.1:{tls.port}")  # an admin's grant (docs/egress.md)
        assert (await op.put("/v1/tenants/a/egress", json={"private": [f"127.0.0.1:{tls.port}"]})).status_code == 200
        stored = await AsyncSecret.put("github", VALUE, hosts=[BOUND, "*.example.org"], api_key=api.keys["a_op"],
                                       base_url=BASE, transport=transport)
        assert (stored.name, stored.hosts, stored.body) == ("github", (BOUND, "*.example.org"), False)
        r = await dev.put("/v1/secrets/mine", json={"value": "x", "hosts": ["a.example"]})
        assert r.status_code == 403, r.text  # developers use stored secrets, operators store them
        listed = (await dev.get("/v1/secrets")).json()["secrets"]
        assert [s["name"] for s in listed] == ["github"] and VALUE not in json.dumps(listed)
        sb = await create(dev, network=[BOUND], secrets={"GH": {"stored": "github", "hosts": [BOUND]}})
        out = await run(dev, sb["id"], f'curl -sS -H "Authorization: Bearer $GH" https://{BOUND}:{tls.port}/s')
        assert out["exit_code"] == 0 and VALUE.encode() not in base64.b64decode(out["stdout_b64"]), out
        assert tls.seen[-1].headers["Authorization"] == f"Bearer {VALUE}"
        for bad, words in (({"stored": "github", "hosts": ["other.example"]}, "not among them"),
                           ({"stored": "nope"}, "no stored secret named 'nope'"),
                           ({"stored": "github", "value": "v", "hosts": ["a.example"]}, "either a value")):
            r = await dev.post("/v1/sandboxes", json={"template": TEMPLATE, "secrets": {"GH": bad}})
            assert r.status_code == 400 and words in r.text, r.text
        assert (await dev.delete("/v1/secrets/github")).status_code == 403
        assert (await op.delete("/v1/secrets/github")).status_code == 204
        assert (await op.delete("/v1/secrets/github")).status_code == 404
        assert (await dev.get("/v1/secrets")).json()["secrets"] == []
    records = await api.store.audit.query()
    put = next(r for r in records if r.action == "secret.put")
    assert put.params["hosts"] == [BOUND, "*.example.org"] and put.target == "github"
    assert not any(VALUE in json.dumps([r.params, r.outcome]) for r in records)
    database = b"".join(p.read_bytes() for p in tmp_path.glob("corral.db*"))
    assert VALUE.encode() not in database


async def test_a_fork_keeps_its_parents_secrets_and_trust(egress: Any, tls: Echo) -> None:
    engine, _, _ = egress
    async with await engine.create(secret_spec(engine, tls)) as sb:
        async with await sb.fork() as child:
            r = await sh(child, f'curl -sS -H "Authorization: Bearer $TOKEN" https://{BOUND}:{tls.port}/fork')
            assert r.exit_code == 0 and VALUE not in r.stdout, r.stderr
            assert tls.seen[-1].headers["Authorization"] == f"Bearer {VALUE}"
