"""The Kubernetes objects, without a cluster: a sandbox's Secret, NetworkPolicy and Pod, and the reference deployment.

What this proves: every object is well-formed for Kubernetes 1.33, 1.35 and 1.37 (the official schemas, strict:
an unknown field fails), carries the hardening `hardening_problems` checks (each rule shown to fire on its own),
the admission policy's CEL admits our Pods and refuses the ones it should (evaluated with cel-python), and
`deploy/kubernetes/` is exactly what the functions render. What it cannot prove: that a cluster admits, schedules
and isolates them (docs/kubernetes.md, "What only a real cluster proves").
"""

from __future__ import annotations

import base64
import copy
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from celpy.adapter import json_to_cel
from typer.testing import CliRunner

from corral._exceptions import InvalidRequestError
from corral.backends._spec import Limits, Runtime, SandboxSpec
from corral.backends.kubernetes import ClusterSettings, SandboxObjects, hardening_problems, sandbox_objects
from corral.backends.kubernetes._deployment import (
    admission_expressions,
    reference_deployment,
    reference_files,
    render_files,
)
from corral.backends.kubernetes._objects import AGENT_ARGV, PATH, WRITABLE, quantity
from corral.backends.kubernetes._yaml import dump, dump_all
from corral.cli import app

VERSIONS = ["1.33.0", "1.35.0", "1.37.0"]
DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
IMAGE = "registry.example.org/corral/default@sha256:" + "ab" * 32
NAME = "sb-0123456789abcdef"
MIB = 1024**2
GIB = 1024**3


def build(spec: SandboxSpec | None = None, settings: ClusterSettings | None = None, *, name: str = NAME,
          **overrides: Any) -> SandboxObjects:
    args: dict[str, Any] = {"image": IMAGE, "settings": settings or ClusterSettings(),
                            "labels": {"corral.dev/sandbox": NAME}, "secrets": {"token": "t0ken"},
                            "env": {"TZ": "UTC"}, "deadline_seconds": 360}
    return sandbox_objects(name, spec or SandboxSpec(), **{**args, **overrides})


CASES: dict[str, Callable[[], SandboxObjects]] = {
    "defaults": lambda: build(),
    "tight-limits": lambda: build(SandboxSpec(limits=Limits(memory=64 * MIB, cpus=0.05, disk=16 * MIB, pids=16))),
    "big-limits": lambda: build(SandboxSpec(limits=Limits(memory=16 * GIB, cpus=8, disk=100 * GIB, tmp=4 * GIB))),
    "root-false-runsc": lambda: build(SandboxSpec(root=False, runtime=Runtime.RUNSC, network=("pypi.org",))),
    "runtime-class-none": lambda: build(settings=ClusterSettings(runtime_class=None)),
    "localhost-seccomp": lambda: build(settings=ClusterSettings(seccomp_profile="profiles/corral.json")),
    "pull-secrets-ports": lambda: build(settings=ClusterSettings(image_pull_secrets=("regcred",), agent_port=9000,
                                                                 egress_port=8080)),
    "warm-no-deadline": lambda: build(labels={"corral.dev/pool": "default"}, deadline_seconds=None),
    "user-namespace": lambda: build(settings=ClusterSettings(user_namespace=True)),
}


# --- the official schemas ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_sandbox_objects_validate_strictly(case: str, version: str) -> None:
    for obj in CASES[case]().all():
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_reference_deployment_validates_strictly(version: str) -> None:
    objects = reference_deployment()
    assert len(objects) > 15
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_refuses_what_kubernetes_does_not_know() -> None:
    """The check above can fail: a field the schema lacks, or a wrong type, is refused."""
    pod = build().pod
    pod["spec"]["containers"][0]["securityContext"]["noNewPrivileges"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="noNewPrivileges"):
        kubernetes_validate.validate(pod, "1.37.0", strict=True)
    pod = build().pod
    pod["spec"]["activeDeadlineSeconds"] = "360"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.33.0", strict=True)


# --- what the objects say ----------------------------------------------------------------------------------------


