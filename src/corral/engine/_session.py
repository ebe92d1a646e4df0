"""One session object per sandbox: every operation on a running sandbox goes through it.

`engine.get(id)` (or `create`) looks the sandbox up once and hands out a `SandboxSession`: commands (`exec`),
code cells and contexts, files (`files`), background processes (`processes`), terminals (`pty`), ports
(`open_port`), and the lifecycle calls that the runtime carries out (`pause`, `resume`, `snapshot`, `fork`,
`destroy`). Each call checks the sandbox is running (a paused one is `ConflictError`, a destroyed one is the
runtime's `NotFoundError`/`SandboxTimeoutError`); none looks it up again.
"""

from __future__ import annotations

import builtins
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Protocol

from .._exceptions import ConflictError, InvalidRequestError, NotFoundError
from .._paths import WORKSPACE, sandbox_path
from .._users import check_user
from ._agent_client import AgentClient, OutputCallback, PtySession, Source, StartCallback, WatchStream
from ._code import CodeResult, CodeSession, ResultCallback
from ._environment import code_with_oom, may_be_oom, with_denials, with_oom
from ._exec_options import ExecOptions
from ._models import Entry, ExecResult, ProcessInfo, ProcessSelector, PtySize, SandboxInfo, SandboxState, WatchEvent
from ._sandbox import LiveSandbox

if TYPE_CHECKING:
    from ..backends import Backend, SnapshotArtifact
    from ._egress_attach import EgressAttachment
    from ._models import SandboxSpec


