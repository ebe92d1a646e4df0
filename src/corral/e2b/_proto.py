"""Reading and writing envd's messages in protobuf's JSON mapping (what Connect's JSON codec carries).

Readers accept what a conforming client may send: field names in lowerCamelCase or as in the .proto
(`include_entry`), enum values by name or number, int64 as a string or a number, bytes as standard or URL-safe
base64. Writers emit lowerCamelCase names, enum names, bytes as standard base64, and only fields of the .proto
(clients may refuse unknown ones).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from .._exceptions import InvalidRequestError
from ..engine import ProcessRef

__all__ = ["b64", "enum_of", "field", "integer", "message_of", "process_ref", "timestamp", "unb64"]


def field(message: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """The field `name` (lowerCamelCase), also when sent under its .proto name."""
    if name in message:
        return message[name]
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in name)
    return message.get(snake, default)


def message_of(message: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = field(message, name, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a message (a JSON object)")
    return value


def integer(value: Any, name: str, *, default: int | None = None) -> int:
    if value is None:
        if default is None:
            raise InvalidRequestError(f"{name} is required")
        return default
    if isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{name} must be a number, not {value!r}") from None


def enum_of(value: Any, names: Mapping[str, int], name: str, default: int = 0) -> int:
    """An enum value sent by name (`"SIGNAL_SIGKILL"`) or by number."""
    if value is None:
        return default
    if isinstance(value, str):
        if value in names:
            return names[value]
        raise InvalidRequestError(f"unknown {name} {value!r}: one of {', '.join(names)}")
    return integer(value, name)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value: Any, name: str) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be base64 text")
    text = value.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        raise InvalidRequestError(f"{name} is not valid base64") from None


def timestamp(at: float) -> str:
    """A google.protobuf.Timestamp as RFC 3339 text."""
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def process_ref(message: Mapping[str, Any]) -> ProcessRef:
    """envd's `ProcessSelector` (`{"pid": n}` or `{"tag": "..."}`) as Corral's `ProcessRef`."""
    selector = message_of(message, "process")
    if field(selector, "pid") is not None:
        return ProcessRef(pid=integer(field(selector, "pid"), "process.pid"))
    tag = field(selector, "tag")
    if isinstance(tag, str) and tag:
        return ProcessRef(tag=tag)
    raise InvalidRequestError("process must name a pid or a tag")
