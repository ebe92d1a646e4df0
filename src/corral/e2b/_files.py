"""envd's REST file routes, `GET /files` and `POST /files`, on Corral's file service.

Downloads stream the file, gzip-compressed when the client accepts it. Uploads take `application/octet-stream`
(one file at `path`, optionally `Content-Encoding: gzip`) or `multipart/form-data` (one or more `file` parts, each
named by `path` or by its filename); each file is written in place, like envd does, and answered with its entry.
`X-Metadata-<key>` headers become the file's metadata. Relative paths start in the user's home.

Signed URLs (`download_url`/`upload_url` of the SDKs) carry no sandbox header and no token: their signature,
`v1_` + base64(sha256("path:operation:user:token[:expiry]")), names the sandbox by the token it was made with,
so the sandbox is the one whose token reproduces it; an expired one is refused as envd refuses it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import urllib.parse
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .._exceptions import AuthenticationError, CorralError, InvalidRequestError
from .._negotiation import quality
from .._users import SandboxUser
from ..control import Principal
from ._auth import client_info, sandbox_caller
from ._errors import corral_error, e2b_error
from ._front import front_of
from ._user import absolute_path, envd_user, home_of, service_user

__all__ = ["download", "sandbox_of", "upload"]

SANDBOX_SCOPE_KEY = "corral.e2b.sandbox"
_CHUNK = 1024 * 1024
_METADATA_PREFIX = "x-metadata-"


def sandbox_of(request: Request) -> str | None:
    sandbox_id = request.scope.get(SANDBOX_SCOPE_KEY)
    return sandbox_id if isinstance(sandbox_id, str) else None


async def download(request: Request) -> Response:
    try:
        sandbox_id, principal, maybe_path = await _authorized(request, "read")
        path = absolute_path(maybe_path)
        chunks = await front_of(request).service.files.read(principal, sandbox_id, path, user=_user(request))
    except CorralError as exc:
        return corral_error(exc)
    headers = {"Content-Disposition": f"attachment; filename*=UTF-8''{_quote(path.rsplit('/', 1)[-1])}"}
    encoding = _accepted_encoding(request.headers.get("accept-encoding", ""))
    if encoding is None:
        return e2b_error(406, "unsupported Accept-Encoding: use gzip or identity")
    if encoding == "gzip":
        headers["Content-Encoding"] = "gzip"
        chunks = _gzip(chunks)
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


async def upload(request: Request) -> Response:
    try:
        sandbox_id, principal, path = await _authorized(request, "write", path_required=False)
        metadata = _metadata(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type == "multipart/form-data":
            written = await _upload_parts(request, sandbox_id, principal, path, metadata)
        elif content_type == "application/x-www-form-urlencoded":
            raise InvalidRequestError("a urlencoded form is not a file: send the bytes as application/octet-stream, "
                                      "or a multipart/form-data 'file' part")
        else:
            if path is None:
                raise InvalidRequestError("path is required for an application/octet-stream upload")
            body = _decoded(request.stream(), request.headers.get("content-encoding", ""))
            await _write(request, sandbox_id, principal, path, body, metadata)
            written = [path]
    except CorralError as exc:
        return corral_error(exc)
    return JSONResponse([_written(p, metadata) for p in written])


def _written(path: str, metadata: dict[str, str] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": path, "name": path.rsplit("/", 1)[-1], "type": "file"}
    if metadata:
        entry["metadata"] = metadata
    return entry


async def _upload_parts(request: Request, sandbox_id: str, principal: Principal, path: str | None,
                        metadata: dict[str, str] | None) -> list[str]:
    try:
        form = await request.form(max_files=1000, max_fields=100)
    except Exception as exc:  # python-multipart's errors, and Starlette's limits, as the client's mistake
        raise InvalidRequestError(f"the multipart body could not be read: {exc}") from exc
    written: list[str] = []
    try:
        parts = [part for key, part in form.multi_items() if key == "file"]
        if not parts:
            raise InvalidRequestError("the multipart body has no 'file' part")
        if path is not None and len(parts) > 1:
            raise InvalidRequestError("several files need no 'path' parameter: each part's filename names it")
        for part in parts:
            # A part without a filename is a plain field (`form.append('file', 'text')`): its value is the content.
            named = part.filename if isinstance(part, UploadFile) else None
            if path is None and not named:
                raise InvalidRequestError("a 'file' part has no filename: name each file's path in its part's "
                                          "filename (or give a path parameter)")
            target = path if path is not None else absolute_path(
                named, what="the file part's filename", home=home_of(envd_user(request.query_params.get("username"))))
            content = _part_chunks(part) if isinstance(part, UploadFile) else _once(part.encode())
            await _write(request, sandbox_id, principal, target, content, metadata)
            written.append(target)
    finally:
        await form.close()
    return written


async def _write(request: Request, sandbox_id: str, principal: Principal, path: str,
                 data: AsyncIterator[bytes], metadata: dict[str, str] | None) -> None:
    svc = front_of(request).service
    await svc.files.write(principal, sandbox_id, path, data, user=_user(request), **_write_options(metadata))


def _user(request: Request) -> SandboxUser | None:
    return service_user(envd_user(request.query_params.get("username")))


def _write_options(metadata: dict[str, str] | None) -> dict[str, Any]:
    # In place, as envd writes: a watcher sees the file's own name created and written, not a temporary one.
    return {"in_place": True, "metadata": metadata}


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _part_chunks(part: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await part.read(_CHUNK):
        yield chunk


# -- who, which sandbox, which path ----------------------------------------------------------------------------


async def _authorized(request: Request, operation: str, *,
                      path_required: bool = True) -> tuple[str, Principal, str | None]:
    """The sandbox, the caller and the (absolute) path of a file request, by header credentials or signature."""
    params = request.query_params
    user = envd_user(params.get("username"))
    raw_path = params.get("path")
    path = absolute_path(raw_path, home=home_of(user)) if raw_path or path_required else None
    signature = params.get("signature")
    sandbox_id = sandbox_of(request)
    svc = front_of(request).service
    if signature is None:
        if sandbox_id is None:
            raise InvalidRequestError("no sandbox: send the E2b-Sandbox-Id header")
        return sandbox_id, await sandbox_caller(svc, request, sandbox_id), path
    signed, principal = await svc.access.signed(_signer(request, operation, raw_path or ""), signature,
                                                client_info(request), sandbox_id=sandbox_id)
    expiry = params.get("signature_expiration")
    if expiry is not None and int(expiry) < time.time():
        exc = AuthenticationError(_EXPIRED)  # checked after the signature, as envd does
        await svc.record_denial(client_info(request), exc, None)
        raise exc
    return signed, principal, path


def _signer(request: Request, operation: str, path: str) -> Callable[[str], str]:
    return url_signer(request.query_params, operation, path)


def signed_url_signer(method: str, params: Mapping[str, str]) -> Callable[[str], str] | None:
    """For a signed `/files` URL (its method and query): what a sandbox's token makes of it; None if the URL is
    not one (no signature, another method, a malformed expiry). The replicas' middleware finds the sandbox of
    such a URL with it, among other replicas' sandboxes."""
    operation = {"GET": "read", "POST": "write"}.get(method)
    if operation is None or "signature" not in params:
        return None
    try:
        return url_signer(params, operation, params.get("path") or "")
    except InvalidRequestError:
        return None


