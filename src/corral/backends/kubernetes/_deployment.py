"""Corral's reference deployment on Kubernetes, as pure functions (`corral k8s manifests`, `deploy/kubernetes/`).

Two namespaces: the control plane's (the API server, 2 replicas on one PostgreSQL, and the egress proxy) and the
sandboxes' (Pod Security `restricted`, default-deny networking, and a ValidatingAdmissionPolicy that refuses any
Pod there without the gVisor RuntimeClass or with privileges). The server's ServiceAccount may touch only what the
backend creates, and only in the sandboxes' namespace.

`reference_files` groups the objects by file, as `deploy/kubernetes/` holds them (a Kustomize base);
`write_kustomization` writes that directory, and tests/test_k8s_objects.py fails if it drifts from what the
functions render. Nothing here talks to a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..._exceptions import InvalidRequestError
from ._objects import CORRAL_LABELS, ClusterSettings, validate_name
from ._yaml import dump, dump_all

__all__ = ["API_PORT", "DEFAULT_IMAGE", "EGRESS_COMMAND", "admission_expressions", "reference_deployment",
           "reference_files", "render_files", "write_kustomization"]

# A placeholder to override (`images:` in a Kustomize overlay, or `--image`): Corral publishes no image of its own.
DEFAULT_IMAGE = "registry.invalid/corral/corral:latest"
API_PORT = 7770
EGRESS_COMMAND = ("corral", "egress-proxy")  # the egress proxy as a process of its own (the server's, on one host)
_SERVER = "corral-server"
_EGRESS = "corral-egress"
_PART_OF = {"app.kubernetes.io/part-of": "corral"}
# Names of Secrets (noqa: S105, not their values).
_DATABASE_SECRET = "corral-database"  # noqa: S105 key `url`: postgresql+asyncpg://... (docs/kubernetes.md)
_ACCESS_SECRET = "corral-access"  # noqa: S105 key `secret`: what agent tokens and egress credentials derive from
_AUDIT_SECRET = "corral-audit"  # noqa: S105 key `keys`: the audit chain's HMAC keys, newest first (docs/security.md)
_IMAGES_CONFIG = "corral-images"  # key `images.json`: template -> image by digest (`corral templates push`)
_DNS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
# What the egress proxy may reach: public addresses only; its own policy refuses the rest too (docs/egress.md).
_PRIVATE_V4 = ["0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
               "192.168.0.0/16"]
_PRIVATE_V6 = ["::1/128", "fc00::/7", "fe80::/10"]
_UID = 10001  # the control plane's non-root user (no relation to the sandboxes' uid 1000)


def reference_deployment(namespace: str = "corral", sandbox_namespace: str = "corral-sandboxes",
                         image: str = DEFAULT_IMAGE, *, runtime_class: str = "gvisor",
                         replicas: int = 2) -> list[dict[str, Any]]:
    """Every object of the reference deployment, in the order `kubectl apply` can create them."""
    return [obj for objects in reference_files(namespace, sandbox_namespace, image, runtime_class=runtime_class,
                                               replicas=replicas).values() for obj in objects]


def reference_files(namespace: str = "corral", sandbox_namespace: str = "corral-sandboxes",
                    image: str = DEFAULT_IMAGE, *, runtime_class: str = "gvisor",
                    replicas: int = 2) -> dict[str, list[dict[str, Any]]]:
    """The objects by file name of the Kustomize base, in creation order."""
    if namespace == sandbox_namespace:
        raise InvalidRequestError("the sandboxes need a namespace of their own, not the control plane's")
    settings = ClusterSettings(namespace=sandbox_namespace, control_namespace=namespace, runtime_class=runtime_class)
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        raise InvalidRequestError(f"the server image must be an image reference, not {image!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InvalidRequestError(f"replicas must be a positive integer, not {replicas!r}")
    return {
        "namespaces.yaml": _namespaces(settings),
        "runtimeclass.yaml": [_runtime_class(runtime_class)],
        "rbac.yaml": _rbac(settings),
        "server.yaml": _server(settings, image, replicas, runtime_class),
        "egress.yaml": _egress(settings, image),
        "network-policies.yaml": _network_policies(settings),
        "admission.yaml": _admission(settings, runtime_class),
    }


def render_files(files: Mapping[str, list[dict[str, Any]]]) -> dict[str, str]:
    """The text of each file of the Kustomize base, `kustomization.yaml` included."""
    out = {name: _HEADER + dump_all(objects) for name, objects in files.items()}
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": list(files)}
    out["kustomization.yaml"] = _HEADER + dump(kustomization)
    return out


_HEADER = ("# Generated by `corral k8s manifests --write deploy/kubernetes` from src/corral/backends/kubernetes/:\n"
           "# edit those functions, not this file (tests/test_k8s_objects.py fails on any difference).\n")


def write_kustomization(directory: Path, files: Mapping[str, list[dict[str, Any]]] | None = None) -> list[Path]:
    """Write the Kustomize base into `directory` (made if missing); the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_files(files or reference_files()).items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


