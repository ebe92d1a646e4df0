"""The Docker Engine API through the official SDK (`docker>=7`): the one module that touches it, and the boundary
where its errors become Corral's.

Only the low-level `docker.APIClient` is used: the backend writes the whole ContainerCreate body itself
(`_container`), as the local backend writes its OCI `config.json`, so nothing the SDK's high-level models add
(a proxy environment from `~/.docker/config.json`, for one) reaches a sandbox.

The SDK is synchronous (requests over the daemon's Unix socket): every call runs in this module's own thread
pool, so fifty concurrent creates neither queue on the event loop's small default executor nor starve the rest
of the engine. A call that is cancelled still finishes in its thread before the cancellation proceeds, so
whoever cleans up after a cancelled create never races a container that is still being made.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import docker  # type: ignore[import-untyped,unused-ignore]
import docker.errors  # type: ignore[import-untyped,unused-ignore]
import requests

from ..._exceptions import ConflictError, CorralError, RuntimeUnavailableError, ServerError

__all__ = ["DEFAULT_BASE_URL", "MIN_API_VERSION", "START_HINT", "DockerAPI", "docker_errors"]

DEFAULT_BASE_URL = "unix:///var/run/docker.sock"
MIN_API_VERSION = (1, 41)  # Docker 20.10: CgroupnsMode, MaskedPaths/ReadonlyPaths, seccomp's defaultErrnoRet
START_HINT = "start it (scripts/start-dockerd, or `systemctl start docker`)"
_THREADS = 32
_TIMEOUT = 120.0  # seconds between bytes of one API answer (a create under heavy load can take several)
_IMPORT_TIMEOUT = 1800.0  # an import streams gigabytes; the daemon answers only once it has unpacked them
_REMOVAL_WAIT = 30.0

T = TypeVar("T")


@contextlib.contextmanager
def docker_errors(what: str, base_url: str) -> Iterator[None]:
    """Map what the SDK raises to Corral's errors, naming what was being done."""
    try:
        yield
    except CorralError:
        raise
    except docker.errors.APIError as exc:
        if exc.status_code == 409:
            raise ConflictError(f"{what}: {_explanation(exc)}") from exc
        raise ServerError(f"{what}: the Docker daemon answered {exc.status_code}: {_explanation(exc)}") from exc
    except (requests.exceptions.ConnectionError, FileNotFoundError, ConnectionRefusedError) as exc:
        raise RuntimeUnavailableError(f"{what}: the Docker daemon at {base_url} is not reachable ({exc}); "
                                      f"{START_HINT}", details={"docker": base_url}) from exc
    except requests.exceptions.Timeout as exc:
        raise ServerError(f"{what}: the Docker daemon at {base_url} did not answer in time") from exc
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        raise ServerError(f"{what}: {exc}") from exc


def _explanation(exc: Any) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text).strip()


