"""The client stands alone: `import corral` and the CLI's client commands load no server code, and a command that
needs an extra which is not installed says which in one line. Each check runs a fresh interpreter, so that what
other tests imported cannot hide an import."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from corral.cli import app
from corral.cli._app import _COMMANDS, _EXTRA_OF_MODULE, _Command, missing_extra

ROOT = Path(__file__).resolve().parent.parent
# What only the server side may import: Corral's own server-side packages and the server extra's dependencies.
SERVER_SIDE = ("corral.server", "corral.engine", "corral.templates", "corral.control", "corral.egress",
               "corral.backends", "corral.agent", "corral.eval", "corral.check", "fastapi", "starlette", "uvicorn",
               "sqlalchemy", "aiosqlite", "asyncpg", "docker")


def _loaded_after(code: str, *, before: str = "") -> list[str]:
    """The modules a fresh interpreter has loaded after running `before` and then `code` (those of `before`
    left out)."""
    script = (f"import sys, json\n{before}\nfirst = set(sys.modules)\n{code}\n"
              "print(json.dumps(sorted(set(sys.modules) - first)))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_import_corral_loads_only_the_client() -> None:
    loaded = _loaded_after("import corral\ncorral.Sandbox, corral.AsyncSandbox, corral.Admin, corral.AsyncAdmin",
                           before="import httpx")  # httpx (and what it brings) is the SDK's one dependency
    assert not [m for m in loaded if _within(m, SERVER_SIDE)]
    # Not even lazily-needed pieces: websockets comes with the first terminal, asyncio with the first coroutine.
    forbidden = ("fcntl", "ctypes", "pydantic", "websockets", "asyncio", "subprocess")
    assert not [m for m in loaded if _within(m, forbidden)]
    third_party = {m.partition(".")[0] for m in loaded} - set(sys.stdlib_module_names)
    assert third_party == {"corral"}
    ours = {m for m in loaded if m.startswith("corral")}
    assert ours <= {"corral", "corral._exceptions", "corral._output", "corral._settings"} | {
        m for m in ours if m.startswith("corral._sdk")}


def test_import_corral_without_any_server_package() -> None:
    blocked = ("pydantic", "fastapi", "starlette", "uvicorn", "sqlalchemy", "aiosqlite", "asyncpg", "fcntl",
               "ctypes")
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)  # `import x` then fails
    _loaded_after("import corral\ncorral.Sandbox.create, corral.Admin", before=block)


@pytest.mark.slow  # fresh interpreters, seconds each
@pytest.mark.parametrize("argv", [["exec", "--help"], ["sandbox", "ls", "--help"], ["run-code", "--help"],
                                  ["cp", "--help"], ["--help"]])
def test_cli_client_commands_load_no_server_code(argv: list[str]) -> None:
    run = ("from corral.cli import app\nimport typer.main\n"
           f"try:\n    typer.main.get_command(app).main({argv!r}, prog_name='corral', standalone_mode=False)\n"
           "except SystemExit:\n    pass\n")
    loaded = _loaded_after(run)
    assert not [m for m in loaded if _within(m, (*SERVER_SIDE, "ctypes"))]
    assert "corral.cli._templates" not in loaded and "corral.cli._bench" not in loaded


@pytest.mark.slow  # fresh interpreters, seconds each
def test_corral_mcp_is_a_client_too() -> None:
    """The stdio relay loads the `mcp` SDK (which brings starlette and uvicorn along) and none of Corral's server
    side: the tools run on the server it relays to."""
    run = ("from corral.cli import app\nimport typer.main\n"
           "try:\n    typer.main.get_command(app).main(['mcp', '--help'], prog_name='corral', standalone_mode=False)\n"
           "except SystemExit:\n    pass\n")
    loaded = _loaded_after(run)
    assert "corral.cli._mcp" in loaded and "mcp.server.stdio" in loaded
    ours = [p for p in SERVER_SIDE if p.startswith("corral.")]
    server_side = (*ours, "corral.service", "corral.mcp", "fastapi", "sqlalchemy", "aiosqlite", "asyncpg")
    assert not [m for m in loaded if _within(m, server_side)]


def test_corral_mcp_without_the_mcp_extra_says_which_to_install() -> None:
    proc = _corral(["mcp"], missing=("mcp",))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == ("error: `corral mcp` needs the mcp extra (module 'mcp' is not installed): "
                                   "install corral[mcp] (pip install 'corral[mcp]')")


def _corral(argv: list[str], *, missing: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """`corral ARGV` in a fresh interpreter where the modules `missing` cannot be imported."""
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in missing)
    script = f"import sys\n{block}sys.argv = ['corral', *{argv!r}]\nfrom corral.cli import main\nmain()\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)


# pydantic is not among them: typer itself requires it, so the client always has it.
SERVER_EXTRA = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "aiosqlite", "asyncpg")


@pytest.mark.slow  # fresh interpreters, seconds each
@pytest.mark.parametrize("missing", SERVER_EXTRA[:3])
def test_a_missing_server_extra_is_one_clear_line(missing: str) -> None:
    proc = _corral(["serve", "--port", "1"], missing=(missing,))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: `corral serve` needs the server extra")
    assert f"module {missing!r} is not installed" in lines[0] and "install corral[server]" in lines[0]


class _Unimportable(_Command):
    def load(self, name: str) -> Any:
        raise ModuleNotFoundError("import of fastapi halted; None in sys.modules", name="fastapi")


def test_a_command_whose_module_needs_an_extra_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_COMMANDS, "templates", _Unimportable("_templates", "templates_app", "Templates."))
    result = CliRunner().invoke(app, ["templates", "ls"])
    assert result.exit_code == 1
    assert result.stderr.strip() == ("error: `corral templates` needs the server extra (module 'fastapi' is not "
                                     "installed): install corral[server] (pip install 'corral[server]')")


@pytest.mark.slow  # fresh interpreters, seconds each
def test_client_commands_run_without_the_server_extra() -> None:
    for argv in (["exec", "--help"], ["sandbox", "ls", "--help"], ["run-code", "--help"], ["version"]):
        proc = _corral(argv, missing=SERVER_EXTRA)
        assert proc.returncode == 0, proc.stderr


def test_other_missing_modules_are_not_blamed_on_an_extra() -> None:
    assert missing_extra(ModuleNotFoundError("no", name="nosuchthing"), "exec") is None
    line = missing_extra(ModuleNotFoundError("no", name="docker.errors"), "serve")
    assert line is not None and "install corral[docker]" in line and "'docker'" in line


def _import_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None
    return name.group(0).lower().replace("-", "_")


def test_the_extras_table_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    assert {"server", "eval", "docker"} <= set(extras)
    for extra, requirements in extras.items():
        for requirement in requirements:
            if requirement.startswith("corral["):  # an extra made of others (eval = the server's)
                continue
            assert _EXTRA_OF_MODULE.get(_import_name(requirement)) == extra, requirement
    client = {_import_name(r) for r in project["dependencies"]}
    assert client <= {"httpx", "typer", "rich", "websockets", "h11", "idna"}  # no server package by default
    assert not client & set(_EXTRA_OF_MODULE) - {"h11", "idna"}


def test_install_script_installs_every_extra() -> None:
    script = (ROOT / "scripts" / "install").read_text()
    assert "uv sync --frozen --all-extras" in script


def test_stand_ins_show_the_help_of_their_commands() -> None:
    for name, command in _COMMANDS.items():
        loaded = command.load(name)
        first = (loaded.help or "").split("\n\n")[0]
        assert " ".join(first.split()) == command.help, name
