"""The Kubernetes objects of one sandbox: its Secret, its NetworkPolicy and its Pod, built by pure functions.

No cluster and no client here: the backend creates what `sandbox_objects` returns, `corral k8s sandbox-manifest`
prints it, and the tests check it against the official schemas and against `hardening_problems`.

The Pod carries the hardening of DESIGN.md as far as a Pod can say it, like the Docker backend's container
(`corral.backends.docker._container`), in Kubernetes' terms:
- Pod Security `restricted` and more: non-root uid/gid 1000 (the sandbox user of every backend), no privilege
  escalation, all capabilities dropped, seccomp RuntimeDefault (or a Localhost profile: Corral's own, installed on
  the nodes), no service-account token, no service links, no host namespaces, nothing shared between containers.
- The RuntimeClass (gVisor by default) is the isolation boundary that stands in for the local backend's user
  namespace and Corral's own seccomp profile: a sandbox's syscalls reach gVisor's kernel, not the node's.
- The image is read-only (`readOnlyRootFilesystem`), as the Docker backend's: everything the sandbox can write is
  an emptyDir (/workspace, /home/user, /var/tmp on disk; /tmp and /dev/shm in memory, counting against the memory
  limit as tmpfs does elsewhere), capped by `sizeLimit` and by the Pod's ephemeral-storage limit.
- No network but the egress proxy (the NetworkPolicy) and no resolver (`dnsPolicy: None`, 127.0.0.1, where the
  agent refuses at once): names resolve through the proxy only, as on every backend.
- The agent listens on TCP (`CORRAL_AGENT_TCP`) and reads its per-sandbox token from the Secret's file, so the
  token is in no environment and no Pod spec; only the control plane's Pods may connect (the NetworkPolicy).

What a Pod cannot say: a pids limit (the kubelet's `podPidsLimit` sets it for every Pod of a node, see
docs/kubernetes.md) and an open-files rlimit (the container runtime's default).
"""

from __future__ import annotations

import base64
import math
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..._exceptions import InvalidRequestError
from .._spec import Limits, Runtime, SandboxSpec
from ..local._bundle import SANDBOX_GID, SANDBOX_UID

__all__ = [
    "AGENT_ARGV",
    "AGENT_CONTAINER",
    "CORRAL_LABELS",
    "PATH",
    "POD_LABEL",
    "TOKEN_DIR",
    "TOKEN_FILE",
    "WRITABLE",
    "ClusterSettings",
    "SandboxObjects",
    "hardening_problems",
    "quantity",
    "sandbox_objects",
    "validate_label_key",
    "validate_labels",
    "validate_name",
]

# On every object Corral creates for a sandbox; `POD_LABEL` names the one Pod its NetworkPolicy selects (the
# caller's labels may be shared: a warm pool's `corral.dev/pool` is on every Pod of the pool).
CORRAL_LABELS: Mapping[str, str] = MappingProxyType({"app.kubernetes.io/managed-by": "corral",
                                                     "corral.dev/role": "sandbox"})
POD_LABEL = "corral.dev/pod"
AGENT_CONTAINER = "agent"
TOKEN_DIR = "/run/corral"  # noqa: S105 (a path, not a password): the Secret's files, read-only
TOKEN_FILE = f"{TOKEN_DIR}/token"
# As the Docker backend starts the agent and where its sandboxes write (`corral.backends.docker._container`, which
# needs the Docker SDK to import; tests/test_k8s_objects.py checks that both say the same).
AGENT_ARGV = ("/usr/bin/python3", "-S", "-B", "-c", "from agent.__main__ import main; main()")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WRITABLE = (("/workspace", "workspace"), ("/home/user", "home"), ("/var/tmp", "var-tmp"))  # (path, volume name)
_RESERVED_ENV = ("CORRAL_AGENT_",)  # the agent's own settings: never the caller's to set
_SAFE_SYSCTLS = {"net.ipv4.ip_unprivileged_port_start": "53"}  # the agent answers DNS on 127.0.0.1:53 (refusing)

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _server_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "corral-server"}


def _egress_labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "corral-egress"}


