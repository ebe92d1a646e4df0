"""The package mirror: pip and npm inside a sandbox reach PyPI and npm through a cache on the host.

The egress proxy hands origin-form requests under `/pypi/` and `/npm/` to `PackageMirror.handle`:

    /pypi/simple/                      the project list (HTML, links rewritten)
    /pypi/simple/<project>/            PEP 691 JSON or PEP 503 HTML, every file link rewritten to /pypi/files/...
    /pypi/files/packages/...           wheels, sdists and their PEP 658 `.metadata` files
    /npm/<name>, /npm/@scope/<name>    package metadata, `dist.tarball` rewritten to the mirror
    /npm/<name>/-/<name>-<v>.tgz       tarballs

Index pages are cached for `index_ttl` seconds (and served stale, marked so, when upstream is down). Files are
cached by upstream URL forever: they are immutable upstream, and they enter the cache only complete and matching the
digest upstream published for them (the index page's sha256, npm's `dist.integrity`/`dist.shasum`, or the BLAKE2b-256
that files.pythonhosted.org spells into each path).

Layout under `cache_dir` (names are hashes of the upstream URL, never a client's path):

    index/<sha256(url, variant)>       one JSON header line, then the upstream body as received
    files/<h[:2]>/<h>                  a file's bytes, h = sha256(upstream URL)

The parts: `_mirror_pages.py` (index pages rewritten, their digests, `MirrorError`), `_mirror_cache.py` (the cache
on disk); here `PackageMirror`: routing, upstream fetches, downloads checked against their digests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import httpx

from corral.egress._events import MirrorResponse
from corral.egress._mirror_cache import CachedPage, CacheWriter, ensure_dir, read_page, write_page
from corral.egress._mirror_pages import Digest, MirrorError, blake2b_from_path, render_project, rewrite_npm_metadata

__all__ = ["MAX_FILE_BYTES", "MAX_INDEX_BYTES", "MirrorError", "PackageMirror"]

log = logging.getLogger(__name__)

MAX_INDEX_BYTES = 50 << 20
MAX_FILE_BYTES = 2 << 30
PYPI_JSON = "application/vnd.pypi.simple.v1+json"
NPM_ABBREVIATED = "application/vnd.npm.install-v1+json"

_CHUNK = 1 << 16
# Digests learnt from index pages, by file. Bounded: one numpy page alone lists thousands of files.
_MAX_DIGESTS = 200_000
_PROJECT = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")
_NPM_PART = re.compile(r"[A-Za-z0-9._~-]+")
_FILE_HEADERS = [("Cache-Control", "public, max-age=31536000, immutable")]


class PackageMirror:
    """Answers `/pypi/...` and `/npm/...` requests from `cache_dir`, filling it from PyPI and the npm registry.

    **Parameters:**

    * **cache_dir** - where index pages and files are kept (created 0755).
    * **client** - the httpx client for upstream requests; the mirror makes (and closes) its own when none is given.
    * **index_ttl** - seconds an index page is served from the cache before it is fetched again.
    * **pypi**, **files**, **npm** - the upstream bases (tests point them at local servers).
    * **public_url** - where sandboxes reach the mirror; npm needs absolute tarball URLs.
    """

    def __init__(self, cache_dir: Path, *, client: httpx.AsyncClient | None = None, index_ttl: float = 600,
                 pypi: str = "https://pypi.org", files: str = "https://files.pythonhosted.org",
                 npm: str = "https://registry.npmjs.org", public_url: str = "http://127.0.0.1:3128") -> None:
        self._root = Path(cache_dir)
        for directory in (self._root, self._root / "index", self._root / "files"):
            ensure_dir(directory)
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(60, connect=10), follow_redirects=False,
                                                   headers={"User-Agent": "corral-package-mirror"})
        self._index_ttl = index_ttl
        self._pypi, self._files, self._npm = pypi.rstrip("/"), files.rstrip("/"), npm.rstrip("/")
        self._public = public_url.rstrip("/")
        self._digests: OrderedDict[str, Digest] = OrderedDict()
        self._stats = {"hits": 0, "misses": 0, "stale": 0, "rejected": 0, "bytes_from_cache": 0,
                       "bytes_from_upstream": 0}

    @property
    def stats(self) -> dict[str, int]:
        """Counters since start: requests served from cache (`hits`) or upstream (`misses`), stale index pages
        served, files rejected for a wrong digest, and bytes read from each side."""
        return dict(self._stats)

    def handles(self, path: str) -> bool:
        return path.split("?", 1)[0].startswith(("/pypi/", "/npm/"))

    async def close(self) -> None:
        if self._own_client:
            await self._client.aclose()

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]]) -> MirrorResponse:
        """Answers one request. Never raises for bad input or upstream trouble: those become 4xx/5xx responses."""
        try:
            if method not in ("GET", "HEAD"):
                raise MirrorError(405, f"the package mirror answers GET and HEAD only, not {method}")
            response = await self._route(method, _split_path(path), _header(headers, "accept"))
        except MirrorError as exc:
            response = _error(exc)
        if method == "HEAD":
            return MirrorResponse(response.status, response.reason, response.headers, _chunks(b""))
        return response

    async def _route(self, method: str, segments: list[str], accept: str) -> MirrorResponse:
        match segments:
            case ["pypi", "simple", ""]:
                return await self._pypi_root()
            case ["pypi", "simple", project] | ["pypi", "simple", project, ""]:
                return await self._pypi_project(project, accept)
            case ["pypi", "files", "packages", *rest] if rest and rest[-1]:
                return await self._pypi_file(method, "/".join(["packages", *rest]))
            case ["npm", *rest] if rest and rest[-1]:
                return await self._npm_request(method, rest, accept)
        raise MirrorError(404, f"the package mirror has nothing at /{'/'.join(segments)}")

    # --- PyPI ---

    async def _pypi_root(self) -> MirrorResponse:
        # pypi.org serves the project list as HTML only; links given as absolute paths (/simple/x/) must stay
        # under /pypi/ (relative ones already do).
        page, state = await self._index(f"{self._pypi}/simple/", "text/html", "html")
        body = page.body.replace(b'href="/simple/', b'href="/pypi/simple/')
        return _content(body, page.content_type, state)

    async def _pypi_project(self, project: str, accept: str) -> MirrorResponse:
        if not _PROJECT.fullmatch(project):
            raise MirrorError(404, f"not a valid project name: {project!r}")
        # Normalised (PEP 503) so pypi.org answers directly instead of redirecting.
        name = re.sub(r"[-_.]+", "-", project).lower()
        page, state = await self._index(f"{self._pypi}/simple/{name}/", PYPI_JSON, "json")
        as_json = PYPI_JSON in accept  # what pip asks for first; anything else gets PEP 503 HTML
        body, digests = await asyncio.to_thread(render_project, page.body, self._files, as_json)
        self._remember(digests)
        return _content(body, PYPI_JSON if as_json else "text/html; charset=utf-8", state)

    async def _pypi_file(self, method: str, path: str) -> MirrorResponse:
        key = f"pypi:{path}"
        digest = self._digests.get(key) or blake2b_from_path(path)
        content_type = "text/plain" if path.endswith(".metadata") else "application/octet-stream"
        return await self._file(method, f"{self._files}/{_quote(path)}", digest, content_type)

    # --- npm ---

    async def _npm_request(self, method: str, parts: list[str], accept: str) -> MirrorResponse:
        name, tarball = _npm_route(parts)
        if tarball is None:
            return await self._npm_metadata(name, abbreviated=NPM_ABBREVIATED in accept)
        key = f"npm:{name}/-/{tarball}"
        digest = self._digests.get(key)
        if digest is None:
            # Not seen in this process (restart, or a client with its own metadata cache): learn it from metadata.
            with contextlib.suppress(MirrorError):
                await self._npm_metadata(name, abbreviated=True)
            digest = self._digests.get(key)
        return await self._file(method, f"{self._npm}/{name}/-/{_quote(tarball)}", digest, "application/octet-stream")

    async def _npm_metadata(self, name: str, *, abbreviated: bool) -> MirrorResponse:
        accept = NPM_ABBREVIATED if abbreviated else "application/json"
        url = f"{self._npm}/{quote(name, safe='@')}"
        page, state = await self._index(url, accept, "abbreviated" if abbreviated else "full")
        body, digests = await asyncio.to_thread(rewrite_npm_metadata, page.body, self._npm, self._public)
        self._remember(digests)
        return _content(body, page.content_type, state)

    # --- index pages ---

    async def _index(self, url: str, accept: str, variant: str) -> tuple[CachedPage, str]:
        """The page at `url` and how it was served: "hit" (fresh in the cache), "miss" (fetched) or "stale"."""
        where = self._root / "index" / _hash(f"{variant}\n{url}")
        cached = await asyncio.to_thread(read_page, where)
        if cached is not None and time.time() - cached.fetched_at < self._index_ttl:
            self._count("hits", "bytes_from_cache", len(cached.body))
            return cached, "hit"
        try:
            page = await self._fetch_page(url, accept)
        except MirrorError as exc:
            # A deleted project is gone (404 passes through); an outage should not stop installs that worked before.
            if cached is None or exc.status == 404:
                raise
            self._count("stale", "bytes_from_cache", len(cached.body))
            return cached, f"stale; upstream: {exc.reason}"
        await asyncio.to_thread(write_page, where, page, url)
        self._count("misses", "bytes_from_upstream", len(page.body))
        return page, "miss"

    async def _fetch_page(self, url: str, accept: str) -> CachedPage:
        response = await self._open("GET", url, {"Accept": accept})
        try:
            _refuse_declared_size(response, MAX_INDEX_BYTES, url)
            body = bytearray()
            with _map_errors(url):
                async for chunk in response.aiter_bytes():  # decoded: the cap also bounds a gzip bomb
                    body += chunk
                    if len(body) > MAX_INDEX_BYTES:
                        raise _too_large(url, MAX_INDEX_BYTES)
        finally:
            await response.aclose()
        return CachedPage(bytes(body), response.headers.get("content-type", "application/octet-stream"), time.time())

    # --- files ---

    async def _file(self, method: str, url: str, digest: Digest | None, content_type: str) -> MirrorResponse:
        where = self._root / "files" / (name := _hash(url))[:2] / name
        with contextlib.suppress(FileNotFoundError):
            size = where.stat().st_size
            self._stats["hits"] += 1
            headers = [("Content-Type", content_type), ("Content-Length", str(size)), ("X-Corral-Mirror", "hit")]
            return MirrorResponse(200, "OK", headers + _FILE_HEADERS, self._read_cached(where))
        if method == "HEAD":
            response = await self._open("HEAD", url, {"Accept-Encoding": "identity"})
            await response.aclose()
            length = [("Content-Length", v) for v in response.headers.get_list("content-length")[:1]]
            return MirrorResponse(200, "OK", [("Content-Type", content_type), *length, ("X-Corral-Mirror", "miss")],
                                  _chunks(b""))
        # Identity, so the bytes streamed and hashed are the file's own bytes.
        response = await self._open("GET", url, {"Accept-Encoding": "identity"})
        try:
            declared = _refuse_declared_size(response, MAX_FILE_BYTES, url)
        except MirrorError:
            await response.aclose()
            raise
        self._stats["misses"] += 1
        headers = [("Content-Type", content_type), ("X-Corral-Mirror", "miss")]
        if declared is not None:
            headers.append(("Content-Length", str(declared)))
        return MirrorResponse(200, "OK", headers + _FILE_HEADERS, self._download(response, where, digest, url))

    async def _read_cached(self, where: Path) -> AsyncIterator[bytes]:
        # Opened only when the body is consumed, so an unread body leaves no file open.
        with where.open("rb") as file:
            while chunk := file.read(_CHUNK):  # small reads from the page cache: not worth a thread each
                self._stats["bytes_from_cache"] += len(chunk)
                yield chunk

    async def _download(self, response: httpx.Response, where: Path, digest: Digest | None,
                        url: str) -> AsyncIterator[bytes]:
        """Streams the upstream body to the client and into a private temporary file; the file enters the cache
        only complete and matching `digest`. Concurrent downloads of one file each write their own temporary file,
        and the rename makes whichever finishes last (with identical bytes) the cached one."""
        sink = CacheWriter(where)
        hasher = digest.hasher() if digest else None
        size = 0
        held = b""  # the last chunk waits for the digest check: a wrong file must never reach the client whole
        try:
            with _map_errors(url):
                async for chunk in response.aiter_raw(_CHUNK):
                    size += len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise _too_large(url, MAX_FILE_BYTES)
                    sink.write(chunk)
                    if hasher:
                        hasher.update(chunk)
                    self._stats["bytes_from_upstream"] += len(chunk)
                    if held:
                        yield held
                    held = chunk
            if digest and hasher and hasher.digest() != digest.value:
                self._stats["rejected"] += 1
                # Headers are gone already: raising makes the proxy cut the connection, so the client sees a
                # broken download rather than a complete wrong one.
                raise MirrorError(502, f"upstream {urlsplit(url).netloc} sent {url} with the wrong digest "
                                       f"(expected {digest}); not cached")
            await sink.commit()
            if held:
                yield held
        finally:
            sink.abandon()
            await response.aclose()

    # --- upstream ---

    async def _open(self, method: str, url: str, headers: dict[str, str]) -> httpx.Response:
        """An open streaming response with status 200 (the caller closes it), else the matching MirrorError."""
        with _map_errors(url):
            response = await self._client.send(self._client.build_request(method, url, headers=headers), stream=True)
        if response.status_code == 200:
            return response
        await response.aclose()
        if response.status_code in (404, 410):
            raise MirrorError(404, f"not found upstream: {url}")
        raise MirrorError(502, f"upstream {urlsplit(url).netloc} answered {response.status_code} for {url}")

    def _remember(self, digests: list[tuple[str, Digest]]) -> None:
        for key, digest in digests:
            self._digests[key] = digest
            self._digests.move_to_end(key)
        while len(self._digests) > _MAX_DIGESTS:
            self._digests.popitem(last=False)

    def _count(self, event: str, side: str, size: int) -> None:
        self._stats[event] += 1
        self._stats[side] += size


# --- requests and responses ---


def _split_path(path: str) -> list[str]:
    """The path's segments after percent-decoding once; a trailing slash leaves a last empty segment. Refuses what
    could name something outside the mirror's tree: dot segments, empty segments, NUL and control characters."""
    raw = path.split("?", 1)[0].split("#", 1)[0]
    try:
        decoded = unquote(raw, errors="strict")
    except UnicodeDecodeError as exc:
        raise MirrorError(400, "the path is not valid UTF-8 after percent-decoding") from exc
    if not decoded.startswith("/") or "\\" in decoded or any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
        raise MirrorError(400, "the path has a NUL, a control character or a backslash, or is not absolute")
    segments = decoded[1:].split("/")
    if any(s in ("", ".", "..") for s in segments[:-1]) or segments[-1] in (".", ".."):
        raise MirrorError(400, "the path has an empty, '.' or '..' segment")
    return segments