class SandboxSession:
    """One sandbox: `exec`, `run_code`, `files`, `processes`, `pty`, `open_port`, `pause`/`resume`, `destroy`."""

    def __init__(self, engine: SessionHost, sb: LiveSandbox) -> None:
        self._engine = engine
        self._sb = sb
        self.id = sb.id
        self.files = Files(self)
        self.processes = Processes(self)

    def __repr__(self) -> str:
        return f"<SandboxSession {self.id}>"

    def _live(self) -> LiveSandbox:
        """The sandbox, if it is still the engine's (destroyed: the runtime's error; another of the same id since:
        that one)."""
        if self._sb.state is SandboxState.STOPPED:
            self._sb = self._engine.lookup(self.id)
        return self._sb

    def running(self) -> LiveSandbox:
        sb = self._live()
        if sb.state is SandboxState.PAUSED:
            how = "paused to disk" if sb.paused_to_disk else "paused"
            raise ConflictError(f"sandbox {sb.id} is {how}; resume it first (or connect, which resumes it)")
        return sb

    def agent(self, user: str | None = None) -> AgentClient:
        agent = self.running().agent
        return agent if user is None else agent.as_user(user)

    @property
    def info(self) -> SandboxInfo:
        return self._live().info()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment every process of the sandbox starts with (`extra` on top)."""
        return self._engine.attachment.env(self._live(), extra)

    def files_for(self, *, roots: builtins.list[str] | None = None, user: str | None = None) -> Files:
        """The sandbox's files as `user` sees them, limited to `roots` (None: the spec's)."""
        return Files(self, roots=roots, user=user)

    # -- commands -----------------------------------------------------------------------------------------

    async def exec(self, cmd: str | builtins.list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                   stdin: bytes | None = None, timeout: float | None = None, max_output: int | None = None,
                   on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None,
                   on_start: StartCallback | None = None, detached: bool = False, tag: str | None = None,
                   pty: PtySize | None = None, keep_stdin: bool = False, user: str | None = None) -> ExecResult:
        """`run` for a Python caller: the options (`ExecOptions`, the user checked here) and the callbacks."""
        options = ExecOptions(cmd, cwd=cwd, env=env or {}, stdin=stdin, timeout=timeout, max_output=max_output,
                              detached=detached, tag=tag, pty=pty, keep_stdin=keep_stdin, user=check_user(user))
        return await self.run(options, on_stdout=on_stdout, on_stderr=on_stderr, on_start=on_start)

    async def run(self, options: ExecOptions, *, on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None, on_start: StartCallback | None = None) -> ExecResult:
        """Run a command (`ExecOptions`: a shell string or argv, and how). Never raises for exit codes, timeouts
        or OOM; its result names any egress refusals while it ran.

        `on_start(id, pid)` comes before any output; `options.tag` names the process while it runs (unique:
        `ConflictError`); `options.user` acts only in a sandbox created with root (`PermissionDeniedError`).
        `options.detached`: the command is a background process that this call follows: cancelling the call only
        stops following, and the process goes on, listed and addressable by id, pid or tag (E2B runs every
        command so). Only a detached command may run in a terminal (`pty`: its output is stdout) or keep its
        stdin open (`keep_stdin`) for `processes.send_stdin`."""
        if not options.detached and (options.pty is not None or options.keep_stdin):
            raise InvalidRequestError("pty and keep_stdin need a detached command (a terminal bound to its caller "
                                      "is SandboxSession.pty)")
        sb = self.running()
        agent = sb.agent.as_user(options.user)
        backend = self._engine.backend
        before = await backend.oom_kills(sb.record)
        started = time.time()
        result = await agent.run(options, self._engine.attachment.env(sb), on_stdout=on_stdout, on_stderr=on_stderr,
                                 on_start=on_start)
        after = await backend.oom_kills(sb.record) if may_be_oom(result) else None
        result = with_oom(result, before, after)
        return with_denials(result, await self._engine.attachment.denials(sb.id, started))

    async def pty(self, cmd: str | builtins.list[str] = "bash", *, rows: int = 24, cols: int = 80,
                  cwd: str | None = None, env: dict[str, str] | None = None,
                  timeout: float | None = None, user: str | None = None) -> PtySession:
        agent = self.agent(check_user(user))
        return await agent.pty(cmd, rows=rows, cols=cols, cwd=cwd, env=self.env(), cmd_env=env, timeout=timeout)

    async def open_port(self, port: int) -> socket.socket:
        """A connection to `port` inside the sandbox, through its agent (the sandbox's network stays
        loopback-only): a connected, non-blocking socket, from now on a raw byte pipe to that port; the caller
        closes it. Nothing listening there is `AgentError` naming the port; a paused sandbox `ConflictError`."""
        return await self.agent().open_port(port)

    # -- code (docs/code.md) ------------------------------------------------------------------------------

    async def run_code(self, code: str, *, language: str = "python", session: str | None = None,
                       context: str | None = None, timeout: float | None = None, stdin: bytes | None = None,
                       env: Mapping[str, str] | None = None, cwd: str | None = None,
                       show_saved_images: bool = False, on_stdout: OutputCallback | None = None,
                       on_stderr: OutputCallback | None = None, on_result: ResultCallback | None = None,
                       max_output: int | None = None) -> CodeResult:
        """Run a cell in a stateful session. Never raises for the cell's errors, timeouts or OOM.

        `session` None: the language's own default context (`default_context(language)`). `context`: run in that
        context, in its own language (`language` is ignored). `env`: for this cell only, on top of the sandbox's.
        `cwd` and `show_saved_images` apply if this call makes the context. Of each stream the result keeps
        `max_output` bytes (None: 16 MiB), its first three quarters and last quarter; the callbacks get all."""
        sb = self.running()
        before = await self._engine.backend.oom_kills(sb.record)
        result = await sb.agent.run_code(code, language=None if context is not None else language,
                                         session=session, context=context, timeout=timeout, stdin=stdin,
                                         env=self._engine.attachment.env(sb), cell_env=env, cwd=cwd,
                                         show_saved_images=show_saved_images, on_stdout=on_stdout,
                                         on_stderr=on_stderr, on_result=on_result, max_output=max_output)
        after = await self._engine.backend.oom_kills(sb.record) if may_be_oom(result) else None
        return code_with_oom(result, before, after)

    async def create_code_context(self, language: str = "python", *, cwd: str | None = None,
                                  name: str | None = None, show_saved_images: bool = False) -> CodeSession:
        """A new code context (its session starts with its first cell): its id is `name`, else a new UUID."""
        return await self.agent().create_code_context(language, cwd=cwd, name=name, env=self.env(),
                                                      show_saved_images=show_saved_images)

    async def code_contexts(self, *, cwd: str | None = None,
                            show_saved_images: bool = False) -> builtins.list[CodeSession]:
        """Every code context, the default python and javascript ones first (made here if they do not exist)."""
        return await self.agent().code_contexts(cwd=cwd, env=self.env(), show_saved_images=show_saved_images)

    async def code_sessions(self) -> builtins.list[CodeSession]:
        return await self.agent().code_sessions()

    async def interrupt_code(self, session: str = "default") -> None:
        await self.agent().interrupt_code(session)

    async def restart_code(self, session: str = "default") -> None:
        await self.agent().restart_code(session, env=self.env())

    async def close_code(self, session: str = "default") -> None:
        await self.agent().close_code(session)

    # -- lifecycle: the runtime's ---------------------------------------------------------------------------

    async def pause(self, *, memory: bool = True) -> None:
        await self._engine.pause(self.id, memory=memory)

    async def resume(self) -> None:
        await self._engine.resume(self.id)

    async def snapshot(self) -> SnapshotArtifact:
        return await self._engine.snapshot(self.id)

    async def fork(self) -> SandboxSession:
        return await self._engine.fork(self.id)

    async def destroy(self) -> None:
        await self._engine.destroy(self.id)

    async def __aenter__(self) -> SandboxSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError):
            await self.destroy()


class Files:
    """File operations, resolved inside the sandbox.

    Paths are `SandboxPath`s, checked by the front end that received them, or plain strings from a Python caller,
    checked here by the same check (`corral._paths.sandbox_path`; relative ones resolve in /workspace).

    `roots`: the directories they may touch, if the caller holds them (the service: the sandbox's store record);
    None: the spec the engine created the sandbox with. `user`: who opens the files (the kernel checks each path
    as that user's, and what it makes is that user's): None the sandbox user, "root" only in a sandbox created
    with root (`PermissionDeniedError`)."""

    def __init__(self, session: SandboxSession, *, roots: builtins.list[str] | None = None,
                 user: str | None = None) -> None:
        self._session = session
        self._given_roots = roots
        self._user = check_user(user)

    def _agent(self) -> AgentClient:
        return self._session.agent(self._user)

    def _roots(self) -> builtins.list[str] | None:
        if self._given_roots is not None:
            return list(self._given_roots)
        roots = self._session._live().spec.file_roots
        return None if roots is None else list(roots)

    async def read(self, path: str) -> bytes:
        return await self._agent().read_file(sandbox_path(path), roots=self._roots())

    async def iter_read(self, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._agent().iter_file(sandbox_path(path), roots=self._roots()):
            yield chunk

    async def write(self, path: str, data: Source, *, mode: int = 0o644, in_place: bool = False,
                    metadata: dict[str, str] | None = None) -> int:
        """Write `data` to `path`. Whole or not at all (a temporary file renamed over it), or `in_place` as E2B's
        envd writes (the file itself, opened and truncated: a watcher sees its own name change). `metadata`:
        the file's user.e2b.* attributes, replacing any it had; refused before anything is written if invalid
        or if the file system keeps none."""
        return await self._agent().write_file(sandbox_path(path), data, mode=mode, roots=self._roots(),
                                              in_place=in_place, metadata=metadata)

    async def list(self, path: str = WORKSPACE, *, depth: int = 1) -> builtins.list[Entry]:
        """The entries below `path`, `depth` levels deep (1: its own), depth first in name order; symlinks are
        listed, not followed."""
        return await self._agent().list(sandbox_path(path), roots=self._roots(), depth=depth)

    async def stat(self, path: str) -> Entry:
        return await self._agent().stat(sandbox_path(path), roots=self._roots())

    async def exists(self, path: str) -> bool:
        return await self._agent().exists(sandbox_path(path), roots=self._roots())

    async def make_dir(self, path: str, *, parents: bool = True) -> bool:
        return await self._agent().make_dir(sandbox_path(path), parents=parents, roots=self._roots())

    async def remove(self, path: str, *, recursive: bool = True) -> None:
        await self._agent().remove(sandbox_path(path), recursive=recursive, roots=self._roots())

    async def rename(self, src: str, dst: str, *, overwrite: bool = False, parents: bool = False) -> Entry:
        """Move `src` to `dst`; `parents`: make dst's missing parent directories (E2B's Move). The entry at dst."""
        return await self._agent().rename(sandbox_path(src), sandbox_path(dst), overwrite=overwrite,
                                          roots=self._roots(), parents=parents)

    async def watch(self, path: str, *, recursive: bool = False, include_entry: bool = False) -> WatchStream:
        """Events in the directory `path` as they happen, until the stream is closed (`aclose()`). Refusals
        (missing: not found; a file: invalid request; outside the roots; too many watches) raise here."""
        return await self._agent().watch(sandbox_path(path), recursive=recursive, include_entry=include_entry,
                                         roots=self._roots())

    async def create_watcher(self, path: str, *, recursive: bool = False, include_entry: bool = False,
                             owner: str = "") -> str:
        """A watcher the agent keeps, polled with `watcher_events` (by `owner` only); its id. Refusals as
        `watch`; a watcher nobody polls for 10 minutes goes away."""
        return await self._agent().create_watcher(sandbox_path(path), recursive=recursive,
                                                  include_entry=include_entry, owner=owner, roots=self._roots())

    async def watcher_events(self, watcher_id: str, *, owner: str = "") -> builtins.list[WatchEvent]:
        """The watcher's events since the last poll: every change that finished before this call is in them."""
        return await self._agent().watcher_events(watcher_id, owner=owner)

    async def remove_watcher(self, watcher_id: str, *, owner: str = "") -> None:
        await self._agent().remove_watcher(watcher_id, owner=owner)

    async def download_tar(self, path: str) -> AsyncIterator[bytes]:
        async for chunk in self._agent().download_tar(sandbox_path(path), roots=self._roots()):
            yield chunk

    async def upload_tar(self, path: str, data: Source) -> int:
        return await self._agent().upload_tar(sandbox_path(path), data, roots=self._roots())


