"""TierKVStore end to end on CPU: save, push down by pressure, match, load back byte-identical."""

from __future__ import annotations

import os

import pytest
import torch

from _kv import LAYOUT, ODD_LAYOUT, block_for, prompt, same_bytes, save_prompt
from _prom import families, value
from tierkv.config import IOConfig
from tierkv.index import Tier
from tierkv.layout import KVLayout
from tierkv.store import OutOfBlocks

L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3


def check_loaded_into_l1(store, m, result) -> None:
    """Every block of the match is usable and its L1 slot holds exactly its bytes."""
    assert result.ok == [True] * m.num_blocks and result.num_ok == m.num_blocks
    for i in range(m.num_blocks):
        slot = m.entries[i].l1_slot
        assert slot is not None
        assert same_bytes(store.l1.block(slot), block_for(m.keys[i], store.layout)), i


def load_into_l1(store, m):
    slots = store.allocate(len(m.to_load))
    result = store.load(m, slots).wait(30)
    return slots, result


def three_prompts_in_three_tiers(store):
    """A -> L3, B -> L2, C -> L1 (4 blocks each; L1 and L2 hold 4 blocks)."""
    prompts = {name: prompt(seed, 4, store.layout, tail=3) for seed, name in enumerate("ABC")}
    for name in "ABC":
        save_prompt(store, prompts[name])
    return prompts


@pytest.mark.parametrize("layout", [LAYOUT, ODD_LAYOUT], ids=["4KiB", "odd"])
@pytest.mark.parametrize("tier", [L1, L2, L3], ids=["L1", "L2", "L3"])
def test_round_trip_from_each_tier_into_l1(make_store, layout, tier):
    store = make_store(l1=4, l2=4, l3=16, layout=layout)
    prompts = three_prompts_in_three_tiers(store)
    assert store.stats()["usage"] == {"l1": (4, 4), "l2": (4, 4), "l3": (4, 16)}
    name = {L1: "C", L2: "B", L3: "A"}[tier]
    m = store.lookup(prompts[name])
    assert m.tiers == [tier] * 4 and m.num_tokens == 4 * layout.block_size
    slots, result = load_into_l1(store, m)
    check_loaded_into_l1(store, m, result)
    assert result.adopted == [tier != L1] * 4
    if tier == L1:
        assert slots == [] and [e.l1_slot for e in m.entries] == m.l1_slots()
    else:
        assert [m.entries[i].l1_slot for i in m.to_load] == slots
    store.release(m)
    again = store.lookup(prompts[name])
    assert again.tiers == [L1] * 4
    check_loaded_into_l1(store, again, store.load(again, []).wait(30))
    store.release(again)
    stats = store.stats()
    assert stats["hits"] == ({"l1": 8} if tier == L1 else {"l1": 4, tier.name.lower(): 4})
    if tier != L1:
        assert stats["bytes"][f"{tier.name.lower()}_read"] == 4 * layout.block_bytes


@pytest.mark.parametrize("tier", [L2, L3], ids=["L2", "L3"])
def test_load_into_plain_tensors_adopts_nothing(make_store, layout, tier):
    store = make_store(l1=4, l2=4, l3=16)
    prompts = three_prompts_in_three_tiers(store)
    name = {L2: "B", L3: "A"}[tier]
    m = store.lookup(prompts[name])
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
    result = store.load(m, dst).wait(30)
    assert result.ok == [True] * 4 and result.adopted == [False] * 4
    assert all(same_bytes(d, block_for(m.keys[i], layout)) for d, i in zip(dst, m.to_load))
    store.release(m)
    assert store.lookup(prompts[name], pin=False).tiers == [tier] * 4


def test_a_match_across_three_tiers_loads_every_block(make_store, layout):
    store = make_store(l1=6, l2=2, l3=16)
    tokens = prompt(7, 8, layout)
    keys = store.hash(tokens)
    assert store.put_blocks(keys, [block_for(k, layout) for k in keys[2:6]], start=2) == [True] * 4
    save_prompt(store, tokens[: 2 * layout.block_size])
    m = store.lookup(tokens)
    # Blocks 0-1 were saved into L1; L2 holds two blocks, the others went down to L3.
    assert m.tiers[:2] == [L1, L1] and sorted(m.tiers[2:]) == [L2, L2, L3, L3] and m.num_blocks == 6
    assert m.counts == {"l1": 2, "l2": 2, "l3": 2, "l4": 0}
    slots, result = load_into_l1(store, m)
    check_loaded_into_l1(store, m, result)
    store.release(m)


SLICED = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=8)  # 4 KiB per layer


