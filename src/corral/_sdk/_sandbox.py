"""`Sandbox` and `AsyncSandbox`: a sandbox on a Corral server, with its `commands`, `files`, `pty` and `code`.

The two classes are twins written side by side; what they share without I/O is `_SandboxBase` and the request
helpers below.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Self, overload

import httpx

from .._exceptions import InvalidRequestError, NotFoundError, SandboxTimeoutError, ServerError
from ._checkpoints import AsyncCheckpointing, Checkpointing
from ._code import AsyncCodeInterpreter, CodeInterpreter, Execution, ResultCallback
from ._commands import AsyncCommands, Commands
from ._config import DEFAULT_MAX_RETRIES, DEFAULT_REQUEST_TIMEOUT, ConnectionConfig
from ._create import create_body as _create_body
from ._files import AsyncFiles, Files
from ._models import SandboxInfo, SandboxMetric
from ._processes import OutputCallback
from ._pty import AsyncPty, Pty
from ._snapshots import AsyncSnapshot, Snapshot
from ._transport import AsyncClient, SyncClient, json_dict, sandbox_path

__all__ = ["AsyncSandbox", "Sandbox"]


def _pause_body(memory: bool) -> dict[str, Any]:
    if not isinstance(memory, bool):
        raise TypeError("memory is True (freeze in place) or False (pause to disk)")
    return {"memory": memory}


def _snapshot_body(name: str | None) -> dict[str, Any]:
    return {} if name is None else {"name": name}


def _fork_body(timeout: float | None, metadata: Mapping[str, str] | None, count: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if timeout is not None:
        body["timeout"] = timeout
    if metadata is not None:
        body["metadata"] = dict(metadata)
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError("count is a number of sandboxes")
        body["count"] = count
    return body


def _forked(data: Any, count: int | None) -> builtins.list[SandboxInfo]:
    """The children in a fork's answer: one sandbox object, or `{"sandboxes": [...]}` when `count` was given."""
    if count is None:
        return [SandboxInfo.from_wire(data)]
    return [SandboxInfo.from_wire(s) for s in json_dict(data, "a fork").get("sandboxes", [])]


def _check_port(port: int) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise InvalidRequestError(f"port must be an integer from 1 to 65535, not {port!r}")


def _ports_domain(info: Any) -> str:
    """The domain sandboxes' ports are served under, from `GET /v1/info`."""
    domain = info.get("domain") if isinstance(info, dict) else None
    if not isinstance(domain, str) or not domain:
        raise ServerError("this Corral server does not say where sandboxes' ports are served (no 'domain' in "
                          "GET /v1/info): it is older than get_host(); upgrade it")
    return domain


def _port_host(sandbox_id: str, port: int, domain: str, base_url: str) -> str:
    """`<port>-<sandbox id>.<domain>:<server port>`: the server's port as this client reaches it."""
    url = httpx.URL(base_url)
    server_port = url.port or (443 if url.scheme == "https" else 80)
    return f"{port}-{sandbox_id}.{domain}:{server_port}"


def _network_body(network: str | Sequence[str]) -> dict[str, Any]:
    return {"network": network if isinstance(network, str) else builtins.list(network)}


def _list_params(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {f"metadata.{key}": value for key, value in (metadata or {}).items()}


Moment = datetime | float  # a datetime (naive: local time, as `datetime.timestamp` takes it) or unix seconds


def _metrics_params(start: Moment | None, end: Moment | None) -> dict[str, str]:
    moments = {"start": start, "end": end}
    return {name: repr(m.timestamp() if isinstance(m, datetime) else float(m))
            for name, m in moments.items() if m is not None}


def _metrics(data: Any) -> builtins.list[SandboxMetric]:
    samples = json_dict(data, "a list of metrics").get("metrics")
    if not isinstance(samples, builtins.list):
        raise ServerError("malformed response from Corral: expected {'metrics': [...]}")
    return [SandboxMetric.from_wire(m) for m in samples]


class _SandboxBase:
    """What `Sandbox` and `AsyncSandbox` share that does no I/O."""

    def __init__(self, info: SandboxInfo) -> None:
        self._info = info
        self._killed = False
        self._domain: str | None = None  # where the server serves sandboxes' ports, once asked

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> SandboxInfo:
        """The description from the last call that returned one (see `get_info()` for a fresh one)."""
        return self._info

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, template={self._info.template!r})"