@dataclass(frozen=True)
class ClusterSettings:
    """How Corral uses a cluster (`corral serve --backend kubernetes` options). Validated when made."""

    namespace: str = "corral-sandboxes"  # where sandbox Pods live
    control_namespace: str = "corral"  # where the server and the egress proxy run
    runtime_class: str | None = "gvisor"  # RuntimeClass of sandbox Pods (handler runsc); None: cluster default
    agent_port: int = 7771  # the agent's TCP port in each Pod
    seccomp_profile: str | None = None  # None: RuntimeDefault; else a Localhost profile (relative to the kubelet's)
    image_pull_secrets: tuple[str, ...] = ()
    server_labels: Mapping[str, str] = field(default_factory=_server_labels)  # the control plane's Pods
    egress_labels: Mapping[str, str] = field(default_factory=_egress_labels)  # the egress proxy's Pods
    egress_port: int = 3128
    # `hostUsers: false`: each Pod in a user namespace of its own (Kubernetes 1.33+, where it is on by default;
    # needs a runtime that supports it: runc/crun with idmapped mounts; check your RuntimeClass).
    user_namespace: bool = False

    def __post_init__(self) -> None:
        validate_name(self.namespace, "namespace")
        validate_name(self.control_namespace, "control namespace")
        if self.runtime_class is not None:
            validate_name(self.runtime_class, "runtime class", subdomain=True)
        for port, what in ((self.agent_port, "agent port"), (self.egress_port, "egress port")):
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise InvalidRequestError(f"the {what} must be a TCP port (1-65535), not {port!r}")
        if self.seccomp_profile is not None:
            _check_seccomp_path(self.seccomp_profile)
        for secret in self.image_pull_secrets:
            validate_name(secret, "image pull secret", subdomain=True)
        for attr in ("server_labels", "egress_labels"):
            labels = getattr(self, attr)
            what = attr.replace("_", " ")
            if not labels:
                raise InvalidRequestError(f"the {what} must select something: at least one label")
            # A copy nobody can change: the settings are shared by every Pod the backend makes.
            object.__setattr__(self, attr, MappingProxyType(validate_labels(labels, what)))
        object.__setattr__(self, "image_pull_secrets", tuple(self.image_pull_secrets))


@dataclass(frozen=True)
class SandboxObjects:
    """What the backend creates for one sandbox, as plain JSON-shaped dicts."""

    secret: dict[str, Any]
    pod: dict[str, Any]
    network_policy: dict[str, Any]

    def all(self) -> list[dict[str, Any]]:
        """In creation order: the Pod last, so that its token and its NetworkPolicy exist before it starts."""
        return [self.secret, self.network_policy, self.pod]


def sandbox_objects(name: str, spec: SandboxSpec, *, image: str, settings: ClusterSettings,
                    labels: Mapping[str, str], secrets: Mapping[str, str], env: Mapping[str, str],
                    deadline_seconds: int | None) -> SandboxObjects:
    """The Secret, NetworkPolicy and Pod named `name` that run `spec` from `image`.

    `labels` go on all three (beside Corral's own and `corral.dev/pod: <name>`); `secrets` are the Secret's files
    (at least `token`, the agent's), mounted at /run/corral; `env` is the agent's environment beyond its own;
    `deadline_seconds` is the Pod's `activeDeadlineSeconds` (None: none, e.g. a warm Pod not yet claimed).
    Bad input is an `InvalidRequestError` that says what is wrong.
    """
    validate_name(name, "sandbox object name")
    _check_spec(spec, settings)
    _check_image(image)
    meta = _metadata(name, settings.namespace, labels)
    return SandboxObjects(
        secret=_secret(meta, secrets),
        pod=_pod(meta, spec, image=image, settings=settings, env=env, deadline_seconds=deadline_seconds),
        network_policy=_network_policy(meta, settings),
    )


# --- validation -------------------------------------------------------------------------------------------------


def validate_name(value: object, what: str, *, subdomain: bool = False) -> str:
    """`value` if it is a DNS-1123 label (63 characters at most; `subdomain`: a DNS-1123 subdomain, 253)."""
    limit, pattern = (253, _DNS_SUBDOMAIN) if subdomain else (63, _DNS_LABEL)
    kind = "DNS-1123 subdomain" if subdomain else "DNS-1123 label"
    chars = "'-' and '.'" if subdomain else "'-'"
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"the {what} must be a non-empty {kind}, not {value!r}")
    if len(value) > limit or not pattern.fullmatch(value):
        raise InvalidRequestError(
            f"the {what} {value[:80]!r} is not a {kind}: at most {limit} characters of lower-case letters, digits "
            f"and {chars}, starting and ending with a letter or digit",
            details={"name": value[:80]})
    return value


