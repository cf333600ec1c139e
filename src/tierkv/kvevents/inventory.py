"""What one node holds, per tier, as its KV events say. Pure Python; moves nothing.

``Inventory`` applies decoded ``KVEventBatch`` es (removals, stores, clears)
to a map block key -> tier bitmask, and answers the router's question: how
many leading blocks of a prompt this node holds, in which tier.
``TierKeySets`` is the publisher's side: a set of keys per tier, updated a
whole event at a time, read for snapshots.

Thread-safety: one writer (the subscriber thread) and any number of readers.
Readers see each key's mask as of some batch (single dict operations are
atomic); a match racing a batch may mix two neighbouring states, which a
routing hint tolerates.
"""

from __future__ import annotations

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

    ``store``/``remove`` take a whole event's keys in one set operation. One
    writer at a time (the publisher's lock); readers get copies, each tier's
    taken in one step under the GIL (a reader racing a batch may see one
    tier before it and another after).
    """

    def __init__(self) -> None:
        self._sets: tuple[set[bytes], ...] = (set(), set(), set(), set())

    def store(self, tier: int, keys: Iterable[bytes]) -> None:
        self._sets[tier].update(keys)

    def remove(self, tier: int, keys: Iterable[bytes]) -> None:
        self._sets[tier].difference_update(keys)

    def __len__(self) -> int:
        """Distinct keys held in any tier."""
        return len(set().union(*self._sets))

    def by_tier(self) -> list[list[bytes]]:
        """The keys each tier holds, L1..L4 (copies)."""
        return [list(s) for s in self._sets]

    def holds(self) -> dict[bytes, int]:
        """key -> tier mask, as ``Inventory.holds`` (for tests and status)."""
        out: dict[bytes, int] = {}
        for tier, keys in enumerate(self.by_tier()):
            bit = 1 << tier
            for key in keys:
                out[key] = out.get(key, 0) | bit
        return out
