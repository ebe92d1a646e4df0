"""Entry point of the agent: `python3 -S -B -m agent` inside the sandbox."""

from __future__ import annotations

import os
import signal
import socket
import sys

from . import server
from .processes import set_dumpable

LISTEN_FD = 0  # the host passes a listening Unix socket as our stdin


def _ignore(signum: int, frame: object) -> None:
    pass


def main() -> None:
    token = os.environ.pop("CORRAL_AGENT_TOKEN", "")
    if not token:
        sys.stderr.write("corral-agent: no token given; refusing to serve\n")
        sys.exit(2)
    # Non-dumpable: /proc/1/{environ,mem,fd} become unreadable to sandbox code running as the same uid.
    set_dumpable(False)
    sys.setswitchinterval(0.0005)
    # As PID 1 we get only the signals we handle: catch the polite ones so sandbox code cannot stop us.
    # Caught, not ignored: an ignored signal stays ignored in every command we exec, a caught one does not.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)
    path = os.environ.pop("CORRAL_AGENT_LISTEN", "")
    if path:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(128)
    else:
        listener = socket.socket(fileno=os.dup(LISTEN_FD))
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, LISTEN_FD)  # and stdin becomes an ordinary /dev/null again
        os.close(devnull)
    listener.set_inheritable(False)
    server.serve(listener, token)


if __name__ == "__main__":
    main()
