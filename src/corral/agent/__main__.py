"""Entry point of the agent: `python3 -S -B -m agent` inside the sandbox."""

from __future__ import annotations

# `_socket`, not `socket`: the `socket` module builds enums on import, and every millisecond of the agent's
# start-up is a millisecond of every sandbox's start-up.
import _socket
import os
import sys

from . import network, server
from .processes import set_dumpable

LISTEN_FD = 0  # the host passes a listening Unix socket as our stdin


def main() -> None:
    token = os.environ.pop("CORRAL_AGENT_TOKEN", "")
    if not token:
        sys.stderr.write("corral-agent: no token given; refusing to serve\n")
        sys.exit(2)
    # Non-dumpable: /proc/1/{environ,mem,fd} become unreadable to sandbox code running as the same uid.
    set_dumpable(False)
    # No signal handlers: as PID 1 of its namespace, the agent gets only the signals it handles, so sandbox
    # code cannot stop it; and commands inherit default dispositions.
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


if __name__ == "__main__":
    main()
