"""L1: the engine's block pool as a tier (DESIGN §5).

A ``SlotPool`` on the device (``pool[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]``; a CPU pool where there is no CUDA) plus the map
from block key to slot. Slots are handed to the engine by ``allocate``; a slot
the engine filled becomes a cached block by ``adopt``; ``put`` copies a block
into a fresh slot (a load or a promotion). The store's index decides which
block is kept and who pins it; this class only keeps the map true.

Thread-safety: the map is changed only under the store's lock; the pool's
free list has its own lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.layout import KVLayout
from tierkv.tiers.base import Lineage, copy_block
from tierkv.tiers.slots import OutOfBlocks, SlotPool, resolve_device

__all__ = ["DeviceTier", "OutOfBlocks", "resolve_device"]


class DeviceTier:
    """L1 as a BlockTier: ``SlotPool`` slots named by block key, plus private slots for the engine."""

    name = "l1"

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "auto",
                 slot_room: int = 0) -> None:
        """``slot_room``: bytes each CPU slot keeps free after its block (see ``SlotPool``): a remote
        pool that moves registered memory (Mooncake) then lands a whole value, block and trailer,
        in one piece (``tiers.remote.trailer_room``)."""
        self.slots = SlotPool(layout, num_blocks, device, slot_room, name="l1")
        self.layout = layout
        self.device = self.slots.device
        self.pool = self.slots.pool
        self.slot_bytes = self.slots.slot_bytes
        self._by_key: dict[bytes, int] = {}

    # -- the slot pool, for the engine -----------------------------------------

    @property
    def _mm(self):
        return self.slots._mm

    @property
    def slot_room(self) -> int:
        return self.slots.slot_room

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` private slots (the caller owns them until ``free`` or ``adopt``); OutOfBlocks if fewer."""
        return self.slots.allocate(n)

    def free(self, slots: Sequence[int]) -> None:
        """Return private slots; a slot freed twice (or not ours) raises ValueError."""
        self.slots.free(list(slots))

    def block(self, slot: int) -> torch.Tensor:
        """A view of one slot's block (no copy; contiguous, whatever the slot room)."""
        return self.slots.block(slot)

    def adopt(self, key: bytes, slot: int) -> None:
        """The private ``slot`` now holds block ``key`` (the engine filled it, or a load landed there)."""
        self._by_key[key] = slot

    def slot_of(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    # -- BlockTier ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def used(self) -> int:
        return len(self._by_key)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._by_key for k in keys]

    def view(self, key: bytes) -> torch.Tensor | None:
        slot = self._by_key.get(key)
        return None if slot is None else self.slots.block(slot)

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            lineage: Sequence[Lineage] | None = None) -> list[bool]:
        """Copy each block into a fresh slot; False where no slot is free. Held keys are kept."""
        out = []
        for key, src in zip(keys, blocks):
            if key not in self._by_key:
                got = self.slots.try_allocate(1)
                if got is None:
                    out.append(False)
                    continue
                copy_block(self.slots.block(got[0]), src)
                self._by_key[key] = got[0]
            out.append(True)
        return out

    def get(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> list[bool]:
        out = []
        for key, d in zip(keys, dst):
            slot = self._by_key.get(key)
            if slot is not None:
                copy_block(d, self.slots.block(slot))
            out.append(slot is not None)
        return out

    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget the blocks and free their slots."""
        slots = [s for s in (self._by_key.pop(k, None) for k in keys) if s is not None]
        if slots:
            self.slots.free(slots)

    def close(self) -> None:
        pass