def url_signer(params: Mapping[str, str], operation: str, path: str) -> Callable[[str], str]:
    """What a sandbox's token makes of this URL: `v1_` + base64(sha256("path:operation:user:token[:expiry]"))."""
    user = params.get("username") or ""
    expiry = params.get("signature_expiration")
    if expiry is not None and not expiry.lstrip("-").isdigit():
        raise InvalidRequestError("signature_expiration is not a Unix time")

    def sign(token: str) -> str:
        raw = f"{path}:{operation}:{user}:{token}" + (f":{expiry}" if expiry is not None else "")
        return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")

    return sign


_EXPIRED = "signature is already expired"  # envd's words, which E2B's SDK tests compare


def _metadata(request: Request) -> dict[str, str] | None:
    found = {k[len(_METADATA_PREFIX):]: v for k, v in request.headers.items() if k.startswith(_METADATA_PREFIX)}
    return found or None


# -- encodings -------------------------------------------------------------------------------------------------


def _accepted_encoding(header: str) -> str | None:
    """gzip when the client asks for gzip alone (E2B's SDKs' `gzip=True` sends exactly that); the bytes as they are
    when it merely accepts several encodings (HTTP clients' defaults, e.g. pyqwest's `zstd,gzip,br`), since
    compressing costs more than it saves on a fast link (about 30 MB/s for data that does not compress); None when
    the client refuses both gzip and identity."""
    accepted: dict[str, float] = {}
    for part in header.split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip():
            accepted[coding.strip().lower()] = quality(params.split(";"))
    if not accepted:
        return "identity"
    if accepted.get("gzip", 0) > 0 and not any(q > 0 for c, q in accepted.items() if c not in ("gzip", "identity")):
        return "gzip"
    refused = accepted.get("identity", accepted.get("*", 1.0)) == 0
    if not refused:
        return "identity"
    return "gzip" if accepted.get("gzip", accepted.get("*", 0)) > 0 else None


async def _gzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    async for chunk in chunks:
        # In a thread: compressing a 1 MiB chunk takes milliseconds (zlib lets go of the GIL meanwhile).
        if out := await asyncio.to_thread(compressor.compress, chunk):
            yield out
    yield compressor.flush()


async def _decoded(chunks: AsyncIterator[bytes], encoding: str) -> AsyncIterator[bytes]:
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        async for chunk in chunks:
            yield chunk
        return
    if encoding != "gzip":
        raise InvalidRequestError(f"unsupported Content-Encoding {encoding!r}: use gzip or none")
    decompressor = zlib.decompressobj(31)
    try:
        async for chunk in chunks:
            data = chunk
            while data:  # bounded output per step: a small bomb never becomes one huge buffer
                out = decompressor.decompress(data, _CHUNK)
                if out:
                    yield out
                data = decompressor.unconsumed_tail
        if not decompressor.eof:
            raise InvalidRequestError("the gzip body is truncated")
        if tail := decompressor.flush():
            yield tail
    except zlib.error as exc:
        raise InvalidRequestError(f"the body is not valid gzip: {exc}") from None


def _file_error(exc: CorralError) -> Response:
    return corral_error(exc)


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")
