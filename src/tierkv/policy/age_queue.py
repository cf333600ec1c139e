"""Oldest-first queue of one tier's listed blocks: integer age keys, FIFO among equal keys.

The ranking structure of the recency-ordered policies (``lru``, and each class
of ``hit_density``). Blocks are keyed by ``entry.last_access``, an integer
clock, and most keys arrive in non-decreasing order (a fresh save, a touch,
a parent exposed by its child's eviction, which was used no later than the
child), so a bucket per key — a deque, appended and popped at the ends — with
a heap over the *keys* (one push per new key, not per block) replaces a heap
of blocks: add, discard and pop are O(1) amortised instead of O(log n), and
equal keys leave in the order they came, as (key, sequence) heap items did.

Deletion is lazy. ``entry.handles[tier]`` holds the block's handle, an int
``key << TAG_BITS | tag`` (``tag`` names the queue, e.g. a class); an
occurrence in a bucket is live while the entry's handle still equals that
bucket's. A block discarded and listed again under the same key leaves a
stale occurrence ahead of its new one; the first one reached is taken (the
block is listed there, so that is a valid pick) and the other is then dead.
Dead occurrences are swept when they outnumber live ones 4 to 1.

Owned by one policy; not thread-safe (the store holds its lock).
"""

from __future__ import annotations

import heapq
from collections import deque

from tierkv.index import Entry

TAG_BITS = 4  # up to 16 queues per tier can share the handle slot (hit_density's classes)


class AgeQueue:
    """Listed blocks of tier ``tier`` under ``tag``, oldest ``last_access`` first."""

    __slots__ = ("tier", "tag", "buckets", "keys", "live", "stored")

    def __init__(self, tier: int, tag: int = 0) -> None:
        if not 0 <= tag < 1 << TAG_BITS:
            raise ValueError(f"age_queue.tag: expected 0..{(1 << TAG_BITS) - 1}, got {tag}")
        self.tier = tier
        self.tag = tag
        self.buckets: dict[int, deque[Entry]] = {}
        self.keys: list[int] = []  # heap of the keys that have a bucket
        self.live = 0              # blocks listed
        self.stored = 0            # occurrences in the buckets, dead ones included

    def __len__(self) -> int:
        return self.live

    def add(self, entry: Entry) -> None:
        """List ``entry`` (not listed in this tier) under its current ``last_access``."""
        key = entry.last_access
        entry.handles[self.tier] = key << TAG_BITS | self.tag
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = deque()
            heapq.heappush(self.keys, key)
        bucket.append(entry)
        self.live += 1
        self.stored += 1

    def discard(self, entry: Entry) -> None:
        """Unlist ``entry`` if listed (here: a listed block's handle carries this queue's tag)."""
        handles = entry.handles
        if handles[self.tier] is None:
            return
        handles[self.tier] = None
        self.live -= 1
        if self.stored > 4 * self.live + 64:
            self._sweep()

    def touch(self, entry: Entry) -> None:
        """``entry`` was used while listed: list it again under its new ``last_access``."""
        self.discard(entry)
        self.add(entry)

    def head(self) -> Entry | None:
        """The oldest listed block, left listed (dead occurrences ahead of it are dropped)."""
        buckets, keys, tier, tag = self.buckets, self.keys, self.tier, self.tag
        while keys:
            key = keys[0]
            bucket = buckets[key]
            handle = key << TAG_BITS | tag
            while bucket:
                entry = bucket[0]
                if entry.handles[tier] == handle:
                    return entry
                bucket.popleft()
                self.stored -= 1
            del buckets[key]
            heapq.heappop(keys)
        return None

    def pop(self) -> Entry | None:
        """Unlist and return the oldest listed block (None if none)."""
        buckets, keys, tier, tag = self.buckets, self.keys, self.tier, self.tag
        while keys:  # head(), taking as it goes
            key = keys[0]
            bucket = buckets[key]
            handle = key << TAG_BITS | tag
            while bucket:
                entry = bucket.popleft()
                self.stored -= 1
                if entry.handles[tier] == handle:
                    entry.handles[tier] = None
                    self.live -= 1
                    return entry
            del buckets[key]
            heapq.heappop(keys)
        return None

    def pop_after(self, entry: Entry) -> Entry:
        """``add(entry)`` then ``pop()``: ``entry`` itself, never listed, when it would be the oldest."""
        keys = self.keys
        if keys:  # head(), with its common case inlined: the first block of the first bucket is live
            bucket = self.buckets[keys[0]]
            if not (bucket and bucket[0].handles[self.tier] == keys[0] << TAG_BITS | self.tag):
                self.head()  # drops dead occurrences and empty buckets (keys is the same heap)
        if not keys or keys[0] > entry.last_access:
            return entry
        self.add(entry)
        return self.pop()

    def _sweep(self) -> None:
        """Drop dead occurrences (and a live block's second one), keeping the order."""
        tier, tag = self.tier, self.tag
        buckets: dict[int, deque[Entry]] = {}
        for key, bucket in self.buckets.items():
            handle = key << TAG_BITS | tag
            seen: set[int] = set()
            kept = deque()
            for entry in bucket:
                if entry.handles[tier] == handle and id(entry) not in seen:
                    seen.add(id(entry))
                    kept.append(entry)
            if kept:
                buckets[key] = kept
        self.buckets = buckets
        self.keys = sorted(buckets)
        self.stored = self.live = sum(map(len, buckets.values()))
