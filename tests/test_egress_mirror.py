"""The package mirror against real PyPI and npm (pip itself, through a loopback server), and against loopback fakes
for what real registries never do: wrong bytes, errors, outages, oversized answers."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import NoReturn

import httpx
import pytest

from corral.egress import _mirror, _mirror_cache
from corral.egress._events import MirrorResponse, PackageMirrorProtocol
from corral.egress._mirror import NPM_ABBREVIATED, PYPI_JSON, PackageMirror

pytestmark = pytest.mark.anyio

SIX_WHEEL_SHA256 = "8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254"  # PyPI's, for six 1.16.0
Handler = Callable[[str, str, list[tuple[str, str]]], Awaitable[MirrorResponse]]


class LoopbackServer:
    """A minimal HTTP/1.1 server (one request per connection) that answers with a handler's MirrorResponse, as the
    egress proxy does: a body that fails part-way cuts the connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.errors: list[BaseException] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, target, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
            headers = []
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers.append((name.strip(), value.strip()))
            response = await self.handler(method, target, headers)
            head = [f"HTTP/1.1 {response.status} {response.reason}", *(f"{k}: {v}" for k, v in response.headers),
                    "Connection: close", "", ""]
            writer.write("\r\n".join(head).encode("latin-1"))
            async with contextlib.aclosing(response.body) as body:  # type: ignore[type-var]
                async for chunk in body:
                    if method != "HEAD":
                        writer.write(chunk)
                        await writer.drain()
            writer.close()
        except Exception as exc:
            self.errors.append(exc)
            writer.transport.abort()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[LoopbackServer]:
    server = LoopbackServer(handler)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    async with listener:
        yield server


async def body_of(data: bytes) -> AsyncIterator[bytes]:
    yield data


def answer(status: int, data: bytes = b"", content_type: str = "application/octet-stream") -> MirrorResponse:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(data)))]
    return MirrorResponse(status, "Whatever", headers, body_of(data))


def cached_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "files").rglob("*") if p.is_file())


@pytest.fixture
async def mirror(tmp_path: Path) -> AsyncIterator[PackageMirror]:
    mirror = PackageMirror(tmp_path / "cache")
    yield mirror
    await mirror.close()


@pytest.fixture
async def server(mirror: PackageMirror) -> AsyncIterator[LoopbackServer]:
    async with serve(mirror.handle) as server:
        yield server


@pytest.fixture(scope="session")
def pip() -> list[str]:
    """A Python that has pip (the test venv may not)."""
    for python in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if python and subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [python, "-m", "pip"]
    pytest.fail("no python with pip found (tried the test interpreter, python3 and /usr/bin/python3)")


async def run_pip(pip: list[str], *args: str) -> float:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(*pip, *args, env=env, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT)
    output, _ = await process.communicate()
    assert process.returncode == 0, output.decode(errors="replace")
    return time.perf_counter() - started


# --- real pip against real PyPI ---


@pytest.mark.slow
async def test_pip_download_fills_the_cache_then_is_served_from_it(pip, mirror, server, tmp_path):
    index = f"{server.url}/pypi/simple/"
    args = ["download", "--no-deps", "--no-cache-dir", "--retries", "0", "--index-url", index, "six==1.16.0"]
    first = await run_pip(pip, *args, "-d", str(tmp_path / "one"))
    after_first = mirror.stats
    assert after_first["misses"] >= 2 and after_first["bytes_from_upstream"] > 11_000  # the page and the wheel
    wheel = tmp_path / "one" / "six-1.16.0-py2.py3-none-any.whl"
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == SIX_WHEEL_SHA256
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in cached_files(tmp_path / "cache")] == [SIX_WHEEL_SHA256]

    second = await run_pip(pip, *args, "-d", str(tmp_path / "two"))
    stats = mirror.stats
    assert stats["misses"] == after_first["misses"]
    assert stats["bytes_from_upstream"] == after_first["bytes_from_upstream"]
    assert stats["hits"] >= after_first["hits"] + 2
    assert (tmp_path / "two" / wheel.name).read_bytes() == wheel.read_bytes()
    assert not server.errors
    print(f"\npip download six: first {first:.2f}s, cached {second:.2f}s, stats {stats}")