def test_a_load_in_parts_says_when_each_slice_of_every_block_has_landed(make_store):
    # Blocks in L2 and L3: after wait_part(p), slices 0..p of every block hold their bytes (L3 reads
    # them slice by slice, L2 copies whole blocks); wait() then verifies as a plain load does.
    store = make_store(l1=6, l2=2, l3=16, layout=SLICED)
    tokens = prompt(9, 6, SLICED)
    keys = store.hash(tokens)
    assert store.put_blocks(keys, [block_for(k, SLICED) for k in keys]) == [True] * 6
    m = store.lookup(tokens)
    assert sorted(m.tiers) == [L2, L2, L3, L3, L3, L3]
    dst = [store.l1.block(s) for s in store.allocate(6)]
    part = SLICED.block_bytes // 4
    handle = store.load(m, dst, parts=4)
    for p in range(4):
        handle.wait_part(p)
        for d, k in zip(dst, m.keys):
            got = d.view(torch.uint8).reshape(-1)[: (p + 1) * part]
            assert torch.equal(got, block_for(k, SLICED).view(torch.uint8).reshape(-1)[: (p + 1) * part]), p
    assert handle.wait(30).ok == [True] * 6
    store.release(m)
    with pytest.raises(ValueError, match="load: parts must be an integer >= 1, got 0"):
        store.load(store.lookup(tokens), dst, parts=0)


def test_prefix_sharing_k_blocks_matches_exactly_k(make_store, layout):
    store = make_store(l1=8, l2=4, l3=16)
    base = prompt(1, 6, layout)
    save_prompt(store, base)
    bs = layout.block_size
    for k in range(7):
        other = base[: k * bs] + [t + 1 for t in base[k * bs:]] + [5, 6, 7]
        assert store.lookup(other, pin=False).num_blocks == min(k, 6), k
        if k < 6:  # one token changed at the end of block k
            edited = list(base)
            edited[k * bs + bs - 1] += 1
            assert store.lookup(edited, pin=False).num_blocks == k
    assert store.lookup(base[: 3 * bs + bs - 1], pin=False).num_blocks == 3  # partial block: no key
    assert store.lookup(base + [1] * (bs - 1), pin=False).num_blocks == 6


def test_namespace_extra_keys_model_revision_and_layout_isolate(make_store, layout, l3_dir, tmp_path):
    store = make_store(l1=4, l2=0, l3=16)
    tokens = prompt(2, 4, layout)
    save_prompt(store, tokens)
    save_prompt(store, prompt(3, 4, layout))  # pushes the first prompt down to L3
    assert store.lookup(tokens, pin=False).tiers == [L3] * 4
    assert store.lookup(tokens, namespace="tenant-b", pin=False).num_blocks == 0
    assert store.lookup(tokens, extra_keys=("lora:1",), pin=False).num_blocks == 0
    save_prompt(store, tokens, namespace="tenant-b")
    assert store.lookup(tokens, namespace="tenant-b", pin=False).num_blocks == 4
    keys = store.hash(tokens)
    store.close()
    # Other stores on the same L3 directory (one at a time: LMDB allows one per process).
    for fields, hits in (({}, 4), ({"model_id": "other-model"}, 0), ({"model_revision": "v2"}, 0)):
        other = make_store(l1=4, l2=0, l3=16, **fields)
        assert other.lookup(tokens, pin=False).num_blocks == hits, fields
        other.close()
    # Another layout gets other keys for the same tokens, and its own directory under this l3.path.
    other_layout = make_store(l1=4, l2=0, l3=16, layout=ODD_LAYOUT, path=tmp_path / "odd")
    assert not set(other_layout.hash(tokens)) & set(keys)
    same = make_store(l1=4, l2=0, l3=16)
    assert same.lookup_keys(other_layout.hash(tokens), pin=False).num_blocks == 0
    assert same.lookup_keys(keys, pin=False).num_blocks == 4
    with pytest.raises(ValueError, match=r"^l3\.path: "):
        make_store(l1=4, l2=0, l3=16)  # already open in this process
    same.close()
    odd = make_store(l1=4, l2=0, l3=16, layout=ODD_LAYOUT)
    assert odd.l3.path.parent.name == "layouts" and odd.l3.used == 0
    save_prompt(odd, prompt(4, 4, ODD_LAYOUT))
    odd.close()
    again = make_store(l1=4, l2=0, l3=16)  # the root's layout still finds its blocks, and only them
    assert again.lookup_keys(keys, pin=False).num_blocks == 4
    assert again.lookup(prompt(4, 4, ODD_LAYOUT), pin=False).num_blocks == 0
    again.close()
    odd = make_store(l1=4, l2=0, l3=16, layout=ODD_LAYOUT)  # reopened: its own directory, its blocks
    assert odd.l3.used == 4 and odd.lookup(prompt(4, 4, ODD_LAYOUT), pin=False).num_blocks == 4
    odd.close()


def test_reopened_store_hits_l3_in_the_same_process(make_store, layout):
    store = make_store(l1=4, l2=0, l3=16)
    tokens = prompt(4, 4, layout)
    save_prompt(store, tokens)
    save_prompt(store, prompt(5, 4, layout))
    store.close()
    again = make_store(l1=4, l2=0, l3=16)
    m = again.lookup(tokens)
    assert m.tiers == [L3] * 4
    check_loaded_into_l1(again, m, load_into_l1(again, m)[1])