class DockerAPI:
    """One daemon's API, by container *name* (the backend derives names from sandbox ids, so a container whose
    create was interrupted is still found). The client is made at the first call (it asks the daemon for its
    API version): a backend that only reads records, as `corral check` does beside a server, never connects."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL) -> None:
        self.base_url = base_url
        self._clients: dict[float, Any] = {}
        self._clients_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # -- the daemon --------------------------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """`GET /info`, plus the negotiated `ApiVersion`."""
        def job() -> dict[str, Any]:
            client = self._client()
            return {**client.info(), "ApiVersion": client.api_version}
        return await self._run("asking the Docker daemon for its configuration", job)

    # -- images ------------------------------------------------------------------------------------

    async def image(self, ref: str) -> dict[str, Any] | None:
        def job() -> dict[str, Any] | None:
            try:
                found: dict[str, Any] = self._client().inspect_image(ref)
            except docker.errors.ImageNotFound:
                return None
            return found
        return await self._run(f"looking up image {ref}", job)

    async def import_image(self, chunks: Iterable[bytes], repository: str, tag: str, changes: list[str]) -> str:
        """`docker import -` of a tar stream; the new image's id."""
        def job() -> str:
            answer = self._client(_IMPORT_TIMEOUT).import_image_from_stream(
                iter(chunks), repository=repository, tag=tag, changes=changes)
            found: dict[str, Any] = self._client().inspect_image(f"{repository}:{tag}")
            if not found.get("Id"):
                raise ServerError(f"importing {repository}:{tag}: the daemon made no image ({answer!r})")
            return str(found["Id"])
        return await self._run(f"importing image {repository}:{tag}", job)

    async def remove_image(self, ref: str) -> None:
        def job() -> None:
            with contextlib.suppress(docker.errors.ImageNotFound):
                self._client().remove_image(ref, force=False, noprune=False)
        await self._run(f"removing image {ref}", job)

    # -- containers --------------------------------------------------------------------------------

    async def create(self, name: str, config: Mapping[str, Any]) -> str:
        """Create (not start) a container; its id. A `Warnings` answer is an error: each one is a setting the
        daemon did not apply, and a sandbox never runs with less isolation than it was given."""
        def job() -> str:
            answer: dict[str, Any] = self._client().create_container_from_config(dict(config), name=name)
            if answer.get("Warnings"):
                with contextlib.suppress(docker.errors.NotFound):
                    self._client().remove_container(name, force=True, v=True)
                raise RuntimeUnavailableError(f"creating container {name}: the Docker daemon would not apply "
                                              f"every setting: {'; '.join(answer['Warnings'])}")
            return str(answer["Id"])
        return await self._run(f"creating container {name}", job)

    async def start(self, name: str) -> None:
        await self._run(f"starting container {name}", lambda: self._client().start(name))

    async def inspect(self, name: str) -> dict[str, Any] | None:
        def job() -> dict[str, Any] | None:
            try:
                found: dict[str, Any] = self._client().inspect_container(name)
            except docker.errors.NotFound:
                return None
            return found
        return await self._run(f"inspecting container {name}", job)

    async def logs(self, name: str, tail: int) -> bytes:
        def job() -> bytes:
            try:
                return bytes(self._client().logs(name, stdout=True, stderr=True, tail=tail))
            except docker.errors.NotFound:
                return b""
        return await self._run(f"reading the log of container {name}", job)

    async def pause(self, name: str) -> None:
        await self._run(f"pausing container {name}", lambda: self._client().pause(name))

    async def unpause(self, name: str) -> None:
        await self._run(f"resuming container {name}", lambda: self._client().unpause(name))

    async def kill(self, name: str) -> None:
        """SIGKILL the container's processes and wait until it no longer runs; the container (and its writable
        layer) stays. Not running, or gone, already is fine."""
        def job() -> None:
            client = self._client()
            try:
                client.kill(name)
            except docker.errors.NotFound:
                return
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: "is not running"
                    raise
            client.wait(name, condition="not-running", timeout=_REMOVAL_WAIT)
        await self._run(f"stopping container {name}", job)

    async def remove(self, name: str) -> None:
        """Kill and remove the container (and its anonymous volumes); gone already is fine."""
        def job() -> None:
            deadline = time.monotonic() + _REMOVAL_WAIT
            while True:
                try:
                    self._client().remove_container(name, force=True, v=True)
                    return
                except docker.errors.NotFound:
                    return
                except docker.errors.APIError as exc:
                    # "removal of container ... is already in progress": another remove races this one.
                    if exc.status_code != 409 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        await self._run(f"removing container {name}", job)

    async def containers(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every container (running or not) carrying all of `labels`."""
        filters = {"label": [f"{key}={value}" for key, value in labels.items()]}

        def job() -> list[dict[str, Any]]:
            return list(self._client().containers(all=True, filters=filters))
        return await self._run("listing containers", job)

    # -- plumbing ----------------------------------------------------------------------------------

    async def _run(self, what: str, job: Callable[[], T]) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="corral-docker")

        def mapped() -> T:
            with docker_errors(what, self.base_url):
                return job()

        future = asyncio.get_running_loop().run_in_executor(self._pool, mapped)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # The thread cannot be stopped: let it finish, so whoever cleans up next sees what it made.
            with contextlib.suppress(Exception):
                await future
            raise

    def _client(self, timeout: float = _TIMEOUT) -> Any:
        with self._clients_lock:
            return self._clients.get(timeout) or self._connect(timeout)

    def _connect(self, timeout: float) -> Any:
        self._probe()
        client = docker.APIClient(base_url=self.base_url, version="auto", timeout=timeout, max_pool_size=_THREADS)
        version = tuple(int(part) for part in str(client.api_version).split(".")[:2])
        if version < MIN_API_VERSION:
            client.close()
            raise RuntimeUnavailableError(
                f"the Docker daemon at {self.base_url} speaks API {client.api_version}; Corral's Docker backend "
                f"needs {'.'.join(map(str, MIN_API_VERSION))} or newer (Docker 20.10+)")
        self._clients[timeout] = client
        return client

    def _probe(self) -> None:
        """Connect once to a Unix socket daemon first: the SDK leaks its socket when that connect fails."""
        if not self.base_url.startswith("unix://"):
            return
        path = "/" + self.base_url.removeprefix("unix://").lstrip("/")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(10)
            try:
                probe.connect(path)
            except OSError as exc:
                raise RuntimeUnavailableError(f"the Docker daemon at {self.base_url} is not reachable "
                                              f"({exc.strerror or exc}); {START_HINT}",
                                              details={"docker": self.base_url}) from exc

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
