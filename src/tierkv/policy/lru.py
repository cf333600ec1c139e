"""Least recently used among evictable leaves (a baseline)."""

from __future__ import annotations

from tierkv.index import Entry
from tierkv.policy.base import HeapPolicy


class LRUPolicy(HeapPolicy):
    name = "lru"

    def __init__(self, tier: int, **_context) -> None:
        super().__init__(tier)

    def priority(self, entry: Entry):
        return entry.last_access
