"""The eviction-policy seam: a policy ranks the evictable blocks of one tier.

The index calls ``add`` when a block becomes evictable in the policy's tier,
``discard`` when it stops being evictable, ``touch`` when an evictable block
is used, and ``pop`` to take the victim. ``PrefixIndex.evict`` calls the
optional ``pop_after(entry)`` — ``add(entry)`` then ``pop()`` in one call — with
the parent each victim exposes (``lru``, ``hit_density`` and every heap policy
have it). A policy stores its bookkeeping in ``entry.handles[tier]`` (None
means "not listed") and never touches bytes.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod

from tierkv.index import Entry, PrefixIndex


class EvictionPolicy(ABC):
    """Ranks one tier's evictable blocks. Not thread-safe (the store holds its lock)."""

    name: str = "base"

    def __init__(self, tier: int) -> None:
        self.tier = tier
        self.index: PrefixIndex | None = None

    def bind(self, index: PrefixIndex) -> None:
        """Called once by the index that lists into this policy (gives access to its clock)."""
        self.index = index

    @abstractmethod
    def add(self, entry: Entry) -> None: ...

    @abstractmethod
    def discard(self, entry: Entry) -> None: ...

    @abstractmethod
    def touch(self, entry: Entry) -> None: ...

    @abstractmethod
    def pop(self) -> Entry | None: ...

    @abstractmethod
    def __len__(self) -> int: ...


class HeapPolicy(EvictionPolicy):
    """Evicts the listed block with the lowest ``priority``; O(log n) with lazy deletion.

    A subclass whose priority is a lookup by block key may say so with an instance
    attribute ``priority_by_key = (mapping, default)`` (``priority(entry)`` must then be
    ``mapping.get(entry.key, default)``): the index's C loops read the mapping instead
    of calling ``priority`` (the replay's oracle does this).
    """

    # Slots: the C hot path (tierkv.index_native) reads these by offset.
    __slots__ = ("tier", "index", "_heap", "_seq", "_size")

    def __init__(self, tier: int) -> None:
        super().__init__(tier)
        self._heap: list[list] = []
        self._seq = itertools.count()
        self._size = 0

    @abstractmethod
    def priority(self, entry: Entry):
        """Lower is evicted first. Must only change when ``touch`` is called."""

    def add(self, entry: Entry) -> None:
        item = [self.priority(entry), next(self._seq), entry]
        entry.handles[self.tier] = item
        heapq.heappush(self._heap, item)
        self._size += 1

    def discard(self, entry: Entry) -> None:
        item = entry.handles[self.tier]
        if item is not None:
            item[2] = None
            entry.handles[self.tier] = None
            self._size -= 1
            if len(self._heap) > 64 and len(self._heap) > 4 * self._size:
                self._heap = [i for i in self._heap if i[2] is not None]
                heapq.heapify(self._heap)

    def touch(self, entry: Entry) -> None:
        self.discard(entry)
        self.add(entry)

    def rekey(self) -> None:
        """Recompute every listed block's priority (after a change that moves all keys). O(n)."""
        live = [item for item in self._heap if item[2] is not None]
        for item in live:
            item[0] = self.priority(item[2])
        heapq.heapify(live)
        self._heap = live

    def pop(self) -> Entry | None:
        heap = self._heap
        while heap:
            item = heapq.heappop(heap)
            entry = item[2]
            if entry is not None:
                entry.handles[self.tier] = None
                self._size -= 1
                return self.taken(entry)
        return None

    def taken(self, entry: Entry) -> Entry:
        """Called with each block ``pop`` or ``pop_after`` takes, before it is returned (a learning hook)."""
        return entry

    def pop_after(self, entry: Entry) -> Entry:
        """``add(entry)`` then ``pop()``; ``entry`` is never listed when it is the one taken."""
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        # A new item's sequence number is the highest: it leads only on a strictly lower priority.
        priority = self.priority(entry)
        if not heap or priority < heap[0][0]:
            return self.taken(entry)
        item = [priority, next(self._seq), entry]
        entry.handles[self.tier] = item
        victim = heapq.heapreplace(heap, item)[2]  # the live head out, entry in: one sift
        victim.handles[self.tier] = None
        return self.taken(victim)

    def __len__(self) -> int:
        return self._size