# --- the objects ------------------------------------------------------------------------------------------------


def _meta(name: str, namespace: str | None = None, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = {**_PART_OF, **(labels or {})}
    return meta


def _app(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name}


def _namespaces(s: ClusterSettings) -> list[dict[str, Any]]:
    # Both run `restricted`: the control plane needs no privilege either. `latest`: the newest rules of the
    # cluster's own version, so that an upgrade tightens rather than freezes them.
    pss = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "audit", "warn")}
    pss["pod-security.kubernetes.io/enforce-version"] = "latest"
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(name, labels=pss)}
            for name in (s.control_namespace, s.namespace)]


def _runtime_class(name: str) -> dict[str, Any]:
    # runsc must be installed on the nodes (docs/kubernetes.md). The overhead is gVisor's own kernel (the Sentry)
    # per Pod, charged by the scheduler beside the sandbox's limits: an estimate, measure it on your nodes.
    return {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": _meta(name), "handler": "runsc",
            "overhead": {"podFixed": {"cpu": "50m", "memory": "64Mi"}}}


def _rbac(s: ClusterSettings) -> list[dict[str, Any]]:
    # Exactly what the backend does, in the sandboxes' namespace only: create and watch Pods, read their logs for
    # diagnostics, claim warm ones and shorten deadlines (patch), and own each sandbox's Secret and NetworkPolicy.
    rules = [
        {"apiGroups": [""], "resources": ["pods"],
         "verbs": ["get", "list", "watch", "create", "delete", "patch"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "create", "delete", "patch"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
         "verbs": ["get", "list", "create", "delete", "patch"]},
    ]
    services = [{"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list"]}]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(_SERVER, s.control_namespace),
         "automountServiceAccountToken": False},  # mounted by the server's Pod alone, which needs it
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(_EGRESS, s.control_namespace),
         "automountServiceAccountToken": False},
        _role(_SERVER, s.namespace, rules),
        _binding(_SERVER, s.namespace, s.control_namespace),
        # Where the egress proxy's Service is: the backend looks it up by its labels in its own namespace.
        _role(f"{_SERVER}-services", s.control_namespace, services),
        _binding(f"{_SERVER}-services", s.control_namespace, s.control_namespace),
        # The one cluster-wide grant, read-only: the nodes' allocatable resources, for the backend's capacity.
        _role(f"{_SERVER}-nodes", None, [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]),
        _binding(f"{_SERVER}-nodes", None, s.control_namespace),
    ]


def _role(name: str, namespace: str | None, rules: list[dict[str, Any]]) -> dict[str, Any]:
    """A Role in `namespace`; a ClusterRole where it is None."""
    kind = "Role" if namespace is not None else "ClusterRole"
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": _meta(name, namespace),
            "rules": rules}