def validate_label_key(key: object, what: str) -> str:
    """`key` if it is a label (or annotation) key: an optional DNS subdomain prefix and '/', then a name."""
    if not isinstance(key, str) or not key:
        raise InvalidRequestError(f"a key of the {what} is empty or not a string: {key!r}")
    prefix, _, name = key.rpartition("/")
    if prefix:
        validate_name(prefix, f"prefix of the {what} key {key!r}", subdomain=True)
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        raise InvalidRequestError(f"the {what} key {key[:80]!r} is not valid: its name part must be at most 63 "
                                  f"letters, digits, '-', '_' or '.', starting and ending with a letter or digit")
    return key


def validate_labels(labels: Mapping[str, str], what: str) -> dict[str, str]:
    """`labels` as a dict if every key and value is valid Kubernetes label syntax."""
    for key, value in labels.items():
        validate_label_key(key, what)
        if not isinstance(value, str) or len(value) > 63 or (value and not _LABEL_NAME.fullmatch(value)):
            raise InvalidRequestError(f"the {what} value {str(value)[:80]!r} of {key!r} is not valid: at most 63 "
                                      f"letters, digits, '-', '_' or '.', starting and ending with a letter or digit")
    return dict(labels)


def _check_seccomp_path(path: str) -> None:
    # The kubelet resolves a Localhost profile below its own seccomp directory: a descending relative path.
    if not path or path.startswith(("/", "..")) or posixpath.normpath(path) != path or "\x00" in path:
        raise InvalidRequestError(f"the seccomp profile {path[:80]!r} must be a relative path below the kubelet's "
                                  f"seccomp directory (e.g. profiles/corral.json), without '..'")


def _check_image(image: object) -> None:
    if not isinstance(image, str) or not image.strip():
        raise InvalidRequestError("the sandbox image must be a non-empty image reference (REGISTRY/REPO@sha256:...)")
    if image != image.strip() or any(c.isspace() or ord(c) < 32 for c in image):
        raise InvalidRequestError(f"the sandbox image {image[:80]!r} contains spaces or control characters")


def _check_spec(spec: SandboxSpec, settings: ClusterSettings) -> None:
    # What a Pod cannot give, refused rather than half-given (docs/kubernetes.md, "What differs").
    if spec.root:
        raise InvalidRequestError("the Kubernetes backend has no sandboxes with root: Pod Security 'restricted' "
                                  "runs every Pod as a non-root user (create the sandbox without root)")
    if spec.volumes:
        raise InvalidRequestError("the Kubernetes backend does not mount volumes yet (create the sandbox without "
                                  "volumes)")
    if spec.runtime is Runtime.RUNSC and settings.runtime_class is None:
        raise InvalidRequestError("runtime 'runsc' needs a gVisor RuntimeClass, and this cluster's settings name "
                                  "none (serve with --runtime-class gvisor)")


# --- the objects ------------------------------------------------------------------------------------------------


def _metadata(name: str, namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    own = {**CORRAL_LABELS, POD_LABEL: name}
    given = validate_labels(labels, "labels")
    clash = sorted(k for k in given if k in own and given[k] != own[k])
    if clash:
        raise InvalidRequestError(f"the labels {', '.join(clash)} are Corral's own and cannot be set")
    return {"name": name, "namespace": namespace, "labels": {**given, **own}}


def _secret(meta: Mapping[str, Any], secrets: Mapping[str, str]) -> dict[str, Any]:
    if "token" not in secrets:
        raise InvalidRequestError("the sandbox's secrets must hold 'token', the agent's token")
    for key, value in secrets.items():
        if not isinstance(key, str) or len(key) > 253 or not _SECRET_KEY.fullmatch(key) or key in (".", ".."):
            raise InvalidRequestError(f"the secret key {str(key)[:80]!r} is not valid: letters, digits, '-', '_' "
                                      f"and '.'")
        if not isinstance(value, str):  # may be empty: the backend fills the token in once the Pod has a uid
            raise InvalidRequestError(f"the secret {key!r} must be a string")
    data = {key: base64.b64encode(value.encode()).decode("ascii") for key, value in secrets.items()}
    # Immutable: nothing may swap a running sandbox's token, and the kubelet need not watch it.
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _copy_meta(meta), "type": "Opaque",
            "immutable": True, "data": data}


