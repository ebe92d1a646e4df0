"""Page tokens of sandbox listings: the last record's creation time and id, opaque to the caller."""

from __future__ import annotations

import base64
import json
from datetime import datetime

from .._exceptions import InvalidRequestError
from ..control import SandboxRecord

__all__ = ["decode_cursor", "encode_cursor"]


def encode_cursor(record: SandboxRecord) -> str:
    raw = json.dumps([record.created_at.isoformat(), record.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        at, last_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return datetime.fromisoformat(at), str(last_id)
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidRequestError(f"malformed page token {cursor[:64]!r}: pass the one the previous page gave")\
            from exc
