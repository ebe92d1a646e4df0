"""A `CheckReport` for people (a rich table and a summary line) and for programs (one JSON document)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._model import CheckReport, ItemResult

__all__ = ["print_report", "report_json", "report_table"]

_STYLE = {"PASS": "green", "FAIL": "bold red", "N/A": "yellow"}
_PASS_DETAIL_MAX = 200


def report_json(report: CheckReport) -> str:
    return json.dumps(report.to_json(), ensure_ascii=False)


def _cell(item: ItemResult) -> Text:
    """What went wrong and how to fix it for a failure; the reason for N/A; briefly what was seen for a pass."""
    if item.status == "FAIL":
        text = Text(item.detail)
        text.append("\nfix: ", style="bold")
        text.append(item.fix)
        return text
    if item.status == "N/A":
        return Text(item.detail)
    detail = item.detail if len(item.detail) <= _PASS_DETAIL_MAX else item.detail[:_PASS_DETAIL_MAX] + "..."
    return Text(detail, style="dim")


def report_table(report: CheckReport) -> Table:
    table = Table("#", "property", "status", "what was found", title=f"corral check: {report.url}",
                  show_lines=True)
    for item in report.items:
        table.add_row(str(item.number), item.title, Text(item.status, style=_STYLE[item.status]), _cell(item))
    return table


def summary(report: CheckReport) -> Text:
    counts = report.counts()
    on = f" on the {report.backend} backend" if report.backend else ""
    line = Text(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['N/A']} not applicable{on} "
                f"in {report.seconds:.0f} s", style="bold red" if counts["FAIL"] else "bold green")
    for note in report.notes:
        line.append(f"\nnot proved by any item: {note}", style="yellow")
    for problem in report.cleanup_problems:
        line.append(f"\nclean-up failed: {problem}", style="bold red")
    return line


def print_report(report: CheckReport, console: Console | None = None) -> None:
    """The table and a summary; in a pipe, never cut a cell (rich would assume 80 columns and elide)."""
    console = console or Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200), file=console.file)
    console.print(report_table(report))
    console.print(summary(report))
