"""`corral eval`: run the task corpus against a sandbox service and report what failed and why (docs/eval.md).

```sh
corral eval run --local --sample 150 --seed 1        # a private server on this machine, a seeded sample
corral eval run --local --backend docker             # the same, its sandboxes in Docker containers
corral eval run --url URL --api-key ADMIN_KEY        # a deployment: a throwaway tenant is made and removed
corral eval run --adapter e2b --local                # E2B's SDK against a private Corral's E2B API
corral eval run --adapter e2b                        # E2B's cloud (E2B_API_KEY)
corral eval ls --category security                   # what the corpus holds
corral eval report results.jsonl --out report/       # Markdown, HTML and JSON
corral eval compare before.jsonl after.jsonl         # two runs side by side
```

`run` exits 1 when any task failed (skipped tasks, which the adapter cannot run, do not fail the run).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..eval import CAPABILITIES, CATEGORIES, MODES, RunResults, Task, TaskResult, load_corpus
from ..eval._corral import CorralAdapter
from ..eval._deployment import AdapterFactory, local_capabilities, local_server, run_on_corral
from ..eval._runner import run_tasks
from ..eval._select import select
from ._common import ApiKeyOption, JsonOption, UrlOption, config, print_json, print_table

eval_app = typer.Typer(help="The evaluation corpus: run it against a sandbox service, report, compare.",
                       no_args_is_help=True)
console = Console(stderr=True)

FamilyOption = Annotated[list[str], typer.Option("--family", "-f", help="Family (prefix), repeatable.")]
CategoryOption = Annotated[list[str], typer.Option("--category", help=f"One of {', '.join(CATEGORIES)}.")]
TagOption = Annotated[list[str], typer.Option("--tag", help="Tag, repeatable.")]
TaskOption = Annotated[list[str], typer.Option("--task", help="Task id (a trailing * matches a prefix).")]
SampleOption = Annotated[int | None, typer.Option("--sample", min=1, help="A seeded sample covering every family.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of the sample.")]


def _tasks(family: list[str], category: list[str], tag: list[str], task: list[str], sample: int | None,
           seed: int) -> list[Task]:
    unknown = [c for c in category if c not in CATEGORIES]
    if unknown:
        raise typer.BadParameter(f"unknown category {unknown[0]!r}; known: {', '.join(CATEGORIES)}")
    chosen = select(load_corpus(), families=family, categories=category, tags=tag, ids=task, sample=sample,
                    seed=seed)
    if not chosen:
        raise typer.BadParameter("no task matches these filters (see `corral eval ls`)")
    return chosen


@eval_app.command("run")
def run_command(
    family: FamilyOption = [],  # noqa: B006 - typer reads the default, never mutates it
    category: CategoryOption = [],  # noqa: B006
    tag: TagOption = [],  # noqa: B006
    task: TaskOption = [],  # noqa: B006
    sample: SampleOption = None,
    seed: SeedOption = 0,
    local: Annotated[bool, typer.Option(
        "--local", help="Start a private `corral serve` on this machine for the run (root; templates from "
                        "$CORRAL_HOME).")] = False,
    backend: Annotated[str, typer.Option(
        "--backend", help="With --local: where the private server runs sandboxes (`corral serve --backend`: "
                          "local or docker; docs/backends.md).")] = "local",
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
    as_tenant: Annotated[bool, typer.Option(
        "--as-tenant", help="The key is a developer key: run as its tenant (the loopback server's tasks are "
                            "skipped). Default: an admin key, and a throwaway tenant is made.")] = False,
    adapter: Annotated[str, typer.Option(help="corral (Corral's SDK), or e2b (E2B's SDK, `pip install "
                                              "e2b-code-interpreter`): with --local or --url, against Corral's "
                                              "E2B API; else E2B's cloud (E2B_API_KEY).")] = "corral",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Tasks at once.")] = 50,
    heavy_concurrency: Annotated[int | None, typer.Option(
        min=1, help="CPU-heavy tasks (ML, data, pip, compiles) at once, within -c (default: 2 per core).")
                                 ] = None,
    retries: Annotated[int, typer.Option(min=0, help="Further attempts at a failed task (default: none).")] = 0,
    without: Annotated[list[str], typer.Option(
        "--without", help=f"A capability the service lacks (skip its tasks): {', '.join(sorted(CAPABILITIES))}.")
                       ] = [],  # noqa: B006
    out: Annotated[Path | None, typer.Option(help="Results, one JSON line per task (default: "
                                                  "eval-results/<time>.jsonl).")] = None,
    report: Annotated[Path | None, typer.Option(help="Write report.md/.html/.json here (default: next to the "
                                                     "results).")] = None,
) -> None:
    """Run tasks of the corpus, N at a time, and report failures by mode."""
    tasks = _tasks(family, category, tag, task, sample, seed)
    bad = [w for w in without if w not in CAPABILITIES]
    if bad:
        raise typer.BadParameter(f"unknown capability {bad[0]!r}; known: {', '.join(sorted(CAPABILITIES))}")
    if backend != "local" and not local:
        raise typer.BadParameter("--backend chooses the backend of the private server: give --local too (a "
                                 "deployment runs whatever backend it was started with)", param_hint="--backend")
    _check_backend(backend)
    if adapter not in ("corral", "e2b"):
        raise typer.BadParameter(f"unknown adapter {adapter!r}: corral or e2b", param_hint="--adapter")
    e2b_cloud = adapter == "e2b" and not local and url is None
    if not local and not e2b_cloud:
        url, api_key = _deployment(url, api_key)
    out = out or Path("eval-results") / f"{time.strftime('%Y%m%d-%H%M%S')}-{adapter}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    filters = {"family": family, "category": category, "tag": tag, "task": task, "sample": sample, "seed": seed}
    header: dict[str, Any] = {"filters": filters}
    if adapter == "e2b":
        header["sdk"] = _e2b_sdk_versions()
    with open(out, "w", encoding="utf-8") as sink, _progress(len(tasks)) as tick, ExitStack() as stack:
        if e2b_cloud:
            from ..eval._e2b import CLOUD_CAPABILITIES, E2BAdapter

            e2b = E2BAdapter(api_key=api_key, capabilities=CLOUD_CAPABILITIES - set(without))
            run = asyncio.run(run_tasks(tasks, e2b, concurrency=concurrency, retries=retries, out=sink,
                                        progress=tick, header=header | {"target": "e2b-cloud"},
                                        heavy_concurrency=heavy_concurrency))
        else:
            caps, factory = _on_corral(adapter, local)
            if local:
                url, api_key = stack.enter_context(local_server(backend=backend))
                as_tenant = False
            run = asyncio.run(run_on_corral(
                tasks, base_url=url, admin_key=None if as_tenant else api_key,
                api_key=api_key if as_tenant else None, concurrency=concurrency, retries=retries,
                capabilities=caps - set(without), out=sink, progress=tick, header=header,
                heavy_concurrency=heavy_concurrency, adapter_type=factory))
    _summary(run, out)
    _write_report(run, report or out.with_suffix(""))
    if run.counts().get("fail"):
        raise typer.Exit(1)


def _on_corral(adapter: str, local: bool) -> tuple[frozenset[str], AdapterFactory]:
    """What the run may claim on a Corral server, and the adapter that drives it: Corral's own SDK, or E2B's SDK
    against the server's E2B API (everything that API offers, `CORRAL_CAPABILITIES`)."""
    caps = local_capabilities() if local else frozenset(CAPABILITIES)
    if adapter == "corral":
        return caps, CorralAdapter
    from ..eval._e2b import CORRAL_CAPABILITIES, E2BAdapter

    return caps & CORRAL_CAPABILITIES, E2BAdapter