def test_pinned_blocks_are_not_evicted_and_l1_runs_out(make_store, layout):
    store = make_store(l1=4, l2=4, l3=16)
    tokens = prompt(6, 4, layout)
    save_prompt(store, tokens)
    m = store.lookup(tokens)
    with pytest.raises(OutOfBlocks, match=r"^l1: "):
        store.allocate(1)
    store.release(m)
    store.release(m)  # idempotent
    assert len(store.allocate(2)) == 2
    assert store.lookup(tokens, pin=False).tiers == [L1, L1, L2, L2]


def test_save_of_a_block_already_in_l1_is_not_adopted(make_store, layout):
    store = make_store(l1=8, l2=0, l3=0)
    tokens = prompt(8, 2, layout)
    save_prompt(store, tokens)
    keys = store.hash(tokens)
    slots = store.allocate(2)
    m = store.lookup(tokens)
    assert store.save(keys, slots, 0, m) == [False, False]
    store.free(slots)
    store.release(m)
    assert store.l1.num_free == 6


def flip(path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def l3_slots(store) -> dict[bytes, int]:
    return {r.key: r.slot for r in store.l3.records()}


def test_corrupt_l3_blocks_are_counted_misses_never_wrong_bytes(make_store, layout):
    store = make_store(l1=4, l2=0, l3=16)
    prompts = [prompt(10 + i, 4, layout) for i in range(3)]
    for p in prompts:
        save_prompt(store, p)          # the first two end up in L3
    slots = l3_slots(store)
    gen = torch.Generator().manual_seed(0)
    victims = {0: 2, 1: 0}             # prompt -> block to damage
    for p, b in victims.items():
        key = store.hash(prompts[p])[b]
        for _ in range(3):
            off = int(torch.randint(0, layout.block_bytes, (1,), generator=gen))
            flip(store.l3.path / "slots.bin", slots[key] * store.l3.stride + off)
    for p, b in victims.items():
        m = store.lookup(prompts[p])
        assert m.tiers == [L3] * 4
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
        result = store.load(m, dst).wait(30)
        assert result.num_ok == b and result.ok[b] is False
        for i, flag in enumerate(result.ok):
            if flag:
                assert same_bytes(dst[i], block_for(m.keys[i], layout))
        store.release(m)
        assert store.lookup(prompts[p], pin=False).num_blocks == b
    stats = store.stats()
    assert stats["corrupt"] == {"l3": 2} and stats["failures"] == {"l3_corrupt": 2}


def leading(keys, good) -> int:
    """How many blocks of a chain, from the first, satisfy ``good``: what a lookup can serve."""
    return next((i for i, k in enumerate(keys) if not good(k)), len(keys))


def test_truncated_slot_file_is_counted_misses_open_and_after_reopen(make_store, layout, l3_dir):
    """Blocks past the cut miss (counted), the rest still hit with their bytes, before and after a reopen."""
    store = make_store(l1=4, l2=0, l3=16)
    prompts = [prompt(20 + i, 4, layout) for i in range(3)]
    for p in prompts:
        save_prompt(store, p)          # the first two end up in L3, the third stays in L1
    slots = l3_slots(store)
    chains = [store.hash(p) for p in prompts]
    assert set(slots) == set(chains[0]) | set(chains[1])
    cut = 6
    os.truncate(l3_dir / "slots.bin", cut * store.l3.stride)
    bad = {k for k, s in slots.items() if s >= cut}
    assert 0 < len(bad) < len(slots)   # some blocks of L3 are cut off, some are not
    corrupt = 0
    for keys in chains[:2]:
        m = store.lookup_keys(keys)
        assert m.tiers == [L3] * 4
        slots_l1, result = load_into_l1(store, m)
        assert result.ok == [k not in bad for k in keys]           # exactly the cut-off blocks fail
        assert result.num_ok == leading(keys, lambda k: k not in bad)
        corrupt += sum(k in bad for k in keys)
        for i in range(result.num_ok):
            assert same_bytes(store.l1.block(m.entries[i].l1_slot), block_for(keys[i], layout))
        store.free([s for j, s in enumerate(slots_l1) if not result.adopted[m.to_load[j]]])
        store.release(m)
        counted = {"l3_corrupt": corrupt} if corrupt else {}
        assert store.stats()["corrupt"].get("l3", 0) == corrupt and store.stats()["failures"] == counted
        # The failed blocks are gone: the next lookup serves the leading good run only.
        assert store.lookup_keys(keys, pin=False).num_blocks == result.num_ok
    before = l3_slots(store)
    store.close()
    # A fresh store on a slot file cut mid-block: records past the end are dropped (counted),
    # the file grows back to its size, and every block that still fits is a hit with its bytes.
    keep = 4
    os.truncate(l3_dir / "slots.bin", keep * store.l3.stride + 17)
    fits = {k for k, s in before.items() if s < keep}
    assert fits and len(fits) < len(before)
    again = make_store(l1=4, l2=0, l3=16)
    assert set(l3_slots(again)) == fits
    assert again.stats()["failures"] == {"l3_corrupt": len(before) - len(fits)}
    served = 0
    for keys in chains:
        m = again.lookup_keys(keys)
        expect = leading(keys, lambda k: k in fits)
        assert m.num_blocks == expect and m.tiers == [L3] * expect
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
        result = again.load(m, dst).wait(30)
        assert result.num_ok == expect
        assert all(same_bytes(dst[i], block_for(keys[i], layout)) for i in range(expect))
        served += expect
        again.release(m)
    assert served > 0 and again.stats()["hits"] == {"l3": served}
    assert again.stats()["failures"] == {"l3_corrupt": len(before) - len(fits)}  # nothing else failed


def test_full_disk_keeps_serving_from_l1_and_l2(make_store, layout, small_tmpfs):
    store = make_store(l1=4, l2=4, l3=1024, path=small_tmpfs / "l3")  # 4 MiB of slots on a 1 MiB disk
    prompts = [prompt(100 + i, 4, layout) for i in range(80)]
    for p in prompts:
        save_prompt(store, p)
    store.flush()  # demotions are written behind: their failures are counted once they were tried
    stats = store.stats()
    assert stats["failures"].get("l3_full", 0) > 0
    assert stats["usage"]["l3"][0] < 256
    # The newest prompts are still served from L1 and L2, byte for byte.
    for p, tier in ((prompts[-1], L1), (prompts[-2], L2)):
        m = store.lookup(p)
        assert m.tiers == [tier] * 4
        check_loaded_into_l1(store, m, load_into_l1(store, m)[1])
        store.release(m)
    # Whatever else still matches is correct; the rest is a miss, never an exception.
    served = 0
    for p in prompts[:-2]:
        m = store.lookup(p)
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
        result = store.load(m, dst).wait(30)
        for j, i in enumerate(m.to_load):
            if result.ok[i]:
                assert same_bytes(dst[j], block_for(m.keys[i], layout))
        served += result.num_ok
        store.release(m)
    assert served > 0


# Every store metric docs/design.md §16 and the README name (the server adds its own, tests/cli).
STORE_FAMILIES = {"tierkv_hits", "tierkv_misses", "tierkv_lookups", "tierkv_bytes", "tierkv_evictions",
                  "tierkv_corrupt_blocks", "tierkv_failures", "tierkv_failure_events", "tierkv_blocks",
                  "tierkv_capacity_blocks", "tierkv_load_seconds"}


def test_stats_and_prometheus_exposition(make_store, layout):
    store = make_store(l1=4, l2=4, l3=16)
    prompts = three_prompts_in_three_tiers(store)
    assert store.stats()["lookups"] == 3 and store.stats()["misses"] == 12 and store.stats()["hits"] == {}
    m = store.lookup(prompts["A"] + [1] * layout.block_size)
    load_into_l1(store, m)
    store.release(m)
    stats = store.stats()
    assert stats["lookups"] == 4 and stats["hits"] == {"l3": 4} and stats["misses"] == 13
    # B pushes A to L2, C pushes B to L2 and A to L3, loading A pushes C to L2 and B to L3.
    assert stats["evictions"] == {"l1": 12, "l2": 8}
    bb = layout.block_bytes
    assert stats["bytes"] == {"l2_write": 12 * bb, "l3_write": 8 * bb, "l3_read": 4 * bb}
    assert stats["usage"] == {"l1": (4, 4), "l2": (4, 4), "l3": (8, 16)}
    assert stats["load_count"] == 1 and stats["block_bytes"] == bb
    # One block of B (now in L3) damaged on disk: its load is a counted miss.
    slot = l3_slots(store)[store.hash(prompts["B"])[1]]
    flip(store.l3.path / "slots.bin", slot * store.l3.stride + 5)
    mb = store.lookup(prompts["B"])
    assert mb.tiers == [L3] * 4
    slots_b, result = load_into_l1(store, mb)
    assert result.ok == [True, False, True, True] and result.num_ok == 1
    store.free([s for j, s in enumerate(slots_b) if not result.adopted[mb.to_load[j]]])
    store.release(mb)
    stats = store.stats()  # also refreshes the usage gauges, as `tierkv serve` does before each scrape
    text = store.metrics.exposition()
    assert families(text) >= STORE_FAMILIES
    assert value(text, "tierkv_hits_total", tier="l3") == 8
    assert value(text, "tierkv_hits_total", tier="l1") == 0
    assert value(text, "tierkv_misses_total") == 13
    assert value(text, "tierkv_lookups_total") == 5
    assert value(text, "tierkv_evictions_total", tier="l1") == stats["evictions"]["l1"] > 12
    assert value(text, "tierkv_bytes_total", tier="l3", direction="read") == stats["bytes"]["l3_read"] == 7 * bb  # good blocks only
    assert value(text, "tierkv_corrupt_blocks_total", tier="l3") == 1
    assert value(text, "tierkv_failures_total", tier="l3", reason="corrupt") == 1
    assert value(text, "tierkv_failure_events_total", tier="l3", reason="corrupt") == 1
    assert value(text, "tierkv_blocks", tier="l3") == stats["usage"]["l3"][0] == store.l3.used
    assert value(text, "tierkv_capacity_blocks", tier="l3") == 16
    assert value(text, "tierkv_load_seconds_count") == 2


def test_store_without_l1_keeps_put_blocks_and_loads_into_tensors(make_store, layout):
    store = make_store(l1=0, l2=2, l3=8)
    tokens = prompt(30, 5, layout)
    keys = store.hash(tokens)
    assert store.put_blocks(keys, [block_for(k, layout) for k in keys]) == [True] * 5
    assert store.put_blocks(keys, [block_for(k, layout) for k in keys[3:]], start=3) == [True, True]  # held: no-op
    with pytest.raises(OutOfBlocks, match=r"^l1: "):
        store.allocate(1)
    m = store.lookup(tokens)
    assert m.counts == {"l1": 0, "l2": 2, "l3": 3, "l4": 0} and m.to_load == [0, 1, 2, 3, 4]
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in range(5)]
    result = store.load(m, dst).wait(30)
    assert result.ok == [True] * 5 and result.adopted == [False] * 5
    assert all(same_bytes(d, block_for(k, layout)) for d, k in zip(dst, keys))
    store.release(m)