@pytest.mark.slow
async def test_pip_install_resolves_dependencies_through_the_mirror(pip, mirror, server, tmp_path):
    target = tmp_path / "site"
    await run_pip(pip, "install", "--no-cache-dir", "--retries", "0", "--only-binary", ":all:", "--target",
                  str(target), "--index-url", f"{server.url}/pypi/simple/", "requests")
    installed = {p.name.split("-")[0].lower() for p in target.glob("*.dist-info")}
    assert {"requests", "urllib3", "idna", "certifi", "charset_normalizer"} <= installed
    assert len(cached_files(tmp_path / "cache")) >= 5
    assert mirror.stats["rejected"] == 0 and not server.errors


# --- index pages and files over HTTP ---


async def test_simple_html_rewrites_links_and_keeps_hashes_and_metadata(server):
    async with httpx.AsyncClient(base_url=server.url) as client:
        page = await client.get("/pypi/simple/Requests/", headers={"Accept": "text/html"})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        links = re.findall(r'<a href="([^"]+)"([^>]*)>', page.text)
        assert links and all(href.startswith("/pypi/files/packages/") and "#sha256=" in href for href, _ in links)
        assert "files.pythonhosted.org" not in page.text
        assert any("data-requires-python=" in attrs for _, attrs in links)
        # PEP 658: the metadata file sits beside the wheel (this PyPI does not advertise it; pip may still ask).
        wheel = next(href for href, _ in reversed(links) if ".whl#" in href)
        metadata = await client.get(wheel.split("#")[0] + ".metadata")
        assert metadata.status_code == 200 and b"Name: requests" in metadata.content

        as_json = await client.get("/pypi/simple/requests/", headers={"Accept": PYPI_JSON})
        assert as_json.headers["content-type"] == PYPI_JSON
        files = as_json.json()["files"]
        assert all(f["url"].startswith("/pypi/files/packages/") for f in files)
        assert as_json.headers["x-corral-mirror"] == "hit"  # the same upstream page, cached once


async def test_npm_metadata_and_tarball_are_rewritten_verified_and_cached(mirror, server, tmp_path):
    async with httpx.AsyncClient(base_url=server.url) as client:
        meta = await client.get("/npm/is-number", headers={"Accept": NPM_ABBREVIATED + ", application/json;q=0.8"})
        assert meta.status_code == 200  # (this registry answers full metadata whatever the Accept: see the fake)
        dist = meta.json()["versions"]["7.0.0"]["dist"]
        assert dist["tarball"] == "http://127.0.0.1:3128/npm/is-number/-/is-number-7.0.0.tgz"
        full = await client.get("/npm/is-number", headers={"Accept": "application/json"})
        assert full.status_code == 200 and full.headers["x-corral-mirror"] == "miss"  # its own cache entry

        path = dist["tarball"].removeprefix("http://127.0.0.1:3128")
        first = await client.get(path)
        algorithm, _, digest = dist["integrity"].partition("-")
        assert algorithm == "sha512" and hashlib.sha512(first.content).digest() == base64.b64decode(digest)
        again = await client.get(path)
        assert again.content == first.content and again.headers["x-corral-mirror"] == "hit"
        assert len(cached_files(tmp_path / "cache")) == 1

        for scoped in ("/npm/@isaacs%2fstring-locale-compare", "/npm/@isaacs/string-locale-compare"):
            response = await client.get(scoped, headers={"Accept": NPM_ABBREVIATED})
            assert response.status_code == 200, response.text
            assert all(v["dist"]["tarball"].startswith("http://127.0.0.1:3128/npm/@isaacs/string-locale-compare/-/")
                       for v in response.json()["versions"].values())
    assert mirror.stats["rejected"] == 0 and not server.errors


async def test_npm_tarball_requested_first_learns_its_digest_from_metadata(mirror, server):
    async with httpx.AsyncClient(base_url=server.url) as client:
        tarball = await client.get("/npm/is-number/-/is-number-7.0.0.tgz")
    assert tarball.status_code == 200
    assert hashlib.sha1(tarball.content).hexdigest() == "7535345b896734d5f80c4d06c50955527a14f12b"
    assert mirror._digests["npm:is-number/-/is-number-7.0.0.tgz"].algorithm == "sha512"