def test_a_user_namespace_per_pod_is_asked_for_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "hostUsers" not in build().pod["spec"]  # the cluster's default (the host's users) unless asked
    pod = build(settings=ClusterSettings(user_namespace=True)).pod
    assert pod["spec"]["hostUsers"] is False
    assert hardening_problems(pod) == []


def test_pod_resources_and_tmpfs_come_from_the_limits() -> None:
    limits = Limits(memory=GIB, cpus=1.5, disk=2 * GIB, tmp=128 * MIB, shm=32 * MIB)
    pod = build(SandboxSpec(limits=limits)).pod
    container = pod["spec"]["containers"][0]
    want = {"cpu": "1500m", "memory": "1Gi", "ephemeral-storage": "2Gi"}
    assert container["resources"] == {"requests": want, "limits": want}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tmp"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Mi"}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Mi"}
    for path, volume in WRITABLE:
        assert volumes[volume]["emptyDir"] == {"sizeLimit": "2Gi"}
        assert {"name": volume, "mountPath": path} in container["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_quantities_are_exact() -> None:
    assert [quantity(n) for n in (512 * MIB, 3 * 1024**3, 3072, 1536, 1000)] == ["512Mi", "3Gi", "3Ki", "1536", "1000"]
    odd = build(SandboxSpec(limits=Limits(memory=100_000_001))).pod["spec"]["containers"][0]
    assert odd["resources"]["limits"]["memory"] == "100000001"
    assert odd["resources"]["limits"]["cpu"] == "1000m"
    tiny = build(SandboxSpec(limits=Limits(cpus=0.011))).pod["spec"]["containers"][0]
    assert tiny["resources"]["limits"]["cpu"] == "11m"  # rounded up: never less CPU than asked


def test_pod_runs_the_agent_as_the_docker_backend_does() -> None:
    docker_container = pytest.importorskip("corral.backends.docker._container")
    assert list(AGENT_ARGV) == docker_container.AGENT_ARGV
    assert docker_container.PATH == PATH
    assert [(d.path, d.name) for d in docker_container.WRITABLE] == list(WRITABLE)
    container = build().pod["spec"]["containers"][0]
    assert container["command"] == list(AGENT_ARGV)
    assert container["workingDir"] == "/.corral"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"PATH": PATH, "LANG": "C.UTF-8", "CORRAL_AGENT_TCP": "0.0.0.0:7771",
                   "CORRAL_AGENT_TOKEN_FILE": "/run/corral/token", "TZ": "UTC"}
    assert "t0ken" not in repr(container)  # the token only in the Secret


def test_secret_holds_the_token_mounted_read_only() -> None:
    objects = build(secrets={"token": "t0ken", "egress": "cred"})
    assert objects.secret["data"] == {"token": base64.b64encode(b"t0ken").decode(),
                                      "egress": base64.b64encode(b"cred").decode()}
    assert objects.secret["immutable"] is True
    volume = next(v for v in objects.pod["spec"]["volumes"] if "secret" in v)
    assert volume["secret"] == {"secretName": NAME, "defaultMode": 0o440, "optional": False}
    mount = next(m for m in objects.pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/run/corral", "readOnly": True}
    # An empty value is allowed: the backend fills the token in once it knows the Pod's uid.
    assert build(secrets={"token": ""}).secret["data"] == {"token": ""}


def test_labels_and_order() -> None:
    objects = build()
    want = {"corral.dev/sandbox": NAME, "app.kubernetes.io/managed-by": "corral", "corral.dev/role": "sandbox",
            "corral.dev/pod": NAME}
    assert [o["kind"] for o in objects.all()] == ["Secret", "NetworkPolicy", "Pod"]
    for obj in objects.all():
        assert obj["metadata"]["labels"] == want
        assert obj["metadata"]["name"] == NAME
        assert obj["metadata"]["namespace"] == "corral-sandboxes"
    annotations = build(SandboxSpec(network=("pypi.org", "*.github.com"))).pod["metadata"]["annotations"]
    assert annotations == {"corral.dev/template": "default", "corral.dev/network": "pypi.org,*.github.com"}


def test_network_policy_admits_the_server_and_lets_out_to_the_proxy_only() -> None:
    settings = ClusterSettings(agent_port=9000, egress_port=8080, control_namespace="ctl",
                               server_labels={"app": "srv"}, egress_labels={"app": "egr"})
    spec = build(settings=settings).network_policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"corral.dev/pod": NAME}}
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    ctl = {"matchLabels": {"kubernetes.io/metadata.name": "ctl"}}
    assert spec["ingress"] == [{"from": [{"namespaceSelector": ctl, "podSelector": {"matchLabels": {"app": "srv"}}}],
                                "ports": [{"protocol": "TCP", "port": 9000}]}]
    assert spec["egress"] == [{"to": [{"namespaceSelector": ctl, "podSelector": {"matchLabels": {"app": "egr"}}}],
                               "ports": [{"protocol": "TCP", "port": 8080}]}]