def _network_policy(meta: Mapping[str, Any], settings: ClusterSettings) -> dict[str, Any]:
    server = _peer(settings.control_namespace, settings.server_labels)
    egress = _peer(settings.control_namespace, settings.egress_labels)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _copy_meta(meta),
        "spec": {
            "podSelector": {"matchLabels": {POD_LABEL: meta["name"]}},
            "policyTypes": ["Ingress", "Egress"],
            # The agent's port, from the control plane alone: the token is the second lock, not the only one.
            "ingress": [{"from": [server], "ports": [{"protocol": "TCP", "port": settings.agent_port}]}],
            # Out only through the egress proxy. No rule for port 53: names resolve through the proxy, never DNS.
            "egress": [{"to": [egress], "ports": [{"protocol": "TCP", "port": settings.egress_port}]}],
        },
    }


def _peer(namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """A NetworkPolicy peer: the Pods with `labels` in `namespace` (its name label is set by the API server)."""
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": dict(labels)}}


def _copy_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {**meta, "labels": dict(meta["labels"])}


def _pod(meta: Mapping[str, Any], spec: SandboxSpec, *, image: str, settings: ClusterSettings,
         env: Mapping[str, str], deadline_seconds: int | None) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # a sandbox has no business with the API server
        "enableServiceLinks": False,  # no *_SERVICE_HOST variables naming the cluster's services
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "shareProcessNamespace": False,
        "restartPolicy": "Never",  # a sandbox that died is gone: a restart would be a new, empty sandbox
        "terminationGracePeriodSeconds": 0,  # the agent handles no signal (PID 1): a stop is a kill
        "hostname": "sandbox",
        # No resolver: the agent answers 127.0.0.1:53 and refuses at once, as on every backend (docs/egress.md).
        "dnsPolicy": "None",
        "dnsConfig": {"nameservers": ["127.0.0.1"], "searches": [], "options": [{"name": "ndots", "value": "1"}]},
        "securityContext": _pod_security(settings),
        "containers": [_container(spec.limits, image=image, settings=settings, env=env)],
        "volumes": _volumes(meta["name"], spec.limits),
    }
    if settings.runtime_class is not None:
        pod_spec["runtimeClassName"] = settings.runtime_class
    if settings.user_namespace:
        pod_spec["hostUsers"] = False  # root in the Pod (none runs as root: runAsNonRoot) maps to no host uid
    if deadline_seconds is not None:
        if isinstance(deadline_seconds, bool) or not isinstance(deadline_seconds, int) or deadline_seconds < 1:
            raise InvalidRequestError(f"the deadline must be a positive number of seconds, not {deadline_seconds!r}")
        pod_spec["activeDeadlineSeconds"] = deadline_seconds  # the kubelet kills it even if Corral is gone
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    annotations = {"corral.dev/template": spec.template, "corral.dev/network": _network_text(spec)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**_copy_meta(meta), "annotations": annotations},
            "spec": pod_spec}


def _network_text(spec: SandboxSpec) -> str:
    # For people reading the Pod: the policy itself is enforced by the egress proxy, which knows the sandbox by
    # the credential in its proxy URL (Pod IPs are reused), not by this annotation.
    return spec.network if isinstance(spec.network, str) else ",".join(spec.network)


def _pod_security(settings: ClusterSettings) -> dict[str, Any]:
    seccomp: dict[str, Any] = {"type": "RuntimeDefault"}
    if settings.seccomp_profile is not None:
        seccomp = {"type": "Localhost", "localhostProfile": settings.seccomp_profile}
    return {
        "runAsNonRoot": True,
        "runAsUser": SANDBOX_UID,
        "runAsGroup": SANDBOX_GID,
        "fsGroup": SANDBOX_GID,  # the token file (0440) and the emptyDirs belong to the sandbox user's group
        "fsGroupChangePolicy": "OnRootMismatch",
        "supplementalGroups": [],
        "seccompProfile": seccomp,
        "sysctls": [{"name": k, "value": v} for k, v in _SAFE_SYSCTLS.items()],  # in the kubelet's safe set
    }


def _container(limits: Limits, *, image: str, settings: ClusterSettings, env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "name": AGENT_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",  # images are referenced by digest: a pull never changes what runs
        "command": list(AGENT_ARGV),  # as the Docker backend starts it: the agent is PID 1, no init
        "args": [],
        "workingDir": "/.corral",
        "env": _env(env, settings),
        "ports": [{"name": "agent", "containerPort": settings.agent_port, "protocol": "TCP"}],
        # Ready once the agent listens. The probe connects and leaves without a token: the agent refuses it.
        "readinessProbe": {"tcpSocket": {"port": "agent"}, "periodSeconds": 1, "timeoutSeconds": 1,
                           "failureThreshold": 3, "successThreshold": 1},
        "resources": _resources(limits),
        "securityContext": {
            "allowPrivilegeEscalation": False,  # no_new_privs
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": SANDBOX_UID,
            "runAsGroup": SANDBOX_GID,
            "capabilities": {"drop": ["ALL"]},
            "procMount": "Default",  # masked and read-only /proc paths, as the runtime's defaults have them
        },
        "volumeMounts": _mounts(),
        "terminationMessagePolicy": "FallbackToLogsOnError",  # the agent's last words, for `diagnostics`
        "stdin": False,
        "tty": False,
    }


