"""The Kubernetes API through the official asyncio client (`kubernetes_asyncio`): the one module that touches it,
and the boundary where its errors become Corral's.

Objects go in and come out as plain dicts in the API's own JSON shape (camelCase, as `_objects` builds them and
as the API documents them), never the client's generated models: the backend reads a few fields and the
manifests are data. `k8s_errors` maps what the client raises:

    404               -> NotFoundError (callers that delete treat it as done)
    409               -> ConflictError (a name taken; a resourceVersion that moved)
    403               -> RuntimeUnavailableError naming the RBAC permission the server's account lacks
    422, 400          -> InvalidRequestError with the API server's own message
    410               -> left to the watch, which lists again (a resourceVersion too old)
    5xx, 0, transport -> RuntimeUnavailableError (the API server cannot be reached or fails)

`KubeAPI.version` asks whether a cluster is there at all (`corral check --backend kubernetes` does, before it
starts anything): no configuration, or no answer in time, is a `RuntimeUnavailableError` without a
`kubernetes_status`, naming the server and where its address came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from ..._exceptions import (
    ConflictError,
    CorralError,
    InvalidRequestError,
    NotFoundError,
    RuntimeUnavailableError,
    ServerError,
)
from ..._settings import kubeconfig

__all__ = ["GONE", "KubeAPI", "api_message", "k8s_errors"]

GONE = 410
_WATCH_RESTARTS = 20  # 410s in a row before a wait gives up: each costs one GET, so a few are cheap
_MERGE_PATCH = "application/merge-patch+json"
Obj = dict[str, Any]


def api_message(exc: ApiException) -> str:
    """The API server's own message (its Status body), else the HTTP reason."""
    body = getattr(exc, "body", None)
    if body:
        try:
            status = json.loads(body)
        except (TypeError, ValueError):
            return str(body)[:500]
        if isinstance(status, dict) and status.get("message"):
            return str(status["message"])
    return str(getattr(exc, "reason", "") or f"HTTP {exc.status}")


@contextlib.contextmanager
def k8s_errors(verb: str, resource: str, namespace: str | None, name: str = "") -> Iterator[None]:
    """Map what the client raises while doing `verb` on `resource` (a plural: "pods") to Corral's errors. The
    403 names the RBAC rule the server's service account is missing, as `kubectl auth can-i` would ask it."""
    what = f"{verb} {resource}{'/' + name if name else ''}" + (f" in namespace {namespace}" if namespace else "")
    try:
        yield
    except CorralError:
        raise
    except ApiException as exc:
        message = api_message(exc)
        details = {"kubernetes_status": exc.status, "resource": resource}
        if exc.status == 404:
            raise NotFoundError(f"{what}: {message}", details=details) from exc
        if exc.status == 409:
            raise ConflictError(f"{what}: {message}", details=details) from exc
        if exc.status == 403:
            scope = f" in namespace {namespace}" if namespace else " (cluster-wide)"
            raise RuntimeUnavailableError(
                f"{what}: forbidden: Corral's service account needs RBAC permission to {verb} {resource}{scope} "
                f"(a Role rule: resources [{resource}], verbs [{verb}]); the API server said: {message}",
                details={**details, "verb": verb, "namespace": namespace}) from exc
        if exc.status in (400, 422):
            raise InvalidRequestError(f"{what}: the API server refused it: {message}", details=details) from exc
        if exc.status == 0 or exc.status >= 500:
            raise RuntimeUnavailableError(f"{what}: the Kubernetes API server failed ({exc.status}): {message}",
                                          details=details) from exc
        raise ServerError(f"{what}: the Kubernetes API server answered {exc.status}: {message}",
                          details=details) from exc
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise RuntimeUnavailableError(f"{what}: the Kubernetes API server is not reachable ({exc!r})") from exc


