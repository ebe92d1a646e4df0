"""The one place that reads Corral's environment variables.

`CORRAL_HOME` is the server's state directory (database, templates, sandboxes); default `/var/lib/corral`.
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
