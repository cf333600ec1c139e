"""Least (decayed) frequently used among evictable leaves (a baseline).

Ranks by ``1 + freq`` (the use that computed the block plus the index's
decayed count of hits) as it stands now. ``freq`` decays by
``2 ** (-age / half_life)``, so comparing ``log2(1 + freq) + last_access / half_life``
orders blocks exactly as their decayed counts at any later time would: the key
changes only on ``touch`` and the heap stays valid. Ties go to the older block.
"""

from __future__ import annotations

from math import log2

from tierkv.index import Entry
from tierkv.policy.base import HeapPolicy


class LFUPolicy(HeapPolicy):
    name = "lfu"

    def __init__(self, tier: int, half_life: float = 2000.0, **_context) -> None:
        super().__init__(tier)
        self._per_access = 1.0 / half_life

    def priority(self, entry: Entry):
        return log2(1.0 + entry.freq) + entry.last_access * self._per_access