def test_settings_shape_the_pod() -> None:
    default = build().pod["spec"]
    assert default["runtimeClassName"] == "gvisor"
    assert default["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert default["activeDeadlineSeconds"] == 360
    assert "imagePullSecrets" not in default
    assert "runtimeClassName" not in CASES["runtime-class-none"]().pod["spec"]
    assert CASES["localhost-seccomp"]().pod["spec"]["securityContext"]["seccompProfile"] == {
        "type": "Localhost", "localhostProfile": "profiles/corral.json"}
    assert CASES["pull-secrets-ports"]().pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "activeDeadlineSeconds" not in CASES["warm-no-deadline"]().pod["spec"]


# --- hardening_problems ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_sandbox_pod_is_hardened(case: str) -> None:
    settings_none = case == "runtime-class-none"
    problems = hardening_problems(CASES[case]().pod, runtime_class=None if settings_none else "gvisor",
                                  deadline=case != "warm-no-deadline")
    assert problems == []


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(pod: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = pod
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return mutate


_DELETE = object()
_C = "spec.containers.0"
MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "token-automount": (_set("spec.automountServiceAccountToken", True), "spec.automountServiceAccountToken"),
    "token-default": (_set("spec.automountServiceAccountToken", _DELETE), "spec.automountServiceAccountToken"),
    "service-links": (_set("spec.enableServiceLinks", True), "spec.enableServiceLinks"),
    "host-network": (_set("spec.hostNetwork", True), "spec.hostNetwork"),
    "host-pid": (_set("spec.hostPID", True), "spec.hostPID"),
    "host-ipc": (_set("spec.hostIPC", True), "spec.hostIPC"),
    "share-pid": (_set("spec.shareProcessNamespace", True), "spec.shareProcessNamespace"),
    "restart": (_set("spec.restartPolicy", "Always"), "spec.restartPolicy"),
    "grace": (_set("spec.terminationGracePeriodSeconds", 30), "spec.terminationGracePeriodSeconds"),
    "deadline": (_set("spec.activeDeadlineSeconds", _DELETE), "spec.activeDeadlineSeconds"),
    "runtime-class": (_set("spec.runtimeClassName", "runc"), "spec.runtimeClassName"),
    "no-runtime-class": (_set("spec.runtimeClassName", _DELETE), "spec.runtimeClassName"),
    "cluster-dns": (_set("spec.dnsPolicy", "ClusterFirst"), "spec.dnsPolicy"),
    "non-root": (_set("spec.securityContext.runAsNonRoot", False), "spec.securityContext.runAsNonRoot"),
    "uid": (_set("spec.securityContext.runAsUser", 0), "spec.securityContext.runAsUser"),
    "gid": (_set("spec.securityContext.runAsGroup", 0), "spec.securityContext.runAsGroup"),
    "fs-group": (_set("spec.securityContext.fsGroup", _DELETE), "spec.securityContext.fsGroup"),
    "seccomp-unconfined": (_set("spec.securityContext.seccompProfile", {"type": "Unconfined"}),
                           "spec.securityContext.seccompProfile"),
    "seccomp-localhost-no-path": (_set("spec.securityContext.seccompProfile", {"type": "Localhost"}),
                                  "spec.securityContext.seccompProfile"),
    "host-path": (lambda pod: pod["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
                  "spec.volumes[6] (h) must be a secret or an emptyDir"),
    "unbounded-empty-dir": (_set("spec.volumes.3.emptyDir", {}), "spec.volumes[3] (workspace) emptyDir"),
    "tmp-on-disk": (_set("spec.volumes.1.emptyDir.medium", ""), "spec.volumes: /tmp"),
    "escalation": (_set(f"{_C}.securityContext.allowPrivilegeEscalation", True),
                   "spec.containers[0].securityContext.allowPrivilegeEscalation"),
    "privileged": (_set(f"{_C}.securityContext.privileged", True), "spec.containers[0].securityContext.privileged"),
    "caps-kept": (_set(f"{_C}.securityContext.capabilities.drop", []),
                  "spec.containers[0].securityContext.capabilities.drop"),
    "caps-added": (_set(f"{_C}.securityContext.capabilities.add", ["NET_RAW"]),
                   "spec.containers[0].securityContext.capabilities.add"),
    "writable-root": (_set(f"{_C}.securityContext.readOnlyRootFilesystem", False),
                      "spec.containers[0].securityContext.readOnlyRootFilesystem"),
    "container-root": (_set(f"{_C}.securityContext.runAsUser", 0), "spec.containers[0].securityContext must not"),
    "container-unconfined": (_set(f"{_C}.securityContext.seccompProfile", {"type": "Unconfined"}),
                             "spec.containers[0].securityContext.seccompProfile"),
    "proc-unmasked": (_set(f"{_C}.securityContext.procMount", "Unmasked"),
                      "spec.containers[0].securityContext.procMount"),
    "host-port": (_set(f"{_C}.ports.0.hostPort", 7771), "spec.containers[0].ports"),
    "no-probe": (_set(f"{_C}.readinessProbe", _DELETE), "spec.containers[0].readinessProbe"),
    "no-memory-limit": (lambda pod: pod["spec"]["containers"][0]["resources"]["limits"].pop("memory"),
                        "spec.containers[0].resources.limits must set memory"),
    "no-disk-request": (lambda pod: pod["spec"]["containers"][0]["resources"]["requests"].pop("ephemeral-storage"),
                        "spec.containers[0].resources.requests must set ephemeral-storage"),
    "privileged-init": (lambda pod: pod["spec"].setdefault("initContainers", []).append(
        {**copy.deepcopy(pod["spec"]["containers"][0]), "securityContext": {
            **pod["spec"]["containers"][0]["securityContext"], "privileged": True}}),
        "spec.initContainers[0].securityContext.privileged"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_hardening_rule_fires_alone(mutation: str) -> None:
    mutate, expected = MUTATIONS[mutation]
    pod = copy.deepcopy(build().pod)
    assert hardening_problems(pod) == []
    mutate(pod)
    problems = hardening_problems(pod)
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems


def test_hardening_options() -> None:
    pod = build(deadline_seconds=None).pod
    assert hardening_problems(pod, deadline=False) == []
    assert hardening_problems(pod) == ["spec.activeDeadlineSeconds must be set (the sandbox's TTL)"]
    assert hardening_problems(build(settings=ClusterSettings(runtime_class="kata")).pod, runtime_class="kata") == []
    assert "spec.containers: the Pod has no container" in hardening_problems({"spec": {}})


# --- bad input ---------------------------------------------------------------------------------------------------


BAD_INPUTS: dict[str, tuple[dict[str, Any], str]] = {
    "upper-name": ({"name": "Sandbox"}, "DNS-1123 label"),
    "long-name": ({"name": "a" * 64}, "DNS-1123 label"),
    "empty-name": ({"name": ""}, "non-empty"),
    "underscore-name": ({"name": "a_b"}, "DNS-1123 label"),
    "empty-image": ({"image": ""}, "non-empty image"),
    "blank-image": ({"image": "  "}, "non-empty image"),
    "spaced-image": ({"image": "a b"}, "spaces"),
    "label-key": ({"labels": {"bad key": "x"}}, "labels key"),
    "label-prefix": ({"labels": {"Bad.Prefix/x": "y"}}, "prefix"),
    "label-value": ({"labels": {"corral.dev/sandbox": "-x-"}}, "labels value"),
    "label-long": ({"labels": {"a": "x" * 64}}, "labels value"),
    "label-own": ({"labels": {"corral.dev/role": "server"}}, "Corral's own"),
    "no-token": ({"secrets": {"other": "x"}}, "'token'"),
    "secret-key": ({"secrets": {"token": "t", "a/b": "x"}}, "secret key"),
    "env-name": ({"env": {"1X": "y"}}, "not valid"),
    "env-reserved": ({"env": {"CORRAL_AGENT_TCP": "0.0.0.0:1"}}, "the agent's own"),
    "env-nul": ({"env": {"X": "a\x00b"}}, "NUL"),
    "deadline-zero": ({"deadline_seconds": 0}, "positive"),
    "deadline-float": ({"deadline_seconds": 1.5}, "positive"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_clearly(case: str) -> None:
    overrides, message = BAD_INPUTS[case]
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(")):
        build(**overrides)


@pytest.mark.parametrize(("spec", "settings", "message"), [
    (SandboxSpec(root=True), ClusterSettings(), "no sandboxes with root"),
    (SandboxSpec(volumes={"/mnt/data": "vol-1"}), ClusterSettings(), "volumes"),
    (SandboxSpec(runtime=Runtime.RUNSC), ClusterSettings(runtime_class=None), "gVisor RuntimeClass"),
])
def test_specs_a_pod_cannot_honour_are_refused(spec: SandboxSpec, settings: ClusterSettings, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        build(spec, settings)


@pytest.mark.parametrize(("fields", "message"), [
    ({"namespace": "Corral"}, "namespace"),
    ({"control_namespace": "x" * 64}, "control namespace"),
    ({"runtime_class": "G_VISOR"}, "runtime class"),
    ({"agent_port": 0}, "agent port"),
    ({"egress_port": 70000}, "egress port"),
    ({"agent_port": True}, "agent port"),
    ({"seccomp_profile": "/var/lib/kubelet/seccomp/x.json"}, "relative path"),
    ({"seccomp_profile": "../x.json"}, "relative path"),
    ({"image_pull_secrets": ("Bad Name",)}, "image pull secret"),
    ({"server_labels": {}}, "server labels"),
    ({"egress_labels": {"app": "bad value"}}, "egress labels"),
])
def test_bad_settings_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        ClusterSettings(**fields)


# --- the reference deployment ------------------------------------------------------------------------------------


def _by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_namespaces_enforce_restricted() -> None:
    namespaces = {n["metadata"]["name"]: n["metadata"]["labels"] for n in _by_kind(reference_deployment(), "Namespace")}
    assert set(namespaces) == {"corral", "corral-sandboxes"}
    for labels in namespaces.values():
        for mode in ("enforce", "audit", "warn"):
            assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"


def test_rbac_is_least_privilege() -> None:
    objects = reference_deployment()
    cluster_roles = _by_kind(objects, "ClusterRole")  # the one cluster-wide grant: reading nodes (capacity)
    assert [r["rules"] for r in cluster_roles] == [[{"apiGroups": [""], "resources": ["nodes"],
                                                     "verbs": ["get", "list"]}]]
    assert [b["roleRef"]["name"] for b in _by_kind(objects, "ClusterRoleBinding")] == ["corral-server-nodes"]
    roles = {r["metadata"]["name"]: r for r in _by_kind(objects, "Role") + cluster_roles}
    sandboxes = roles["corral-server"]
    assert sandboxes["metadata"]["namespace"] == "corral-sandboxes"
    verbs = {(g, r): set(rule["verbs"]) for rule in sandboxes["rules"] for g in rule["apiGroups"]
             for r in rule["resources"]}
    assert verbs[("", "pods")] == {"get", "list", "watch", "create", "delete", "patch"}
    assert verbs[("", "pods/log")] == {"get"}
    assert "watch" not in verbs[("", "secrets")] and "update" not in verbs[("", "secrets")]
    assert ("", "pods/exec") not in verbs and ("", "pods/portforward") not in verbs
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    assert roles["corral-server-services"]["rules"] == [
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list"]}]
    for binding in _by_kind(objects, "RoleBinding") + _by_kind(objects, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "corral-server", "namespace": "corral"}]


def test_server_deployment() -> None:
    objects = reference_deployment(image="example.org/corral:1")
    server = next(d for d in _by_kind(objects, "Deployment") if d["metadata"]["name"] == "corral-server")
    assert server["spec"]["replicas"] == 2
    pod = server["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "example.org/corral:1"
    assert container["args"][:7] == ["serve", "--host", "0.0.0.0", "--port", "7770", "--backend", "kubernetes"]
    env = {e["name"]: e for e in container["env"]}
    assert env["CORRAL_DB_URL"]["valueFrom"] == {"secretKeyRef": {"name": "corral-database", "key": "url",
                                                                  "optional": False}}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/v1/health", "port": "http"}
    assert "/v1/health" in (Path(__file__).resolve().parents[1] / "src/corral/server/_app.py").read_text()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert set(container["resources"]["limits"]) == {"cpu", "memory", "ephemeral-storage"}
    pdb = _by_kind(objects, "PodDisruptionBudget")[0]
    assert pdb["spec"]["selector"] == server["spec"]["selector"] and pdb["spec"]["minAvailable"] == 1
    services = {s["metadata"]["name"]: s for s in _by_kind(objects, "Service")}
    assert services["corral-egress"]["metadata"]["labels"]["app.kubernetes.io/name"] == "corral-egress"
    egress = next(d for d in _by_kind(objects, "Deployment") if d["metadata"]["name"] == "corral-egress")
    assert egress["spec"]["template"]["spec"]["containers"][0]["command"] == ["corral"]
    assert egress["spec"]["template"]["spec"]["containers"][0]["args"][0] == "egress-proxy"
    assert egress["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_network_policies() -> None:
    policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p["spec"]
                for p in _by_kind(reference_deployment(), "NetworkPolicy")}
    for namespace in ("corral", "corral-sandboxes"):
        deny = policies[(namespace, "default-deny")]
        assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": []}
    sandboxes = [spec for (ns, _), spec in policies.items() if ns == "corral-sandboxes"]
    for spec in sandboxes:  # no DNS, no way out but the proxy
        for rule in spec.get("egress", []):
            assert all(port["port"] != 53 for port in rule.get("ports", []))
            assert rule["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "corral"}},
                                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "corral-egress"}}}]
    public = policies[("corral", "corral-egress")]["egress"][1]["to"][0]["ipBlock"]
    assert public["cidr"] == "0.0.0.0/0" and "169.254.0.0/16" in public["except"] and "10.0.0.0/8" in public["except"]
    server = policies[("corral", "corral-server")]
    assert {"protocol": "UDP", "port": 53} in server["egress"][0]["ports"]
    assert server["ingress"] == [{"ports": [{"protocol": "TCP", "port": 7770}]}]


def test_runtime_class_and_namespaces_are_parameters() -> None:
    objects = reference_deployment("ctl", "boxes", runtime_class="gvisor-kvm")
    assert _by_kind(objects, "RuntimeClass")[0]["metadata"]["name"] == "gvisor-kvm"
    assert _by_kind(objects, "RuntimeClass")[0]["handler"] == "runsc"
    assert {o["metadata"].get("namespace") for o in objects} == {None, "ctl", "boxes"}
    policy = _by_kind(objects, "ValidatingAdmissionPolicy")[0]
    assert "'gvisor-kvm'" in policy["spec"]["validations"][0]["expression"]
    with pytest.raises(InvalidRequestError, match="namespace of their own"):
        reference_deployment("same", "same")
    with pytest.raises(InvalidRequestError, match="replicas"):
        reference_deployment(replicas=0)
    with pytest.raises(InvalidRequestError, match="image"):
        reference_deployment(image="")


# --- the admission policy's CEL ----------------------------------------------------------------------------------


def _admits(pod: dict[str, Any]) -> list[bool]:
    env = celpy.Environment()
    activation: Any = json_to_cel({"object": pod})
    return [bool(env.program(env.compile(expr)).evaluate(activation)) for expr, _ in admission_expressions("gvisor")]


def test_admission_policy_is_bound_to_the_sandboxes_namespace() -> None:
    objects = reference_deployment()
    policy = _by_kind(objects, "ValidatingAdmissionPolicy")[0]
    binding = _by_kind(objects, "ValidatingAdmissionPolicyBinding")[0]
    where = {"matchLabels": {"kubernetes.io/metadata.name": "corral-sandboxes"}}
    assert policy["spec"]["matchConstraints"]["namespaceSelector"] == where
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"],
                               "matchResources": {"namespaceSelector": where}}
    assert [v["expression"] for v in policy["spec"]["validations"]] == [e for e, _ in admission_expressions("gvisor")]


def test_admission_admits_every_sandbox_pod() -> None:
    for case in ("defaults", "tight-limits", "localhost-seccomp", "warm-no-deadline"):
        assert _admits(CASES[case]().pod) == [True] * 5


ADMISSION_MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], int]] = {
    "no-runtime-class": (_set("spec.runtimeClassName", _DELETE), 0),
    "other-runtime-class": (_set("spec.runtimeClassName", "runc"), 0),
    "host-network": (_set("spec.hostNetwork", True), 1),
    "host-pid": (_set("spec.hostPID", True), 1),
    "host-ipc": (_set("spec.hostIPC", True), 1),
    "privileged": (_set(f"{_C}.securityContext.privileged", True), 2),
    "escalation": (_set(f"{_C}.securityContext.allowPrivilegeEscalation", True), 3),
    "escalation-unset": (_set(f"{_C}.securityContext.allowPrivilegeEscalation", _DELETE), 3),
    "caps-added": (_set(f"{_C}.securityContext.capabilities.add", ["SYS_ADMIN"]), 4),
    "ephemeral-privileged": (lambda pod: pod["spec"].__setitem__("ephemeralContainers", [
        {"name": "debug", "image": "busybox", "securityContext": {"privileged": True,
                                                                  "allowPrivilegeEscalation": False}}]), 2),
    "init-caps": (lambda pod: pod["spec"].__setitem__("initContainers", [
        {"name": "init", "image": "busybox", "securityContext": {"allowPrivilegeEscalation": False,
                                                                 "capabilities": {"add": ["NET_ADMIN"]}}}]), 4),
}


@pytest.mark.parametrize("mutation", sorted(ADMISSION_MUTATIONS))
def test_admission_refuses_each_privilege(mutation: str) -> None:
    mutate, refused = ADMISSION_MUTATIONS[mutation]
    pod = copy.deepcopy(build().pod)
    mutate(pod)
    assert _admits(pod) == [i != refused for i in range(5)]


# --- deploy/kubernetes and YAML ------------------------------------------------------------------------------------


def test_deploy_directory_is_what_the_functions_render() -> None:
    rendered = render_files(reference_files())
    on_disk = {p.name: p.read_text() for p in DEPLOY.iterdir() if p.is_file()}
    assert set(on_disk) == set(rendered), "regenerate: corral k8s manifests --write deploy/kubernetes"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"{name} drifted: corral k8s manifests --write deploy/kubernetes"


def test_kustomization_lists_every_file() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    parsed = [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((DEPLOY / name).read_text())]
    assert parsed == reference_deployment()


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (scripts/install adds it)")
def test_kubectl_kustomize_renders_the_base() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    rendered = sorted(yaml.safe_load_all(out), key=_key)
    assert rendered == sorted(reference_deployment(), key=_key)


def test_yaml_writer_round_trips_tricky_scalars() -> None:
    doc = {"a": ["yes", "No", "on", "null", "~", "1", "0o17", "1e3", "-x", "a: b", "#c", "", " pad", "x\ny",
                 "*.example.org", "0.0.0.0:7771", "100m", "ünïcode", "@at", "it's"],
           "b": {"c": [], "d": {}, "e": None, "f": True, "g": 0, "h": -5},
           "nested": [[1, [2]], [{"k": "v", "l": [{"m": 1}]}], {}], "key with space": "v", "true": "key"}
    assert yaml.safe_load(dump(doc)) == doc
    assert list(yaml.safe_load_all(dump_all([doc, {"x": 1}]))) == [doc, {"x": 1}]
    with pytest.raises(TypeError):
        dump({"float": 1.5})


# --- the CLI -------------------------------------------------------------------------------------------------------


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["k8s", *args])


def test_cli_manifests_prints_the_reference_deployment() -> None:
    result = _cli("manifests")
    assert result.exit_code == 0, result.output
    assert list(yaml.safe_load_all(result.stdout)) == reference_deployment()
    result = _cli("manifests", "--namespace", "ctl", "--sandbox-namespace", "boxes", "--image", "example.org/c:2")
    assert list(yaml.safe_load_all(result.stdout)) == reference_deployment("ctl", "boxes", "example.org/c:2")


def test_cli_manifests_writes_the_base(tmp_path: Path) -> None:
    result = _cli("manifests", "--write", str(tmp_path / "base"))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert {p.name: p.read_text() for p in (tmp_path / "base").iterdir()} == render_files(reference_files())


def test_cli_sandbox_manifest() -> None:
    result = _cli("sandbox-manifest", "--template", "default", "--memory", "256M", "--network", "pypi.org, *.npmjs.org",
                  "--cpus", "0.5", "--disk", "2G", "--timeout", "90.5")
    assert result.exit_code == 0, result.output
    secret, policy, pod = yaml.safe_load_all(result.stdout)
    assert (secret["kind"], policy["kind"], pod["kind"]) == ("Secret", "NetworkPolicy", "Pod")
    assert base64.b64decode(secret["data"]["token"]).decode().startswith("PLACEHOLDER-")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "500m", "memory": "256Mi",
                                                                   "ephemeral-storage": "2Gi"}
    assert pod["spec"]["activeDeadlineSeconds"] == 91
    assert pod["metadata"]["annotations"]["corral.dev/network"] == "pypi.org,*.npmjs.org"
    assert pod["spec"]["containers"][0]["image"] == "registry.invalid/corral/default:latest"
    assert hardening_problems(pod) == []
    kubernetes_validate.validate(pod, "1.37.0", strict=True)
    none = yaml.safe_load_all(_cli("sandbox-manifest", "--template", "t", "--memory", "1G", "--network", "none",
                                   "--runtime-class", "none", "--image", "example.org/t@sha256:" + "0" * 64).stdout)
    pod = list(none)[2]
    assert "runtimeClassName" not in pod["spec"]
    assert pod["spec"]["containers"][0]["image"] == "example.org/t@sha256:" + "0" * 64


