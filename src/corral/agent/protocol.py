"""The framed, binary-safe protocol between the host and the in-sandbox agent.

Standard library only: this module runs on both sides (the agent imports it inside the sandbox).

A connection carries one operation. Every frame is

    u32 length (big-endian, of what follows) | u8 kind | payload

`REQUEST`, `EVENT`, `ERROR` and `CONTROL` payloads are UTF-8 JSON objects; `STDOUT`, `STDERR`, `STDIN` and `DATA`
payloads are raw bytes, never JSON strings of bytes. The host opens with one `REQUEST` that carries the agent
token; the agent answers with `EVENT`s and byte frames, and ends with a final `EVENT` or an `ERROR`.

Liveness (version 2): a request that carries `"heartbeat": <seconds>` gets an empty `HEARTBEAT` frame whenever the
agent has sent nothing on that connection for that long, so the host can bound every wait (docs/architecture.md,
"Agent liveness"). Without the field no heartbeat is ever sent: a host of version 1 never sees the new kind.
"""

from __future__ import annotations

import json
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is slow to import, and the agent's start-up is every sandbox's start-up
    from typing import Any

VERSION = 2  # 2: heartbeats

REQUEST = 1  # host -> agent: {"op": ..., "token": ..., ...}
EVENT = 2  # agent -> host: {"event": ...}
STDOUT = 3  # agent -> host: bytes
STDERR = 4  # agent -> host: bytes
STDIN = 5  # host -> agent: bytes
STDIN_EOF = 6  # host -> agent: empty
DATA = 7  # either way: file or archive bytes
DATA_END = 8  # either way: end of DATA frames
CONTROL = 9  # host -> agent: {"resize": [rows, cols]} | {"signal": n} | {"kill": true}
ERROR = 10  # agent -> host: {"code", "message", "details"}
HEARTBEAT = 11  # agent -> host: empty; only to a request that asked for them

KINDS = frozenset({REQUEST, EVENT, STDOUT, STDERR, STDIN, STDIN_EOF, DATA, DATA_END, CONTROL, ERROR, HEARTBEAT})
JSON_KINDS = frozenset({REQUEST, EVENT, CONTROL, ERROR})

HEADER = struct.Struct(">IB")
MAX_FRAME = 4 * 1024 * 1024  # a frame's payload; bigger payloads are split by the sender
CHUNK = 1024 * 1024  # what senders put in one byte frame


class ProtocolError(Exception):
    """A peer broke the framing rules; the connection must be dropped."""


def encode(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame payload of {len(payload)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(payload) + 1, kind) + payload


def encode_json(kind: int, obj: dict[str, Any]) -> bytes:
    return encode(kind, json.dumps(obj, separators=(",", ":")).encode())


def parse_header(header: bytes) -> tuple[int, int]:
    """Return (kind, payload length) from the 5 header bytes, validating both."""
    length, kind = HEADER.unpack(header)
    if kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if length < 1 or length - 1 > MAX_FRAME:
        raise ProtocolError(f"bad frame length {length}")
    return kind, length - 1


def decode_json(payload: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError("JSON frame is not an object")
    return obj