def _npm_route(parts: list[str]) -> tuple[str, str | None]:
    """(package name, tarball file name or None) for the segments after /npm/."""
    scoped = parts[0].startswith("@")
    name_parts, rest = (parts[:2], parts[2:]) if scoped else (parts[:1], parts[1:])
    if len(name_parts) == (2 if scoped else 1) and all(_NPM_PART.fullmatch(p.removeprefix("@")) for p in name_parts):
        name = "/".join(name_parts)
        if not rest:
            return name, None
        if len(rest) == 2 and rest[0] == "-" and rest[1].endswith(".tgz") and _NPM_PART.fullmatch(rest[1]):
            return name, rest[1]
    raise MirrorError(404, f"the package mirror has nothing at /npm/{'/'.join(parts)}")


def _header(headers: list[tuple[str, str]], name: str) -> str:
    return ", ".join(value for key, value in headers if key.lower() == name)


def _content(body: bytes, content_type: str, state: str) -> MirrorResponse:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), ("Vary", "Accept"),
               ("Cache-Control", "max-age=0"), ("X-Corral-Mirror", _phrase(state))]
    if state.startswith("stale"):
        headers.append(("Warning", '110 corral-mirror "Response is Stale"'))
    return MirrorResponse(200, "OK", headers, _chunks(body))