@pytest.mark.parametrize(("args", "message"), [
    (["sandbox-manifest", "--template", "t", "--memory", "1M", "--network", "none"], "at least 32M"),
    (["sandbox-manifest", "--template", "t", "--memory", "lots", "--network", "none"], "--memory"),
    (["sandbox-manifest", "--template", "t", "--memory", "1G", "--network", "http://x/"], "--network"),
    (["sandbox-manifest", "--template", "t", "--memory", "1G", "--network", "none", "--cpus", "0"], "cpus"),
    (["sandbox-manifest", "--template", "t", "--memory", "1G", "--network", "none", "--name", "Bad_Name"],
     "DNS-1123"),
    (["sandbox-manifest", "--template", "t", "--memory", "1G", "--network", "none", "--image", " "], "image"),
    (["sandbox-manifest", "--template", "t", "--memory", "1G", "--network", "none", "--namespace", "X"], "DNS-1123"),
    (["sandbox-manifest", "--memory", "1G", "--network", "none"], "--template"),
    (["manifests", "--namespace", "same", "--sandbox-namespace", "same"], "namespace of their own"),
    (["manifests", "--image", ""], "image"),
    (["manifests", "--runtime-class", "Not Valid"], "runtime class"),
])
def test_cli_bad_input_is_a_usage_error(args: list[str], message: str) -> None:
    result = _cli(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert message in " ".join(result.stderr.replace("│", " ").split())


def test_settings_cannot_be_changed_behind_the_backend() -> None:
    labels = {"app": "srv"}
    settings = ClusterSettings(server_labels=labels, image_pull_secrets=["regcred"])  # type: ignore[arg-type]
    labels["app"] = "other"
    assert dict(settings.server_labels) == {"app": "srv"}
    with pytest.raises(TypeError):
        settings.server_labels["app"] = "x"  # type: ignore[index]
    assert settings.image_pull_secrets == ("regcred",)
