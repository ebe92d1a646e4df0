"""The inside half of a rootless build: `python -m corral.templates._userns_build SPEC_FILE HOME [--force]`.

`build_template` starts this as root of the build's user namespace (`_userns.py`); it builds as a root build
does and streams the same progress lines. A failure is reported as one last line, `INSIDE_ERROR` followed by
the error as JSON, which the outside half raises again as the same `TemplateBuildError`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .._exceptions import CorralError
from ._build import INSIDE_ERROR, build_template
from ._spec import TemplateSpec
from ._store import TemplateStore

__all__ = ["main"]


def _print(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str]) -> int:
    """Build the spec in `argv[0]` into the store at `argv[1]`; 0 on success, 1 after reporting the error."""
    spec_file, home, *options = argv
    try:
        text = Path(spec_file).read_bytes()
        Path(spec_file).unlink()  # the outside half's temporary file: read once, and gone even if it is killed
        spec = TemplateSpec.model_validate_json(text)
        build_template(spec, TemplateStore(home), progress=_print, force="--force" in options, rootless=False)
    except CorralError as exc:
        _print(INSIDE_ERROR + json.dumps({"message": exc.message, "details": exc.details}, default=str))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
