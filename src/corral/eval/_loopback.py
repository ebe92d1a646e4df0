"""The runner's loopback file server: deterministic blobs over plain HTTP, for the download tasks.

Download tasks must not depend on the internet, so the runner serves what they fetch itself, on 127.0.0.1, and
the sandbox reaches it only through an explicit allowance of that exact `ip:port` (a private pair of the tenant;
docs/egress.md). `GET /blob/<kind>/<size>/<seed>` streams `Blob(kind, size, seed)` with its Content-Length and a
`X-Blob-Sha256` header; a single `Range: bytes=a-b` is honoured with 206. `GET /echo/<anything>` answers with the
request's headers as JSON (and its Authorization in `X-Echo-Authorization`) and keeps them in `echoes`: `corral
check` item 38 sees what a secret's bound host received, and whether the echo reached the sandbox scrubbed. For
the same item, `GET /reflect/<anything>?<text>` answers with the text as its reason phrase and in a header's name
(`X-<text>`), and `GET /gzip-te/<anything>?<text>` with the text gzipped under `Transfer-Encoding: gzip, chunked`.
Anything else is a 404.

Why the standard library: it is one GET route on loopback, run in a thread beside the asyncio runner.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import urllib.parse
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self

from ._blob import Blob, blob_from_path

__all__ = ["LoopbackServer"]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "corral-eval"

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the runner's results say what happened."""

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        if self.path.startswith("/echo/"):
            self._echo()
            return
        if self.path.startswith(("/reflect/", "/gzip-te/")):
            self._reflect(urllib.parse.unquote(self.path.partition("?")[2]))
            return
        self._serve(body=True)

    def _reflect(self, text: str) -> None:
        """The request's query where a value must be scrubbed from too: the head outside header values, or a body
        under a transfer-coding (which a proxy that scrubs must decode or refuse)."""
        if not text.isprintable() or not text:
            self._plain(400, b"a printable query is reflected\n")
            return
        if self.path.startswith("/reflect/"):
            self.send_response(200, text)
            self.send_header(f"X-{text}", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = gzip.compress(text.encode())
        self.send_response(200)
        self.send_header("Transfer-Encoding", "gzip, chunked")
        self.end_headers()
        self.wfile.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))

    def _echo(self) -> None:
        headers = dict(self.headers.items())
        self.server.echoes.append((self.path, headers))  # type: ignore[attr-defined]
        data = json.dumps({"path": self.path, "headers": headers}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Echo-Authorization", headers.get("Authorization", ""))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, *, body: bool) -> None:
        blob = blob_from_path(self.path.split("?", 1)[0])
        if blob is None:
            self._plain(404, b"no such blob: paths are /blob/<random|all_bytes>/<size>/<seed>\n")
            return
        start, end = 0, blob.size - 1
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            m = _RANGE.match(wanted.strip())
            if m is None or not blob.size:
                self._plain(416, b"unsupported range\n")
                return
            first, last = m.groups()
            if first:
                start, end = int(first), min(int(last), blob.size - 1) if last else blob.size - 1
            elif last:
                start = max(blob.size - int(last), 0)
            if start > end or start >= blob.size:
                self._plain(416, b"range not satisfiable\n")
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1 if blob.size else 0))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Blob-Sha256", blob.sha256)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{blob.size}")
        self.end_headers()
        if body and blob.size:
            self._stream(blob, start, end)

    def _stream(self, blob: Blob, start: int, end: int) -> None:
        offset = 0
        for chunk in blob.chunks():
            lo, hi = max(start - offset, 0), min(end + 1 - offset, len(chunk))
            if lo < hi:
                self.wfile.write(chunk[lo:hi])
            offset += len(chunk)
            if offset > end:
                break

    def _plain(self, status: int, text: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)


class LoopbackServer:
    """`with LoopbackServer() as server: server.address` -> `"127.0.0.1:PORT"`, serving until the block ends."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._httpd = ThreadingHTTPServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self.echoes: deque[tuple[str, dict[str, str]]] = deque(maxlen=100)  # /echo/ requests: path, headers
        self._httpd.echoes = self.echoes  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="corral-eval-loopback", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