class Sandbox(_SandboxBase, Checkpointing):
    """A sandbox on a Corral server. Make one with `Sandbox.create()` or `Sandbox.connect()`.

    Used as a context manager, leaving the block kills the sandbox.
    """

    def __init__(self, info: SandboxInfo, client: SyncClient) -> None:
        super().__init__(info)
        self._client = client
        self.commands = Commands(client, info.id)
        self.files = Files(client, info.id)
        self.pty = Pty(client, info.id)
        self.code = CodeInterpreter(client, info.id)

    @classmethod
    def create(
        cls,
        template: str = "default",
        *,
        timeout: float = 300,
        network: str | Sequence[str] = "none",
        limits: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        file_roots: Sequence[str] | None = None,
        runtime: str | None = None,
        on_timeout: str = "kill",
        auto_resume: bool = False,
        volumes: Mapping[str, str] | None = None,
        public_ports: bool = False,
        root: bool = False,
        secrets: Mapping[str, Mapping[str, Any]] | None = None,
        checkpoints: str | None = None,
        checkpoint_keep: int | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.BaseTransport | None = None,
    ) -> Sandbox:
        """Start a new sandbox. `template` is a template's name or a snapshot's id (`Snapshot.id`); `timeout` is
        its time to live in seconds (never None: every sandbox has one); `on_timeout="pause"` pauses it to disk
        when that ends instead of killing it; `auto_resume`: paused (by that, or by `pause()`), it resumes when a
        request reaches it (a command, a file, code, a port) and serves it; `volumes` mounts the tenant's volumes
        by path (`{"/mnt/data": "name"}`); `public_ports` lets anyone reach its ports (`get_host`) without the
        key; `root` gives it root inside (`commands.run(..., user="root")`, files with `user="root"`, `sudo`;
        that root is an unprivileged host uid, docs/security.md) where the server's backend can (the Docker
        backend refuses it: `InvalidRequestError`);
        `secrets` (`{"GITHUB_TOKEN": {"value": "...", "hosts": ["api.github.com"]}}`) never enter the sandbox:
        `$GITHUB_TOKEN` inside is a placeholder the egress proxy replaces in requests to those hosts only
        (docs/secrets.md; `"body": True` also in request bodies); `checkpoints="auto"` takes a checkpoint before
        each command, code cell and file change, keeping the last `checkpoint_keep` (20) (docs/lifecycle.md);
        `runtime` is the OCI runtime, `"runc"` or `"runsc"` (gVisor), None: the server's default (`runc`);
        `api_key`/`base_url` default to `$CORRAL_API_KEY`/`$CORRAL_URL`; a 429 or 503 answer (quota, full
        machine: nothing was created) is retried up to `max_retries` times after the server's `Retry-After` (when
        at most 10 s); `transport` is an httpx transport (for tests)."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        client = SyncClient(config, transport)
        try:
            body = _create_body(template, timeout, network, limits, env, metadata, file_roots, runtime,
                                on_timeout=on_timeout, auto_resume=auto_resume, volumes=volumes,
                                public_ports=public_ports, root=root, secrets=secrets, checkpoints=checkpoints,
                                checkpoint_keep=checkpoint_keep)
            info = SandboxInfo.from_wire(client.request("POST", "/v1/sandboxes", json=body))
        except BaseException:
            client.close()
            raise
        return cls(info, client)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.BaseTransport | None = None,
    ) -> Sandbox:
        """Attach to an existing sandbox (`NotFoundError` if it does not exist for this key); a paused one is
        resumed (from disk too: booted again with its files)."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        client = SyncClient(config, transport)
        try:
            info = SandboxInfo.from_wire(client.request("GET", sandbox_path(sandbox_id)))
            if info.state == "paused":
                info = SandboxInfo.from_wire(client.request("POST", sandbox_path(sandbox_id, "/resume")))
        except BaseException:
            client.close()
            raise
        return cls(info, client)

    @classmethod
    def list(
        cls,
        *,
        metadata: Mapping[str, str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.BaseTransport | None = None,
    ) -> builtins.list[SandboxInfo]:
        """The caller's tenant's sandboxes, optionally only those whose metadata has every given KEY=VALUE."""
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        client = SyncClient(config, transport)
        try:
            data = json_dict(client.request("GET", "/v1/sandboxes", params=_list_params(metadata)), "a list")
        finally:
            client.close()
        return [SandboxInfo.from_wire(s) for s in data.get("sandboxes", [])]

    def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        session: str | None = None,
        timeout: float | None = 60,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
        stdin: bytes | str | None = None,
        max_output: int | None = None,
    ) -> Execution:
        """Run `code` like a notebook cell in a stateful session (`sb.code.run`): `ex.text`, `ex.results[0].png`,
        `ex.stdout`, `ex.error`. Never raises for a failing cell."""
        return self.code.run(code, language=language, session=session, timeout=timeout, stdin=stdin,
                             on_stdout=on_stdout, on_stderr=on_stderr, on_result=on_result, max_output=max_output)

    def get_info(self) -> SandboxInfo:
        self._info = SandboxInfo.from_wire(self._client.request("GET", sandbox_path(self.id)))
        return self._info

    def get_host(self, port: int) -> str:
        """The host (`"<port>-<sandbox id>.<domain>:<server port>"`) under which the server forwards HTTP and
        WebSocket requests to `port` inside the sandbox (docs/ports.md). Requests need this client's key as
        `Authorization: Bearer` unless the sandbox was created with `public_ports=True`. The server's domain is
        asked once (`GET /v1/info`)."""
        _check_port(port)
        if self._domain is None:
            self._domain = _ports_domain(self._client.request("GET", "/v1/info"))
        return _port_host(self.id, port, self._domain, self._client.config.base_url)

    def get_metrics(self, start: Moment | None = None, end: Moment | None = None) -> builtins.list[SandboxMetric]:
        """The sandbox's resource samples (CPU, memory, disk) taken from `start` to `end` (both included, to the
        second; default: all that are kept, the last hour), oldest first. One every 5 s while it runs, the first
        about a second after it starts; [] for a window before it existed."""
        return _metrics(self._client.request("GET", sandbox_path(self.id, "/metrics"),
                                             params=_metrics_params(start, end)))

    def set_timeout(self, seconds: int) -> SandboxInfo:
        """Let the sandbox live `seconds` from now."""
        data = self._client.request("POST", sandbox_path(self.id, "/timeout"), json={"timeout": seconds})
        self._info = SandboxInfo.from_wire(data)
        return self._info

    def set_network(self, network: str | Sequence[str]) -> SandboxInfo:
        """Change the egress policy ("none", "internet" or rules); new connections follow it at once."""
        data = self._client.request("PUT", sandbox_path(self.id, "/network"), json=_network_body(network))
        self._info = SandboxInfo.from_wire(data)
        return self._info

    def pause(self, *, memory: bool = True) -> SandboxInfo:
        """`memory=True`: freeze every process in place (memory kept, no CPU used; its timeout still runs).
        `memory=False`: pause to disk: processes end, memory is released, every file stays (/tmp too) and its
        timeout's clock stops; `resume()` or `Sandbox.connect()` boots it again (docs/lifecycle.md)."""
        data = self._client.request("POST", sandbox_path(self.id, "/pause"), json=_pause_body(memory))
        self._info = SandboxInfo.from_wire(data)
        return self._info

    def snapshot(self, name: str | None = None) -> Snapshot:
        """Keep the sandbox's files (not /tmp or /dev/shm, which are memory) as a snapshot that starts sandboxes:
        `Sandbox.create(template=snap.id)`. The sandbox is frozen for the copy and runs on."""
        data = self._client.request("POST", sandbox_path(self.id, "/snapshots"), json=_snapshot_body(name))
        return Snapshot._parse(data, self._client.config)  # type: ignore[no-any-return]

    @overload
    def fork(self, *, timeout: float | None = None, metadata: Mapping[str, str] | None = None) -> Sandbox: ...

    @overload
    def fork(self, *, count: int, timeout: float | None = None,
             metadata: Mapping[str, str] | None = None) -> builtins.list[Sandbox]: ...

    def fork(self, *, count: int | None = None, timeout: float | None = None,
             metadata: Mapping[str, str] | None = None) -> Sandbox | builtins.list[Sandbox]:
        """A new running sandbox with this one's files at this instant (and its spec, env included), independent
        from then on. `timeout`/`metadata`: the child's, instead of the parent's. `count=N`: a list of N such
        sandboxes of the same instant (the parent is frozen and copied once), all started or none."""
        data = self._client.request("POST", sandbox_path(self.id, "/fork"),
                                    json=_fork_body(timeout, metadata, count))
        infos = _forked(data, count)
        made = [Sandbox(info, SyncClient(self._client.config, self._client.transport)) for info in infos]
        return made if count is not None else made[0]

    def resume(self) -> SandboxInfo:
        self._info = SandboxInfo.from_wire(self._client.request("POST", sandbox_path(self.id, "/resume")))
        return self._info

    def kill(self) -> None:
        """Destroy the sandbox now, and close this object's connection."""
        if self._killed:
            return
        try:
            self._client.request("DELETE", sandbox_path(self.id))
            self._killed = True
        finally:
            self._client.close()

    def close(self) -> None:
        """Close the connection; the sandbox keeps running until its timeout (reattach with `connect`)."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._killed:
            self._client.close()
            return
        with contextlib.suppress(NotFoundError, SandboxTimeoutError):  # already gone: the goal is met
            self.kill()


class AsyncSandbox(_SandboxBase, AsyncCheckpointing):
    """`Sandbox`, awaited: `async with await AsyncSandbox.create() as sb: await sb.commands.run("ls")`."""

    def __init__(self, info: SandboxInfo, client: AsyncClient) -> None:
        super().__init__(info)
        self._client = client
        self.commands = AsyncCommands(client, info.id)
        self.files = AsyncFiles(client, info.id)
        self.pty = AsyncPty(client, info.id)
        self.code = AsyncCodeInterpreter(client, info.id)

    @classmethod
    async def create(
        cls,
        template: str = "default",
        *,
        timeout: float = 300,
        network: str | Sequence[str] = "none",
        limits: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        file_roots: Sequence[str] | None = None,
        runtime: str | None = None,
        on_timeout: str = "kill",
        auto_resume: bool = False,
        volumes: Mapping[str, str] | None = None,
        public_ports: bool = False,
        root: bool = False,
        secrets: Mapping[str, Mapping[str, Any]] | None = None,
        checkpoints: str | None = None,
        checkpoint_keep: int | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        client = AsyncClient(config, transport)
        try:
            body = _create_body(template, timeout, network, limits, env, metadata, file_roots, runtime,
                                on_timeout=on_timeout, auto_resume=auto_resume, volumes=volumes,
                                public_ports=public_ports, root=root, secrets=secrets, checkpoints=checkpoints,
                                checkpoint_keep=checkpoint_keep)
            info = SandboxInfo.from_wire(await client.request("POST", "/v1/sandboxes", json=body))
        except BaseException:
            await client.close()
            raise
        return cls(info, client)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        client = AsyncClient(config, transport)
        try:
            info = SandboxInfo.from_wire(await client.request("GET", sandbox_path(sandbox_id)))
            if info.state == "paused":
                info = SandboxInfo.from_wire(await client.request("POST", sandbox_path(sandbox_id, "/resume")))
        except BaseException:
            await client.close()
            raise
        return cls(info, client)

    @classmethod
    async def list(
        cls,
        *,
        metadata: Mapping[str, str] | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> builtins.list[SandboxInfo]:
        config = ConnectionConfig.resolve(api_key=api_key, base_url=base_url, request_timeout=request_timeout,
                                          max_retries=max_retries)
        client = AsyncClient(config, transport)
        try:
            data = await client.request("GET", "/v1/sandboxes", params=_list_params(metadata))
        finally:
            await client.close()
        return [SandboxInfo.from_wire(s) for s in json_dict(data, "a list").get("sandboxes", [])]

    async def run_code(
        self,
        code: str,
        *,
        language: str = "python",
        session: str | None = None,
        timeout: float | None = 60,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_result: ResultCallback | None = None,
        stdin: bytes | str | None = None,
        max_output: int | None = None,
    ) -> Execution:
        """Run `code` like a notebook cell in a stateful session (see `Sandbox.run_code`)."""
        return await self.code.run(code, language=language, session=session, timeout=timeout, stdin=stdin,
                                   on_stdout=on_stdout, on_stderr=on_stderr, on_result=on_result,
                                   max_output=max_output)

    async def get_info(self) -> SandboxInfo:
        self._info = SandboxInfo.from_wire(await self._client.request("GET", sandbox_path(self.id)))
        return self._info

    async def get_host(self, port: int) -> str:
        """The host for `port` inside the sandbox (see `Sandbox.get_host`)."""
        _check_port(port)
        if self._domain is None:
            self._domain = _ports_domain(await self._client.request("GET", "/v1/info"))
        return _port_host(self.id, port, self._domain, self._client.config.base_url)

    async def get_metrics(self, start: Moment | None = None,
                          end: Moment | None = None) -> builtins.list[SandboxMetric]:
        """The sandbox's resource samples from `start` to `end` (see `Sandbox.get_metrics`)."""
        return _metrics(await self._client.request("GET", sandbox_path(self.id, "/metrics"),
                                                   params=_metrics_params(start, end)))

    async def set_timeout(self, seconds: int) -> SandboxInfo:
        data = await self._client.request("POST", sandbox_path(self.id, "/timeout"), json={"timeout": seconds})
        self._info = SandboxInfo.from_wire(data)
        return self._info

    async def set_network(self, network: str | Sequence[str]) -> SandboxInfo:
        data = await self._client.request("PUT", sandbox_path(self.id, "/network"), json=_network_body(network))
        self._info = SandboxInfo.from_wire(data)
        return self._info

    async def pause(self, *, memory: bool = True) -> SandboxInfo:
        data = await self._client.request("POST", sandbox_path(self.id, "/pause"), json=_pause_body(memory))
        self._info = SandboxInfo.from_wire(data)
        return self._info

    async def snapshot(self, name: str | None = None) -> AsyncSnapshot:
        data = await self._client.request("POST", sandbox_path(self.id, "/snapshots"), json=_snapshot_body(name))
        return AsyncSnapshot._parse(data, self._client.config)  # type: ignore[no-any-return]

    @overload
    async def fork(self, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None) -> AsyncSandbox: ...

    @overload
    async def fork(self, *, count: int, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None) -> builtins.list[AsyncSandbox]: ...

    async def fork(self, *, count: int | None = None, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None) -> AsyncSandbox | builtins.list[AsyncSandbox]:
        data = await self._client.request("POST", sandbox_path(self.id, "/fork"),
                                          json=_fork_body(timeout, metadata, count))
        infos = _forked(data, count)
        made = [AsyncSandbox(info, AsyncClient(self._client.config, self._client.transport)) for info in infos]
        return made if count is not None else made[0]

    async def resume(self) -> SandboxInfo:
        self._info = SandboxInfo.from_wire(await self._client.request("POST", sandbox_path(self.id, "/resume")))
        return self._info

    async def kill(self) -> None:
        if self._killed:
            return
        try:
            await self._client.request("DELETE", sandbox_path(self.id))
            self._killed = True
        finally:
            await self._client.close()

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._killed:
            await self._client.close()
            return
        with contextlib.suppress(NotFoundError, SandboxTimeoutError):
            await self.kill()
