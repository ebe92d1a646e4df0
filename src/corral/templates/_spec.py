"""What a template is made of: `TemplateSpec`, its digest, and the built-in `default` and `polyglot` specs."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.functional_validators import ModelWrapValidatorHandler

from .._exceptions import InvalidRequestError, NotFoundError

__all__ = [
    "BUILDER_VERSION",
    "BUILTIN_SPECS",
    "DEFAULT_TEMPLATE",
    "POLYGLOT_TEMPLATE",
    "TemplateSpec",
    "builtin_spec",
    "load_spec",
]

# Part of every digest: bump it whenever the build steps change what a spec produces, so templates built by
# an older Corral are rebuilt instead of silently reused.
# 2: packages are installed by apt-get in the chroot after a bare debootstrap, not by debootstrap --include.
# 3: mmdebstrap installs the base system and the packages in one run.
BUILDER_VERSION = "corral-mmdebstrap/3"

# Names live in one flat directory and in CLI arguments; 63 characters keeps them from ever being mistaken
# for a 64-character digest.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
DIGEST_RE = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")
_SUITE_RE = re.compile(r"^[a-z][a-z0-9.-]{0,63}$")
_APT_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]{1,127}$")  # Debian policy 5.6.1
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

# Paths the runtime mounts over in every sandbox: a file written there would be hidden, so reject it early.
_MOUNTED_OVER = ("/proc", "/sys", "/dev", "/.corral")

# pip and certificates are needed to install `pip_packages`; a spec that asks for them gets them.
_PIP_NEEDS = ("ca-certificates", "python3-pip")


def validate_name(name: str) -> str:
    """Raise `InvalidRequestError` unless `name` is a usable template name."""
    if not NAME_RE.match(name):
        raise InvalidRequestError(
            f"invalid template name {name!r}: use 1-63 characters from a-z, 0-9, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return name


class TemplateSpec(BaseModel):
    """A declarative recipe for a template's root filesystem.

    **Parameters:**

    * **name** - the name the template is known by (`default`, `py-ml`...). Not part of the digest: two names
      for the same recipe share one root filesystem.
    * **suite**, **mirror**, **variant** - what `mmdebstrap` installs from.
    * **apt_packages** - Debian packages installed by apt (through mmdebstrap), without recommends (a set: order and
      duplicates do not matter).
    * **pip_packages** - requirement strings installed with pip into `/usr/local`, in this order.
    * **files** - absolute path inside the template -> text content (UTF-8).
    * **env** - environment every sandbox made from the template starts with.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    variant: Literal["minbase"] = "minbase"
    apt_packages: list[str] = Field(default_factory=list)
    pip_packages: list[str] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _as_corral_error(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        # pydantic lets exceptions other than ValueError through, so every way of building a spec
        # (constructor, model_validate, JSON) reports bad input as Corral's own InvalidRequestError.
        try:
            return handler(data)
        except ValidationError as exc:
            raise InvalidRequestError(_describe(exc), details={"errors": _error_list(exc)}) from exc

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not NAME_RE.match(value):
            raise ValueError(
                f"{value!r} is not a valid name: use 1-63 characters from a-z, 0-9, '.', '_' and '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("suite")
    @classmethod
    def _check_suite(cls, value: str) -> str:
        if not _SUITE_RE.match(value):
            raise ValueError(f"{value!r} is not a Debian suite name (e.g. 'bookworm')")
        return value

    @field_validator("mirror")
    @classmethod
    def _check_mirror(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https", "file") or _CONTROL_RE.search(value) or " " in value:
            raise ValueError(f"{value!r} is not an http(s):// or file:// mirror URL")
        if parts.scheme != "file" and not parts.netloc:
            raise ValueError(f"{value!r} has no host")
        return value

    @field_validator("apt_packages")
    @classmethod
    def _check_apt(cls, value: list[str]) -> list[str]:
        for package in value:
            if not _APT_RE.match(package):
                raise ValueError(f"{package!r} is not a Debian package name")
        return sorted(set(value))

    @field_validator("pip_packages")
    @classmethod
    def _check_pip(cls, value: list[str]) -> list[str]:
        for requirement in value:
            # A leading '-' would be read by pip as an option (-r file, --index-url ...), not a package.
            if not requirement.strip() or requirement.lstrip().startswith("-"):
                raise ValueError(f"{requirement!r} is not a pip requirement (options are not allowed)")
            if _CONTROL_RE.search(requirement) or len(requirement) > 500:
                raise ValueError(f"{requirement!r} is not a pip requirement")
        return value

    @field_validator("files")
    @classmethod
    def _check_files(cls, value: dict[str, str]) -> dict[str, str]:
        return {_check_file_path(path): content for path, content in value.items()}

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not _ENV_KEY_RE.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
            if "\x00" in item:
                raise ValueError(f"the value of {key} contains a NUL byte")
        return value

    def effective_apt_packages(self) -> list[str]:
        """The packages handed to apt-get: `apt_packages` plus what `pip_packages` needs."""
        extra = _PIP_NEEDS if self.pip_packages else ()
        return sorted({*self.apt_packages, *extra})

    def digest(self) -> str:
        """SHA-256 (hex) of everything that decides the built root filesystem, and the builder's version."""
        content = {"builder": BUILDER_VERSION, "spec": self.model_dump(mode="json", exclude={"name"})}
        return hashlib.sha256(canonical_json(content)).hexdigest()


def canonical_json(value: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _check_file_path(path: str) -> str:
    if "\x00" in path:
        raise ValueError(f"file path {path!r} contains a NUL byte")
    if not path.startswith("/"):
        raise ValueError(f"file path {path!r} is not absolute")
    if ".." in path.split("/"):
        raise ValueError(f"file path {path!r} contains '..'")
    normal = posixpath.normpath(path)
    if normal == "/" or path.endswith("/"):
        raise ValueError(f"file path {path!r} names a directory, not a file")
    for mounted in _MOUNTED_OVER:
        if normal == mounted or normal.startswith(mounted + "/"):
            raise ValueError(f"file path {path!r} is under {mounted}, which every sandbox mounts over")
    return normal


def _error_list(exc: ValidationError) -> list[dict[str, str]]:
    return [{"field": _format_loc(err["loc"]), "message": _message(err["msg"])} for err in exc.errors()]


def _describe(exc: ValidationError) -> str:
    problems = [f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in _error_list(exc)]
    return "invalid template spec: " + "; ".join(problems)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part != "[key]":
            text += f".{part}" if text else part
    return text


def _message(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def load_spec(path: str | Path) -> TemplateSpec:
    """Read a spec from a `.json` or `.toml` file; `InvalidRequestError` if it is unreadable or invalid."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read template spec {path}: {exc.strerror}") from exc
    try:
        data: Any = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequestError(f"template spec {path} is not valid {path.suffix[1:] or 'JSON'}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"template spec {path} must be a table/object of fields")
    return TemplateSpec.model_validate(data)


_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

DEFAULT_TEMPLATE = TemplateSpec(
    name="default",
    apt_packages=[
        "bash",
        "ca-certificates",
        "coreutils",
        "curl",
        "file",
        "g++",
        "gcc",
        "git",
        "gzip",
        "less",
        "make",
        "nodejs",
        "npm",
        "procps",
        "python-is-python3",  # agents type `python`, not `python3`
        "python3",
        "python3-matplotlib",
        "python3-numpy",
        "python3-pandas",
        "python3-pip",
        "python3-sklearn",
        "python3-venv",
        "tar",
        "xz-utils",
    ],
    files={
        # Sandboxes are headless: without this, pyplot picks an interactive backend that is not installed.
        "/etc/matplotlibrc": "backend: Agg\n",
        # Bookworm marks the system Python as externally managed, so a plain `pip install x` by an agent
        # fails with a long refusal. Let it install (into ~/.local for the sandbox user) instead.
        "/etc/pip.conf": "[global]\nbreak-system-packages = true\n",
    },
    env={"PATH": _PATH, "LANG": "C.UTF-8", "MPLBACKEND": "Agg"},
)

# `default` plus the toolchains of the compiled `java`, `go`, `rust` and `typescript` code languages and of the
# `r`, `java` (jshell) and `typescript` sessions (docs/code.md): OpenJDK 17, Go 1.19, rustc 1.63, tsc 4.8 (which
# runs on the default's nodejs) and R 4.2 (`r-base-core`: the interpreter without the recommended packages).
POLYGLOT_TEMPLATE = TemplateSpec.model_validate({
    **DEFAULT_TEMPLATE.model_dump(),
    "name": "polyglot",
    "apt_packages": [*DEFAULT_TEMPLATE.apt_packages, "default-jdk-headless", "golang-go", "node-typescript",
                     "r-base-core", "rustc"],
})

BUILTIN_SPECS: Mapping[str, TemplateSpec] = {spec.name: spec for spec in (DEFAULT_TEMPLATE, POLYGLOT_TEMPLATE)}


def builtin_spec(name: str) -> TemplateSpec:
    """The spec Corral ships under `name`; `NotFoundError` listing the built-in names otherwise."""
    try:
        return BUILTIN_SPECS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_SPECS))
        raise NotFoundError(
            f"no built-in template spec named {name!r}; built-in specs: {known}. Pass a spec file for anything else."
        ) from None
