"""The lookup side of the store: the longest cached prefix of a chain, per block its fastest tier.

``Matcher.lookup_keys`` walks the index (and, where another process may have
written, the shared L2 slab and L3's LMDB), asks L4 for the rest without the
store lock held, cuts the match where loading stops paying (the cost model),
and pins and touches what it names. It moves no bytes: ``reads.py`` loads.

Thread-safety: every method takes the store's lock for its index work and
never holds it across the L4 round trip.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from tierkv.cost import CostModel
from tierkv.hashing import BlockHash
from tierkv.index import Entry, PrefixIndex, Tier
from tierkv.metrics import Metrics
from tierkv.reads import Match, probe_shared
from tierkv.tiers.base import BlockTier, FailureHook

WriteThrough = Callable[[Sequence[Entry], Sequence[Entry] | None], None]


class Matcher:
    """Builds ``Match``es for the store; owns no state (the index, tiers and lock are the store's)."""

    def __init__(self, tiers: dict[int, BlockTier], index: PrefixIndex, lock: threading.RLock, cost: CostModel,
                 metrics: Metrics, block_size: int, selective: bool, write_through: WriteThrough,
                 on_failure: FailureHook) -> None:
        self.tiers = tiers
        self.index = index
        self._lock = lock
        self.cost = cost
        self.metrics = metrics
        self.block_size = block_size
        self._selective = selective  # policy.write == "write_through_selective"
        self._write_through = write_through
        self._on_failure = on_failure

    def lookup_keys(self, keys: Sequence[BlockHash], pin: bool = True) -> Match:
        """See ``TierKVStore.lookup_keys``."""
        keys = list(keys)
        l2, l4 = self.tiers.get(Tier.L2), self.tiers.get(Tier.L4)
        with self._lock:
            tiers = self.index.match(keys)
            if len(tiers) < len(keys) and (Tier.L3 in self.tiers or (l2 is not None and l2.shared)):
                probe_shared(self.tiers, self.index, keys, tiers)
            if len(tiers) == len(keys) or l4 is None:
                return self._matched(keys, tiers, pin)  # one lock section: tiers cannot go stale
            local = len(tiers)
            held = [self.index.get(k) for k in keys[:local]]
            self.index.pin(held)  # the local prefix stays cached while L4 is asked without the lock
        try:  # a slow or dead pool delays this lookup only, never the store
            for hit in self._probe_l4(l4, keys[local:]):
                if not hit:
                    break
                tiers.append(Tier.L4)
        finally:
            with self._lock:
                self.index.unpin(held)
        with self._lock:
            # Pinned, the prefix stayed cached but may have changed tier meanwhile (a load by
            # another request, or a failed one): match it again so every tier named is current.
            now_local = self.index.match(keys[:local])
            tiers = now_local if len(now_local) < local else now_local + tiers[local:]
            return self._matched(keys, tiers, pin)

    def _matched(self, keys: list[BlockHash], tiers: list[int], pin: bool) -> Match:
        """Caller holds the lock: cut ``tiers`` by cost, pin and touch the local blocks, count."""
        tiers = tiers[: self.cost.cut(tiers, self.block_size)]
        entries = [self.index.get(k) if t != Tier.L4 else None for k, t in zip(keys, tiers)]
        local = [e for e in entries if e is not None]
        m = Match(keys, tiers, entries, self.block_size)
        m.est_load_us, m.est_recompute_us = self.cost.estimate_us(tiers, len(keys), self.block_size)
        unselected = [e for e in local if e.freq <= 1.0] if self._selective else []
        self.index.use(local, pin)  # pin (if asked) and touch in one pass, as the replay does
        if pin:
            m.pinned = list(local)
        if self._selective:
            # freq > 1 only after a block's second hit (each hit adds 1, decay keeps the rest > 0).
            # L2/L3 copies are redone whenever a selected block lacks them; L4, which the index
            # does not track, gets one copy, at the hit that selects the block.
            self._write_through([e for e in local if e.freq > 1.0], [e for e in unselected if e.freq > 1.0])
        self.metrics.count_lookup(tiers, len(keys) - len(tiers))
        return m

    def _probe_l4(self, l4: BlockTier, keys: list[BlockHash]) -> list[bool]:
        """One batched L4 membership call; a failing pool is all misses (the tier counts why)."""
        try:
            return l4.contains(keys)
        except Exception as exc:  # the tier never raises for a pool failure; this guards its bugs
            self._on_failure("l4", "error", len(keys), repr(exc))
            return [False] * len(keys)
