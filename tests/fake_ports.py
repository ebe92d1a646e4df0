"""The fake agent's port tunnels (`connect`, `corral/agent/tunnel.py`) and the one server its toy shell can start.

A server "in the sandbox" is a handler in `FakeAgent.ports` (port -> coroutine over a stream pair). `connect`
answers as the real agent does: `connected`, then the connection is a raw byte pipe to that handler; nothing
listening is the real `agent_error` naming the port. `python3 -m http.server` in the toy shell registers a
static-file HTTP/1.0 server over the fake file system until the command is killed, as the real one serves until
it is; it answers GET and HEAD, with a directory's index.html or a listing, and 404 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import mimetypes
import posixpath
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from corral.agent.process_requests import ProcessError
from corral.agent.tunnel import _port

if TYPE_CHECKING:
    from .fake_shell import FakeFs, Io, Shell
    from .fake_wire import Conn

__all__ = ["PortHandler", "PortOps", "serve_http"]

PortHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class PortOps:
    """Mixed into `FakeAgent`."""

    ports: dict[int, PortHandler]

    async def op_connect(self, conn: Conn, req: dict[str, Any]) -> None:
        port = _port(req.get("port"))
        handler = self.ports.get(port)
        if handler is None:
            raise ProcessError("agent_error", f"nothing is listening on port {port} in the sandbox (127.0.0.1: "
                                              "Connection refused; ::1: Connection refused); start a server there "
                                              "on 127.0.0.1, ::1 or 0.0.0.0")
        conn.event(event="connected", port=port, address="127.0.0.1")
        await conn.drain()
        await handler(conn.reader, conn.writer)


async def serve_http(shell: Shell, args: list[str], io: Io) -> int:
    """`python3 -m http.server [PORT] [--bind ADDR] [--directory DIR]`, until cancelled (killed)."""
    assert shell.ports is not None
    port, bind, directory = 8000, "0.0.0.0", shell.cwd
    it = iter(args)
    for arg in it:
        if arg in ("--bind", "-b"):
            bind = next(it, bind)
        elif arg in ("--directory", "-d"):
            directory = posixpath.normpath(posixpath.join(shell.cwd, next(it, ".")))
        elif arg.isdigit():
            port = int(arg)
    if port in shell.ports:
        await io.err(b"OSError: [Errno 98] Address already in use\n")
        return 1
    fs = shell.fs

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = ([*head.split(b"\r\n", 1)[0].decode(errors="replace").split(" "), "", ""])[:3]
            status, kind, body = _answer(fs, directory, urllib.parse.unquote(target.split("?", 1)[0]))
            writer.write(f"HTTP/1.0 {status}\r\nServer: SimpleHTTP/0.6 Python/3 (fake)\r\nContent-Type: {kind}\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + (b"" if method == "HEAD" else body))
            await writer.drain()

    shell.ports[port] = handle
    shown = "::" if bind == "::" else bind
    await io.out(f"Serving HTTP on {shown} port {port} (http://{shown}:{port}/) ...\n".encode())
    try:
        await asyncio.Event().wait()
    finally:
        shell.ports.pop(port, None)
    return 0


def _answer(fs: FakeFs, directory: str, path: str) -> tuple[str, str, bytes]:
    host = fs.host(posixpath.normpath(posixpath.join(directory, path.lstrip("/"))))
    if host.is_dir():
        if (host / "index.html").is_file():
            host = host / "index.html"
        else:
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in host.iterdir())
            items = "".join(f'<li><a href="{urllib.parse.quote(n)}">{html.escape(n)}</a></li>\n' for n in names)
            page = f"<!DOCTYPE HTML>\n<html>\n<body>\n<h1>Directory listing for {html.escape(path)}</h1>\n" \
                   f"<hr>\n<ul>\n{items}</ul>\n<hr>\n</body>\n</html>\n"
            return "200 OK", "text/html; charset=utf-8", page.encode()
    if not host.is_file():
        return "404 File not found", "text/html;charset=utf-8", b"<html><body>Error code: 404</body></html>\n"
    kind = mimetypes.guess_type(host.name)[0] or "application/octet-stream"
    return "200 OK", kind, host.read_bytes()