def _binding(name: str, namespace: str | None, account_namespace: str) -> dict[str, Any]:
    """The server's ServiceAccount bound to the role `name` (a ClusterRoleBinding where `namespace` is None)."""
    kind = "Role" if namespace is not None else "ClusterRole"
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{kind}Binding",
            "metadata": _meta(name, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": _SERVER, "namespace": account_namespace}]}


def _secret_env(name: str, secret: str, key: str, *, optional: bool = False) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}}


def _hardened(container: dict[str, Any]) -> dict[str, Any]:
    security = {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    return {**container, "securityContext": security, "terminationMessagePolicy": "FallbackToLogsOnError"}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": _UID, "runAsGroup": _UID, "fsGroup": _UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _http_probe(period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/v1/health", "port": "http"}, "periodSeconds": period, "timeoutSeconds": 2,
            "failureThreshold": failures}


def _server(s: ClusterSettings, image: str, replicas: int, runtime_class: str) -> list[dict[str, Any]]:
    labels = dict(s.server_labels)
    pod = _control_pod(_SERVER, _server_container(s, image, runtime_class), home="512Mi", token=True)
    # Replicas on different nodes where there are several: a node's loss leaves one serving.
    pod["topologySpreadConstraints"] = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                         "whenUnsatisfiable": "ScheduleAnyway",
                                         "labelSelector": {"matchLabels": labels}}]
    return [
        _deployment(_SERVER, s.control_namespace, labels, replicas, pod),
        _service(_SERVER, s.control_namespace, labels, "http", API_PORT),
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(_SERVER, s.control_namespace),
         "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}}},
    ]


def _server_container(s: ClusterSettings, image: str, runtime_class: str) -> dict[str, Any]:
    args = ["serve", "--host", "0.0.0.0", "--port", str(API_PORT), "--backend", "kubernetes"]  # noqa: S104
    return _hardened({
        "name": "server", "image": image, "command": ["corral"], "args": args,
        "env": [
            _HOME_ENV,
            # Each Pod is a replica (docs/replicas.md): named after the Pod, reached at its IP. The name also
            # owns its sandbox Pods, so that one replica's sweep never removes another's.
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "CORRAL_REPLICA_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "CORRAL_ADVERTISE_URL", "value": f"http://$(POD_IP):{API_PORT}"},
            # The backend's settings (`corral serve` takes no backend options: `_settings.k8s_backend`).
            {"name": "CORRAL_K8S_NAMESPACE", "value": s.namespace},
            {"name": "CORRAL_K8S_CONTROL_NAMESPACE", "value": s.control_namespace},
            {"name": "CORRAL_K8S_RUNTIME_CLASS", "value": runtime_class},
            _secret_env("CORRAL_DB_URL", _DATABASE_SECRET, "url"),  # replicas share one PostgreSQL
            _secret_env("CORRAL_ACCESS_SECRET", _ACCESS_SECRET, "secret"),  # and the key tokens derive from
            _secret_env("CORRAL_AUDIT_KEY", _AUDIT_SECRET, "keys"),  # and the audit chain's keys
            _secret_env("CORRAL_ADMIN_KEY", "corral-admin", "key", optional=True),
            {"name": "CORRAL_K8S_IMAGES", "valueFrom": {"configMapKeyRef": {
                "name": _IMAGES_CONFIG, "key": "images.json", "optional": True}}},
        ],
        "ports": [{"name": "http", "containerPort": API_PORT, "protocol": "TCP"}],
        "startupProbe": _http_probe(2, 30),
        "readinessProbe": _http_probe(5, 2),
        "livenessProbe": _http_probe(10, 3),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi", "ephemeral-storage": "256Mi"},
                      "limits": {"cpu": "2", "memory": "1Gi", "ephemeral-storage": "1Gi"}},
        "volumeMounts": _CONTROL_MOUNTS,
    })