def _e2b_sdk_versions() -> dict[str, str | None]:
    """The E2B SDKs' versions, for the run's header (None: not installed; the run then says how to install it)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in ("e2b", "e2b-code-interpreter"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


class _progress:
    """A progress bar on stderr counting passes and failures; the callable the runner calls per task."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.counts: Counter[str] = Counter()
        self.bar = Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[counts]}"), TimeElapsedColumn(), console=console)
        self.task = self.bar.add_task("eval", total=total, counts="")

    def __enter__(self) -> _progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def __call__(self, result: TaskResult) -> None:
        self.counts[result.status] += 1
        if result.status == "fail":
            first = result.failures[0] if result.failures else None
            self.bar.console.print(f"[red]FAIL[/red] {result.id}: {result.mode}: "
                                   f"{first.detail[:160] if first else ''}", markup=True, highlight=False)
        text = " ".join(f"{k} {self.counts[k]}" for k in ("pass", "fail", "skip") if self.counts[k])
        self.bar.update(self.task, advance=1, counts=text)


def _check_backend(name: str) -> None:
    from ..backends import BACKEND_NAMES  # as `corral serve` does: the backends' package loads only when asked

    if name not in BACKEND_NAMES:
        raise typer.BadParameter(f"choose one of {', '.join(BACKEND_NAMES)}", param_hint="--backend")