async def test_concurrent_identical_downloads_leave_one_correct_cache_file(mirror, server, tmp_path):
    async with httpx.AsyncClient(base_url=server.url) as client:
        page = await client.get("/pypi/simple/six/", headers={"Accept": PYPI_JSON})
        url = next(f["url"] for f in page.json()["files"] if f["filename"] == "six-1.16.0-py2.py3-none-any.whl")
        responses = await asyncio.gather(*(client.get(url) for _ in range(6)))
    assert {hashlib.sha256(r.content).hexdigest() for r in responses} == {SIX_WHEEL_SHA256}
    files = list((tmp_path / "cache" / "files").rglob("*"))
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()] == [SIX_WHEEL_SHA256]
    assert not [p for p in files if p.name.endswith(".tmp")]


async def test_cache_layout_uses_hashed_names_and_fixed_modes(server, tmp_path):
    async with httpx.AsyncClient(base_url=server.url) as client:
        await client.get("/npm/is-number/-/is-number-7.0.0.tgz")
    cache = tmp_path / "cache"
    for path in cache.rglob("*"):
        assert re.fullmatch(r"index|files|[0-9a-f]{2}|[0-9a-f]{64}", path.name), path
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


# --- refusals ---


async def test_it_is_what_the_proxy_expects(mirror):
    seam: PackageMirrorProtocol = mirror  # checked by mypy
    assert seam.handles("/pypi/simple/six/") and seam.handles("/npm/x?write=true")
    assert not seam.handles("/pypi") and not seam.handles("/_corral/dns") and not seam.handles("/npmx/")


@pytest.mark.parametrize("path", [
    "/pypi/files/packages/../../etc/passwd", "/pypi/files/packages/%2e%2e/%2e%2e/etc/passwd",
    "/npm/%2e%2e%2f%2e%2e/x", "/pypi/simple/six%00/", "/pypi/files//etc/passwd", "/pypi/files/packages/a%5c..%5cb",
    "/pypi/simple/..%2f..%2fx/", "/pypi/%ff/", "/npm/is-number/-/../../x.tgz", "/pypi/files/packages/./x",
])
async def test_path_traversal_is_refused_without_going_upstream(tmp_path, path):
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500)

    client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    mirror = PackageMirror(tmp_path / "cache", client=client)
    response = await mirror.handle("GET", path, [])
    assert response.status == 400, (path, response.reason)
    assert not seen
    await client.aclose()


@pytest.mark.parametrize("path", ["/pypi/", "/pypi/simple/not a name/", "/npm/", "/npm/a/b/c", "/npm/x/-/y.zip",
                                  "/pypi/files/elsewhere/x.whl", "/other"])
async def test_paths_outside_the_mirror_are_404(tmp_path, path):
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: pytest.fail(f"went upstream: {r.url}"))) as c:
        mirror = PackageMirror(tmp_path / "cache", client=c)
        assert (await mirror.handle("GET", path, [])).status == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "CONNECT"])
async def test_other_methods_are_405(mirror, method):
    response = await mirror.handle(method, "/pypi/simple/six/", [])
    assert response.status == 405 and ("Allow", "GET, HEAD") in response.headers
    assert mirror.stats["misses"] == 0


async def test_head_answers_without_a_body(server):
    async with httpx.AsyncClient(base_url=server.url) as client:
        await client.get("/npm/is-number/-/is-number-7.0.0.tgz")
        head = await client.head("/npm/is-number/-/is-number-7.0.0.tgz")
        page = await client.head("/npm/is-number")
    assert head.status_code == 200 and int(head.headers["content-length"]) > 1000 and head.content == b""
    assert page.status_code == 200 and page.content == b""


# --- a registry that misbehaves (a loopback fake) ---


