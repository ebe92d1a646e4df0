"""A command's options, written once: the one typed value that carries them from a front end to the agent.

A front end builds it from its request (REST's `ExecRequest`, E2B's `process.Start`, MCP's `run_command`; the
service's `Command` is this value with its audit record), the service and the engine pass it on untouched, and
the agent client turns it into the agent's `exec` request with `request` (agent/protocol.py: the wire is as it
was). Its `user` is a checked `SandboxUser` (`corral._users`); the engine's keyword methods (`exec`,
`processes.start`) build one for Python callers, checking what they are given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._bounds import env_problem
from .._exceptions import InvalidRequestError
from .._users import SandboxUser
from ._models import PtySize

__all__ = ["ExecOptions"]


@dataclass(frozen=True)
class ExecOptions:
    """What to run: a shell string (`bash -lc`) or an argv list, and how.

    `env` is the command's own, over the sandbox's, and never reaches a later command. `detached`: a background
    process that the call follows, named by `tag` (unique among running processes) if given, in a terminal of
    size `pty` (its output is stdout; a detached command only), its stdin kept open for `processes.send_stdin`
    with `keep_stdin` (after `stdin`, if any). `user`: who runs it, None the sandbox user (uid 1000), "root" only
    in a sandbox created with root (else `PermissionDeniedError`; docs/security.md).
    """

    cmd: str | list[str]
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    max_output: int | None = None
    stdin: bytes | None = None
    detached: bool = False
    tag: str | None = None
    pty: PtySize | None = None
    keep_stdin: bool = False
    user: SandboxUser | None = None

    def __post_init__(self) -> None:
        # Every front end's command reaches here: a variable execve cannot take is a 400 naming it, not a 502.
        problem = env_problem(self.env)
        if problem is not None:
            raise InvalidRequestError(f"env: {problem}", details={"field": "env"})

    def request(self, env: dict[str, str] | None, *, follow: bool = True) -> dict[str, Any]:
        """The fields of the agent's `exec` request (not `op`, `token`, `user`: the client's own), over the
        sandbox's environment `env`. A detached command is a background process, streamed to this caller when
        it `follow`s it. Fields that were added later (`cmd_env`, `tag`, `pty`) are sent only when set, so that
        a plain command's request stays what it always was, for agents of before them."""
        fields: dict[str, Any] = {"cmd": self.cmd, "cwd": self.cwd, "env": env,
                                  "timeout": self.timeout, "max_output": self.max_output,
                                  "stdin": self.stdin is not None or self.keep_stdin}
        if self.detached:
            fields["background"] = True
            if follow:
                fields["stream"] = True
        if self.env:
            fields["cmd_env"] = self.env
        if self.tag is not None:
            fields["tag"] = self.tag
        if self.pty is not None:
            fields["pty"] = {"rows": self.pty.rows, "cols": self.pty.cols}
        return fields
