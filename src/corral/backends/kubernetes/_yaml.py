"""YAML out of the JSON-shaped dicts the object builders return, with the standard library alone.

Only what Kubernetes objects hold (dicts, lists, strings, integers, booleans, None), written block-style and
deterministically, so that `deploy/kubernetes/` can be compared byte for byte with what the functions render.
A string is written plain only when YAML would read it back as the same string; any other is a double-quoted
JSON string, which YAML reads as the same (tests/test_k8s_objects.py parses the output back with PyYAML).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["dump", "dump_all"]

_PLAIN = re.compile(r"[A-Za-z/][A-Za-z0-9/._-]*")  # a safe plain scalar: no ':', '#', leading digit or sign
# Words YAML 1.1 (PyYAML, kubectl's parser in places) reads as booleans or null.
_RESERVED = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"})


def dump_all(documents: Iterable[Mapping[str, Any]]) -> str:
    """Several documents, each started by `---`."""
    return "".join(f"---\n{dump(doc)}" for doc in documents)


def dump(value: Mapping[str, Any]) -> str:
    return "".join(f"{line}\n" for line in _mapping(value, 0))


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"not a YAML scalar of a Kubernetes object: {value!r}")


def _is_block(value: Any) -> bool:
    return isinstance(value, Mapping | list) and len(value) > 0


def _empty(value: Mapping[str, Any] | list[Any]) -> str:
    return "{}" if isinstance(value, Mapping) else "[]"


def _mapping(value: Mapping[str, Any], indent: int) -> list[str]:
    pad = " " * indent
    lines = []
    for key, item in value.items():
        head = f"{pad}{_scalar(key)}:"
        if _is_block(item):
            lines.append(head)
            # Lists stay at their key's indentation, as kubectl and kustomize write them.
            lines += _mapping(item, indent + 2) if isinstance(item, Mapping) else _list(item, indent)
        elif isinstance(item, Mapping | list):
            lines.append(f"{head} {_empty(item)}")
        else:
            lines.append(f"{head} {_scalar(item)}")
    return lines


def _list(value: list[Any], indent: int) -> list[str]:
    pad = " " * indent
    lines = []
    for item in value:
        if _is_block(item):
            inner = _mapping(item, indent + 2) if isinstance(item, Mapping) else _list(item, indent + 2)
            lines.append(f"{pad}- {inner[0].lstrip()}")  # the first line shares the dash's line
            lines += inner[1:]
        elif isinstance(item, Mapping | list):
            lines.append(f"{pad}- {_empty(item)}")
        else:
            lines.append(f"{pad}- {_scalar(item)}")
    return lines