class FakeRegistry:
    """Serves a PEP 691 page and npm metadata promising `good`, then serves `served` as the file."""

    def __init__(self, good: bytes, served: bytes) -> None:
        self.good, self.served = good, served
        self.status = 200
        self.metadata = b"Name: pkg\n"
        self.accepts: list[str] = []
        self.url = ""

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]]) -> MirrorResponse:
        if self.status != 200:
            return answer(self.status)
        if path == "/simple/pkg/":
            page = {"meta": {"api-version": "1.1"}, "name": "pkg", "files": [{
                "filename": "pkg-1.0-py3-none-any.whl", "url": f"{self.url}/packages/x/pkg-1.0-py3-none-any.whl",
                "hashes": {"sha256": hashlib.sha256(self.good).hexdigest()}, "requires-python": ">=3.8",
                "core-metadata": {"sha256": hashlib.sha256(b"Name: pkg\n").hexdigest()}, "yanked": "broken"}]}
            return answer(200, json.dumps(page).encode(), PYPI_JSON)
        if path == "/pkg":
            self.accepts.append(dict(headers).get("Accept", ""))
            integrity = "sha512-" + base64.b64encode(hashlib.sha512(self.good).digest()).decode()
            meta = {"name": "pkg", "versions": {"1.0.0": {"dist": {
                "tarball": f"{self.url}/pkg/-/pkg-1.0.0.tgz", "integrity": integrity}}}}
            return answer(200, json.dumps(meta).encode(), self.accepts[-1].split(",")[0])
        if path == "/packages/x/pkg-1.0-py3-none-any.whl.metadata":
            return answer(200, self.metadata)
        if path in ("/packages/x/pkg-1.0-py3-none-any.whl", "/pkg/-/pkg-1.0.0.tgz"):
            return answer(200, self.served)
        return answer(404)


@contextlib.asynccontextmanager
async def fake_setup(tmp_path: Path, good: bytes, served: bytes, index_ttl: float = 600) -> AsyncIterator[
        tuple[FakeRegistry, PackageMirror, LoopbackServer]]:
    fake = FakeRegistry(good, served)
    async with serve(fake.handle) as upstream:
        fake.url = upstream.url
        mirror = PackageMirror(tmp_path / "cache", pypi=upstream.url, files=upstream.url, npm=upstream.url,
                               index_ttl=index_ttl)
        async with serve(mirror.handle) as front:
            yield fake, mirror, front
        await mirror.close()


FAKE_FILES = {"pypi": ("/pypi/simple/pkg/", "/pypi/files/packages/x/pkg-1.0-py3-none-any.whl"),
              "npm": ("/npm/pkg", "/npm/pkg/-/pkg-1.0.0.tgz")}


@pytest.mark.parametrize("registry", ["pypi", "npm"])
async def test_wrong_bytes_are_cut_off_and_never_cached(tmp_path, registry):
    good = os.urandom(300_000)
    bad = bytearray(good)
    bad[-1] ^= 1  # only the very end differs: the client must still not get a complete file
    index, file = FAKE_FILES[registry]
    async with fake_setup(tmp_path, good, bytes(bad)) as (fake, mirror, front), \
            httpx.AsyncClient(base_url=front.url) as client:
        assert (await client.get(index)).status_code == 200
        for _ in range(2):
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(file)
        assert mirror.stats["rejected"] == 2 and "wrong digest" in str(front.errors[-1])
        assert cached_files(tmp_path / "cache") == []

        fake.served = good
        assert (await client.get(file)).content == good
        assert [p.read_bytes() for p in cached_files(tmp_path / "cache")] == [good]


async def test_html_keeps_metadata_and_yanked_attributes_and_metadata_files_are_verified(tmp_path):
    async with fake_setup(tmp_path, b"x", b"x") as (fake, mirror, front), \
            httpx.AsyncClient(base_url=front.url) as client:
        page = (await client.get("/pypi/simple/pkg/", headers={"Accept": "text/html"})).text
        digest = hashlib.sha256(b"Name: pkg\n").hexdigest()
        href = "/pypi/files/packages/x/pkg-1.0-py3-none-any.whl"
        assert (f'<a href="{href}#sha256={hashlib.sha256(b"x").hexdigest()}" data-requires-python="&gt;=3.8" '
                f'data-dist-info-metadata="sha256={digest}" data-core-metadata="sha256={digest}" '
                f'data-yanked="broken">pkg-1.0-py3-none-any.whl</a>') in page
        fake.metadata = b"Name: evil\n"
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(href + ".metadata")
        fake.metadata = b"Name: pkg\n"
        assert (await client.get(href + ".metadata")).content == b"Name: pkg\n"
        assert mirror.stats["rejected"] == 1