class KubeAPI:
    """One cluster's API for one namespace of sandboxes (and the control plane's, for the egress Service).

    The client is configured at the first call (kubeconfig, else the in-cluster service account): a backend
    that only reads records never connects."""

    def __init__(self, namespace: str, *, kubeconfig: str | Path | None = None, context: str | None = None) -> None:
        self.namespace = namespace
        self._kubeconfig = kubeconfig
        self._context = context
        self._api: Any = None
        self._lock = asyncio.Lock()

    async def _client(self) -> Any:
        async with self._lock:
            if self._api is None:
                self._api = await self._connect()
            return self._api

    async def _connect(self) -> Any:
        configuration = client.Configuration()
        try:
            if self._kubeconfig is None and _in_cluster():
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                await config.load_kube_config(config_file=str(self._config_file()), context=self._context,
                                              client_configuration=configuration)
        except (config.ConfigException, OSError, ValueError, TypeError) as exc:
            raise RuntimeUnavailableError(f"no Kubernetes configuration ({self.source()}): {exc}") from exc
        return client.ApiClient(configuration=configuration)

    def _config_file(self) -> str | Path:
        """The kubeconfig to load: the client's own default (`$KUBECONFIG`, else `~/.kube/config`), read now,
        where the client reads `$KUBECONFIG` once, when it is first imported."""
        found = self._kubeconfig or kubeconfig() or Path.home() / ".kube" / "config"
        # A missing file is said here: the client would log "Config not found" and complain of an empty config.
        if os.pathsep not in str(found) and not Path(found).exists():
            raise config.ConfigException(f"{found} does not exist")
        return found

    def source(self) -> str:
        """Where the client's configuration comes from, as an operator would go and look."""
        if self._kubeconfig is not None:
            return f"kubeconfig {self._kubeconfig}"
        if _in_cluster():
            return "this Pod's service account"
        if (named := kubeconfig()) is not None:
            return f"KUBECONFIG={named}"
        return "KUBECONFIG is not set and this is not a Pod"

    async def version(self, timeout: float) -> str:
        """The cluster's Kubernetes version (`GET /version`, which every account may read): proof that its API
        server answers. `RuntimeUnavailableError` with no `kubernetes_status` in its details when nothing does
        (no configuration, or no answer within `timeout` seconds; the message names the server and where its
        address came from); what the API server answers is mapped as for every other call (`k8s_errors`)."""
        api = await self._client()
        server = str(api.configuration.host)
        try:
            async with asyncio.timeout(timeout):
                found = await client.VersionApi(api).get_code()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            why = f": {exc}" if str(exc) else ""
            raise RuntimeUnavailableError(f"no Kubernetes API server answers at {server} ({self.source()}) within "
                                          f"{timeout:g} s{why}", details={"server": server}) from exc
        except ApiException:
            with k8s_errors("get", "version", None):
                raise
        return str(found.git_version)

    async def close(self) -> None:
        if self._api is not None:
            api, self._api = self._api, None
            await api.close()

    def _plain(self, api: Any, obj: Any) -> Obj:
        found: Obj = api.sanitize_for_serialization(obj)
        return found

    # -- core/v1 pods ----------------------------------------------------------------------------------

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        """Create one object of `_objects` (its `kind` says where)."""
        api = await self._client()
        kind = str(obj["kind"])
        resource, method = _CREATE[kind]
        name = str(obj["metadata"]["name"])
        with k8s_errors("create", resource, self.namespace, name):
            made = await getattr(_group(api, kind), method)(self.namespace, dict(obj))
        return self._plain(api, made)

    async def delete(self, kind: str, name: str) -> bool:
        """Delete one object; False if it was not there. Pods go at once (grace 0): a sandbox has nothing to
        flush, and its name may be wanted again."""
        api = await self._client()
        resource, method = _DELETE[kind]
        try:
            with k8s_errors("delete", resource, self.namespace, name):
                await getattr(_group(api, kind), method)(name, self.namespace, grace_period_seconds=0,
                                                         propagation_policy="Background")
        except NotFoundError:
            return False
        return True

    async def get_pod(self, name: str) -> Obj | None:
        api = await self._client()
        try:
            with k8s_errors("get", "pods", self.namespace, name):
                found = await client.CoreV1Api(api).read_namespaced_pod(name, self.namespace)
        except NotFoundError:
            return None
        return self._plain(api, found)

    async def patch_pod(self, name: str, patch: Mapping[str, Any]) -> Obj:
        """A JSON merge patch; a `metadata.resourceVersion` in it makes it conditional (409 if the Pod moved)."""
        api = await self._client()
        with k8s_errors("patch", "pods", self.namespace, name):
            found = await client.CoreV1Api(api).patch_namespaced_pod(name, self.namespace, dict(patch),
                                                                     _content_type=_MERGE_PATCH)  # type: ignore[call-arg]
        return self._plain(api, found)

    async def list_objects(self, kind: str, selector: str) -> list[Obj]:
        api = await self._client()
        resource, method = _LIST[kind]
        with k8s_errors("list", resource, self.namespace):
            found = await getattr(_group(api, kind), method)(self.namespace, label_selector=selector)
        return [self._plain(api, item) for item in found.items]

    async def services(self, namespace: str, selector: str) -> list[Obj]:
        api = await self._client()
        with k8s_errors("list", "services", namespace):
            found = await client.CoreV1Api(api).list_namespaced_service(namespace, label_selector=selector)
        return [self._plain(api, item) for item in found.items]

    async def nodes(self) -> list[Obj]:
        api = await self._client()
        with k8s_errors("list", "nodes", None):
            found = await client.CoreV1Api(api).list_node()
        return [self._plain(api, item) for item in found.items]

    async def wait_pod(self, name: str, timeout: float, ready: Any) -> Obj:
        """The Pod once `ready(pod)` holds, watching from the resourceVersion of a GET; a 410 (that version is
        too old for the API server's watch cache) lists again and watches on. `NotFoundError` if the Pod goes;
        `ServerError` when `timeout` passes or it fails (`ready` may raise to say why)."""
        api = await self._client()
        core = client.CoreV1Api(api)
        deadline = time.monotonic() + timeout
        for _ in range(_WATCH_RESTARTS):
            pod = await self.get_pod(name)
            if pod is None:
                raise NotFoundError(f"pod {name} in namespace {self.namespace} is gone")
            if ready(pod):
                return pod
            left = deadline - time.monotonic()
            if left <= 0:
                break
            version = str(pod["metadata"].get("resourceVersion") or "")
            try:
                found = await self._watch_until(core, api, name, version, left, ready)
            except ApiException as exc:
                if exc.status == GONE:
                    continue  # the watch cache moved past our version: GET again for a fresh one
                with k8s_errors("watch", "pods", self.namespace, name):
                    raise
            if found is not None:
                return found
        raise ServerError(f"pod {name} in namespace {self.namespace} was not running after {timeout:g}s")

    async def _watch_until(self, core: Any, api: Any, name: str, version: str, left: float, ready: Any) -> Obj | None:
        stream = watch.Watch(return_type="object")  # events stay dicts: no model built per event
        try:
            async with asyncio.timeout(left):
                async for event in stream.stream(core.list_namespaced_pod, self.namespace,
                                                 field_selector=f"metadata.name={name}", resource_version=version,
                                                 timeout_seconds=max(1, int(left) + 1)):
                    pod: Obj = event["raw_object"]
                    if event["type"] == "DELETED":
                        raise NotFoundError(f"pod {name} in namespace {self.namespace} was deleted")
                    if ready(pod):
                        return pod
        except TimeoutError:
            return None
        except (aiohttp.ClientError, OSError) as exc:
            with k8s_errors("watch", "pods", self.namespace, name):
                raise exc
        finally:
            await stream.close()
        return None


_CREATE = {"Pod": ("pods", "create_namespaced_pod"), "Secret": ("secrets", "create_namespaced_secret"),
           "NetworkPolicy": ("networkpolicies", "create_namespaced_network_policy")}
_DELETE = {"Pod": ("pods", "delete_namespaced_pod"), "Secret": ("secrets", "delete_namespaced_secret"),
           "NetworkPolicy": ("networkpolicies", "delete_namespaced_network_policy")}
_LIST = {"Pod": ("pods", "list_namespaced_pod"), "Secret": ("secrets", "list_namespaced_secret"),
         "NetworkPolicy": ("networkpolicies", "list_namespaced_network_policy")}


def _group(api: Any, kind: str) -> Any:
    return client.NetworkingV1Api(api) if kind == "NetworkPolicy" else client.CoreV1Api(api)


def _in_cluster() -> bool:
    """A Pod's service account is mounted here; outside a cluster, the kubeconfig's default applies."""
    return Path("/var/run/secrets/kubernetes.io/serviceaccount/token").is_file()
