"""Entry point of the agent: `python3 -S -B -m agent` inside the sandbox.

Where it listens: the listening Unix socket the host passes as stdin (the local backend), a Unix socket it binds
itself (`CORRAL_AGENT_LISTEN`: runsc, Docker), or TCP (`CORRAL_AGENT_TCP=host:port`: a Pod on the Kubernetes
backend, reached at its IP). Its token: `CORRAL_AGENT_TOKEN`, or the file `CORRAL_AGENT_TOKEN_FILE` names (a
Kubernetes Secret mounted read-only: the token never appears in the Pod's spec).

On Kubernetes the agent and sandbox code share a uid (Pod Security `restricted` forbids the root the agent would
need to hide the file), so sandbox code can read the token. That grants it nothing it does not have already: the
token opens this sandbox's own agent, which runs that same code's commands; other Pods cannot reach the port (the
NetworkPolicy admits only the control plane's Pods), and the token is an HMAC of this sandbox and Pod alone, so it
opens no other sandbox's agent (docs/kubernetes-backend.md).
"""

from __future__ import annotations

# `_socket`, not `socket`: the `socket` module builds enums on import, and every millisecond of the agent's
# start-up is a millisecond of every sandbox's start-up.
import _signal  # type: ignore[import-not-found]  # `signal` builds enums on import: ~12 ms
import _socket
import ctypes
import os
import sys

from . import network, server
from .spawn import SIGINT, set_dumpable

LISTEN_FD = 0  # the host passes a listening Unix socket as our stdin


def main() -> None:
    # Wiped from the environment block the process started with (what /proc/1/environ shows, whatever os.environ
    # holds), then popped: where the kernel does not keep a non-dumpable process's environ private (gVisor), the
    # token is not there to read.
    _wipe_environ_value(b"CORRAL_AGENT_TOKEN=")
    token = os.environ.pop("CORRAL_AGENT_TOKEN", "")
    token_file = os.environ.pop("CORRAL_AGENT_TOKEN_FILE", "")
    if token_file:
        token = _read_token(token_file)
    if not token:
        sys.stderr.write("corral-agent: no token given; refusing to serve\n")
        sys.exit(2)
    # Non-dumpable: /proc/1/{environ,mem,fd} become unreadable to sandbox code running as the same uid (and to
    # the sandbox's root, which has no CAP_SYS_PTRACE).
    set_dumpable(False)
    # No signal handlers: as PID 1 of its namespace, the agent gets only the signals it handles, so sandbox
    # code cannot stop it. Python handles SIGINT (KeyboardInterrupt), which would let `kill -INT 1` end the
    # sandbox: ignored instead (commands get it back at its default, `processes.CHILD_DEFAULT_SIGNALS`).
    _signal.signal(SIGINT, _signal.SIG_IGN)
    listener = _listener()
    network.start()  # the egress bridge on 127.0.0.1:3128 and the refusing resolver on 127.0.0.1:53
    server.serve(listener, token)


def _listener() -> _socket.socket:
    """Where to serve: TCP (a Pod), a Unix socket we bind (runsc, Docker), or the one passed as stdin."""
    path = os.environ.pop("CORRAL_AGENT_LISTEN", "")
    tcp = os.environ.pop("CORRAL_AGENT_TCP", "")
    if tcp:
        listener = _listen_tcp(tcp)
    elif path:
        # The runtime could not pass us a socket (runsc): bind our own, 0600 from the start (the umask applies
        # to bind), and again by name in case the runtime's file system ignores the umask. Once it accepts
        # connections the host moves it out of the sandbox's reach and makes it root's, 0600, whatever we did.
        listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        umask = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(umask)  # commands get the usual one
        try:
            os.chmod(path, 0o600)
        except OSError:
            pass
        listener.listen(128)
    else:
        listener = _socket.socket(fileno=os.dup(LISTEN_FD))
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, LISTEN_FD)  # and stdin becomes an ordinary /dev/null again
        os.close(devnull)
    return listener


def _read_token(path: str) -> str:
    """The token in `path` (a Secret's file ends with whatever the writer put: a trailing newline is dropped);
    "" if it cannot be read, which refuses to serve."""
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except OSError as exc:
        sys.stderr.write(f"corral-agent: cannot read the token file {path}: {exc.strerror}\n")
        return ""
    return data.decode("utf-8", "replace").rstrip("\r\n")


def _listen_tcp(address: str) -> _socket.socket:
    """A listening TCP socket on `host:port` (`[v6]:port` too). SO_REUSEADDR: a restarted agent (a Pod's
    container restarting) binds again at once, whatever connections of the old one linger in TIME_WAIT."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    listener = _socket.socket(family, _socket.SOCK_STREAM)
    listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, int(port)))
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"corral-agent: cannot listen on {address!r}: {exc}\n")
        sys.exit(2)
    listener.listen(128)
    return listener


def _wipe_environ_value(prefix: bytes) -> None:
    """Zero the value of the C environment's entry that starts with `prefix` (`NAME=`), in place: the strings
    the process started with, which /proc/self/environ shows. Python's copy (os.environ) is left as it was."""
    entries = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.pythonapi, "environ")
    i = 0
    while entries[i]:
        address = entries[i]
        text = ctypes.string_at(address)
        if text.startswith(prefix):
            ctypes.memset(address + len(prefix), 0, len(text) - len(prefix))
        i += 1


if __name__ == "__main__":
    main()