async def test_npm_abbreviated_metadata_is_asked_upstream_and_cached_apart(tmp_path):
    async with fake_setup(tmp_path, b"x", b"x") as (fake, mirror, _):
        for accept in (NPM_ABBREVIATED + "; q=1.0, application/json; q=0.8, */*", "application/json", "", "*/*"):
            response = await mirror.handle("GET", "/npm/pkg", [("accept", accept)])
            assert response.status == 200
        assert fake.accepts == [NPM_ABBREVIATED, "application/json"]
        assert dict(response.headers)["Content-Type"] == "application/json"
        assert (mirror.stats["misses"], mirror.stats["hits"]) == (2, 2)


async def test_a_failing_disk_costs_the_cache_not_the_download(tmp_path, monkeypatch):
    def full(path: Path) -> NoReturn:
        raise OSError(28, "No space left on device")

    async with fake_setup(tmp_path, b"z" * 1000, b"z" * 1000) as (_, mirror, front), \
            httpx.AsyncClient(base_url=front.url) as client:
        monkeypatch.setattr(_mirror_cache, "create", full)
        assert (await client.get("/npm/pkg")).status_code == 200
        for _ in range(2):
            assert (await client.get("/npm/pkg/-/pkg-1.0.0.tgz")).content == b"z" * 1000
        assert mirror.stats["misses"] == 3 and cached_files(tmp_path / "cache") == []


async def test_upstream_errors_become_502_504_or_404(tmp_path):
    async with fake_setup(tmp_path, b"x", b"x") as (fake, mirror, _):
        fake.status = 503
        response = await mirror.handle("GET", "/pypi/simple/pkg/", [])
        assert response.status == 502 and "127.0.0.1" in response.reason and "503" in response.reason
        fake.status = 404
        assert (await mirror.handle("GET", "/npm/pkg", [])).status == 404

    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    for transport, status in ((httpx.MockTransport(timeout), 504), (httpx.AsyncHTTPTransport(), 502)):
        async with httpx.AsyncClient(transport=transport) as client:
            # Port 9 (discard) on loopback has no listener here: a connection error.
            mirror = PackageMirror(tmp_path / "other", client=client, pypi="http://127.0.0.1:9")
            response = await mirror.handle("GET", "/pypi/simple/six/", [])
            assert response.status == status and "127.0.0.1:9" in response.reason, response.reason


async def test_stale_index_page_is_served_when_upstream_is_down(tmp_path):
    async with fake_setup(tmp_path, b"x", b"x", index_ttl=0) as (fake, mirror, _):
        first = await mirror.handle("GET", "/pypi/simple/pkg/", [])
        assert first.status == 200 and ("X-Corral-Mirror", "miss") in first.headers
        fake.status = 500
        stale = await mirror.handle("GET", "/pypi/simple/pkg/", [("Accept", PYPI_JSON)])
        state = dict(stale.headers)["X-Corral-Mirror"]
        assert stale.status == 200 and state.startswith("stale") and "500" in state
        body = b"".join([chunk async for chunk in stale.body])
        assert json.loads(body)["files"][0]["url"] == "/pypi/files/packages/x/pkg-1.0-py3-none-any.whl"
        assert mirror.stats["stale"] == 1


async def test_oversized_answers_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(_mirror, "MAX_INDEX_BYTES", 100)
    monkeypatch.setattr(_mirror, "MAX_FILE_BYTES", 1000)
    async with fake_setup(tmp_path, b"y" * 5000, b"y" * 5000) as (_, mirror, _front):
        page = await mirror.handle("GET", "/pypi/simple/pkg/", [])
        assert page.status == 502 and "limit" in page.reason
        file = await mirror.handle("GET", "/pypi/files/packages/x/pkg-1.0-py3-none-any.whl", [])
        assert file.status == 502 and "limit" in file.reason
        assert cached_files(tmp_path / "cache") == []
