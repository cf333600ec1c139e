"""Where the connector's loads land: page-aligned CPU blocks, registered with the store's L4.

A load reads each block into a landing block, then scatters it into vLLM's
cache. A fresh ``torch.empty`` batch is only 64-byte aligned, so every L3 hit
went through the disk tier's aligned bounce buffer (O_DIRECT) and every
Mooncake L4 hit through the pool client's registered staging buffer: one
extra copy of each block. Landing slots are page-aligned (an O_DIRECT read
lands in place) and registered with the L4 client, with room for the value
trailer after each block when the pool moves registered memory (a Mooncake
value then lands whole, in one piece), as the store's own L1 pool is built.

A load takes a run of consecutive slots, so the scatter reads them as one
strided batch; when no run of that length is free it gets a fresh tensor
(correct, one copy slower), counted in ``fallbacks``. The slots are
anonymous memory, committed as they are first written. Thread-safe.
"""

from __future__ import annotations

import threading

import torch

from tierkv.store import TierKVStore
from tierkv.tiers.remote import trailer_room
from tierkv.tiers.slots import SlotPool


class LandingPool:
    """``num_blocks`` landing slots for ``store``'s loads; ``take`` a run, ``give_back`` it once read."""

    def __init__(self, store: TierKVStore, num_blocks: int) -> None:
        self.layout = store.layout
        self._l4 = store.l4
        room = trailer_room(store.config.l4.url)
        self.slots = SlotPool(store.layout, num_blocks, "cpu", room, name="landing") if num_blocks else None
        self._lock = threading.Lock()
        self.fallbacks = 0  # loads that found no free run and got a fresh tensor
        if self._l4 is not None and self.slots is not None:
            self._l4.register(self.slots.pool, room=self.slots.slot_room)

    def take(self, n: int) -> torch.Tensor:
        """``[n, *block_shape]`` blocks to load into: ``n`` consecutive landing slots when a run is
        free (the caller owns them until ``give_back``), else a fresh tensor."""
        start = self.slots.take_run(n) if self.slots is not None else -1  # -1 too for n = 0 or > the pool
        if start >= 0:
            return self.slots.pool[start:start + n]
        with self._lock:
            self.fallbacks += bool(n)
        return torch.empty((n, *self.layout.block_shape), dtype=self.layout.torch_dtype)

    def give_back(self, blocks: torch.Tensor) -> None:
        """Return what ``take`` handed out once nothing reads it any more (a fresh tensor: nothing to do)."""
        if not self.owns(blocks):
            return
        start = self.slots.slot_at(blocks)
        self.slots.free(list(range(start, start + len(blocks))))

    def owns(self, blocks: torch.Tensor) -> bool:
        """Whether ``blocks`` are landing slots (rather than a fallback tensor)."""
        return self.slots is not None and self.slots.slot_at(blocks) >= 0

    @property
    def num_free(self) -> int:
        return 0 if self.slots is None else self.slots.num_free

    def close(self) -> None:
        """Unregister the slots from L4; no load may still be landing in them."""
        if self._l4 is not None and self.slots is not None:
            self._l4.unregister(self.slots.pool)
