"""Accept connections, check the token, run one operation per connection."""

from __future__ import annotations

import _socket
import sys
import time
from _operator import _compare_digest  # what hmac.compare_digest is, without importing hashlib

from . import files, heartbeats, protocol, users
from .channel import Channel, Closed
from .file_access import FileError
from .follow import follow, send_all_kept
from .process import Process
from .process_requests import ProcessError, pty_size, resolve_user
from .processes import ProcessTable
from .spawn import SIGKILL

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from _socket import socket
    from typing import Any

STARTED = time.time()


class Agent:
    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self.table = ProcessTable()
        self._code: Any = None  # the code sessions, made on first use: most sandboxes never run any

    def handle(self, sock: socket) -> None:
        ch = Channel(sock)
        try:
            req = ch.recv_json(protocol.REQUEST)
            token = req.pop("token", "")
            if not isinstance(token, str) or not _compare_digest(token.encode(), self.token):
                ch.error("unauthenticated", "the agent token is missing or wrong")
                return
            _act_as(req.get("user"))
            self._beat(ch, req)
            self.dispatch(ch, req)
        except (FileError, ProcessError) as exc:
            _send_error(ch, exc.code, exc.message)
        except protocol.ProtocolError as exc:
            _send_error(ch, "invalid_request", f"protocol error: {exc}")
        except Closed:
            pass
        except OSError as exc:  # a file operation raced with the sandbox (a swapped symlink, a vanished dir)
            err = FileError.from_os(exc, str(exc.filename or ""))
            _send_error(ch, err.code, err.message)
        except Exception as exc:  # the agent must outlive any one request
            _send_error(ch, "server_error", f"agent failure: {type(exc).__name__}: {exc}")
        finally:
            heartbeats.unregister(ch)
            sock.close()

    @staticmethod
    def _beat(ch: Channel, req: dict[str, Any]) -> None:
        """Heartbeats on this connection if the host asks (a raw pipe, `connect`, never gets them)."""
        interval = heartbeats.interval_of(req.pop("heartbeat", None))
        if interval is None or req.get("op") == "connect":
            return
        try:
            heartbeats.register(ch, interval)
        except RuntimeError:
            raise ProcessError("quota_exceeded", "the sandbox's process limit is reached") from None

    def dispatch(self, ch: Channel, req: dict[str, Any]) -> None:
        op = req.get("op")
        if op in files.OPS:
            files.OPS[op](ch, req)
        elif op in files.ARCHIVE_OPS:
            from . import archives

            archives.OPS[op](ch, req)
        elif op in files.WATCH_OPS:
            from . import watch  # inotify through ctypes: loaded by the first watch

            watch.OPS[op](ch, req)
        elif op == "ping":
            ch.event(event="pong", version=protocol.VERSION, uptime=time.time() - STARTED,
                     python=sys.version.split()[0])
        elif op == "exec":
            self.op_exec(ch, req)
        elif op == "ps":
            self.op_ps(ch, req)
        elif op == "kill":
            self.op_kill(ch, req)
        elif op == "resize":
            self.op_resize(ch, req)
        elif op == "stdin":
            self.op_stdin(ch, req)
        elif op == "wait":
            self.op_wait(ch, req)
        elif op == "attach":
            self.op_attach(ch, req)
        elif op == "connect":  # a raw pipe to one of the sandbox's ports (docs/ports.md)
            from . import tunnel

            tunnel.op_connect(ch, req)
        elif isinstance(op, str) and op.startswith("code_"):
            self.op_code(ch, req, op)
        else:
            raise ProcessError("invalid_request", f"unknown operation {op!r}")

    # -- processes -----------------------------------------------------------------------------

    def op_exec(self, ch: Channel, req: dict[str, Any]) -> None:
        background = bool(req.get("background"))
        if req.get("stream") and not background:
            raise ProcessError("invalid_request", "stream applies to background processes (a foreground "
                               "command streams anyway)")

        def live(stream: str, data: bytes) -> None:
            try:
                ch.send(protocol.STDOUT if stream == "stdout" else protocol.STDERR, data)
            except Closed:
                pass

        proc = self.table.spawn(req)
        proc.reclaimed = self.table.take_reclaimed()  # leftovers stopped to make room: this result says so
        if not background:
            proc.sinks.append(live)
        started = {"event": "started", "id": proc.id, "pid": proc.pid, "max_output": proc.max_output}
        if background and req.get("stream"):
            # A background process that streams to this request until it ends or the host leaves: output made
            # before the follower is in place is in the kept output, which it sends first.
            self.table.pump(proc)
            follow(ch, proc, first=started, replay=True)
            return
        ch.send_json(protocol.EVENT, started)
        if background:
            self.table.pump(proc)
            return
        if proc.stdin_fd is None and not proc.is_pty:
            # Nothing to feed: this thread moves the output and watches the socket for controls and hang-ups.
            self.table.pump_here(proc, ch.sock.fileno(), lambda: self._one_input(ch, proc))
        else:
            # Feeding stdin may block on a process that does not read it: feed from a thread of its own.
            self.table.pump(proc)
            try:
                self.table.start_thread(self._pump_input, ch, proc)
            except RuntimeError:
                proc.kill_tree()
                raise ProcessError("quota_exceeded", "the sandbox's process limit is reached") from None
            proc.done.wait()
        _send_kept(ch, proc)
        ch.send_json(protocol.EVENT, proc.result())

    def op_code(self, ch: Channel, req: dict[str, Any], op: str) -> None:
        from . import code

        with self.table.lock:
            if self._code is None:
                self._code = code.Sessions(self.table)
        handler = getattr(self._code, "op_" + op[len("code_"):], None)
        if handler is None:
            raise ProcessError("invalid_request", f"unknown operation {op!r}")
        handler(ch, req)

    def _one_input(self, ch: Channel, proc: Process) -> bool:
        try:
            kind, payload = ch.recv()
            if kind == protocol.CONTROL:
                _control(proc, protocol.decode_json(payload))
            return True
        except (Closed, protocol.ProtocolError, ProcessError, OSError):
            if not proc.done.is_set():
                proc.kill_tree()
            return False

    def _pump_input(self, ch: Channel, proc: Process) -> None:
        """Host -> process: stdin, EOF, resize, signals. A vanished host kills a foreground tree."""
        try:
            while not proc.done.is_set():
                kind, payload = ch.recv()
                if kind == protocol.STDIN:
                    proc.write_stdin(payload)
                elif kind == protocol.STDIN_EOF:
                    proc.close_stdin()
                elif kind == protocol.CONTROL:
                    _control(proc, protocol.decode_json(payload))
        except (Closed, protocol.ProtocolError, ProcessError, OSError):
            if not proc.done.is_set() and not proc.background:
                proc.kill_tree()

    def op_stdin(self, ch: Channel, req: dict[str, Any]) -> None:
        proc = self.table.find(req)
        # Refuse before "ready", while the host still listens and before any byte is written.
        if proc.stdin_fd is None and not proc.is_pty:
            raise ProcessError("conflict", f"process {proc.id} was started without stdin (or its stdin is closed)")
        if req.get("eof"):  # the host says up front that it will close: a terminal refuses now
            proc.check_stdin_closable()
        ch.event(event="ready")
        while True:
            kind, payload = ch.recv()
            if kind == protocol.STDIN:
                proc.write_stdin(payload)
            elif kind == protocol.STDIN_EOF:
                proc.check_stdin_closable()
                proc.close_stdin()
                break
            elif kind == protocol.DATA_END:
                break
        ch.event(event="done")

    def op_wait(self, ch: Channel, req: dict[str, Any]) -> None:
        proc = self.table.find(req)
        timeout = req.get("timeout")
        if not proc.done.wait(None if timeout is None else float(timeout)):
            ch.event(event="running", id=proc.id)
            return
        if req.get("output", True):
            send_all_kept(ch, proc)
        ch.send_json(protocol.EVENT, proc.result())

    def op_attach(self, ch: Channel, req: dict[str, Any]) -> None:
        """Replay what is kept (unless `replay` is false), then follow every new byte live until the process
        ends, or until the host leaves (the process goes on)."""
        proc = self.table.find(req)
        attached = {"event": "attached", "id": proc.id, "pid": proc.pid, "max_output": proc.max_output}
        follow(ch, proc, first=attached, replay=bool(req.get("replay", True)))

    def op_ps(self, ch: Channel, req: dict[str, Any]) -> None:
        """Every process the table holds; with a selector (id, pid or tag), just that one."""
        if any(req.get(key) is not None for key in ("id", "pid", "tag")):
            ch.event(event="done", process=self.table.find(req).info())
        else:
            ch.event(event="done", processes=self.table.list())

    def op_kill(self, ch: Channel, req: dict[str, Any]) -> None:
        """SIGKILL (the default) ends the whole tree and answers once the root is reaped (its pid free: no
        zombie answers `kill -0`), or after a bounded wait (`reaped` false); other signals go to the group."""
        proc = self.table.find(req)
        sig = int(req.get("signal") or SIGKILL)
        if sig == SIGKILL:
            ch.event(event="done", reaped=proc.kill_and_reap())
        else:
            proc.signal(sig)
            ch.event(event="done")

    def op_resize(self, ch: Channel, req: dict[str, Any]) -> None:
        proc = self.table.find(req)
        rows, cols = pty_size(req)
        proc.resize(rows, cols)
        ch.event(event="done")


