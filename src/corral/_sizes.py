"""Sizes as people write them (`512M`, `1G`, `1.5GiB`) and as bytes: a leaf shared by the client and the server."""

from __future__ import annotations

import re

__all__ = ["MAX_SIZE", "parse_size"]

MAX_SIZE = 2**50  # 1 PiB: more than any machine has, far below SQLite's 64-bit INTEGER

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value: int | float | str, what: str = "size") -> int:
    """`512M`, `1G`, `1.5GiB`, `1048576` -> bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count or a string like '512M'")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{what} must be a whole number of bytes or a string like '512M'")
        n = int(value)
    elif not isinstance(value, str):
        raise ValueError(f"{what} must be a byte count or a string like '512M'")
    else:
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"{what} {value!r} is not a size; use bytes or a string like '512M' or '1G'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{what} must be positive")
    if n > MAX_SIZE:
        raise ValueError(f"{what} must be at most {MAX_SIZE} bytes (1P)")
    return n
