"""E2B's `code-interpreter-v1` means `polyglot` where that template is built, `default` otherwise, and the serve
command says which (issue 25, item 2); an operator's `--e2b-alias` still wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from corral import server
from corral.cli import app
from corral.e2b import E2BConfig, interpreter_alias
from corral.templates import TemplateStore

INSTALLED = Path("/var/lib/corral")


def test_interpreter_is_polyglot_where_it_is_built() -> None:
    aliases, line = interpreter_alias({}, lambda name: name in {"default", "polyglot"})
    assert E2BConfig(aliases=aliases).template("code-interpreter-v1") == "polyglot"
    assert E2BConfig(aliases=aliases).template("base") == "default"
    assert "'polyglot'" in line and "built" in line


def test_interpreter_is_default_without_polyglot() -> None:
    aliases, line = interpreter_alias({}, lambda name: name == "default")
    assert E2BConfig(aliases=aliases).template("code-interpreter-v1") == "default"
    assert "'default'" in line and "'polyglot' is not built" in line


def test_an_operators_alias_wins() -> None:
    aliases, line = interpreter_alias({"code-interpreter-v1": "default", "mine": "x"}, lambda name: True)
    assert aliases["code-interpreter-v1"] == "default" and aliases["mine"] == "x"
    assert "--e2b-alias" in line


def _served_config(monkeypatch: pytest.MonkeyPatch, home: Path, *args: str) -> tuple[E2BConfig, str]:
    """What `corral serve` hands the server for E2B, and what it printed (the server itself is not started)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(server, "serve", lambda *a, **kw: seen.update(kw))
    monkeypatch.setenv("CORRAL_HOME", str(home))
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 0, result.output
    return seen["e2b"], result.output


def test_serve_aliases_polyglot_when_the_store_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    if not TemplateStore(INSTALLED).exists("polyglot"):
        pytest.skip("the install has not built polyglot")
    config, output = _served_config(monkeypatch, INSTALLED)
    assert config.template("code-interpreter-v1") == "polyglot"
    assert "code-interpreter-v1 is template 'polyglot'" in output


def test_serve_aliases_default_when_polyglot_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config, output = _served_config(monkeypatch, tmp_path)
    assert config.template("code-interpreter-v1") == "default"
    assert "'polyglot' is not built" in output
    config, output = _served_config(monkeypatch, INSTALLED, "--e2b-alias", "code-interpreter-v1=default")
    assert config.template("code-interpreter-v1") == "default"
