"""Logs as JSON lines: `corral --verbose` (any command) and `corral serve --log-format json`.

Standard library only: the CLI's client commands use it too, without the server's dependencies.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = ["LOG_FORMATS", "JSONFormatter", "log_as_json"]

LOG_FORMATS = ("text", "json")


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, milliseconds), level, logger, event, and every `extra` field."""

    _SKIP = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in self._SKIP})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log_as_json(level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Every logger's records, from `level` up, as JSON lines on `stream` (default stderr); replaces any handlers
    the root logger had."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
