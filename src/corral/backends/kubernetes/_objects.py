"""The Kubernetes objects of one sandbox, built by a pure function: its Secret, NetworkPolicy and Pod.

A minimal version, kept to the interface the full one (hardening checks, schema validation) provides, so that
the backend can be driven now; the full module replaces this one.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .._spec import SandboxSpec

__all__ = ["ClusterSettings", "SandboxObjects", "sandbox_objects"]

SANDBOX_UID = 1000
AGENT_ARGV = ["/usr/bin/python3", "-S", "-B", "-c", "from agent.__main__ import main; main()"]
SECRET_DIR = "/run/corral"  # noqa: S105 - a directory, not a secret


@dataclass(frozen=True)
class ClusterSettings:
    namespace: str = "corral-sandboxes"
    control_namespace: str = "corral"
    runtime_class: str | None = "gvisor"
    agent_port: int = 7771
    seccomp_profile: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    server_labels: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({"app.kubernetes.io/name": "corral-server"}))
    egress_labels: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({"app.kubernetes.io/name": "corral-egress"}))
    egress_port: int = 3128


@dataclass(frozen=True)
class SandboxObjects:
    secret: dict[str, Any]
    pod: dict[str, Any]
    network_policy: dict[str, Any]

    def all(self) -> list[dict[str, Any]]:
        return [self.secret, self.network_policy, self.pod]


def sandbox_objects(name: str, spec: SandboxSpec, *, image: str, settings: ClusterSettings,
                    labels: Mapping[str, str], secrets: Mapping[str, str], env: Mapping[str, str],
                    deadline_seconds: int | None) -> SandboxObjects:
    meta_labels = {**labels, "app.kubernetes.io/managed-by": "corral", "corral.dev/role": "sandbox"}

    def meta() -> dict[str, Any]:
        return {"name": name, "namespace": settings.namespace, "labels": dict(meta_labels)}

    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta(), "type": "Opaque",
              "data": {k: base64.b64encode(v.encode()).decode() for k, v in secrets.items()}}
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(), "spec": {
        "podSelector": {"matchLabels": {"corral.dev/sandbox-pod": name}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": settings.control_namespace}},
            "podSelector": {"matchLabels": dict(settings.server_labels)}}],
            "ports": [{"protocol": "TCP", "port": settings.agent_port}]}],
        "egress": [{"to": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": settings.control_namespace}},
            "podSelector": {"matchLabels": dict(settings.egress_labels)}}],
            "ports": [{"protocol": "TCP", "port": settings.egress_port}]}]}}
    container_env = [{"name": "CORRAL_AGENT_TCP", "value": f"0.0.0.0:{settings.agent_port}"},
                     {"name": "CORRAL_AGENT_TOKEN_FILE", "value": f"{SECRET_DIR}/token"},
                     *({"name": k, "value": v} for k, v in env.items())]
    limits = spec.limits
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False, "enableServiceLinks": False, "restartPolicy": "Never",
        "dnsPolicy": "None", "dnsConfig": {"nameservers": ["127.0.0.1"]},
        "securityContext": {"runAsNonRoot": True, "runAsUser": SANDBOX_UID, "runAsGroup": SANDBOX_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "sandbox", "image": image, "command": AGENT_ARGV, "workingDir": "/.corral",
            "env": container_env, "ports": [{"containerPort": settings.agent_port, "protocol": "TCP"}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                "runAsNonRoot": True},
            "resources": {"limits": {"cpu": str(limits.cpus), "memory": str(limits.memory),
                                     "ephemeral-storage": str(limits.disk)}},
            "volumeMounts": [{"name": "corral", "mountPath": SECRET_DIR, "readOnly": True}]}],
        "volumes": [{"name": "corral", "secret": {"secretName": name, "defaultMode": 0o400}}]}
    if settings.runtime_class:
        pod_spec["runtimeClassName"] = settings.runtime_class
    if deadline_seconds is not None:
        pod_spec["activeDeadlineSeconds"] = deadline_seconds
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    pod_meta = meta()
    pod_meta["labels"]["corral.dev/sandbox-pod"] = name
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": pod_spec}
    return SandboxObjects(secret=secret, pod=pod, network_policy=policy)
