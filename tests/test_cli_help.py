"""`--help` works for every command of `corral`, found by walking the click tree the typer app builds.

A help text is shown as written: a bracket in one (`--pool TEMPLATE[/root][/runsc]=SIZE`) once made Rich read
it as a closing markup tag and `corral serve --help` end in a traceback. The walk loads every command the way
the root group does when one is run (`resolve_command`), so a command added later is covered without a list.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from corral.cli import app

CORRAL = Path(sys.executable).with_name("corral")


def _context(command: Any, name: str, parent: Any = None) -> Any:
    return command.context_class(command, info_name=name, parent=parent)


def _walk(command: Any, path: tuple[str, ...], ctx: Any) -> Iterator[tuple[str, ...]]:
    # Any: typer ships its own copy of click (typer._click), whose classes are not the `click` package's
    yield path
    if not hasattr(command, "list_commands"):  # a group
        return
    for name in command.list_commands(ctx):
        _, sub, _ = command.resolve_command(ctx, [name])  # loads a stand-in as running it would
        assert sub is not None, f"{' '.join((*path, name))} is listed but does not resolve"
        yield from _walk(sub, (*path, name), _context(sub, name, ctx))


def _paths() -> list[tuple[str, ...]]:
    root = typer.main.get_command(app)
    return list(_walk(root, (), _context(root, "corral")))


PATHS = _paths()


def _assert_help(path: tuple[str, ...], code: int, out: str) -> None:
    assert code == 0, out
    assert "Traceback" not in out, out
    assert f"Usage: {' '.join(('corral', *path))}" in out, out


def test_the_walk_finds_every_group_and_nested_command() -> None:
    # the walk must see nested commands, or every assertion below would pass on the top level alone
    assert ("serve",) in PATHS and ("version",) in PATHS
    assert ("sandbox", "create") in PATHS and ("secret", "put") in PATHS
    assert len(PATHS) > 40
    undo = {("sandbox", name) for name in ("checkpoint", "checkpoints", "restore", "changes", "delete-checkpoint")}
    assert undo <= set(PATHS), undo - set(PATHS)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "corral")
def test_help_of_every_command(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], prog_name="corral")
    _assert_help(path, result.exit_code, result.output)


def test_help_shows_brackets_as_written() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], prog_name="corral", env={"COLUMNS": "300"})
    _assert_help(("serve",), result.exit_code, result.output)
    assert "TEMPLATE[/root][/runsc]=SIZE" in result.output


@pytest.mark.parametrize("path", [p for p in PATHS if len(p) <= 1] + [("sandbox", "create")],
                         ids=lambda p: " ".join(p) or "corral")
def test_help_as_a_real_process(path: tuple[str, ...]) -> None:
    env = {**os.environ, "COLUMNS": "120"}
    done = subprocess.run([str(CORRAL), *path, "--help"], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    _assert_help(path, done.returncode, done.stdout + done.stderr)