def _act_as(name: Any) -> None:
    """This connection's thread acts as the user the request names (the sandbox user unless it asks for root):
    every path it opens is checked as that user's (see `users`)."""
    if not users.act_as(resolve_user(name)):
        raise ProcessError("server_error", "the kernel refused to switch this request's file-system identity; "
                           "refusing to act as root instead")


def _control(proc: Process, msg: dict[str, Any]) -> None:
    if "resize" in msg:
        rows, cols = msg["resize"]
        proc.resize(int(rows), int(cols))
    if "signal" in msg:
        proc.signal(int(msg["signal"]))
    if msg.get("kill"):
        proc.kill_tree()


def _send_kept(ch: Channel, proc: Process) -> None:
    """After a foreground run: what the live stream could not carry (past the head) is the kept tail."""
    for name, buf, kind in (("stdout", proc.stdout, protocol.STDOUT), ("stderr", proc.stderr, protocol.STDERR)):
        if buf.tail_len:
            ch.event(event="tail", stream=name, omitted=buf.omitted)
            ch.send(kind, buf.tail_bytes())


def _send_error(ch: Channel, code: str, message: str) -> None:
    try:
        ch.error(code, message)
    except Closed:
        pass


def _refuse(conn: socket, code: str, message: str) -> None:
    try:
        conn.settimeout(1.0)
        Channel(conn).recv()  # read the request first: closing on unread data resets the connection
        conn.sendall(protocol.encode_json(protocol.ERROR, {"code": code, "message": message, "details": {}}))
    except (OSError, Closed, protocol.ProtocolError):
        pass
    finally:
        conn.close()