def test_lend_gives_a_private_l2_match_in_place_and_nothing_when_a_block_is_on_disk(make_store, layout):
    store = make_store(l1=0, l2=3, l3=8)
    tokens = prompt(31, 3, layout)
    keys = store.hash(tokens)
    assert store.put_blocks(keys, [block_for(k, layout) for k in keys]) == [True] * 3
    m = store.lookup(tokens)
    assert m.tiers == [Tier.L2] * 3
    views = store.lend(m)
    assert views is not None and len(views) == 3
    assert all(same_bytes(v, block_for(k, layout)) for v, k in zip(views, keys))
    assert all(v.data_ptr() == store.l2.view(k).data_ptr() for v, k in zip(views, keys))  # no copy
    store.release(m)
    assert store.stats()["bytes"].get("l2_read", 0) == 3 * layout.block_bytes
    longer = prompt(32, 5, layout)  # 5 blocks into an L2 of 3: some go down to L3
    lkeys = store.hash(longer)
    assert store.put_blocks(lkeys, [block_for(k, layout) for k in lkeys]) == [True] * 5
    m = store.lookup(longer)
    assert m.num_blocks == 5 and Tier.L3 in m.tiers
    assert store.lend(m) is None  # an L3 block cannot be lent: load copies the match
    store.release(m)


