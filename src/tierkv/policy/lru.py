"""Least recently used among evictable leaves (a baseline)."""

from __future__ import annotations

from tierkv.index import Entry
from tierkv.policy.age_queue import AgeQueue
from tierkv.policy.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the listed leaf used longest ago; ties leave in listing order. Not thread-safe."""

    name = "lru"

    def __init__(self, tier: int, **_context) -> None:
        super().__init__(tier)
        self._queue = AgeQueue(tier)
        # The seam's calls go straight to the queue (one per block of every request).
        self.add, self.discard, self.touch, self.pop, self.pop_after = (
            self._queue.add, self._queue.discard, self._queue.touch, self._queue.pop, self._queue.pop_after)

    def add(self, entry: Entry) -> None:
        self._queue.add(entry)

    def discard(self, entry: Entry) -> None:
        self._queue.discard(entry)

    def touch(self, entry: Entry) -> None:
        self._queue.touch(entry)

    def pop(self) -> Entry | None:
        return self._queue.pop()

    def pop_after(self, entry: Entry) -> Entry:
        """``add(entry)`` then ``pop()`` (``PrefixIndex.evict`` passes the parent a victim exposed)."""
        return self._queue.pop_after(entry)

    def __len__(self) -> int:
        return len(self._queue)
