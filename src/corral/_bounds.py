"""The documented sizes and ranges of what a request may carry (docs/api.md, "Sizes and ranges").

Every front end's models use these, so a value out of range is a 400 naming the field and its range before it
reaches SQLite (whose INTEGER is 64-bit), asyncio (whose timers overflow past about 1e9 years) or `execve`
(whose strings are at most 128 KiB each, `MAX_ARG_STRLEN`, and 2 MiB together by default).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

__all__ = ["ENV_ENTRIES", "ENV_TOTAL", "ENV_VALUE", "MAX_DURATION", "MAX_INT64", "MAX_OUTPUT", "METADATA_ENTRIES",
           "METADATA_KEY", "METADATA_VALUE", "Duration", "EnvVars", "Metadata", "env_problem"]

MAX_INT64 = 2**63 - 1  # what SQLite's INTEGER holds: every stored number is at most this
MAX_DURATION = 7 * 24 * 3600.0  # seconds: the longest timeout anything takes (a sandbox's time to live too)
MAX_OUTPUT = 2**40  # bytes of output a command may keep (`max_output`)
ENV_ENTRIES = 1024
ENV_VALUE = 128 * 1024 - 256  # bytes of one `NAME=value` string the kernel takes, less room for the name
ENV_TOTAL = 1024 * 1024  # bytes of every name and value together: half of what execve takes for argv and env
METADATA_ENTRIES = 64
METADATA_KEY = 256  # characters
METADATA_VALUE = 4096  # characters

Duration = Annotated[float, Field(gt=0, le=MAX_DURATION)]


def env_problem(env: dict[str, str]) -> str | None:
    """What is wrong with `env`'s sizes (None: nothing), for callers that are not pydantic models."""
    try:
        _check_env(env)
    except ValueError as exc:
        return str(exc)
    return None


def _check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > ENV_ENTRIES:
        raise ValueError(f"at most {ENV_ENTRIES} variables")
    total = 0
    for name, value in env.items():
        size = len(name.encode()) + len(value.encode())
        if size > ENV_VALUE:
            raise ValueError(f"variable {name[:64]!r} is {size} bytes: at most {ENV_VALUE} bytes (name and value)")
        total += size
    if total > ENV_TOTAL:
        raise ValueError(f"the variables are {total} bytes together: at most {ENV_TOTAL}")
    return env


def _check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > METADATA_ENTRIES:
        raise ValueError(f"at most {METADATA_ENTRIES} entries")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY or len(value) > METADATA_VALUE:
            raise ValueError(f"entry {key[:64]!r}: keys are at most {METADATA_KEY} characters, values at most "
                             f"{METADATA_VALUE}")
    return metadata


EnvVars = Annotated[dict[str, str], AfterValidator(_check_env)]
Metadata = Annotated[dict[str, str], AfterValidator(_check_metadata)]
