"""The one place that reads Corral's environment variables.

`CORRAL_HOME` is the server's state directory (database, templates, sandboxes); default `/var/lib/corral`.
`CORRAL_ADMIN_KEY` is the bootstrap admin key a fresh server takes (else it generates one).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = Path("/var/lib/corral")


def corral_home(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state directory: `explicit`, else `$CORRAL_HOME`, else `/var/lib/corral`."""
    if explicit is not None:
        return Path(explicit)
    value = os.environ.get("CORRAL_HOME")
    return Path(value) if value else DEFAULT_HOME


def admin_key() -> str | None:
    """`$CORRAL_ADMIN_KEY`, the bootstrap admin key of a fresh server, if set."""
    return os.environ.get("CORRAL_ADMIN_KEY") or None
