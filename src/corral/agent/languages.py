"""Code languages: their names and aliases, which run as stateful sessions (code contexts), and the ids of their
default contexts (docs/code.md). Standard library only: the agent owns these rules and the engine re-exports them,
so that hosts name default contexts exactly as the agent does.
"""

from __future__ import annotations

# E2B's code interpreter accepts these short names (and any case) for its kernels.
ALIASES = {"js": "javascript", "ts": "typescript"}
# Languages that run as a stateful session: a context of one of them keeps its state from cell to cell.
SESSION_LANGUAGES = ("python", "bash", "javascript", "typescript", "r", "java")
# Default contexts listed before they ever ran, as E2B's code interpreter lists its default python and javascript.
LISTED_DEFAULTS = ("python", "javascript")


def normalize(language: str) -> str:
    """`"JS"` -> `"javascript"`: what a language name means, without checking that it exists."""
    name = language.strip().lower()
    return ALIASES.get(name, name)


def default_context(language: str) -> str:
    """The id of a language's default context: `"default"` for python, the language's own name otherwise."""
    name = normalize(language)
    return "default" if name == "python" else name


# A default context's id -> its language (the ids a cell may name before anyone created them).
DEFAULT_CONTEXTS = {default_context(language): language for language in SESSION_LANGUAGES}

__all__ = ["ALIASES", "DEFAULT_CONTEXTS", "LISTED_DEFAULTS", "SESSION_LANGUAGES", "default_context", "normalize"]