def serve(listener: socket, token: str) -> None:
    agent = Agent(token)
    if users.AGENT_IS_ROOT:  # the sandbox has root: its `sudo` asks us (docs/security.md)
        from . import sudo_service

        sudo_service.start(agent.table)
    # Over TCP (a Pod), small frames must leave at once: Nagle would hold a final event behind an unacknowledged
    # output frame for a delayed ACK (~40 ms per exec).
    tcp = listener.family != _socket.AF_UNIX
    while True:
        try:
            fd, _ = listener._accept()  # type: ignore[attr-defined]  # _socket.socket has it; typeshed omits it
            conn = _socket.socket(fileno=fd)
        except InterruptedError:
            continue
        except OSError:
            time.sleep(0.01)  # e.g. EMFILE under the open-files limit: back off, never die
            continue
        if tcp:
            try:
                conn.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            except OSError:
                pass  # a peer already gone: its request fails on its own
        try:
            # At the pids limit, what ended commands left running is stopped first (`ProcessTable.make_room`).
            agent.table.start_thread(agent.handle, conn)
        except RuntimeError:
            # The pids limit is still full (live commands hold it): refuse this request, but never let PID 1 (and
            # the sandbox) die of it.
            _refuse(conn, "quota_exceeded", "the sandbox's process limit is reached; kill some processes first")


__all__ = ["Agent", "serve"]
