"""What one node holds, per tier, as its KV events say. Pure Python; moves nothing.

``Inventory`` applies decoded ``KVEventBatch`` es (removals, stores, clears)
to a map block key -> tier bitmask, and answers the router's question: how
many leading blocks of a prompt this node holds, in which tier.
``TierKeySets`` is the publisher's side: a set of keys per tier, updated
many batches at a time, read for snapshots.

Thread-safety: one writer (the subscriber thread) and any number of readers.
Readers see each key's mask as of some batch (single dict operations are
atomic); a match racing a batch may mix two neighbouring states, which a
routing hint tolerates.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from tierkv.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, tier_of

# Fastest tier of a 4-bit mask over L1..L4 (lowest set bit), -1 for none.
_FASTEST = tuple(((m & -m).bit_length() - 1) if m else -1 for m in range(16))


class Inventory:
    """block key -> tier mask (bit t set: tier t holds the block), with per-tier counts."""

    def __init__(self) -> None:
        self._masks: dict[bytes, int] = {}
        self.counts = [0, 0, 0, 0]

    def __len__(self) -> int:
        return len(self._masks)

    def clear(self) -> None:
        self._masks = {}
        self.counts = [0, 0, 0, 0]

    def apply(self, events: Iterable[object]) -> None:
        """Apply one batch's events in order. Unknown media are ignored."""
        masks = self._masks
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.clear()
                masks = self._masks
                continue
            tier = tier_of(event.medium)
            if tier is None:
                continue
            bit = 1 << tier
            if isinstance(event, BlockStored):
                for key in event.block_hashes:
                    mask = masks.get(key, 0)
                    if not mask & bit:
                        masks[key] = mask | bit
                        self.counts[tier] += 1
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    mask = masks.get(key, 0)
                    if mask & bit:
                        self.counts[tier] -= 1
                        if mask == bit:
                            del masks[key]
                        else:
                            masks[key] = mask & ~bit

    def holds(self) -> dict[bytes, int]:
        """A copy of the key -> mask map (for tests and snapshots)."""
        return dict(self._masks)

    def by_tier(self) -> list[list[bytes]]:
        """The keys each tier holds, L1..L4."""
        out: list[list[bytes]] = [[], [], [], []]
        for key, mask in self._masks.items():
            for t in range(4):
                if mask >> t & 1:
                    out[t].append(key)
        return out

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Fastest tier of each block of the longest prefix of ``keys`` this node holds."""
        get, out = self._masks.get, []
        for key in keys:
            mask = get(key, 0)
            if not mask:
                break
            out.append(_FASTEST[mask])
        return out


class TierKeySets:
    """The keys each tier L1..L4 holds, as sets: what a publisher sent, for snapshots and status.

    ``apply`` takes one batch's changes and only queues them (the key lists
    are kept, not copied: callers hand over lists they no longer change);
    they are folded into the sets in arrival order, in one go, when
    ``fold_keys`` keys are queued or when anyone reads. Folding many
    batches at once runs with warm caches; one set update per batch, right
    after a put has streamed megabytes through the caches, cost the
    publisher more than its encode. Thread-safe: an internal lock orders
    ``apply`` and the folds; readers get copies, as of the last batch
    applied.
    """

    def __init__(self, fold_keys: int = 16384) -> None:
        self._sets: tuple[set[bytes], ...] = (set(), set(), set(), set())
        self._queued: list[tuple[bool, int, list[bytes]]] = []  # (stored?, tier, keys), oldest first
        self._queued_keys = 0
        self.fold_keys = fold_keys
        self._lock = threading.Lock()

    def apply(self, groups: Iterable[tuple[bool, int, list[bytes]]], n_keys: int) -> None:
        """Queue one batch: ``(stored, tier, keys)`` per group, in order (``stored`` False: removed);
        ``n_keys`` their total."""
        with self._lock:
            self._queued.extend(groups)
            self._queued_keys += n_keys
            if self._queued_keys >= self.fold_keys:
                self._fold()

    def _fold(self) -> None:
        sets, queued = self._sets, self._queued
        self._queued, self._queued_keys = [], 0
        for stored, tier, keys in queued:
            if stored:
                sets[tier].update(keys)
            else:
                sets[tier].difference_update(keys)

    def __len__(self) -> int:
        """Distinct keys held in any tier."""
        return len(set().union(*self.by_tier()))

    def by_tier(self) -> list[list[bytes]]:
        """The keys each tier holds, L1..L4 (copies)."""
        with self._lock:
            self._fold()
            return [list(s) for s in self._sets]

    def holds(self) -> dict[bytes, int]:
        """key -> tier mask, as ``Inventory.holds`` (for tests and status)."""
        out: dict[bytes, int] = {}
        for tier, keys in enumerate(self.by_tier()):
            bit = 1 << tier
            for key in keys:
                out[key] = out.get(key, 0) | bit
        return out
