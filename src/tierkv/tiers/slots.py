"""SlotPool: a fixed number of block-sized slots in one tensor, handed out from a free list.

The one slot allocator of the project: L1's block pool (``tiers/device.py``),
the L4 outbox (``outbox.py``), the L3 write staging area and the vLLM
connector's landing area are each a SlotPool. It knows nothing of keys or
tiers: it owns memory and says which slots are free.

On CPU the pool is anonymous, page-aligned memory, so O_DIRECT reads and
writes use slots in place; each slot may keep ``slot_room`` bytes after its
block (a remote pool's value trailer lands there), and the pool is then a
strided view whose blocks are each contiguous. On CUDA it is one device
tensor with blocks back to back.

Thread-safety: allocation and freeing take the pool's own lock; the bytes of
a slot belong to whoever allocated it until they free it.
"""

from __future__ import annotations

import mmap
import threading

import torch

from tierkv.layout import KVLayout
from tierkv.tiers.base import round_up


class OutOfBlocks(RuntimeError):
    """No free slot (for L1: nothing evictable either); the engine must wait or preempt."""


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; a CUDA device asked for without CUDA fails naming l1.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"l1.device: {name!r} asked for but CUDA is not available; use 'auto' or 'cpu'")
    return dev


class SlotPool:
    """``num_blocks`` slots of one block each; ``allocate``/``free`` single slots, ``take_run`` consecutive ones."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
                 slot_room: int = 0, name: str = "slots") -> None:
        """``slot_room``: bytes kept free after every block on CPU (0: blocks back to back).

        Slots stay page-aligned (the room is rounded up to a page). Ignored on
        CUDA; ``slot_bytes`` says what was used. ``name`` prefixes error messages.
        """
        if slot_room < 0:
            raise ValueError(f"{name} slot_room: expected >= 0 bytes, got {slot_room}")
        self.layout = layout
        self.name = name
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.slot_bytes = layout.block_bytes
        if self.device.type == "cpu":
            if slot_room:
                self.slot_bytes = round_up(layout.block_bytes + slot_room, mmap.PAGESIZE)
            # MAP_POPULATE: the pool is faulted in now (as L2's slab is), so a process's memory is
            # what it will be from the start, and no step pays the first touch of a page.
            self._mm = mmap.mmap(-1, max(1, num_blocks * self.slot_bytes),
                                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
            items = num_blocks * self.slot_bytes // layout.itemsize
            flat = torch.frombuffer(self._mm, dtype=layout.torch_dtype, count=items)
            shape = layout.pool_shape(num_blocks)
            dense = torch.empty(shape, dtype=layout.torch_dtype, device="meta").stride()
            self.pool = flat.as_strided(shape, (self.slot_bytes // layout.itemsize, *dense[1:]))
        else:
            self.pool = torch.zeros(layout.pool_shape(num_blocks), dtype=layout.torch_dtype, device=self.device)
        self._lock = threading.Lock()
        self._free = list(range(num_blocks - 1, -1, -1))  # pop from the end: lowest slot ids first
        self._is_free = bytearray(b"\x01" * num_blocks)

    @property
    def capacity(self) -> int:
        return self.pool.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def slot_room(self) -> int:
        """Bytes after each block that belong to no block (a remote pool may write value trailers there)."""
        return self.slot_bytes - self.layout.block_bytes

    def block(self, slot: int) -> torch.Tensor:
        """A view of one slot's block (no copy; contiguous, whatever the slot room)."""
        return self.pool[slot]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots (the caller owns them until ``free``); OutOfBlocks if fewer are free."""
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"{self.name}: asked for {n} slots, {len(self._free)} free")
            slots = [self._free.pop() for _ in range(n)]
            for slot in slots:
                self._is_free[slot] = 0
        return slots

    def try_allocate(self, n: int) -> list[int] | None:
        """``allocate(n)``, or None when fewer than ``n`` are free."""
        try:
            return self.allocate(n)
        except OutOfBlocks:
            return None

    def take_run(self, n: int) -> int:
        """Take ``n`` consecutive free slots and return the first, or -1 when no such run is free."""
        with self._lock:
            start = self._is_free.find(b"\x01" * n) if n else -1  # -1 too when n exceeds the pool
            if start < 0:
                return -1
            self._is_free[start:start + n] = bytes(n)
            taken = set(range(start, start + n))
            self._free = [s for s in self._free if s not in taken]
            return start

    def free(self, slots: list[int]) -> None:
        """Return slots; a slot freed twice (or not ours) raises ValueError and frees nothing.

        A double free would hand one slot to two owners: silently wrong bytes later.
        """
        with self._lock:
            seen: set[int] = set()
            for slot in slots:
                if (not (isinstance(slot, int) and 0 <= slot < len(self._is_free)) or self._is_free[slot]
                        or slot in seen):
                    raise ValueError(f"{self.name}: slot {slot!r} is already free or not a {self.name} slot")
                seen.add(slot)
            for slot in reversed(slots):
                self._is_free[slot] = 1
                self._free.append(slot)

    def slot_at(self, block: torch.Tensor) -> int:
        """The slot ``block`` (a view from ``block``/``pool``) starts at, or -1 when it is not in this pool."""
        if not block.numel() or block.device.type != self.device.type:
            return -1
        offset = block.data_ptr() - self.pool.data_ptr()
        if not 0 <= offset < self.capacity * self.slot_bytes:
            return -1
        return offset // self.slot_bytes
