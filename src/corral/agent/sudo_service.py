"""The agent's side of `sudo` (see `sudo`), in a sandbox created with root: run a command as root for a caller.

Listens on the abstract Unix socket `sudo.SOCKET` of the sandbox's network namespace (nothing outside the sandbox
shares it, nothing inside can replace it). Per connection: the peer's credentials from the kernel
(SO_PEERCRED, for SUDO_UID and friends; a peer from outside the sandbox's pid namespace is refused), one request
with the caller's stdin, stdout and stderr attached (SCM_RIGHTS), then the command as a process of the agent's
own: a subreaper in its own session, reaped by the agent's reaper, its tree killed with the agent's tree kill.
Signals the caller relays go to its process group; its exit status goes back; a caller that hangs up (killed by
its own timeout, say) gets the command's whole tree killed.

Only started when the agent is root (`users.AGENT_IS_ROOT`): a sandbox without root has no such socket.
"""

from __future__ import annotations

import _socket
import itertools
import os
import select
import struct
import threading
import time

from . import protocol
from .process import REAP_WAIT, Process, decode_status
from .process_requests import ProcessError
from .processes import ProcessTable
from .spawn import which
from .sudo import SOCKET
from .users import ROOT, USER

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

REQUEST_TIMEOUT = 10.0  # for the request to arrive once connected: a silent client holds no thread for long
MAX_REQUEST = 1024 * 1024  # argv and environment of one command
_SCM_RIGHTS_SPACE = _socket.CMSG_SPACE(3 * 4)
_UCRED = struct.Struct("3i")  # pid, uid, gid
_ids = itertools.count(1)


def start(table: ProcessTable) -> None:
    """Listen for `sudo` callers, in a daemon thread. A socket that cannot be bound leaves sudo unavailable."""
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        listener.bind(SOCKET)
        listener.listen(64)
    except OSError:
        listener.close()
        return
    threading.Thread(target=_serve, args=(listener, table), name="sudo", daemon=True).start()


def _serve(listener: _socket.socket, table: ProcessTable) -> None:
    while True:
        try:
            fd, _ = listener._accept()  # type: ignore[attr-defined]  # _socket.socket has it; typeshed omits it
        except OSError:
            time.sleep(0.01)  # EMFILE and friends: the sandbox's own limits; never die of them
            continue
        conn = _socket.socket(fileno=fd)
        try:
            table.start_thread(_session, conn, table)
        except RuntimeError:  # the pids limit is full: this caller is refused, sudo goes on
            _refuse(conn, "quota_exceeded", "the sandbox's process limit is reached")


def _session(conn: _socket.socket, table: ProcessTable) -> None:
    fds: list[int] = []
    try:
        pid, uid, gid = _UCRED.unpack(conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _UCRED.size))
        if pid <= 0:  # the kernel names no pid for a peer outside our pid namespace: not a process of the sandbox
            raise ProcessError("permission_denied", "sudo serves the sandbox's own processes only")
        conn.settimeout(REQUEST_TIMEOUT)
        req, fds = _receive(conn)
        conn.settimeout(None)
        proc = _start(table, req, fds, uid, gid)
    except ProcessError as exc:
        _refuse(conn, exc.code, exc.message)
        return
    except (OSError, protocol.ProtocolError, ValueError) as exc:
        _refuse(conn, "invalid_request", f"cannot read the request: {exc}")
        return
    finally:
        for fd in fds:  # the command has its own copies
            _close_quietly(fd)
    try:
        _send(conn, protocol.EVENT, {"event": "started", "pid": proc.pid})
        _follow(conn, proc)
    finally:
        proc.close_wake()
        conn.close()