def _env(env: Mapping[str, str], settings: ClusterSettings) -> list[dict[str, str]]:
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise InvalidRequestError(f"environment variable name {str(key)[:80]!r} is not valid")
        if key.startswith(_RESERVED_ENV):
            raise InvalidRequestError(f"environment variable {key} is the agent's own and cannot be set")
        if not isinstance(value, str) or "\x00" in value:
            raise InvalidRequestError(f"environment variable {key} must be a string without NUL bytes")
    own = {"PATH": PATH, "LANG": "C.UTF-8", "CORRAL_AGENT_TCP": f"0.0.0.0:{settings.agent_port}",
           "CORRAL_AGENT_TOKEN_FILE": TOKEN_FILE}
    return [{"name": k, "value": v} for k, v in {**own, **env}.items()]


def quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity, exact: `512Mi` where it divides, else the plain number."""
    for suffix, unit in (("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _resources(limits: Limits) -> dict[str, Any]:
    # Requests equal limits: the Pod is Guaranteed QoS, so the scheduler reserves what the sandbox may use and the
    # kubelet evicts it last. The pids limit is not a Pod field (the kubelet's podPidsLimit: docs/kubernetes.md).
    cpu = f"{max(10, math.ceil(limits.cpus * 1000))}m"
    amounts = {"cpu": cpu, "memory": quantity(limits.memory), "ephemeral-storage": quantity(limits.disk)}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _volumes(name: str, limits: Limits) -> list[dict[str, Any]]:
    # One emptyDir per writable directory, each capped at the disk size; the container's ephemeral-storage limit
    # caps them together (the kubelet evicts a Pod past it: the limit is enforced, though not as ENOSPC).
    disk = [{"name": volume, "emptyDir": {"sizeLimit": quantity(limits.disk)}} for _, volume in WRITABLE]
    return [
        {"name": "corral-token", "secret": {"secretName": name, "defaultMode": 0o440, "optional": False}},
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(limits.tmp)}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(limits.shm)}},
        *disk,
    ]


def _mounts() -> list[dict[str, Any]]:
    return [
        {"name": "corral-token", "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
        *({"name": volume, "mountPath": path} for path, volume in WRITABLE),
    ]



# --- our own checks ---------------------------------------------------------------------------------------------
# `hardening_problems` reads a Pod as the API would return it (the tests, and `corral check` on a real cluster):
# each problem is one line that starts with the field it is about. The schemas prove the Pod is well-formed;
# these prove it is the Pod DESIGN.md asks for. Pod Security admission proves `restricted` only on a cluster.

_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_VOLUME_KINDS = frozenset({"secret", "emptyDir"})  # no hostPath, no PVC, no projected service-account token


def hardening_problems(pod: Mapping[str, Any], *, runtime_class: str | None = "gvisor",
                       deadline: bool = True) -> list[str]:
    """What of the sandbox hardening `pod` lacks (empty: none). `runtime_class`: the RuntimeClass it must have
    (None: any); `deadline`: whether it must have an `activeDeadlineSeconds` (a warm Pod gets one when claimed)."""
    spec = pod.get("spec") or {}
    problems = [*_pod_problems(spec, runtime_class=runtime_class, deadline=deadline),
                *_pod_security_problems(spec.get("securityContext") or {}),
                *_volume_problems(spec)]
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, container in enumerate(spec.get(kind) or []):
            problems += _container_problems(container, f"spec.{kind}[{i}]", probe=kind == "containers")
    if not spec.get("containers"):
        problems.append("spec.containers: the Pod has no container")
    return problems


def _pod_problems(spec: Mapping[str, Any], *, runtime_class: str | None, deadline: bool) -> list[str]:
    problems = [f"spec.{key} must be false" for key in ("automountServiceAccountToken", "enableServiceLinks")
                if spec.get(key) is not False]  # both default to true when left out
    problems += [f"spec.{key} must not be true" for key in ("hostNetwork", "hostPID", "hostIPC",
                                                            "shareProcessNamespace") if spec.get(key)]
    if spec.get("restartPolicy") != "Never":
        problems.append("spec.restartPolicy must be Never")
    if spec.get("terminationGracePeriodSeconds") not in (0, 1):  # 0; an API server may store it as 1
        problems.append("spec.terminationGracePeriodSeconds must be 0 (the agent handles no signal)")
    if deadline and not spec.get("activeDeadlineSeconds"):
        problems.append("spec.activeDeadlineSeconds must be set (the sandbox's TTL)")
    if runtime_class is not None and spec.get("runtimeClassName") != runtime_class:
        problems.append(f"spec.runtimeClassName must be {runtime_class}")
    dns = spec.get("dnsConfig") or {}
    if spec.get("dnsPolicy") != "None" or dns.get("nameservers") != ["127.0.0.1"]:
        problems.append("spec.dnsPolicy must be None with nameserver 127.0.0.1 (names resolve through the proxy)")
    return problems


def _pod_security_problems(ctx: Mapping[str, Any]) -> list[str]:
    problems = [] if ctx.get("runAsNonRoot") is True else ["spec.securityContext.runAsNonRoot must be true"]
    problems += [f"spec.securityContext.{key} must be {want}"
                 for key, want in (("runAsUser", SANDBOX_UID), ("runAsGroup", SANDBOX_GID), ("fsGroup", SANDBOX_GID))
                 if ctx.get(key) != want]
    seccomp = ctx.get("seccompProfile") or {}
    if seccomp.get("type") not in ("RuntimeDefault", "Localhost") or (
            seccomp.get("type") == "Localhost" and not seccomp.get("localhostProfile")):
        problems.append("spec.securityContext.seccompProfile must be RuntimeDefault or a Localhost profile")
    return problems


def _volume_problems(spec: Mapping[str, Any]) -> list[str]:
    problems = []
    memory_backed = set()
    for i, volume in enumerate(spec.get("volumes") or []):
        kinds = sorted(set(volume) - {"name"})
        if not set(kinds) <= _VOLUME_KINDS:
            problems.append(f"spec.volumes[{i}] ({volume.get('name')}) must be a secret or an emptyDir, not "
                            f"{', '.join(kinds)}")
        elif "emptyDir" in volume:
            if not (volume["emptyDir"] or {}).get("sizeLimit"):
                problems.append(f"spec.volumes[{i}] ({volume.get('name')}) emptyDir must have a sizeLimit")
            if (volume["emptyDir"] or {}).get("medium") == "Memory":
                memory_backed.add(volume.get("name"))
    mounts = [m for c in spec.get("containers") or [] for m in c.get("volumeMounts") or []]
    if not any(m.get("mountPath") == "/tmp" and m.get("name") in memory_backed for m in mounts):
        problems.append("spec.volumes: /tmp must be a memory-backed emptyDir (a tmpfs, as on every backend)")
    return problems


def _container_problems(container: Mapping[str, Any], where: str, *, probe: bool) -> list[str]:
    ctx = container.get("securityContext") or {}
    caps = ctx.get("capabilities") or {}
    checks = [
        (ctx.get("allowPrivilegeEscalation") is not False, "securityContext.allowPrivilegeEscalation must be false"),
        (bool(ctx.get("privileged")), "securityContext.privileged must not be true"),
        ("ALL" not in (caps.get("drop") or []), "securityContext.capabilities.drop must include ALL"),
        (bool(caps.get("add")), "securityContext.capabilities.add must be empty"),
        (ctx.get("readOnlyRootFilesystem") is not True, "securityContext.readOnlyRootFilesystem must be true"),
        (ctx.get("runAsNonRoot") is False or ctx.get("runAsUser") == 0,
         "securityContext must not run as root (runAsNonRoot false or runAsUser 0)"),
        ((ctx.get("seccompProfile") or {}).get("type") == "Unconfined",
         "securityContext.seccompProfile must not be Unconfined"),
        (ctx.get("procMount", "Default") != "Default", "securityContext.procMount must be Default"),
        (any(p.get("hostPort") for p in container.get("ports") or []), "ports must not use a hostPort"),
        (probe and not container.get("readinessProbe"), "readinessProbe must be set (the agent's port)"),
    ]
    problems = [f"{where}.{text}" for failed, text in checks if failed]
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):
        missing = [r for r in _RESOURCES if r not in (resources.get(kind) or {})]
        if missing:
            problems.append(f"{where}.resources.{kind} must set {', '.join(missing)}")
    return problems