def _deployment(url: str | None, api_key: str | None) -> tuple[str, str]:
    """Where to run and with which key: the options, else `$CORRAL_URL` and `$CORRAL_API_KEY`, as every command."""
    connection = config(url, api_key)
    if connection.api_key is None:
        raise typer.BadParameter("give an API key with --api-key or $CORRAL_API_KEY: an admin key (a throwaway "
                                 "tenant is made), or with --as-tenant a developer key", param_hint="'--api-key'")
    return connection.base_url, connection.api_key


def _summary(run: RunResults, out: Path) -> None:
    counts = run.counts()
    ran = counts.get("pass", 0) + counts.get("fail", 0)
    wall = (run.end or {}).get("wall_seconds")
    console.print(f"{len(run.results)} tasks: {counts.get('pass', 0)} passed, {counts.get('fail', 0)} failed, "
                  f"{counts.get('skip', 0)} skipped; pass rate {run.pass_rate():.1%} of {ran} run"
                  + (f"; {wall:.0f} s" if wall is not None else ""), highlight=False)
    modes = Counter(r.mode for r in run.results if r.mode)
    for name, n in sorted(modes.items(), key=lambda kv: (-kv[1], kv[0])):
        console.print(f"  {n:4d}  {name}: {MODES[name].title if name in MODES else ''}", highlight=False)
    console.print(f"results: {out}", highlight=False)


def _write_report(run: RunResults, where: Path) -> None:
    from ..eval._report import write_report

    paths = write_report(run, where)
    console.print("report: " + ", ".join(str(p) for p in paths), highlight=False)


@eval_app.command("ls")
def ls_command(
    family: FamilyOption = [],  # noqa: B006
    category: CategoryOption = [],  # noqa: B006
    tag: TagOption = [],  # noqa: B006
    task: TaskOption = [],  # noqa: B006
    sample: SampleOption = None,
    seed: SeedOption = 0,
    tasks_too: Annotated[bool, typer.Option("--tasks", help="One line per task instead of per family.")] = False,
    as_json: JsonOption = False,
) -> None:
    """What the corpus holds: families with their task counts (or every task)."""
    chosen = _tasks(family, category, tag, task, sample, seed)
    if as_json:
        print_json([_task_json(t) for t in chosen])
        return
    if tasks_too:
        table = Table("id", "category", "severity", "title")
        for t in chosen:
            table.add_row(t.id, t.category, t.severity, t.title)
    else:
        table = Table("family", "category", "tasks", "needs")
        families: dict[str, list[Task]] = {}
        for t in chosen:
            families.setdefault(t.family, []).append(t)
        for name, group in families.items():
            needs = sorted(set().union(*(t.needs() for t in group)))
            table.add_row(name, group[0].category, str(len(group)), ", ".join(needs))
        table.add_section()
        table.add_row(f"{len(families)} families", "", str(len(chosen)), "")
    print_table(table)


def _task_json(t: Task) -> dict[str, Any]:
    return {"id": t.id, "family": t.family, "category": t.category, "severity": t.severity, "title": t.title,
            "tags": list(t.tags), "needs": sorted(t.needs()), "checklist": list(t.checklist),
            "steps": [s.kind for s in t.steps], "budget": t.budget}


@eval_app.command("report")
def report_command(
    results: Annotated[Path, typer.Argument(help="A results file of `corral eval run`.")],
    out: Annotated[Path | None, typer.Option(help="Directory for report.md/.html/.json.")] = None,
) -> None:
    """Markdown, HTML (charts included, one self-contained page) and JSON reports of a run."""
    _write_report(_load(results), out or results.with_suffix(""))


@eval_app.command("compare")
def compare_command(
    before: Annotated[Path, typer.Argument(help="The first run (e.g. before, or Corral).")],
    after: Annotated[Path, typer.Argument(help="The second run (e.g. after, or another adapter).")],
    out: Annotated[Path | None, typer.Option(help="Directory for comparison.md/.html/.json.")] = None,
) -> None:
    """Two runs side by side: pass rates, failure modes, tasks that flipped, latency ratios."""
    from ..eval._report import write_comparison

    paths = write_comparison(_load(before), _load(after), out or Path(f"compare-{before.stem}-{after.stem}"))
    console.print("comparison: " + ", ".join(str(p) for p in paths), highlight=False)


@eval_app.command("modes")
def modes_command(as_json: JsonOption = False) -> None:
    """The failure taxonomy: every mode with its severity and what the user would have seen."""
    if as_json:
        print_json([{"name": m.name, "severity": m.severity, "title": m.title, "seen": m.seen}
                    for m in MODES.values()])
        return
    table = Table("mode", "severity", "what the user saw")
    for m in MODES.values():
        table.add_row(m.name, m.severity, m.seen)
    print_table(table)


def _load(path: Path) -> RunResults:
    try:
        return RunResults.load(path)
    except (ValueError, json.JSONDecodeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
