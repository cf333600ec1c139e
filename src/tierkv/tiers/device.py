"""L1: the engine's block pool (docs/design.md §5).

One tensor ``pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
on the device (a CPU tensor where there is no CUDA; there each slot may keep
room after its block for a remote pool's value trailer, and the pool is then
a strided view whose blocks are each contiguous). Slots are handed out from
a free list; the store's index decides which cached block a slot holds and who
pins it. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import mmap

import torch

from tierkv.layout import KVLayout


class OutOfBlocks(RuntimeError):
    """L1 has no free slot and nothing evictable: the engine must wait or preempt."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"l1.device: {name!r} asked for but CUDA is not available; use 'auto' or 'cpu'")
    return dev


class DeviceTier:
    name = "l1"

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "auto",
                 slot_room: int = 0) -> None:
        """``slot_room``: bytes the CPU pool keeps free after every block (0: blocks back to back).

        A remote pool that moves registered memory (Mooncake) lands a whole
        value, block and trailer, in one piece when each slot has room for the
        trailer after its block (``tiers.remote.trailer_room``). Slots stay
        page-aligned (the room is rounded up to a page), so L3 reads still
        land in them with O_DIRECT. Ignored on CUDA (a CUDA pool is never
        registered with a pool client); ``slot_bytes`` says what was used.
        """
        if slot_room < 0:
            raise ValueError(f"l1 slot_room: expected >= 0 bytes, got {slot_room}")
        self.layout = layout
        self.device = resolve_device(device) if isinstance(device, str) else device
        if self.device.type == "cpu":
            # Page-aligned so L3 reads land in L1 slots with O_DIRECT and no bounce copy.
            self.slot_bytes = layout.block_bytes
            if slot_room:
                self.slot_bytes = _round_up(layout.block_bytes + slot_room, mmap.PAGESIZE)
            self._mm = mmap.mmap(-1, max(1, num_blocks * self.slot_bytes))
            items = num_blocks * self.slot_bytes // layout.itemsize
            flat = torch.frombuffer(self._mm, dtype=layout.torch_dtype, count=items)
            shape = layout.pool_shape(num_blocks)
            dense = torch.empty(shape, dtype=layout.torch_dtype, device="meta").stride()
            self.pool = flat.as_strided(shape, (self.slot_bytes // layout.itemsize, *dense[1:]))
        else:
            self.slot_bytes = layout.block_bytes
            self.pool = torch.zeros(layout.pool_shape(num_blocks), dtype=layout.torch_dtype, device=self.device)
        # Pop from the end; lowest slot ids first keeps tests' block ids predictable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_blocks)

    @property
    def capacity(self) -> int:
        return self.pool.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots (the caller owns them until ``free``); OutOfBlocks if fewer."""
        if n > len(self._free):
            raise OutOfBlocks(f"l1: asked for {n} slots, {len(self._free)} free")
        slots = [self._free.pop() for _ in range(n)]
        for slot in slots:
            self._is_free[slot] = 0
        return slots

    def free(self, slots: list[int]) -> None:
        """Return slots to the free list; a slot freed twice (or not ours) raises ValueError.

        A double free would hand one slot to two blocks: silently wrong bytes later.
        """
        seen: set[int] = set()
        for slot in slots:
            if (not (isinstance(slot, int) and 0 <= slot < len(self._is_free)) or self._is_free[slot]
                    or slot in seen):
                raise ValueError(f"l1: slot {slot!r} is already free or not an L1 slot")
            seen.add(slot)
        for slot in reversed(slots):
            self._is_free[slot] = 1
            self._free.append(slot)

    def block(self, slot: int) -> torch.Tensor:
        """A view of one slot's canonical block (no copy; contiguous, whatever the slot room)."""
        return self.pool[slot]

    @property
    def slot_room(self) -> int:
        """Bytes after each block that belong to no block (a remote pool may write value trailers there)."""
        return self.slot_bytes - self.layout.block_bytes


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