def _receive(conn: _socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request frame and the three descriptors that came with it."""
    data = bytearray()
    fds: list[int] = []
    need = protocol.HEADER.size
    while len(data) < need:
        chunk, ancillary, flags, _ = conn.recvmsg(min(need - len(data), 65536), _SCM_RIGHTS_SPACE,
                                                  _socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += [fd for (fd,) in struct.iter_unpack("i", payload[: len(payload) - len(payload) % 4])]
        if flags & _socket.MSG_CTRUNC:
            raise ProcessError("invalid_request", "too many descriptors with the request")
        if not chunk:
            raise ProcessError("invalid_request", "the caller left before its request arrived")
        data += chunk
        if len(data) >= protocol.HEADER.size and need == protocol.HEADER.size:
            kind, length = protocol.parse_header(bytes(data[: protocol.HEADER.size]))
            if kind != protocol.REQUEST or length > MAX_REQUEST:
                raise ProcessError("invalid_request", "not a sudo request")
            need += length
    if len(fds) != 3:
        for fd in fds:
            _close_quietly(fd)
        raise ProcessError("invalid_request", "a sudo request comes with its stdin, stdout and stderr")
    return protocol.decode_json(bytes(data[protocol.HEADER.size:])), fds


def _start(table: ProcessTable, req: dict[str, Any], fds: list[int], uid: int, gid: int) -> Process:
    argv, env, cwd = req.get("argv"), req.get("env"), req.get("cwd")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and "\x00" not in a for a in argv):
        raise ProcessError("invalid_request", "the command is not a list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                                            and "\x00" not in k + v for k, v in env.items()):
        raise ProcessError("invalid_request", "the environment is not an object of strings")
    user = {"root": ROOT, "user": USER}.get(req.get("user") or "root")
    if user is None:
        raise ProcessError("invalid_request", f"unknown user {req.get('user')!r}")
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        raise ProcessError("invalid_request", f"unable to change to directory {cwd!r}")
    if "/" not in argv[0] and which(argv[0], env.get("PATH", "")) is None:
        raise ProcessError("not_found", f"{argv[0]}: command not found")
    env = {**env, "SUDO_UID": str(uid), "SUDO_GID": str(gid), "SUDO_USER": _name(uid),
           "SUDO_COMMAND": " ".join(argv)[:4096]}
    proc = Process(f"sudo-{next(_ids)}", argv, background=True, timeout=None, max_output=4, is_pty=False,
                   cwd=cwd, user=user)
    table.spawn_on(proc, env, (fds[0], fds[1], fds[2]))
    return proc


def _follow(conn: _socket.socket, proc: Process) -> None:
    """Relay signals until the command exits (its status goes back) or the caller leaves (its tree is killed)."""
    poller = select.epoll()
    poller.register(conn.fileno(), select.EPOLLIN)
    poller.register(proc._wake_r, select.EPOLLIN)
    try:
        while not proc.exited.is_set():
            for fd, _ in poller.poll():
                if fd == conn.fileno() and not _control(conn, proc):
                    proc.kill_tree()
                    proc.exited.wait(REAP_WAIT)
                    return
        code, signal = decode_status(proc.status)
        _send(conn, protocol.EVENT, {"event": "exit", "exit_code": code, "signal": signal})
    finally:
        poller.close()


def _control(conn: _socket.socket, proc: Process) -> bool:
    """One frame from the caller: a signal to relay. False once the caller is gone (or talks nonsense)."""
    try:
        header = _recv_exact(conn, protocol.HEADER.size)
        kind, length = protocol.parse_header(header)
        message = protocol.decode_json(_recv_exact(conn, length)) if length else {}
    except (OSError, EOFError, protocol.ProtocolError):
        return False
    signum = message.get("signal")
    if kind == protocol.CONTROL and isinstance(signum, int) and 0 < signum < 65:
        proc.signal(signum)
    return True


def _recv_exact(conn: _socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _name(uid: int) -> str:
    return ROOT.name if uid == ROOT.uid else USER.name if uid == USER.uid else str(uid)


def _send(conn: _socket.socket, kind: int, message: dict[str, Any]) -> None:
    try:
        conn.sendall(protocol.encode_json(kind, message))
    except OSError:
        pass


def _refuse(conn: _socket.socket, code: str, message: str) -> None:
    _send(conn, protocol.ERROR, {"code": code, "message": message, "details": {}})
    conn.close()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
