"""DeviceTier on CPU: blocks back to back, or slots with room after each block (Mooncake L4 trailers)."""

from __future__ import annotations

import mmap

import pytest
import torch
from _kv import LAYOUT, block_for, key_of, same_bytes

from tierkv.tiers.base import Lineage
from tierkv.tiers.device import DeviceTier
from tierkv.tiers.disk import DiskTier


def test_slots_without_room_are_back_to_back():
    l1 = DeviceTier(LAYOUT, 4, "cpu")
    assert l1.slot_room == 0 and l1.slot_bytes == LAYOUT.block_bytes and l1.pool.is_contiguous()


def test_slots_with_room_stay_page_aligned_and_blocks_stay_contiguous():
    l1 = DeviceTier(LAYOUT, 5, "cpu", slot_room=64)
    assert l1.slot_bytes % mmap.PAGESIZE == 0 and l1.slot_room >= 64
    assert l1.pool.shape == LAYOUT.pool_shape(5) and l1.pool.stride(0) * LAYOUT.itemsize == l1.slot_bytes
    for slot in range(5):
        block = l1.block(slot)
        assert block.is_contiguous() and block.data_ptr() % mmap.PAGESIZE == 0
    # Writing every block (through the pool, as the kernels do) leaves the room untouched.
    room = torch.frombuffer(l1._mm, dtype=torch.uint8).view(5, l1.slot_bytes)[:, LAYOUT.block_bytes:]
    room.fill_(0xAB)
    for slot in range(5):
        l1.pool[slot].copy_(block_for(key_of("room", slot), LAYOUT))
    assert bool((room == 0xAB).all())
    assert all(same_bytes(l1.block(s), block_for(key_of("room", s), LAYOUT)) for s in range(5))


def test_l3_reads_land_in_roomy_slots_with_o_direct(tmp_path):
    l1 = DeviceTier(LAYOUT, 3, "cpu", slot_room=64)
    l3 = DiskTier(tmp_path / "l3", LAYOUT, 8)
    try:
        keys = [key_of("l3", i) for i in range(3)]
        assert l3.put(keys, [block_for(k, LAYOUT) for k in keys], [Lineage(None, i) for i in range(3)]) == [True] * 3
        assert all(l3._aligned(l1.block(s)) is not None for s in range(3))  # no bounce copy
        assert l3.get(keys, [l1.block(s) for s in range(3)]) == [True] * 3
        assert all(same_bytes(l1.block(s), block_for(k, LAYOUT)) for s, k in enumerate(keys))
    finally:
        l3.close()


def test_negative_room_is_refused():
    with pytest.raises(ValueError, match="slot_room"):
        DeviceTier(LAYOUT, 2, "cpu", slot_room=-1)
