"""Entry point of the agent: `python3 -S -B -m agent` inside the sandbox."""

from __future__ import annotations

# `_socket`, not `socket`: the `socket` module builds enums on import, and every millisecond of the agent's
# start-up is a millisecond of every sandbox's start-up.
import _signal  # type: ignore[import-not-found]  # `signal` builds enums on import: ~12 ms
import _socket
import ctypes
import os
import sys

from . import network, server
from .processes import SIGINT, set_dumpable

LISTEN_FD = 0  # the host passes a listening Unix socket as our stdin


def main() -> None:
    # Wiped from the environment block the process started with (what /proc/1/environ shows, whatever os.environ
    # holds), then popped: where the kernel does not keep a non-dumpable process's environ private (gVisor), the
    # token is not there to read.
    _wipe_environ_value(b"CORRAL_AGENT_TOKEN=")
    token = os.environ.pop("CORRAL_AGENT_TOKEN", "")
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
    path = os.environ.pop("CORRAL_AGENT_LISTEN", "")
    if path:
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
    network.start()  # the egress bridge on 127.0.0.1:3128 and the refusing resolver on 127.0.0.1:53
    server.serve(listener, token)


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