def _egress(s: ClusterSettings, image: str) -> list[dict[str, Any]]:
    labels = dict(s.egress_labels)
    command, *args = EGRESS_COMMAND
    container = _hardened({
        "name": "egress", "image": image, "command": [command],
        "args": [*args, "--host", "0.0.0.0", "--port", str(s.egress_port)],  # noqa: S104
        "env": [_HOME_ENV,
                _secret_env("CORRAL_DB_URL", _DATABASE_SECRET, "url"),  # each sandbox's policy
                _secret_env("CORRAL_ACCESS_SECRET", _ACCESS_SECRET, "secret"),  # checks sandboxes' credentials
                _secret_env("CORRAL_AUDIT_KEY", _AUDIT_SECRET, "keys")],  # signs its egress audit records
        "ports": [{"name": "proxy", "containerPort": s.egress_port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "proxy"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "proxy"}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi", "ephemeral-storage": "256Mi"},
                      "limits": {"cpu": "2", "memory": "512Mi", "ephemeral-storage": "2Gi"}},
        "volumeMounts": _CONTROL_MOUNTS,
    })
    # The proxy never talks to the API server: no token. Its home holds the package mirror's cache.
    pod = _control_pod(_EGRESS, container, home="1Gi", token=False)
    return [_deployment(_EGRESS, s.control_namespace, labels, 2, pod),
            _service(_EGRESS, s.control_namespace, labels, "proxy", s.egress_port)]


_HOME_ENV = {"name": "CORRAL_HOME", "value": "/var/lib/corral"}
_CONTROL_MOUNTS = [{"name": "home", "mountPath": "/var/lib/corral"}, {"name": "tmp", "mountPath": "/tmp"}]


