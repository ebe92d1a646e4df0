"""`corral k8s manifests|sandbox-manifest`: the Kubernetes objects Corral uses, printed as YAML (docs/kubernetes.md).

Both commands only render (no cluster, no client library): `manifests` the reference deployment (or, with
`--write DIR`, the Kustomize base in `deploy/kubernetes/`), `sandbox-manifest` what the backend creates for one
sandbox. Bad input is a usage error (exit 2) that names the option, with nothing on stdout.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NoReturn

import typer

from .._exceptions import InvalidRequestError
from ..backends._spec import Limits, SandboxSpec
from ..backends.kubernetes import (
    DEFAULT_IMAGE,
    ClusterSettings,
    dump_all,
    reference_files,
    sandbox_objects,
    write_kustomization,
)
from ._common import note

k8s_app = typer.Typer(help="Kubernetes: print the reference deployment, or what the backend creates for one "
                           "sandbox, as YAML.", no_args_is_help=True)

# Stands in for the per-sandbox token `corral serve` derives (an HMAC of the sandbox and its Pod): never a secret.
PLACEHOLDER_TOKEN = "PLACEHOLDER-agent-token-set-by-corral-serve"  # noqa: S105


def _bad(exc: Exception, option: str) -> NoReturn:
    message = exc.message if isinstance(exc, InvalidRequestError) else _problems(exc)
    raise typer.BadParameter(message, param_hint=option) from None


def _problems(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)  # pydantic's ValidationError: its problems in one line
    if callable(errors):
        return "; ".join(str(e.get("msg", e)).removeprefix("Value error, ") for e in errors())
    return str(exc)


@k8s_app.command("manifests")
def manifests(
    namespace: str = typer.Option("corral", "--namespace", help="The control plane's namespace (server, egress "
                                  "proxy)."),
    sandbox_namespace: str = typer.Option("corral-sandboxes", "--sandbox-namespace", help="The sandboxes' "
                                          "namespace."),
    image: str = typer.Option(DEFAULT_IMAGE, "--image", help="The Corral image the server and egress proxy run."),
    runtime_class: str = typer.Option("gvisor", "--runtime-class", help="The RuntimeClass sandbox Pods must use."),
    write: Path | None = typer.Option(None, "--write", help="Write the Kustomize base (one file per group and "
                                      "kustomization.yaml) into this directory instead of printing.",
                                      file_okay=False),
) -> None:
    """Print the reference deployment as multi-document YAML (`kubectl apply -f -`)."""
    try:
        files = reference_files(namespace, sandbox_namespace, image, runtime_class=runtime_class)
    except InvalidRequestError as exc:
        _bad(exc, "--namespace/--sandbox-namespace/--image/--runtime-class")
    if write is not None:
        for path in write_kustomization(write, files):
            note(f"wrote {path}")
        return
    typer.echo(dump_all(obj for objects in files.values() for obj in objects), nl=False)


@k8s_app.command("sandbox-manifest")
def sandbox_manifest(
    template: str = typer.Option(..., "--template", help="The sandbox's template."),
    memory: str = typer.Option(..., "--memory", help="Memory limit, e.g. 512M."),
    network: str = typer.Option(..., "--network", help="Egress policy: none, internet, or domains separated by "
                                "commas (wildcards allowed)."),
    cpus: float = typer.Option(1.0, "--cpus", help="CPU limit."),
    disk: str = typer.Option("1G", "--disk", help="Disk (ephemeral storage) limit."),
    timeout: float = typer.Option(300.0, "--timeout", help="The sandbox's TTL in seconds (the Pod's deadline)."),
    image: str | None = typer.Option(None, "--image", help="The template's image (default: a placeholder; "
                                     "`corral templates push` publishes the real one)."),
    name: str = typer.Option("sandbox-example", "--name", help="The Pod's (and its Secret's, NetworkPolicy's) "
                             "name."),
    namespace: str = typer.Option("corral-sandboxes", "--namespace", help="The sandboxes' namespace."),
    control_namespace: str = typer.Option("corral", "--control-namespace", help="The control plane's namespace."),
    runtime_class: str = typer.Option("gvisor", "--runtime-class", help="RuntimeClass of the Pod ('none': the "
                                      "cluster's default)."),
    user_namespace: bool = typer.Option(False, "--user-namespace", help="The Pod in a user namespace of its own "
                                        "(hostUsers: false; CORRAL_K8S_USER_NAMESPACE=1 for the backend)."),
) -> None:
    """Print the Secret, NetworkPolicy and Pod the Kubernetes backend would create for one sandbox."""
    spec = _spec(template, memory=memory, network=network, cpus=cpus, disk=disk, timeout=timeout)
    try:
        settings = ClusterSettings(namespace=namespace, control_namespace=control_namespace,
                                   runtime_class=None if runtime_class == "none" else runtime_class,
                                   user_namespace=user_namespace)
    except InvalidRequestError as exc:
        _bad(exc, "--namespace/--control-namespace/--runtime-class")
    try:
        objects = sandbox_objects(name, spec, image=image or f"registry.invalid/corral/{template}:latest",
                                  settings=settings, labels={"corral.dev/sandbox": name},
                                  secrets={"token": PLACEHOLDER_TOKEN}, env={},
                                  deadline_seconds=math.ceil(timeout))
    except InvalidRequestError as exc:
        _bad(exc, "--name/--image/--template")
    typer.echo(dump_all(objects.all()), nl=False)


def _spec(template: str, *, memory: str, network: str, cpus: float, disk: str, timeout: float) -> SandboxSpec:
    try:
        limits = Limits.model_validate({"memory": memory, "cpus": cpus, "disk": disk})
    except ValueError as exc:  # pydantic's ValidationError is one
        _bad(exc, "--memory/--cpus/--disk")
    policy: str | tuple[str, ...] = network
    if network not in ("none", "internet"):
        policy = tuple(part.strip() for part in network.split(",") if part.strip())
    try:
        return SandboxSpec(template=template, limits=limits, network=policy, timeout=timeout)
    except ValueError as exc:
        _bad(exc, "--network/--timeout/--template")