class Processes:
    """Background processes: start, list, get, send stdin, resize, kill, wait, follow.

    Each method that names a process takes a `ProcessSelector`: Corral's id as a `str`, or a `ProcessRef` by
    id, pid (inside the sandbox) or tag. An unknown one is `NotFoundError`."""

    def __init__(self, session: SandboxSession) -> None:
        self._session = session

    def _agent(self) -> AgentClient:
        return self._session.agent()

    async def start(self, cmd: str | builtins.list[str], *, cwd: str | None = None,
                    env: dict[str, str] | None = None, timeout: float | None = None, max_output: int | None = None,
                    stdin: bool = False, tag: str | None = None, pty: PtySize | None = None,
                    user: str | None = None) -> ProcessInfo:
        """`launch` for a Python caller: `stdin` keeps the process's stdin open for `send_stdin` (the user is
        checked here)."""
        return await self.launch(ExecOptions(cmd, cwd=cwd, env=env or {}, timeout=timeout, max_output=max_output,
                                             tag=tag, pty=pty, keep_stdin=stdin, user=check_user(user)))

    async def launch(self, options: ExecOptions) -> ProcessInfo:
        """Start a command in the background (in a terminal of size `options.pty`, if given; named
        `options.tag`, if given), as `options.user`. Its `stdin` is written before this returns, then closed
        unless `keep_stdin` (a terminal's input stays open)."""
        agent = self._session.agent(options.user)
        return await agent.launch(options, self._session.env())

    async def list(self) -> builtins.list[ProcessInfo]:
        return await self._agent().ps()

    async def get(self, ref: ProcessSelector) -> ProcessInfo:
        return await self._agent().process(ref)

    async def send_stdin(self, ref: ProcessSelector, data: bytes, *, eof: bool = False) -> None:
        await self._agent().send_stdin(ref, data, eof=eof)

    async def close_stdin(self, ref: ProcessSelector) -> None:
        """EOF on the process's stdin; a terminal's is refused (`InvalidRequestError`: send Ctrl-D, 0x04)."""
        await self._agent().close_stdin(ref)

    async def resize(self, ref: ProcessSelector, rows: int, cols: int) -> None:
        await self._agent().resize(ref, rows, cols)

    async def kill(self, ref: ProcessSelector, signal: int | None = None) -> None:
        """`signal` to the process's group; None (SIGKILL): its whole tree, answered once its pid is free."""
        await self._agent().kill(ref, signal)

    async def wait(self, ref: ProcessSelector, timeout: float | None = None) -> ExecResult | None:
        return await self._agent().wait(ref, timeout)

    async def attach(self, ref: ProcessSelector, on_stdout: OutputCallback | None = None,
                     on_stderr: OutputCallback | None = None, *, replay: bool = True,
                     on_start: StartCallback | None = None) -> ExecResult:
        """Follow the process to its end: the output kept so far (not with `replay=False`: only what comes
        after), then every new byte. Cancelling only detaches."""
        return await self._agent().attach(ref, on_stdout, on_stderr, replay=replay, on_start=on_start)


class SessionHost(Protocol):
    """What a session needs of the engine that made it (`Engine` is one): its backend, its egress attachment,
    the lookup of a live sandbox, and the lifecycle calls the runtime carries out. A protocol, not the `Engine`
    class, so the engine's modules import each other one way only."""

    @property
    def backend(self) -> Backend: ...

    @property
    def attachment(self) -> EgressAttachment: ...

    def lookup(self, sandbox_id: str) -> LiveSandbox: ...

    async def destroy(self, sandbox_id: str) -> None: ...

    async def pause(self, sandbox_id: str, *, memory: bool = True) -> None: ...

    async def resume(self, sandbox_id: str) -> None: ...

    async def snapshot(self, sandbox_id: str, snapshot_id: str | None = None) -> SnapshotArtifact: ...

    async def fork(self, sandbox_id: str, *, child_id: str | None = None,
                   spec: SandboxSpec | None = None) -> SandboxSession: ...
