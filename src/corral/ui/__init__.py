"""The dashboard's files: plain ES modules, HTML and CSS under `static/`, no build step (docs/dashboard.md).

`corral serve` serves them at `/ui` (`corral.server`); the page calls the REST API with the key the user signs
in with, like any client. `static/vendor/` holds xterm.js and its fit addon, copied from npm by
`scripts/vendor-ui` (pinned versions, checked hashes, their licenses beside them).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["INDEX", "STATIC"]

STATIC = Path(__file__).resolve().parent / "static"
INDEX = STATIC / "index.html"  # every page of the dashboard: the script routes by the path
