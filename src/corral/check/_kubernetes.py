"""Item 44: on the Kubernetes backend, a sandbox's Pod is locked down: a RuntimeClass, Pod Security `restricted`'s
rules (non-root, no privilege escalation, every capability dropped, a seccomp profile), no service-account token,
and a NetworkPolicy whose only way out is Corral's egress proxy.

A sandbox of the check's tenant is started, and from inside it no service-account token is mounted. Then:

* **With the cluster** (`Target.kube_namespace`: `corral check --backend kubernetes` sets it, the check then runs
  beside its own server with the same kubeconfig): its Pod and the NetworkPolicy that selects it are read from the
  API server and checked as they are, with the backend's own `hardening_problems`.
* **Without** (a `--url` deployment elsewhere): the objects this build of Corral creates for a sandbox, with the
  backend's default settings (`sandbox_objects`, as `corral k8s sandbox-manifest` prints them), pass the same
  checks; the RuntimeClass is proved live only by gVisor's kernel inside the sandbox (item 31's detection), and a
  sandbox that does not run on gVisor fails the item, its Pod's runtime being unknown from here.

The namespace's own Pod Security admission label is `corral k8s manifests`' and is not read; its rules are checked
on the Pod itself. Other backends: N/A, saying which runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..backends import SandboxSpec
from ..backends.kubernetes import ClusterSettings, hardening_problems, sandbox_objects
from ..backends.kubernetes._objects import CORRAL_LABELS, POD_LABEL
from ._backend import on_gvisor, sandbox_kernel
from ._context import CheckContext, clip, run_ok
from ._model import ItemFailed, NotApplicable

__all__ = ["egress_problems", "item_44_pods_locked_down", "pod_problems"]

_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount"  # noqa: S105 (a path, not a password)
_NO_TOKEN = f"if test -e {_TOKEN}; then ls {_TOKEN}; exit 0; fi; echo none"
_SANDBOX_LABEL = "corral.dev/sandbox"
_MANAGED = f"app.kubernetes.io/managed-by={CORRAL_LABELS['app.kubernetes.io/managed-by']}"  # every object of Corral's


async def item_44_pods_locked_down(ctx: CheckContext) -> str:
    if ctx.deployment.backend != "kubernetes":
        raise NotApplicable(f"Kubernetes Pods: the server runs the {ctx.deployment.backend} backend")
    async with ctx.sandbox() as sb:
        mounted = (await run_ok(sb, _NO_TOKEN, what="a look for a service-account token", cwd="/")).stdout.strip()
        log, _ = await sandbox_kernel(sb)
        if ctx.target.kube_namespace is not None:
            namespace = ctx.target.kube_namespace
            pod, policies = await _live_objects(namespace, sb.id)
            where = f"its Pod {pod.get('metadata', {}).get('name')} in {namespace}, read from the cluster"
        else:
            pod, policies = _built_objects(ctx.target.template)
            where = ("the Pod and NetworkPolicy this build creates with the default settings (the cluster is not "
                     "reachable from here: `corral check --backend kubernetes` reads the live ones)")
    problems = [] if mounted == "none" else [f"a service-account token is mounted in the sandbox ({_TOKEN}: "
                                             f"{clip(mounted, 80)})"]
    problems += pod_problems(pod) + egress_problems(pod, policies)
    if ctx.target.kube_namespace is None and not on_gvisor(log):
        problems.append(f"the sandbox does not run on gVisor (its kernel log begins {clip(log, 80)!r}) and its "
                        "Pod's RuntimeClass cannot be read from here")
    if problems:
        raise ItemFailed(f"a sandbox Pod is not locked down ({where}): {'; '.join(problems)}")
    runtime = pod.get("spec", {}).get("runtimeClassName")
    kernel = "; the sandbox runs on gVisor" if on_gvisor(log) else ""
    return (f"RuntimeClass {runtime}, Pod Security restricted's rules, no service-account token (none inside "
            f"either), egress only to the proxy: {where}{kernel}")


def pod_problems(pod: Mapping[str, Any]) -> list[str]:
    """What of the lockdown the Pod lacks: the backend's own hardening list, and a RuntimeClass of any name."""
    problems = hardening_problems(pod, runtime_class=None, deadline=False)
    if not (pod.get("spec") or {}).get("runtimeClassName"):
        problems.insert(0, "spec.runtimeClassName is not set (the node's default runtime shares its kernel)")
    return problems


def egress_problems(pod: Mapping[str, Any], policies: list[Mapping[str, Any]]) -> list[str]:
    """What lets the Pod out other than to the egress proxy: its NetworkPolicy (the one selecting it by
    `corral.dev/pod`) must restrict egress to the proxy's Pods on one TCP port, with no address block."""
    own = (pod.get("metadata") or {}).get("labels", {}).get(POD_LABEL)
    mine = [p for p in policies if own and ((p.get("spec") or {}).get("podSelector") or {}).get(
        "matchLabels", {}).get(POD_LABEL) == own]
    if not mine:
        return [f"no NetworkPolicy selects the Pod (by {POD_LABEL}={own}): its egress is unrestricted"]
    proxy = dict(ClusterSettings().egress_labels)
    problems = []
    for policy in mine:
        name, spec = (policy.get("metadata") or {}).get("name"), policy.get("spec") or {}
        if "Egress" not in (spec.get("policyTypes") or []):
            problems.append(f"NetworkPolicy {name} does not restrict egress (policyTypes {spec.get('policyTypes')})")
        for i, rule in enumerate(spec.get("egress") or []):
            peers, ports = rule.get("to") or [], rule.get("ports") or []
            if not peers or any("ipBlock" in p or (p.get("podSelector") or {}).get("matchLabels") != proxy
                                for p in peers):
                problems.append(f"NetworkPolicy {name} egress[{i}] reaches more than the egress proxy's Pods "
                                f"({proxy}): {rule.get('to')}")
            if len(ports) != 1 or ports[0].get("protocol", "TCP") != "TCP":
                problems.append(f"NetworkPolicy {name} egress[{i}] allows ports {ports or 'all'}, not the proxy's "
                                "one TCP port")
    return problems


async def _live_objects(namespace: str, sandbox_id: str) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
    from ..backends.kubernetes._api import KubeAPI  # the Kubernetes client: corral[kubernetes], only when asked

    api = KubeAPI(namespace)
    try:
        pods = await api.list_objects("Pod", f"{_SANDBOX_LABEL}={sandbox_id}")
        policies = await api.list_objects("NetworkPolicy", _MANAGED)
    finally:
        await api.close()
    if len(pods) != 1:
        raise ItemFailed(f"{len(pods)} Pods of namespace {namespace} are labelled {_SANDBOX_LABEL}={sandbox_id}, "
                         "the check's sandbox (one expected): is the server's namespace another?")
    return pods[0], list(policies)


def _built_objects(template: str) -> tuple[dict[str, Any], list[Mapping[str, Any]]]:
    objects = sandbox_objects("corral-check-example", SandboxSpec(template=template), image=f"registry.invalid/"
                              f"corral/{template}:latest", settings=ClusterSettings(), labels={},
                              secrets={"token": "corral-check"}, env={}, deadline_seconds=300)
    return objects.pod, [objects.network_policy]
