"""`corral check`: run the sandbox checklist against a running deployment (`--url` and an admin's key), or against
a private server on a backend (`--backend`) that the command starts, checks, stops and empties.

Exit status: 0 nothing failed, 1 an item failed (or the clean-up left something), 2 a usage error, 3 SKIPPED (the
checklist did not run: `--backend kubernetes` and no cluster answers).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .._sdk import ConnectionConfig
from ..check import (
    CLUSTER_TIMEOUT,
    ITEMS,
    SKIPPED,
    CheckOptions,
    Target,
    cluster_missing,
    print_report,
    private_target,
    report_json,
    run_check,
)
from ._common import ApiKeyOption, JsonOption, UrlOption, note

HomeOption = Annotated[Path | None, typer.Option(
    "--home", help="The server's state directory (its CORRAL_HOME), when it runs on this machine: enables the "
                   "host-side probes (agent socket, server memory, fail closed).", show_default=False)]


def _numbers(items: Iterable[int]) -> str:
    """`1-44`: the checklist's item numbers, runs collapsed."""
    runs: list[list[int]] = []
    for n in sorted(items):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


ItemOption = Annotated[list[int], typer.Option("--item", "-i", help=f"Only this item ({_numbers(ITEMS)}), "
                                                                    "repeatable.")]
BackendOption = Annotated[str | None, typer.Option(
    "--backend", help="Check a private `corral serve --backend NAME` (local, docker or kubernetes) that this command "
                      "starts on this machine (temporary state, its own admin key, templates from $CORRAL_HOME), "
                      "stops and empties, instead of a running deployment. kubernetes: the cluster of KUBECONFIG "
                      f"(or this Pod's); exit {SKIPPED} (SKIPPED) if none answers within {CLUSTER_TIMEOUT:g} s.",
    show_default=False)]
NamespaceOption = Annotated[str | None, typer.Option(
    "--namespace", help="With --backend kubernetes: the namespace of the sandbox Pods (default "
                        "$CORRAL_K8S_NAMESPACE, else corral-sandboxes).", show_default=False)]


class _Bar:
    """A progress bar on stderr (only on a terminal), one step per task or item function."""

    def __init__(self) -> None:
        console = Console(stderr=True)
        self.bar = Progress(TextColumn("check"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)
        self.task = self.bar.add_task("", total=None)

    def start(self, total: int) -> None:
        self.bar.update(self.task, total=total)

    def advance(self, label: str, status: str) -> None:
        self.bar.update(self.task, advance=1, description=f"{label}: {status}")

    def __enter__(self) -> _Bar:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def check_command(
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
    home: HomeOption = None,
    backend: BackendOption = None,
    namespace: NamespaceOption = None,
    template: Annotated[str, typer.Option(help="The template the probes' sandboxes use.")] = "default",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="In-sandbox tasks at once.")] = 8,
    item: ItemOption = [],  # noqa: B006 - typer reads the default, never mutates it
    as_json: JsonOption = False,
) -> None:
    """Prove the sandbox checklist (items 1-44) against a running deployment, or a private server on
    --backend; exit 1 if any item fails, 3 if it was skipped.

    Needs an admin's key for a deployment: the check runs in throwaway tenants (`corral-check-<hex>`) that are
    disabled, emptied and stripped of their keys at the end. With `--backend` it makes its own.

    Exit status: 0 nothing failed; 1 an item failed; 2 a usage error; 3 SKIPPED, nothing ran (`--backend
    kubernetes` and no Kubernetes cluster answers: the line says why). A skip never reports anything as passed.
    """
    unknown = [n for n in item if n not in ITEMS]
    if unknown:
        raise typer.BadParameter(f"no checklist item {unknown[0]}: items are {_numbers(ITEMS)}", param_hint="--item")
    options = CheckOptions(concurrency=concurrency, items=frozenset(item) if item else None)
    if backend is None:
        _check_deployment(_deployment(url, api_key, home, namespace, template), options, as_json)
    else:
        _check_private(_private_backend(backend, url, api_key, home, namespace), namespace, template, options,
                       as_json)


def _deployment(url: str | None, api_key: str | None, home: Path | None, namespace: str | None,
                template: str) -> Target:
    """The running deployment at `--url` (else $CORRAL_URL) as a `Target`, or a usage error saying what is wrong."""
    if namespace is not None:
        raise typer.BadParameter("--namespace applies to --backend kubernetes: a running deployment's namespace is "
                                 "its own", param_hint="--namespace")
    if home is not None and not (home / "engine").is_dir():
        raise typer.BadParameter(f"{home} is not a Corral state directory (no engine/ in it)",
                                 param_hint="--home")
    config = ConnectionConfig.resolve(api_key=api_key, base_url=url)
    if not config.api_key:
        raise typer.BadParameter("an admin's API key is needed: set CORRAL_API_KEY or pass --api-key",
                                 param_hint="--api-key")
    return Target(url=config.base_url, admin_key=config.api_key, home=home, template=template)


def _private_backend(backend: str, url: str | None, api_key: str | None, home: Path | None,
                     namespace: str | None) -> str:
    """`backend` if it names one and nothing given belongs to a running deployment instead; else a usage error."""
    from ..backends import BACKEND_NAMES  # as `corral serve` does: the backends' package loads only when asked

    for option, given in (("--url", url), ("--api-key", api_key), ("--home", home)):
        if given is not None:
            raise typer.BadParameter(f"{option} names a running deployment and --backend starts a private one: "
                                     "give one of them", param_hint=option)
    if backend not in BACKEND_NAMES:
        raise typer.BadParameter(f"choose one of {', '.join(BACKEND_NAMES)}", param_hint="--backend")
    if namespace is not None and backend != "kubernetes":
        raise typer.BadParameter("--namespace applies to --backend kubernetes", param_hint="--namespace")
    return backend


def _check_private(backend: str, namespace: str | None, template: str, options: CheckOptions,
                   as_json: bool) -> None:
    """Skip, saying why, when the backend's platform is not there; else check a private server on it."""
    if backend == "kubernetes" and (reason := cluster_missing()) is not None:
        _skipped(backend, reason, as_json)
    note(f"check: starting a private `corral serve --backend {backend}` on this machine")
    with private_target(backend, namespace=namespace, template=template) as target:
        _check_deployment(target, options, as_json)


def _skipped(backend: str, reason: str, as_json: bool) -> NoReturn:
    """The one line (or JSON document) of a check that did not run, and its own exit status."""
    if as_json:
        typer.echo(json.dumps({"ok": False, "skipped": True, "backend": backend, "reason": reason}))
    else:
        typer.echo(f"SKIPPED: the checklist did not run on the {backend} backend: {reason}")
    raise typer.Exit(SKIPPED)


def _check_deployment(target: Target, options: CheckOptions, as_json: bool) -> None:
    with _Bar() as bar:
        report = asyncio.run(run_check(target, options, progress=bar))
    if as_json:
        typer.echo(report_json(report))
    else:
        print_report(report)
    raise typer.Exit(report.exit_code)
