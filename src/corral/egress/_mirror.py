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
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import html
import json
import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import quote, unquote, urlsplit

import httpx

from corral.egress._events import MirrorResponse

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
# files.pythonhosted.org stores each file under the BLAKE2b-256 of its content: packages/ab/cd/<60 more hex>/name.
_PYPI_BLAKE2B_PATH = re.compile(r"packages/([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{60})/[^/]+")
_FILE_HEADERS = [("Cache-Control", "public, max-age=31536000, immutable")]


class MirrorError(Exception):
    """A request the mirror answers with an error status; `reason` is the HTTP reason phrase and the body."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...
    def digest(self) -> bytes: ...


@dataclass(frozen=True)
class Digest:
    """What a file's bytes must hash to: a hashlib algorithm name ("blake2b" meaning BLAKE2b-256) and the digest."""

    algorithm: str
    value: bytes

    def hasher(self) -> _Hasher:
        if self.algorithm == "blake2b":
            return hashlib.blake2b(digest_size=32)
        return hashlib.new(self.algorithm)

    def __str__(self) -> str:
        return f"{self.algorithm}={self.value.hex()}"


@dataclass(frozen=True)
class _Page:
    body: bytes
    content_type: str
    fetched_at: float


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
            _ensure_dir(directory)
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
        body, digests = await asyncio.to_thread(_render_project, page.body, self._files, as_json)
        self._remember(digests)
        return _content(body, PYPI_JSON if as_json else "text/html; charset=utf-8", state)

    async def _pypi_file(self, method: str, path: str) -> MirrorResponse:
        key = f"pypi:{path}"
        digest = self._digests.get(key) or _blake2b_from_path(path)
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

    async def _index(self, url: str, accept: str, variant: str) -> tuple[_Page, str]:
        """The page at `url` and how it was served: "hit" (fresh in the cache), "miss" (fetched) or "stale"."""
        where = self._root / "index" / _hash(f"{variant}\n{url}")
        cached = await asyncio.to_thread(_read_page, where)
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
        await asyncio.to_thread(_write_page, where, page, url)
        self._count("misses", "bytes_from_upstream", len(page.body))
        return page, "miss"

    async def _fetch_page(self, url: str, accept: str) -> _Page:
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
        return _Page(bytes(body), response.headers.get("content-type", "application/octet-stream"), time.time())

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
        sink = _CacheWriter(where)
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


# --- rewriting (pure; run in a thread because pages reach tens of MB) ---


def rewrite_pypi_project(raw: bytes, files_base: str) -> tuple[dict[str, Any], list[tuple[str, Digest]]]:
    """Parses a PEP 691 project page and points every file on `files_base` at `/pypi/files/...`, returning the
    page and the (file key, digest) pairs it promises, `.metadata` files included."""
    data = _json_object(raw, files_base)
    digests: list[tuple[str, Digest]] = []
    for entry in data.get("files") or []:
        url = entry.get("url") if isinstance(entry, dict) else None
        if not isinstance(url, str) or not url.startswith(files_base + "/"):
            continue
        rest = url[len(files_base) + 1:].split("#", 1)[0]
        entry["url"] = f"/pypi/files/{rest}"
        key = f"pypi:{unquote(rest)}"
        if digest := _sha256(entry.get("hashes")):
            digests.append((key, digest))
        metadata = entry.get("core-metadata", entry.get("dist-info-metadata"))
        if digest := _sha256(metadata):
            digests.append((f"{key}.metadata", digest))
    return data, digests


def _render_project(raw: bytes, files_base: str, as_json: bool) -> tuple[bytes, list[tuple[str, Digest]]]:
    data, digests = rewrite_pypi_project(raw, files_base)
    return (json.dumps(data).encode() if as_json else simple_html(data)), digests


def simple_html(data: dict[str, Any]) -> bytes:
    """The PEP 503 page (with PEP 592/658/714 attributes) for a PEP 691 JSON project page."""
    name = html.escape(str(data.get("name", "")))
    lines = ['<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.1">',
             f"<title>Links for {name}</title></head><body><h1>Links for {name}</h1>"]
    for entry in data.get("files") or []:
        if isinstance(entry, dict) and isinstance(entry.get("url"), str):
            lines.append(_html_link(entry))
    lines.append("</body></html>\n")
    return "\n".join(lines).encode()


def _html_link(entry: dict[str, Any]) -> str:
    href = entry["url"]
    if digest := _sha256(entry.get("hashes")):
        href += f"#sha256={digest.value.hex()}"
    attributes = {"href": href}
    if isinstance(requires := entry.get("requires-python"), str):
        attributes["data-requires-python"] = requires
    metadata = entry.get("core-metadata", entry.get("dist-info-metadata"))
    if metadata:
        value = f"sha256={digest.value.hex()}" if (digest := _sha256(metadata)) else "true"
        attributes["data-dist-info-metadata"] = attributes["data-core-metadata"] = value  # old and new pip
    if yanked := entry.get("yanked"):
        attributes["data-yanked"] = yanked if isinstance(yanked, str) else ""
    text = " ".join(f'{key}="{html.escape(value)}"' for key, value in attributes.items())
    return f"<a {text}>{html.escape(str(entry.get('filename', '')))}</a><br/>"