def _control_pod(account: str, container: dict[str, Any], *, home: str, token: bool) -> dict[str, Any]:
    """A control-plane Pod: non-root, RuntimeDefault seccomp, writable only in its emptyDirs. `token`: whether
    it mounts its ServiceAccount's token (the server's Kubernetes client, in-cluster)."""
    return {
        "serviceAccountName": account,
        "automountServiceAccountToken": token,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [{"name": "home", "emptyDir": {"sizeLimit": home}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
    }


def _deployment(name: str, namespace: str, labels: Mapping[str, str], replicas: int,
                pod: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, namespace, labels),
            "spec": {"replicas": replicas, "selector": {"matchLabels": dict(labels)},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": {**_PART_OF, **labels}}, "spec": pod}}}


def _service(name: str, namespace: str, labels: Mapping[str, str], port_name: str, port: int) -> dict[str, Any]:
    # The Service carries the Pods' labels too: the backend finds the egress proxy's Service by them.
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, labels),
            "spec": {"type": "ClusterIP", "selector": dict(labels),
                     "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}]}}


# --- network policies -------------------------------------------------------------------------------------------


def _peer(namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": dict(labels)}}


def _policy(name: str, namespace: str, selector: Mapping[str, str], *, ingress: list[dict[str, Any]] | None = None,
            egress: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"podSelector": {"matchLabels": dict(selector)} if selector else {}, "policyTypes": []}
    if ingress is not None:
        spec["policyTypes"].append("Ingress")
        spec["ingress"] = ingress
    if egress is not None:
        spec["policyTypes"].append("Egress")
        spec["egress"] = egress
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(name, namespace),
            "spec": spec}


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _dns_rule() -> dict[str, Any]:
    return {"to": [_DNS], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


def _network_policies(s: ClusterSettings) -> list[dict[str, Any]]:
    sandboxes = dict(CORRAL_LABELS)
    anywhere = [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
    public = [{"ipBlock": {"cidr": "0.0.0.0/0", "except": _PRIVATE_V4}},
              {"ipBlock": {"cidr": "::/0", "except": _PRIVATE_V6}}]
    return [
        # Everything is denied unless a policy below allows it, in both namespaces (empty lists: no rule).
        _policy("default-deny", s.control_namespace, {}, ingress=[], egress=[]),
        _policy("default-deny", s.namespace, {}, ingress=[], egress=[]),
        # The API, from wherever users are (narrow it to your ingress controller in an overlay). The server
        # reaches DNS, the Kubernetes API and PostgreSQL (wherever they are: addresses differ per cluster),
        # and the sandboxes' agents.
        _policy(_SERVER, s.control_namespace, s.server_labels,
                ingress=[{"ports": _tcp(API_PORT)}],
                egress=[_dns_rule(), {"to": anywhere, "ports": _tcp(443, 6443, 5432)},
                        {"to": [_peer(s.namespace, sandboxes)], "ports": _tcp(s.agent_port)}]),
        # The egress proxy: from sandboxes, out to public addresses (its own policy decides per sandbox), DNS,
        # and PostgreSQL for the sandboxes' policies.
        _policy(_EGRESS, s.control_namespace, s.egress_labels,
                ingress=[{"from": [_peer(s.namespace, sandboxes)], "ports": _tcp(s.egress_port)}],
                egress=[_dns_rule(), {"to": public}, {"to": anywhere, "ports": _tcp(5432)}]),
        # Sandboxes: the agent's port from the server alone, out to the egress proxy alone. No DNS.
        _policy("corral-sandboxes", s.namespace, sandboxes,
                ingress=[{"from": [_peer(s.control_namespace, s.server_labels)], "ports": _tcp(s.agent_port)}],
                egress=[{"to": [_peer(s.control_namespace, s.egress_labels)], "ports": _tcp(s.egress_port)}]),
    ]


# --- admission --------------------------------------------------------------------------------------------------

_LISTS = ("containers", "initContainers", "ephemeralContainers")


def _every_container(condition: str) -> str:
    """`condition` (about `c`) for every container of the Pod, of all three kinds. The kinds are different CEL
    types (EphemeralContainer is not Container), so each list is checked by itself rather than concatenated."""
    return " && ".join(f"(!has(object.spec.{kind}) || object.spec.{kind}.all(c, {condition}))" for kind in _LISTS)


def admission_expressions(runtime_class: str) -> list[tuple[str, str]]:
    """(CEL expression, message) pairs: what a Pod in the sandboxes' namespace must satisfy to be admitted."""
    validate_name(runtime_class, "runtime class", subdomain=True)
    sc = "has(c.securityContext)"
    return [
        (f"has(object.spec.runtimeClassName) && object.spec.runtimeClassName == '{runtime_class}'",
         f"sandbox Pods must run with the RuntimeClass {runtime_class}"),
        ("(!has(object.spec.hostNetwork) || !object.spec.hostNetwork) && "
         "(!has(object.spec.hostPID) || !object.spec.hostPID) && (!has(object.spec.hostIPC) || !object.spec.hostIPC)",
         "sandbox Pods must not use the node's network, PID or IPC namespace"),
        (_every_container(f"!{sc} || !has(c.securityContext.privileged) || !c.securityContext.privileged"),
         "sandbox containers must not be privileged"),
        (_every_container(f"{sc} && has(c.securityContext.allowPrivilegeEscalation) && "
                          "!c.securityContext.allowPrivilegeEscalation"),
         "sandbox containers must set allowPrivilegeEscalation: false"),
        (_every_container(f"!{sc} || !has(c.securityContext.capabilities) || "
                          "!has(c.securityContext.capabilities.add) || size(c.securityContext.capabilities.add) == 0"),
         "sandbox containers must not add capabilities"),
    ]


def _admission(s: ClusterSettings, runtime_class: str) -> list[dict[str, Any]]:
    name = "corral-sandbox-pods"
    where = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": s.namespace}}}
    rules = [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
              "resources": ["pods", "pods/ephemeralcontainers"]}]
    validations = [{"expression": expr, "message": message}
                   for expr, message in admission_expressions(runtime_class)]
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": _meta(name),
         "spec": {"failurePolicy": "Fail", "matchConstraints": {**where, "resourceRules": rules},
                  "validations": validations}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": _meta(name),
         "spec": {"policyName": name, "validationActions": ["Deny"], "matchResources": where}},
    ]
