"""A small in-memory cache with a time to live, safe against the read/invalidate race.

The store caches what every request reads (principals by key hash, sandbox records by id). The pattern:

```python
token = cache.token()               # before reading the database
value = ...read the database...
cache.put(key, value, token)        # ignored if anything was invalidated since `token`
...
cache.invalidate(key)               # by writers, after their commit
```

A reader that read the old row before a writer committed cannot put it back after the writer invalidated: every
invalidation bumps a generation that `put` checks. After a writer's invalidation, therefore, no stale value for
that key is served from this cache. Other processes' writes are not seen here: they show within `ttl`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from datetime import datetime, timedelta
from enum import Enum
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Missing(Enum):
    MISSING = "missing"


MISSING = Missing.MISSING


class TTLCache(Generic[K, V]):
    """Entries expire `ttl` after they were put; at most `max_entries` (the oldest go first). `ttl` 0 disables."""

    def __init__(self, ttl: timedelta, clock: Callable[[], datetime], max_entries: int = 10_000) -> None:
        self._ttl = ttl
        self._clock = clock
        self._max = max_entries
        self._entries: dict[K, tuple[V, datetime]] = {}
        self._generation = 0

    def __len__(self) -> int:
        return len(self._entries)

    def token(self) -> int:
        """Take before reading what will be put; see the module docstring."""
        return self._generation

    def get(self, key: K) -> V | Missing:
        found = self._entries.get(key)
        if found is None:
            return MISSING
        value, stored = found
        if not self._fresh(stored, self._clock()):
            del self._entries[key]
            return MISSING
        return value

    def put(self, key: K, value: V, token: int) -> None:
        if token != self._generation or self._ttl <= timedelta(0):
            return  # invalidated while the caller read: its value may be the old one
        self._entries.pop(key, None)  # re-inserted at the end: the oldest entries stay first
        if len(self._entries) >= self._max:
            self._evict()
        self._entries[key] = (value, self._clock())

    def invalidate(self, key: K) -> None:
        self._generation += 1
        self._entries.pop(key, None)

    def invalidate_where(self, matches: Callable[[V], bool]) -> None:
        self._generation += 1
        for key in [k for k, (v, _) in self._entries.items() if matches(v)]:
            del self._entries[key]

    def _fresh(self, stored: datetime, now: datetime) -> bool:
        return timedelta(0) <= now - stored < self._ttl  # a clock that went back counts as expired

    def _evict(self) -> None:
        now = self._clock()
        for key in [k for k, (_, stored) in self._entries.items() if not self._fresh(stored, now)]:
            del self._entries[key]
        while len(self._entries) >= self._max:
            del self._entries[next(iter(self._entries))]
