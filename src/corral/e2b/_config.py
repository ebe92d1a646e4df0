"""How a deployment's E2B API behaves: which template E2B's template names mean, whether its sandboxes have root,
and envd's advertised version."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["DEFAULT_ALIASES", "ENVD_VERSION", "E2BConfig", "interpreter_alias", "parse_alias"]

# E2B's stock templates, and what they mean here (`corral serve --e2b-alias NAME=TEMPLATE` changes or adds one).
DEFAULT_ALIASES: Mapping[str, str] = MappingProxyType({"base": "default", "code-interpreter-v1": "default"})

# E2B's code-interpreter template runs Python, JavaScript, TypeScript, R, Java and Bash: `polyglot` is the template
# that has them all, `default` the one that is always there (Python, JavaScript, Bash).
INTERPRETER = "code-interpreter-v1"
INTERPRETER_TEMPLATES = ("polyglot", "default")

# The envd version Corral speaks: the newest whose every feature the SDKs gate on is implemented here (recursive
# watch 0.1.4, stdin 0.3.0, default user 0.4.0, close stdin 0.5.2, octet-stream and gzip uploads 0.5.7, file
# metadata 0.6.2, entries in watch events 0.6.3, watching network mounts 0.6.4).
ENVD_VERSION = "0.6.4"


@dataclass(frozen=True)
class E2BConfig:
    aliases: Mapping[str, str] = field(default_factory=lambda: DEFAULT_ALIASES)
    envd_version: str = ENVD_VERSION
    # Sandboxes made through E2B's API have root, as E2B's do (`user="root"`, `sudo`), where the backend can give
    # it (`corral serve --no-e2b-root`: never).
    root: bool = True

    def template(self, template_id: str) -> str:
        """The Corral template (or snapshot) an E2B `templateID` names; `name:tag` means the name."""
        name = template_id.split(":", 1)[0] if not template_id.startswith("snap-") else template_id
        return self.aliases.get(name, name)


def parse_alias(text: str) -> tuple[str, str]:
    """`NAME=TEMPLATE` (`corral serve --e2b-alias`) as a pair; `ValueError` saying what is wrong."""
    name, sep, template = text.partition("=")
    if not sep or not name.strip() or not template.strip():
        raise ValueError(f"{text!r} is not NAME=TEMPLATE (e.g. code-interpreter-v1=polyglot)")
    return name.strip(), template.strip()


def interpreter_alias(given: Mapping[str, str], has_template: Callable[[str], bool]) -> tuple[dict[str, str], str]:
    """The aliases: `DEFAULT_ALIASES`, then `code-interpreter-v1` meaning `polyglot` where that template is built
    (else `default`), then the operator's own (`given`, `--e2b-alias`); and a line saying which the interpreter
    means and why, for the log."""
    if INTERPRETER in given:
        template, why = given[INTERPRETER], "--e2b-alias"
        return {**DEFAULT_ALIASES, **given}, f"corral: E2B's {INTERPRETER} is template {template!r} ({why})"
    rich, fallback = INTERPRETER_TEMPLATES
    template = rich if has_template(rich) else fallback
    why = "it is built" if template == rich else f"{rich!r} is not built"
    line = f"corral: E2B's {INTERPRETER} is template {template!r} ({why})"
    return {**DEFAULT_ALIASES, INTERPRETER: template, **given}, line
