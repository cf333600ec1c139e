"""The outbox: copies of blocks on their way to a slow tier (L3, L4) whose source slot is reused at once.

An evicted block leaves its L1 or L2 slot in the same lock section that picked
it, but its write to disk or to the remote pool runs later, on the IO thread.
Its bytes wait here, in a slot of a ``SlotPool`` that is page-aligned (an
O_DIRECT write reads it in place) and registered with the L4 client with room
for the value trailer (a put moves it without another copy). The outbox is
bounded: ``reserve`` answers None when every slot is taken, and the store then
waits (``allocate``) or drops the copy, counted.

Thread-safety: its own lock (the pool's); a slot belongs to the move it was
staged for until the commit frees it.
"""

from __future__ import annotations

import threading

import torch

from tierkv.layout import KVLayout
from tierkv.tiers.base import copy_block
from tierkv.tiers.slots import SlotPool

OUTBOX_BLOCKS = 256  # blocks that may wait for the IO thread at once


class Outbox:
    """``OUTBOX_BLOCKS`` staging slots; ``reserve`` one, ``stage_into`` it, ``release`` it after the write."""

    def __init__(self, layout: KVLayout, slot_room: int = 0, num_blocks: int = OUTBOX_BLOCKS) -> None:
        self.slots = SlotPool(layout, num_blocks, "cpu", slot_room, name="outbox")
        self._freed = threading.Condition()

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    def block(self, slot: int) -> torch.Tensor:
        return self.slots.block(slot)

    def reserve(self) -> int | None:
        """An empty slot for a block read later (on the IO thread), or None when all are taken."""
        got = self.slots.try_allocate(1)
        return None if got is None else got[0]

    def stage_into(self, slot: int, src: torch.Tensor) -> None:
        """Copy block ``src`` (CPU or device) into the reserved ``slot``.

        A device source is copied asynchronously: the caller synchronises before
        the source slot is reused.
        """
        copy_block(self.slots.block(slot), src)

    def release(self, slots: list[int]) -> None:
        """Free slots whose writes have finished; wakes ``wait_free``."""
        if slots:
            self.slots.free(slots)
            with self._freed:
                self._freed.notify_all()

    def wait_free(self, n: int, timeout: float) -> bool:
        """Block until at least ``n`` slots are free (or ``timeout`` seconds passed)."""
        with self._freed:
            return self._freed.wait_for(lambda: self.slots.num_free >= n, timeout)
