"""The standalone egress proxy (`corral egress-proxy`, for Pods): one TCP listener, each request as the sandbox its
`Proxy-Authorization` names, that sandbox's policy from the shared database, the same refusals and audit records
as the server's own proxy, refusals recorded before they are answered. Real sockets, a real control store
(SQLite), curl as the client where a client's own behaviour matters; every wait is bounded."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.backends import SandboxSpec
from corral.backends.kubernetes import TokenKey
from corral.control import ControlStore, Role, TenantEgress
from corral.egress import EgressProxy
from corral.service import EgressDirectory
from corral.service._egress import recorded_denials

from .test_egress_proxy import FakeMirror, Upstream, exchange, split_response

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # a proxy process per test, seconds each

WAIT = 20.0
SECRET = b"the servers' shared secret"


@dataclass
class Rig:
    store: ControlStore
    key: TokenKey
    proxy: EgressProxy
    port: int
    upstream: Upstream
    tenant_id: str
    principal_key: str

    async def sandbox(self, network: str | list[str]) -> str:
        principal = await self.store.key_principal(self.principal_key)
        record = await self.store.reserve_sandbox(principal, SandboxSpec(template="default", network=network),
                                                  sandbox_id=f"sb-{secrets.token_hex(8)}")  # as the service names them
        await self.store.mark_running(record.id)
        return record.id

    def credentials(self, sandbox_id: str) -> str:
        return f"{sandbox_id}:{self.key.egress_credential(sandbox_id)}"

    def auth(self, sandbox_id: str, header: str = "Proxy-Authorization") -> bytes:
        token = base64.b64encode(self.credentials(sandbox_id).encode()).decode()
        return f"{header}: Basic {token}\r\n".encode()

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(WAIT):
            return await asyncio.open_connection("127.0.0.1", self.port)

    async def request(self, raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
        return await exchange(await self.open(), raw)

    def get(self, sandbox_id: str | None, target: str) -> bytes:
        auth = self.auth(sandbox_id) if sandbox_id else b""
        return f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode() + auth + b"\r\n"

    async def egress_records(self, expected: int) -> list[tuple[str, bool]]:
        """The egress audit records, once there are `expected` (an allowed attempt's is written after it ends;
        for 0, a moment for any that should not be there)."""
        deadline = time.monotonic() + (0.3 if expected == 0 else WAIT)
        while True:
            entries = await self.store.audit.query(limit=None)
            found = [(e.target or "", bool(e.outcome.get("allowed"))) for e in entries
                     if e.action.startswith("egress.")]
            if (expected and len(found) >= expected) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.02)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    store = ControlStore(f"sqlite+aiosqlite:///{tmp_path / 'corral.db'}", home=tmp_path)
    await store.start()
    tenant = await store.create_tenant("acme")
    key = await store.create_key(tenant.id, Role.OPERATOR)
    upstream = Upstream()
    upstream.server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    upstream.port = upstream.server.sockets[0].getsockname()[1]
    await store.grants.grant(tenant.id, f"127.0.0.1:{upstream.port}")  # an admin's grant (docs/egress.md)
    await store.set_tenant_egress(tenant.id, TenantEgress(private=[f"127.0.0.1:{upstream.port}"]))
    tokens = TokenKey(SECRET)
    directory = EgressDirectory(store, tokens.verify_egress, cache_ttl=0.3)
    proxy = EgressProxy(on_event=directory.record, mirror=FakeMirror(), idle_timeout=2.0, connect_timeout=3.0,
                        io_timeout=5.0)
    await proxy.start()
    (_, port), *_ = await proxy.listen("127.0.0.1", 0, directory.policy)
    try:
        yield Rig(store, tokens, proxy, port, upstream, tenant.id, key.info.id)
    finally:
        await proxy.close()
        upstream.server.close()
        await store.close()


async def test_a_sandbox_reaches_what_its_policy_allows_with_its_credential(rig: Rig) -> None:
    sandbox = await rig.sandbox(["127.0.0.1"])
    line, _, body = await rig.request(rig.get(sandbox, f"http://127.0.0.1:{rig.upstream.port}/bytes/5"))
    assert line == b"HTTP/1.1 200 OK" and len(body) == 5
    assert b"proxy-authorization" not in rig.upstream.heads[-1].lower()  # the credential stays with the proxy
    assert await rig.egress_records(1) == [(sandbox, True)]


async def test_curl_sends_the_credential_in_its_proxy_url_and_tunnels(rig: Rig) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed (scripts/install installs it)")
    sandbox = await rig.sandbox(["127.0.0.1"])
    proxy_url = f"http://{rig.credentials(sandbox)}@127.0.0.1:{rig.port}"
    for tunnel in ([], ["--proxytunnel"]):  # absolute-form, then CONNECT
        proc = await asyncio.create_subprocess_exec(
            curl, "-sS", "--max-time", "10", "-x", proxy_url, *tunnel, f"http://127.0.0.1:{rig.upstream.port}/bytes/7",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        async with asyncio.timeout(WAIT):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert len(out) == 7
    assert await rig.egress_records(2) == [(sandbox, True), (sandbox, True)]


async def test_a_refusal_is_recorded_before_the_sandbox_sees_it(rig: Rig) -> None:
    sandbox = await rig.sandbox(["pypi.org"])
    since = time.time()
    line, headers, body = await rig.request(rig.get(sandbox, "http://blocked.example/"))
    assert line.startswith(b"HTTP/1.1 403 Corral egress denied: blocked.example is not in this sandbox's allowlist")
    assert "rule=not in allowlist" in headers["x-corral-egress"]
    # No wait: the server that ran the command reads the trail as soon as the command has ended.
    denials = await recorded_denials(rig.store, sandbox, since)
    assert [(d.host, d.port, d.allowed, d.kind) for d in denials] == [("blocked.example", 80, False, "http")]
    assert denials[0].reason in body.decode()
    entry = (await rig.store.audit.query(sandbox=sandbox))[-1]
    assert entry.tenant_id == rig.tenant_id and entry.key_id == rig.principal_key  # attributed like the server's
    assert await recorded_denials(rig.store, sandbox, time.time() + 1) == []  # only those since the command began


@pytest.mark.parametrize("case", ["missing", "another sandbox's", "not basic", "garbage", "unknown sandbox",
                                  "destroyed sandbox"])
async def test_bad_credentials_are_407_and_reach_nothing(rig: Rig, case: str) -> None:
    sandbox, other = await rig.sandbox("internet"), await rig.sandbox("internet")
    target = f"http://127.0.0.1:{rig.upstream.port}/bytes/1"
    head = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if case == "destroyed sandbox":
        await rig.store.mark_destroyed(sandbox)
    header = {
        "missing": "",
        "another sandbox's": "Proxy-Authorization: Basic " + base64.b64encode(
            f"{sandbox}:{rig.key.egress_credential(other)}".encode()).decode() + "\r\n",
        "not basic": "Proxy-Authorization: Bearer abc\r\n",
        "garbage": "Proxy-Authorization: Basic %%%\r\n",
        "unknown sandbox": rig.auth("sb-0000000000000000").decode(),
        "destroyed sandbox": rig.auth(sandbox).decode(),
    }[case]
    line, headers, _ = await rig.request((head + header + "\r\n").encode())
    assert line.startswith(b"HTTP/1.1 407 Corral egress proxy: proxy credentials refused"), line
    assert headers["proxy-authenticate"] == 'Basic realm="corral-egress"'
    assert rig.upstream.heads == []
    assert await rig.egress_records(0) == []  # nobody to attribute it to: logged, not audited per sandbox


async def test_a_connection_keeps_its_sandbox_for_requests_without_credentials(rig: Rig) -> None:
    first, second = await rig.sandbox(["127.0.0.1"]), await rig.sandbox("none")
    target = f"http://127.0.0.1:{rig.upstream.port}/bytes/3"
    reader, writer = await rig.open()
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n".encode() + rig.auth(first) + b"\r\n"
                 + f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()  # no credentials: still the first
                 + f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode() + rig.auth(second) + b"\r\n")
    async with asyncio.timeout(WAIT):
        data = await reader.read()
    writer.close()
    assert data.count(b"HTTP/1.1 200 OK") == 2
    assert b"HTTP/1.1 403 Corral egress denied" in data and b"(policy: none)" in data
    # An allowed attempt's record is written after it ends, off the connection's path: the denial that
    # follows it on the same connection may be written first, so the records are compared as a set.
    assert sorted(await rig.egress_records(3)) == sorted([(first, True), (first, True), (second, False)])


async def test_a_policy_change_reaches_the_proxy_within_its_cache_ttl(rig: Rig) -> None:
    sandbox = await rig.sandbox(["127.0.0.1"])
    target = f"http://127.0.0.1:{rig.upstream.port}/bytes/1"
    assert (await rig.request(rig.get(sandbox, target)))[0] == b"HTTP/1.1 200 OK"
    await rig.store.set_sandbox_network(sandbox, "none")
    deadline = time.monotonic() + 5
    while (line := (await rig.request(rig.get(sandbox, target)))[0]) == b"HTTP/1.1 200 OK":
        assert time.monotonic() < deadline, "the new policy never reached the proxy"
        await asyncio.sleep(0.05)
    assert line.startswith(b"HTTP/1.1 403 Corral egress denied")


async def test_tenant_private_pairs_come_from_the_shared_database(rig: Rig) -> None:
    sandbox = await rig.sandbox("internet")
    target = f"http://127.0.0.1:{rig.upstream.port}/bytes/1"
    assert (await rig.request(rig.get(sandbox, target)))[0] == b"HTTP/1.1 200 OK"
    await rig.store.set_tenant_egress(rig.tenant_id, TenantEgress(private=[]))
    await asyncio.sleep(0.4)  # past the cache TTL (0.3 s)
    line, _, _ = await rig.request(rig.get(sandbox, target))
    assert line.startswith(b"HTTP/1.1 403 Corral egress denied: 127.0.0.1 (loopback)"), line


async def test_the_package_mirror_takes_the_credential_as_authorization(rig: Rig) -> None:
    # pip asks its index (PIP_INDEX_URL, with the credential in it) directly: origin-form, `Authorization`.
    granted, refused = await rig.sandbox(["@packages"]), await rig.sandbox(["pypi.org"])
    for sandbox, expected in ((granted, b"HTTP/1.1 200 OK"), (refused, b"HTTP/1.1 403 Corral egress denied: "
                                                                       b"package mirror needs the @packages preset")):
        raw = (b"GET /pypi/simple/numpy/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               + rig.auth(sandbox, "Authorization") + b"\r\n")
        line, _, _ = await rig.request(raw)
        assert line.startswith(expected), line
    line, _, _ = await rig.request(b"GET /pypi/simple/numpy/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert line.startswith(b"HTTP/1.1 407 ")


async def test_a_database_that_cannot_answer_is_503_not_a_pass(rig: Rig, tmp_path: Path) -> None:
    sandbox = await rig.sandbox("internet")
    db = tmp_path / "corral.db"
    await rig.store.close()  # its connections go; the next one opens a new, empty file: no tables
    db.rename(tmp_path / "away.db")
    try:
        line, _, _ = await rig.request(rig.get(sandbox, f"http://127.0.0.1:{rig.upstream.port}/bytes/1"))
    finally:
        await rig.store.close()
        (tmp_path / "away.db").replace(db)
    assert line.startswith(b"HTTP/1.1 503 Corral egress: cannot read the network policy of sandbox"), line
    assert rig.upstream.heads == []


# -- the command ----------------------------------------------------------------------------------------------------


def _proxy_env(home: Path, secret: str | None, audit_key: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CORRAL_ACCESS_SECRET", "CORRAL_DB_URL", "CORRAL_AUDIT_KEY")}
    env["CORRAL_HOME"] = str(home)
    if secret is not None:
        env["CORRAL_ACCESS_SECRET"] = secret
    if audit_key is not None:
        env["CORRAL_AUDIT_KEY"] = audit_key
    return env


def _corral() -> list[str]:
    return [sys.executable, "-c", "from corral.cli import main; main()"]


@contextlib.asynccontextmanager
async def _egress_proxy(tmp_path: Path, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`corral egress-proxy` on a free port with the rig's database and the servers' keys; SIGTERMed at the end,
    and it must then exit 0."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'corral.db'}"
    proc = await asyncio.create_subprocess_exec(
        *_corral(), "egress-proxy", "--port", "0", "--db", db, "--no-mirror", *args,
        env=_proxy_env(tmp_path / "proxy-home", SECRET.decode(), (tmp_path / "audit.key").read_text()),
        stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(WAIT):
            code = await proc.wait()
    assert code == 0


async def _said(proc: asyncio.subprocess.Process) -> str:
    """Its next line on stderr."""
    assert proc.stderr is not None
    async with asyncio.timeout(WAIT):
        return (await proc.stderr.readline()).decode()


async def test_corral_egress_proxy_serves_until_sigterm(rig: Rig, tmp_path: Path) -> None:
    sandbox = await rig.sandbox(["127.0.0.1"])
    async with _egress_proxy(tmp_path) as proc:
        line = await _said(proc)
        assert line.startswith("corral egress-proxy: listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        raw = rig.get(sandbox, f"http://127.0.0.1:{rig.upstream.port}/bytes/4")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        async with asyncio.timeout(WAIT):
            status, _, body = split_response(await reader.read())
        writer.close()
        assert status == b"HTTP/1.1 200 OK" and len(body) == 4
    assert (sandbox, True) in await rig.egress_records(1)  # its audit record, in the servers' database
    assert (await rig.store.audit.verify()).ok  # signed with the servers' audit key


async def test_corral_egress_proxy_counts_by_tenant_on_its_metrics_port(rig: Rig, tmp_path: Path) -> None:
    # Prometheus' own parser reads what a scraper reads; one allowed attempt and one refused, by the sandboxes'
    # tenant (the proxy learns it from the database), and the bytes of the allowed one.
    allowed, refused = await rig.sandbox(["127.0.0.1"]), await rig.sandbox("none")
    async with _egress_proxy(tmp_path, "--metrics-port", "0") as proc:
        metrics_line, listening = await _said(proc), await _said(proc)
        assert metrics_line.startswith("corral egress-proxy: metrics on 127.0.0.1:"), metrics_line
        metrics_url = "http://" + metrics_line.split(" on ", 1)[1].strip()
        port = int(listening.rsplit(":", 1)[1])
        for sandbox, expected in ((allowed, b"HTTP/1.1 200 OK"), (refused, b"HTTP/1.1 403 ")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(rig.get(sandbox, f"http://127.0.0.1:{rig.upstream.port}/bytes/4096"))
            async with asyncio.timeout(WAIT):
                assert (await reader.read()).startswith(expected)
            writer.close()
        await rig.egress_records(2)  # counted when recorded
        async with httpx.AsyncClient(timeout=WAIT) as http:
            scraped = (await http.get(metrics_url)).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scraped) for s in family.samples}
    tenant = rig.tenant_id
    counted = [line for line in scraped.splitlines() if line.startswith("corral_egress")]
    # loopback is reached through the tenant's private pairs: rule class "private"
    assert samples.get(("corral_egress_requests_total",
                        (("decision", "allowed"), ("rule", "private"), ("tenant", tenant)))) == 1, counted
    assert samples[("corral_egress_requests_total",
                    (("decision", "denied"), ("rule", "policy_none"), ("tenant", tenant)))] == 1
    assert samples[("corral_egress_bytes_total", (("direction", "down"), ("tenant", tenant)))] > 4096
    assert any(name == "process_resident_memory_bytes" for name, _ in samples)


def test_a_taken_metrics_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = subprocess.run([*_corral(), "egress-proxy", "--port", "0", "--db", "sqlite+aiosqlite:///x.db",
                               "--metrics-port", str(taken.getsockname()[1])],
                              env=_proxy_env(tmp_path, "s", secrets.token_hex(32)), capture_output=True, text=True,
                              timeout=WAIT)
    assert done.returncode == 1 and "--metrics-port: cannot listen on 127.0.0.1:" in done.stderr, done.stderr


@pytest.mark.parametrize(("args", "secret", "words", "code"), [
    (["--db", "sqlite+aiosqlite:////nonexistent/x.db"], None, "CORRAL_ACCESS_SECRET is not set", 1),
    (["--db", "sqlite+aiosqlite:////nonexistent/x.db"], "s", "CORRAL_AUDIT_KEY is not set", 1),
    ([], "s", "the servers' database is needed: set CORRAL_DB_URL or pass --db", 2),
])
def test_corral_egress_proxy_says_what_it_needs(tmp_path: Path, args: list[str], secret: str | None, words: str,
                                                 code: int) -> None:
    done = subprocess.run([*_corral(), "egress-proxy", "--port", "0", *args], env=_proxy_env(tmp_path, secret),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == code, done.stderr
    assert words in re.sub(r"[\s│╭╮╰╯─]+", " ", done.stderr)  # typer draws usage errors in a box