def test_threads_share_one_store(make_store, layout):
    """Lookups, loads, saves and releases from three threads: no error, no wrong byte, no lost slot."""
    import random
    import threading
    import time

    store = make_store(l1=24, l2=4, l3=32)
    problems: list[str] = []

    def engine(worker: int) -> None:
        rng = random.Random(worker)
        deadline = time.monotonic() + 2.0
        try:
            while time.monotonic() < deadline:
                m = store.lookup(prompt(rng.randrange(12), 3, layout))
                try:
                    slots = store.allocate(len(m.to_load))
                    result = store.load(m, slots).wait(30)
                    store.free([s for j, s in enumerate(slots) if not result.adopted[m.to_load[j]]])
                    for i in range(result.num_ok):
                        if not same_bytes(store.l1.block(m.entries[i].l1_slot), block_for(m.keys[i], layout)):
                            problems.append(f"wrong bytes in block {i}")
                    rest = list(range(result.num_ok, len(m.keys)))
                    fresh = store.allocate(len(rest))
                    for i, slot in zip(rest, fresh):
                        store.l1.block(slot).copy_(block_for(m.keys[i], layout))
                    adopted = store.save(m.keys, fresh, result.num_ok, m)
                    store.free([s for s, a in zip(fresh, adopted) if not a])
                except OutOfBlocks:
                    pass  # every slot pinned by the other threads for a moment
                finally:
                    store.release(m)
        except Exception as exc:  # noqa: BLE001 - reported below with its thread
            problems.append(f"worker {worker}: {exc!r}")

    threads = [threading.Thread(target=engine, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert problems == []
    assert store.l1.num_free + store.index.counts[L1] == 24
    assert all(e.ref_count == 0 for e in store.index.entries())
    assert store.stats()["hits"].get("l3", 0) > 0


def shared_l2_store(layout, shm_name, l3_path=None, l3=0):
    """A store whose L2 is the /dev/shm slab ``shm_name`` (4 blocks), L1 4 blocks."""
    import dataclasses

    from _kv import store_config
    from tierkv.store import TierKVStore

    cfg = store_config(layout, 4, l3, l3_path or "/nonexistent")
    cfg = dataclasses.replace(cfg, l2=dataclasses.replace(cfg.l2, shared_name=shm_name))
    return TierKVStore(cfg, layout, l1_blocks=4)


def test_a_shared_l2_slot_reused_by_another_process_during_a_load_is_a_miss(layout, shm_name):
    """Pins are per process: another process may free and reuse a shared slot while our copy waits."""
    import threading

    from _kv import key_of

    store = shared_l2_store(layout, shm_name)
    try:
        tokens = prompt(40, 4, layout)
        save_prompt(store, tokens)
        save_prompt(store, prompt(41, 4, layout))       # the first prompt moves to the shared L2
        m = store.lookup(tokens)
        assert m.tiers == [L2] * 4
        assert store.lend(m) is None  # a shared slot may be reused by another process: copied and checked
        gate = threading.Event()
        store.transfer.copy(gate.wait)                    # hold the copy thread
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in range(4)]
        handle = store.load(m, dst)
        # Meanwhile "another process" evicts block 1 and puts another block in its slot.
        victim = m.keys[1]
        slot = store.l2.slot_of(victim)
        store.l2.remove([victim])
        intruder = key_of("intruder")
        assert store.l2.put([intruder], [block_for(intruder, layout)]) == [True]
        assert store.l2.slot_of(intruder) == slot
        gate.set()
        result = handle.wait(30)
        assert result.ok[0] and not result.ok[1] and result.num_ok == 1
        for i, flag in enumerate(result.ok):
            if flag:
                assert same_bytes(dst[i], block_for(m.keys[i], layout)), i
        store.release(m)
    finally:
        store.close()


def test_a_shared_l2_block_overwritten_by_another_process_is_not_demoted_to_l3(layout, l3_dir, shm_name):
    with shared_l2_store(layout, shm_name, l3_dir, l3=16) as store:
        tokens = prompt(50, 4, layout)
        save_prompt(store, tokens)
        save_prompt(store, prompt(51, 4, layout))          # the first prompt is now in the shared L2
        keys = store.hash(tokens)
        assert store.index.match(keys) == [L2] * 4  # (a lookup would make it the most recent)
        # Another process reused block 2's slot and is writing into it.
        store.l2.slab[store.l2.slot_of(keys[2])].view(torch.uint8).view(-1)[:64] = 7
        save_prompt(store, prompt(52, 4, layout))          # pushes the first prompt from L2 down to L3
        assert store.l3.contains(keys) == [True, True, False, True]
        m = store.lookup(tokens)
        assert m.tiers == [L3, L3]
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
        result = store.load(m, dst).wait(30)
        assert result.ok == [True, True]
        assert all(same_bytes(d, block_for(k, layout)) for d, k in zip(dst, keys))
        store.release(m)


def test_persist_skips_a_shared_l2_block_that_fails_its_checksum(layout, l3_dir, shm_name):
    with shared_l2_store(layout, shm_name, l3_dir, l3=16) as store:
        tokens = prompt(60, 4, layout)
        save_prompt(store, tokens)
        save_prompt(store, prompt(61, 4, layout))
        keys = store.hash(tokens)
        assert store.index.match(keys) == [L2] * 4
        store.l2.slab[store.l2.slot_of(keys[1])].view(torch.uint8).view(-1)[:64] = 7
        assert store.persist(keys, L3) == 3
        assert store.l3.contains(keys) == [True, False, True, True]


def test_freeing_a_slot_twice_is_refused(make_store):
    store = make_store(l1=4, l2=0, l3=0)
    a, b = store.allocate(2)
    store.free([a])
    with pytest.raises(ValueError, match=r"^l1: slot .* already free"):
        store.free([a])
    with pytest.raises(ValueError, match=r"^l1: slot .* already free"):
        store.free([b, b])
    with pytest.raises(ValueError, match=r"^l1: slot 9 "):
        store.free([9])
    store.free([b])
    assert sorted(store.allocate(4)) == [0, 1, 2, 3]


def test_a_victim_the_next_tier_cannot_take_goes_one_further_down(make_store, layout):
    store = make_store(l1=4, l2=4, l3=16)
    a, b, c = (prompt(70 + i, 4, layout) for i in range(3))
    save_prompt(store, a)
    save_prompt(store, b)                  # a -> L2
    m = store.lookup(a)                    # a pinned in L2: L2 has nothing to evict
    assert m.tiers == [L2] * 4
    save_prompt(store, c)                  # b leaves L1: L2 cannot take it, L3 can
    store.release(m)
    mb = store.lookup(b)
    assert mb.tiers == [L3] * 4
    check_loaded_into_l1(store, mb, load_into_l1(store, mb)[1])
    store.release(mb)


def l3_records(store) -> dict[bytes, tuple]:
    return {r.key: (r.slot, r.depth, r.checksum, r.parent) for r in store.l3.records()}


@pytest.mark.parametrize("seed,moved_aside", [(0, True), (1, False), (2, False), (3, False),
                                              (4, True), (5, False), (6, True), (7, False)])
def test_a_randomly_damaged_l3_index_is_moved_aside_or_serves_exactly_its_intact_records(
        make_store, layout, l3_dir, seed, moved_aside):
    """50 seeded byte flips anywhere in the index: the store always starts. The same bytes always
    give the same verdict: either the index is found damaged (moved aside once, counted with the
    blocks it listed, L3 empty, every lookup a miss) or it serves, and then exactly the blocks whose
    records survived intact hit, with their bytes, up to the first damaged one of each chain; a
    record that parses but was changed fails its checksum (a counted miss). Either way the L3 then
    takes new blocks that a restart finds."""
    import random

    store = make_store(l1=4, l2=0, l3=64, io=IOConfig(shutdown_flush_s=0))
    prompts = [prompt(80 + i, 4, layout) for i in range(6)]
    for p in prompts:
        save_prompt(store, p)      # the first five reach L3, the last stays in L1 (close writes nothing)
    chains = [store.hash(p) for p in prompts]
    listed = l3_records(store)
    assert set(listed) == {k for keys in chains[:5] for k in keys}
    store.close()
    index = l3_dir / "index" / "data.mdb"
    rng = random.Random(seed)
    size = os.path.getsize(index)
    for off in rng.sample(range(size), 50):
        flip(index, off)
    again = make_store(l1=4, l2=0, l3=64)
    failures = again.stats()["failures"]
    dropped_at_open = again.stats()["corrupt"].get("l3", 0)
    aside = sorted(l3_dir.glob("damaged-*"))
    assert bool(aside) == moved_aside
    now = l3_records(again)
    intact = {k for k in listed if now.get(k) == listed[k]}
    changed = {k for k in listed if k in now and now[k] != listed[k]}
    if moved_aside:
        assert len(aside) == 1 and sorted(os.listdir(aside[0])) == ["index", "slots.bin"]
        assert list(failures) == ["l3_damaged_index"] and failures["l3_damaged_index"] in (0, len(listed))
        assert again.l3.used == 0 and not now
    else:
        assert set(failures) <= {"l3_corrupt"}  # records that cannot be read are dropped at open
        assert len(intact) >= len(listed) - 2   # 50 flips in a mostly empty file touch few records
    read_bad = 0
    for keys in chains:
        m = again.lookup_keys(keys)
        assert m.num_blocks == leading(keys, lambda k: k in now)
        assert not aside or m.num_blocks == 0
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
        result = again.load(m, dst).wait(30)
        assert result.num_ok == leading(keys[: m.num_blocks], lambda k: k in intact)
        assert result.ok == [k in intact for k in keys[: m.num_blocks]]
        read_bad += sum(k in changed for k in keys[: m.num_blocks])
        for j, i in enumerate(m.to_load):
            if result.ok[i]:
                assert same_bytes(dst[j], block_for(keys[i], layout))
        again.release(m)
    assert again.stats()["corrupt"].get("l3", 0) == dropped_at_open + read_bad  # each failed read counted
    fresh = prompt(180 + seed, 4, layout)
    save_prompt(again, fresh)
    assert again.persist(again.hash(fresh)) == 4
    again.close()
    third = make_store(l1=4, l2=0, l3=64)
    m = third.lookup(fresh)
    assert m.tiers == [L3] * 4
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
    assert third.load(m, dst).wait(30).num_ok == 4
    assert all(same_bytes(d, block_for(m.keys[i], layout)) for d, i in zip(dst, m.to_load))
    third.release(m)
    assert sorted(l3_dir.glob("damaged-*")) == aside


def dead_l4_url() -> str:
    """A Redis URL nobody listens on: the store takes its L4 path, every probe a quick miss."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


class RaceBetweenLockSections:
    """Stands in for the store's lock; the first time a lookup leaves a lock section, ``race`` runs
    (another engine, between that section and the lookup's next one). Records that the lookup took
    the lock again afterwards, so a test knows the race landed inside the lookup."""

    def __init__(self, store, race) -> None:
        self.real, self.race = store._lock, race
        self.raced = False
        self.sections_after = 0

    def __enter__(self):
        self.real.acquire()
        if self.raced:
            self.sections_after += 1

    def __exit__(self, *exc):
        self.real.release()
        if not self.raced:
            self.raced = True
            self.race()

    def acquire(self, *a, **k):
        return self.real.acquire(*a, **k)

    def release(self):
        self.real.release()


def test_a_lookup_racing_an_eviction_keeps_its_pinned_prefix_and_reports_current_tiers(make_store, layout):
    """With an L4 a lookup leaves the lock while it asks the pool. Another engine then fills L1:
    the unpinned blocks are evicted, the lookup's local prefix (pinned) is not, and the Match
    names only tiers its blocks are in."""
    from tierkv.config import L4Config

    store = make_store(l1=8, l2=8, l3=16, l4=L4Config(url=dead_l4_url(), timeout_ms=200))
    tokens = prompt(90, 6, layout)            # 4 blocks cached locally, 2 only asked of L4
    keys = store.hash(tokens)
    save_prompt(store, tokens[: 4 * layout.block_size])
    other = save_prompt(store, prompt(91, 4, layout))
    assert store.lookup_keys(keys, pin=False).tiers == [L1] * 4
    taken = []

    def another_engine_takes_l1():
        taken.extend(store.allocate(4))       # only the other prompt's 4 blocks can go
        with pytest.raises(OutOfBlocks):
            store.allocate(1)                 # the lookup's prefix is pinned meanwhile

    race = RaceBetweenLockSections(store, another_engine_takes_l1)
    store.matcher._lock = race  # the lock the lookup takes (matching.py)
    m = store.lookup(tokens)
    store.matcher._lock = race.real
    assert race.raced and race.sections_after >= 1, "the race did not land inside the lookup"
    assert len(taken) == 4 and store.stats()["evictions"]["l1"] == 4
    assert store.lookup_keys(other, pin=False).tiers == [L2] * 4   # evicted down, not lost
    assert m.tiers == [L1] * 4 and len(m.entries) == 4
    for tier, entry in zip(m.tiers, m.entries):
        assert entry is not None and entry.in_tier(tier), (tier, entry)
    for i, slot in enumerate(m.l1_slots()):
        assert same_bytes(store.l1.block(slot), block_for(keys[i], layout))
    store.release(m)
    store.free(taken)


def test_a_lookup_racing_a_load_names_the_tier_the_block_moved_to(make_store, layout):
    """Between the lookup's lock sections another request loads the prefix from L2 into L1: the
    lookup matches again and reports L1, where the block is now, not the L2 it saw first."""
    from tierkv.config import L4Config

    store = make_store(l1=4, l2=8, l3=16, l4=L4Config(url=dead_l4_url(), timeout_ms=200))
    tokens = prompt(92, 6, layout)
    keys = store.hash(tokens)
    save_prompt(store, tokens[: 4 * layout.block_size])
    save_prompt(store, prompt(93, 4, layout))   # pushes the prefix down to L2
    assert store.lookup_keys(keys, pin=False).tiers == [L2] * 4
    seen = []

    def another_request_loads_it():
        m2 = store.lookup_keys(keys[:4])
        slots, result = load_into_l1(store, m2)
        seen.append((m2.tiers, result.num_ok))
        store.release(m2)

    race = RaceBetweenLockSections(store, another_request_loads_it)
    store.matcher._lock = race  # the lock the lookup takes (matching.py)
    m = store.lookup(tokens)
    store.matcher._lock = race.real
    assert race.raced and race.sections_after >= 1, "the race did not land inside the lookup"
    assert seen == [([L2] * 4, 4)]
    assert m.tiers == [L1] * 4
    for tier, entry in zip(m.tiers, m.entries):
        assert entry.in_tier(tier)
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
    assert store.load(m, dst).wait(30).num_ok == 4
    for i, slot in enumerate(m.l1_slots()):
        assert same_bytes(store.l1.block(slot), block_for(keys[i], layout))
    store.release(m)


def test_finished_gives_a_requests_blocks_their_output_band(make_store, layout):
    from tierkv.config import PolicyConfig
    from tierkv.policy.hit_density import BANDS, block_class

    store = make_store(l1=8, l2=8, l3=16, policy=PolicyConfig(name="hit_density", write="write_back"))
    keys = save_prompt(store, prompt(1, 3, layout))
    assert {block_class(store.index.get(k)) % BANDS for k in keys} == {0}  # nobody said: unknown
    store.finished(keys + [b"\x00" * len(keys[0])], 700)  # a key the store does not hold is skipped
    assert {block_class(store.index.get(k)) % BANDS for k in keys} == {3}
    assert store.lookup_keys(keys, pin=False).num_blocks == 3  # a hint: nothing moved, nothing pinned
    assert all(store.index.get(k).ref_count == 0 for k in keys)
    with pytest.raises(ValueError, match="output_tokens"):
        store.finished(keys, -1)


def test_tensor_parallel_shards_share_the_chain_and_never_the_storage(make_store, layout, l3_dir):
    """Each rank's store (the shard layout of its KV heads) roots its chain in the logical layout, so
    one key names a block on every rank, and keeps its blocks in its own directory under the one
    l3.path, never the root (ranks open theirs at the same moment)."""
    assert layout.num_kv_heads % 2 == 0
    half = layout.num_kv_heads // 2
    s0, s1 = layout.shard(0, half), layout.shard(half, half)
    tokens = prompt(5, 3, layout)
    r0 = make_store(l1=4, l2=0, l3=16, layout=s0)
    r1 = make_store(l1=4, l2=0, l3=16, layout=s1)
    assert r0.hash(tokens) == r1.hash(tokens)
    assert {r0.l3.path.parent.name, r1.l3.path.parent.name} == {"layouts"} and r0.l3.path != r1.l3.path
    save_prompt(r0, tokens)
    assert r0.lookup(tokens, pin=False).num_blocks == 3 and r1.lookup(tokens, pin=False).num_blocks == 0
    r0.close()
    r1.close()
    full = make_store(l1=4, l2=0, l3=16)  # TP=1 on the same l3.path: the root, its own (empty) blocks
    assert full.hash(tokens) == r0.hash(tokens) and full.lookup(tokens, pin=False).num_blocks == 0
