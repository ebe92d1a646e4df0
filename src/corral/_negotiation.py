"""HTTP content negotiation that the fronts share: the quality (`q=`) of one item of an `Accept*` header."""

from __future__ import annotations

from collections.abc import Iterable


def quality(params: Iterable[str]) -> float:
    """The `q` among an item's parameters (`["q=0.5", "level=1"]`): 1.0 when absent, 0.0 when malformed."""
    for param in params:
        name, _, value = param.strip().partition("=")
        if name.strip().lower() == "q":
            try:
                return float(value)
            except ValueError:
                return 0.0
    return 1.0
