"""A command's process tree: its root is a child subreaper, so everything it starts (double-forked or `setsid`
away too) stays under the root's pid until the root exits; `kill_tree` walks `/proc` for the descendants and
SIGKILLs them until none is left, then the root."""

from __future__ import annotations

import collections
import os
import time

from . import room
from .spawn import SIGKILL, SIGSTOP
from .users import privileged

KILL_PASSES = 200


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, state, _) in room.processes().items():  # never PID 1: it descends from no one
        if state != "Z":
            children[ppid].append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(root: int) -> None:
    """SIGKILL every descendant of `root` until none is left, then `root` itself.

    The root is a subreaper, so escaped (setsid, double-forked) children hang under it while it lives: kill it
    last. Bounded: a tree that keeps forking is stopped by the pids limit long before the passes run out.
    """
    with privileged():  # whoever the calling request acts as, the agent kills any tree
        _kill_tree(root)


def _kill_tree(root: int) -> None:
    # Stop the root first: it must stay alive (as the subreaper holding the tree) until the tree is gone, and
    # stopped it cannot spawn more. Killing its process group first would re-parent escapees to us.
    try:
        os.kill(root, SIGSTOP)
    except OSError:
        pass
    for _ in range(KILL_PASSES):
        tree = descendants(root)
        if not tree:
            break
        for pid in tree:
            try:
                os.kill(pid, SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)
    try:
        os.kill(root, SIGKILL)
    except OSError:
        pass