def _error(exc: MirrorError) -> MirrorResponse:
    reason = _phrase(exc.reason)
    body = f"{reason}\n".encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
               ("X-Corral-Mirror", "error")]
    if exc.status == 405:
        headers.append(("Allow", "GET, HEAD"))
    return MirrorResponse(exc.status, reason, headers, _chunks(body))


def _phrase(text: str) -> str:
    # A reason phrase is one line of printable ASCII; upstream URLs and client paths may carry anything.
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:300]


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), _CHUNK):
        yield body[start:start + _CHUNK]


def _quote(path: str) -> str:
    return quote(path, safe="/@+!~")


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def _map_errors(url: str) -> Iterator[None]:
    """Turns httpx's errors into the mirror's, naming the upstream host."""
    host = urlsplit(url).netloc
    try:
        yield
    except httpx.TimeoutException as exc:
        raise MirrorError(504, f"upstream {host} timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise MirrorError(502, f"upstream {host} failed: {type(exc).__name__}: {exc}") from exc
    except httpx.InvalidURL as exc:
        raise MirrorError(400, f"cannot build an upstream URL: {exc}") from exc


def _refuse_declared_size(response: httpx.Response, limit: int, url: str) -> int | None:
    declared = response.headers.get("content-length", "")
    if not declared.isdigit():
        return None
    if int(declared) > limit:
        raise _too_large(url, limit)
    return int(declared)


def _too_large(url: str, limit: int) -> MirrorError:
    return MirrorError(502, f"upstream {urlsplit(url).netloc} sent more than the mirror's {limit >> 20} MiB limit "
                            f"for {url}")
