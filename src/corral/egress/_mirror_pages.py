"""The package mirror's index pages, rewritten (pure; run in a thread because pages reach tens of MB): PyPI's
PEP 691 project pages (served as JSON or as PEP 503 HTML) and npm's package metadata, every file link pointed at
the mirror, with the digests each page promises for its files (`Digest`); and `MirrorError`, what the mirror answers
with an error status (an upstream page that is not what it should be among them)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import html
import json
import re
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

# files.pythonhosted.org stores each file under the BLAKE2b-256 of its content: packages/ab/cd/<60 more hex>/name.
_PYPI_BLAKE2B_PATH = re.compile(r"packages/([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{60})/[^/]+")


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


def render_project(raw: bytes, files_base: str, as_json: bool) -> tuple[bytes, list[tuple[str, Digest]]]:
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


def blake2b_from_path(path: str) -> Digest | None:
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
