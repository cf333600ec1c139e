"""Write policies put blocks where they say: write_back on eviction only, write_through as
blocks fill, write_through_selective on a block's second hit. Real L2 slab and L3 file."""

from __future__ import annotations

import torch
from _kv import block_for, prompt, same_bytes, save_prompt

from tierkv.config import PolicyConfig
from tierkv.index import Tier


def tiers_of(store, keys) -> list[str]:
    """Per key, the tiers holding it as a string like '12' (L1 and L2), '' for none."""
    out = []
    for key in keys:
        entry = store.index.get(key)
        out.append("" if entry is None else "".join(str(t + 1) for t in (0, 1, 2) if entry.in_tier(t)))
    return out


def read_back(store, key, tier) -> torch.Tensor:
    dst = torch.empty(store.layout.block_shape, dtype=store.layout.torch_dtype)
    if tier == Tier.L2:
        dst.copy_(store.l2.block(store.l2.slot_of(key)))
    else:
        assert store.l3.get([key], [dst]) == [True]
    return dst


def test_write_back_keeps_new_blocks_in_l1_until_evicted(make_store, layout):
    store = make_store(l1=4, l2=4, l3=8, policy=PolicyConfig(name="lru", write="write_back"))
    keys = save_prompt(store, prompt(1, 3, layout))
    store.flush()
    assert tiers_of(store, keys) == ["1", "1", "1"]
    assert store.l2.used == 0 and store.l3.used == 0
    save_prompt(store, prompt(2, 3, layout))  # needs 3 slots of 4: two of the first chain demote
    assert tiers_of(store, keys) == ["1", "2", "2"]


def test_write_through_persists_every_new_block_to_l2_and_l3(make_store, layout):
    store = make_store(l1=4, l2=4, l3=8, policy=PolicyConfig(write="write_through"))
    keys = save_prompt(store, prompt(3, 3, layout))
    store.flush()
    assert tiers_of(store, keys) == ["123", "123", "123"]
    assert store.stats()["bytes"]["l3_write"] == 3 * layout.block_bytes and store.stats()["failures"] == {}
    for key in keys:
        want = block_for(key, layout)
        assert same_bytes(read_back(store, key, Tier.L2), want)
        assert same_bytes(read_back(store, key, Tier.L3), want)
    assert all(e.ref_count == 0 for e in map(store.index.get, keys))  # the write's pins are gone


def test_write_through_without_l3_writes_l2_only(make_store, layout):
    store = make_store(l1=4, l2=4, l3=0, policy=PolicyConfig(write="write_through"))
    keys = save_prompt(store, prompt(4, 2, layout))
    store.flush()
    assert tiers_of(store, keys) == ["12", "12"]
    assert store.stats()["failures"] == {}


def test_write_through_selective_persists_on_the_second_hit(make_store, layout):
    store = make_store(l1=4, l2=4, l3=8, policy=PolicyConfig(write="write_through_selective"))
    tokens = prompt(5, 2, layout)
    keys = save_prompt(store, tokens)
    store.flush()
    assert tiers_of(store, keys) == ["1", "1"]
    store.release(store.lookup(tokens))  # first hit: still only in L1
    store.flush()
    assert tiers_of(store, keys) == ["1", "1"]
    store.release(store.lookup(tokens[: layout.block_size]))  # second hit of block 0 only
    store.flush()
    assert tiers_of(store, keys) == ["123", "1"]
    assert same_bytes(read_back(store, keys[0], Tier.L3), block_for(keys[0], layout))
    store.release(store.lookup(tokens))  # now block 1 has its second hit too
    store.flush()
    assert tiers_of(store, keys) == ["123", "123"]


def test_a_persisted_block_survives_l1_eviction_without_a_second_copy(make_store, layout):
    store = make_store(l1=2, l2=4, l3=8, policy=PolicyConfig(name="lru", write="write_through"))
    keys = save_prompt(store, prompt(6, 2, layout))
    store.flush()
    written = store.stats()["bytes"].get("l2_write", 0)
    save_prompt(store, prompt(7, 2, layout))  # evicts both: L2 already holds them, no rewrite
    store.flush()
    assert tiers_of(store, keys) == ["23", "23"]
    assert store.stats()["bytes"]["l2_write"] == written + 2 * layout.block_bytes  # only the new chain


def test_write_through_takes_blocks_put_from_outside_l1_on_to_l3(make_store, layout):
    store = make_store(l1=0, l2=4, l3=8, policy=PolicyConfig(write="write_through"))  # vLLM's case: no L1
    keys = store.hash(prompt(8, 2, layout))
    assert store.put_blocks(keys, [block_for(k, layout) for k in keys]) == [True, True]
    store.flush()
    assert tiers_of(store, keys) == ["23", "23"]
    assert same_bytes(read_back(store, keys[1], Tier.L3), block_for(keys[1], layout))


def test_a_put_larger_than_l2_and_l3_keeps_the_newest_blocks_and_drops_none_as_full(make_store, layout):
    """One put_blocks of 10 blocks into L2 of 2 and L3 of 4 under write_through: L3 makes room by
    evicting its policy's victims (counted), never by refusing blocks as full; what stays reads
    back exactly."""
    store = make_store(l1=0, l2=2, l3=4, policy=PolicyConfig(name="lru", write="write_through"))
    keys = store.hash(prompt(9, 10, layout))
    assert store.put_blocks(keys, [block_for(k, layout) for k in keys]) == [True] * 10
    store.flush()
    stats = store.stats()
    assert stats["failures"] == {}
    assert stats["usage"] == {"l2": (2, 2), "l3": (4, 4)} and store.l3.used == 4
    where = tiers_of(store, keys)
    assert where[-2:] == ["23", "23"]  # the newest two: in L2 and written through to L3
    held = [k for k, w in zip(keys, where) if "3" in w]
    assert len(held) == 4 and set(store.l3.contains(keys)) == {True, False}
    assert [k for k, ok in zip(keys, store.l3.contains(keys)) if ok] == held  # the index and the files agree
    for key in held:
        assert same_bytes(read_back(store, key, Tier.L3), block_for(key, layout))
    assert stats["evictions"]["l3"] == 10 - 4  # every block that left L3 is counted