def rewrite_npm_metadata(raw: bytes, upstream: str, public: str) -> tuple[bytes, list[tuple[str, Digest]]]:
    """Points each version's `dist.tarball` on `upstream` at `public`/npm/..., returning the page and the
    (file key, digest) pairs it promises."""
    data = _json_object(raw, upstream)
    digests: list[tuple[str, Digest]] = []
    versions = data.get("versions")
    for version in versions.values() if isinstance(versions, dict) else []:
        dist = version.get("dist") if isinstance(version, dict) else None
        tarball = dist.get("tarball") if isinstance(dist, dict) else None
        if not isinstance(dist, dict) or not isinstance(tarball, str) or not tarball.startswith(upstream + "/"):
            continue
        rest = tarball[len(upstream) + 1:]
        dist["tarball"] = f"{public}/npm/{rest}"
        if digest := npm_digest(dist):
            digests.append((f"npm:{unquote(rest)}", digest))
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode(), digests


def npm_digest(dist: dict[str, Any]) -> Digest | None:
    """The strongest digest in a `dist` object: an SRI `integrity` (sha512 preferred), else the sha1 `shasum`."""
    found: dict[str, bytes] = {}
    for item in str(dist.get("integrity") or "").split():
        algorithm, _, encoded = item.partition("-")
        with contextlib.suppress(binascii.Error, ValueError):
            found[algorithm] = base64.b64decode(encoded.split("?", 1)[0], validate=True)
    for algorithm in ("sha512", "sha384", "sha256"):
        if algorithm in found:
            return Digest(algorithm, found[algorithm])
    shasum = dist.get("shasum")
    if isinstance(shasum, str) and re.fullmatch(r"[0-9a-fA-F]{40}", shasum):
        return Digest("sha1", bytes.fromhex(shasum))
    return None


def _sha256(value: object) -> Digest | None:
    hexdigest = value.get("sha256") if isinstance(value, dict) else None
    if isinstance(hexdigest, str) and re.fullmatch(r"[0-9a-fA-F]{64}", hexdigest):
        return Digest("sha256", bytes.fromhex(hexdigest))
    return None


def _blake2b_from_path(path: str) -> Digest | None:
    match = _PYPI_BLAKE2B_PATH.fullmatch(path)
    if match is None or path.endswith(".metadata"):  # a .metadata file sits beside its wheel, under the wheel's hash
        return None
    return Digest("blake2b", bytes.fromhex("".join(match.groups())))


def _json_object(raw: bytes, upstream: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise MirrorError(502, f"upstream {urlsplit(upstream).netloc} answered something that is not JSON") from exc
    if not isinstance(data, dict):
        raise MirrorError(502, f"upstream {urlsplit(upstream).netloc} answered JSON that is not an object")
    return data


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


# --- the cache on disk ---


def _ensure_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o755, parents=True)
    except FileExistsError:
        return
    path.chmod(0o755)  # the mode given to mkdir is cut by the umask


def _create(path: Path) -> BinaryIO:
    """A new file at `path` (never an existing file or a planted symlink), 0644 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


class _CacheWriter:
    """Writes one download to a temporary file beside its cache entry. A full or failing disk ends caching, never
    the download: the client still gets its file, the next request tries again."""

    def __init__(self, where: Path) -> None:
        self._where = where
        self._tmp = where.with_name(f".{where.name}.{secrets.token_hex(8)}.tmp")
        self._file: BinaryIO | None = None
        try:
            _ensure_dir(where.parent)
            self._file = _create(self._tmp)
        except OSError as exc:
            log.warning("package mirror: not caching %s: %s", where.name, exc)

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            return
        try:
            self._file.write(chunk)
        except OSError as exc:
            log.warning("package mirror: not caching %s: %s", self._where.name, exc)
            self.abandon()

    async def commit(self) -> None:
        """Moves the complete file into place; it is flushed to disk first, so a crash leaves no torn entry."""
        if self._file is None:
            return
        try:
            self._file.flush()
            await asyncio.to_thread(os.fsync, self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._where)
        except OSError as exc:
            log.warning("package mirror: not caching %s: %s", self._where.name, exc)
        self.abandon()

    def abandon(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


def _read_page(where: Path) -> _Page | None:
    try:
        with where.open("rb") as file:
            header = json.loads(file.readline())
            return _Page(file.read(), str(header["content_type"]), float(header["fetched_at"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("package mirror: ignoring unreadable cached page %s: %s", where.name, exc)
        return None  # fetch it again; the write that follows replaces it


def _write_page(where: Path, page: _Page, url: str) -> None:
    header = {"url": url, "content_type": page.content_type, "fetched_at": page.fetched_at}
    tmp = where.with_name(f".{where.name}.{secrets.token_hex(8)}.tmp")
    try:
        with _create(tmp) as file:
            file.write(json.dumps(header).encode() + b"\n" + page.body)
        os.replace(tmp, where)
    except OSError as exc:  # a full disk costs the cache, not the request
        log.warning("package mirror: not caching %s: %s", url, exc)
    finally:
        tmp.unlink(missing_ok=True)
