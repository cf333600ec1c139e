"""Least recently used among evictable leaves (a baseline)."""

from __future__ import annotations

from tierkv.index import Entry
from tierkv.policy.base import HeapPolicy


class LRUPolicy(HeapPolicy):
    name = "lru"

    def priority(self, entry: Entry):
        return entry.last_access
