"""L2 host tier: the private slab and the /dev/shm slab shared by processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _kv import LAYOUT, ODD_LAYOUT, block_for, key_of, same_bytes
from tierkv.tiers.host import HostTier

WORKERS = str(Path(__file__).parent / "_workers.py")


def keys(*labels) -> list[bytes]:
    return [key_of("shm", label) for label in labels]


@pytest.mark.parametrize("layout", [LAYOUT, ODD_LAYOUT], ids=["4KiB", "odd"])
def test_put_get_contains_remove(layout):
    tier = HostTier(layout, 3, pin=False)
    ks = [key_of("h", i) for i in range(4)]
    assert tier.capacity == 3 and tier.used == 0
    assert tier.put(ks, [block_for(k, layout) for k in ks]) == [True, True, True, False]
    assert tier.contains(ks) == [True, True, True, False] and tier.used == 3
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in ks]
    assert tier.get(ks, dst) == [True, True, True, False]
    assert all(same_bytes(d, block_for(k, layout)) for d, k in zip(dst[:3], ks))
    tier.remove([ks[1], key_of("never put")])
    assert tier.contains(ks) == [True, False, True, False] and tier.used == 2
    assert tier.put([ks[3]], [block_for(ks[3], layout)]) == [True]
    assert tier.slot_of(ks[3]) == tier.slot_of(ks[3]) is not None
    assert sorted(tier.keys()) == sorted([ks[0], ks[2], ks[3]])
    assert tier.get([ks[3]], [dst[3]]) == [True] and same_bytes(dst[3], block_for(ks[3], layout))


def test_putting_a_held_key_keeps_the_first_bytes():
    tier = HostTier(LAYOUT, 2, pin=False)
    k = key_of("h", "same")
    assert tier.put([k], [block_for(k, LAYOUT)]) == [True]
    assert tier.put([k], [block_for(key_of("other"), LAYOUT)]) == [True]
    assert tier.used == 1
    dst = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    assert tier.get([k], [dst]) == [True] and same_bytes(dst, block_for(k, LAYOUT))


def test_block_view_is_the_slot_and_slab_is_one_pool():
    tier = HostTier(LAYOUT, 2, pin=False)
    k = key_of("h", "view")
    tier.put([k], [block_for(k, LAYOUT)])
    assert tier.slab.shape == LAYOUT.pool_shape(2)
    assert same_bytes(tier.block(tier.slot_of(k)), block_for(k, LAYOUT))
    assert tier.slab.data_ptr() % 4096 == 0


def test_non_contiguous_destinations_and_sources_get_the_right_values():
    tier = HostTier(LAYOUT, 2, pin=False)
    k = key_of("h", "strided")
    shape = LAYOUT.block_shape
    src_buf = torch.zeros(shape[:-1] + (shape[-1] * 2,), dtype=LAYOUT.torch_dtype)
    src = src_buf[..., ::2]
    src.copy_(block_for(k, LAYOUT))
    assert tier.put([k], [src]) == [True]
    dst_buf = torch.zeros(shape[:-1] + (shape[-1] * 2,), dtype=LAYOUT.torch_dtype)
    dst = dst_buf[..., 1::2]
    assert not dst.is_contiguous()
    assert tier.get([k], [dst]) == [True]
    assert same_bytes(dst.contiguous(), block_for(k, LAYOUT))
    assert torch.count_nonzero(dst_buf[..., ::2].view(torch.int16)) == 0  # nothing written between


def test_zero_capacity_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^l2\.capacity: "):
        HostTier(LAYOUT, 0)


def run_worker(cmd: str, **args) -> dict:
    out = subprocess.run([sys.executable, WORKERS, cmd, json.dumps(args)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_processes_share_one_slab(shm_name):
    mine = HostTier(LAYOUT, 8, shared_name=shm_name, pin=False)
    assert mine.put(keys("a", "b"), [block_for(k, LAYOUT) for k in keys("a", "b")]) == [True, True]
    other = run_worker("shm", name=shm_name, capacity=8, expect=["a", "b", "c"], put=["c", "d"])
    assert other["seen"] == {"a": True, "b": True, "c": False}
    assert other["written"] == [True, True] and other["used"] == 4
    dst = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in range(2)]
    assert mine.get(keys("c", "d"), dst) == [True, True]
    assert all(same_bytes(d, block_for(k, LAYOUT)) for d, k in zip(dst, keys("c", "d")))
    assert mine.used == 4 and sorted(mine.keys()) == sorted(keys("a", "b", "c", "d"))
    # A slot freed by one process is reused by the next put from any process.
    mine.remove(keys("a"))
    again = run_worker("shm", name=shm_name, capacity=8, expect=["a", "c"], put=["e"])
    assert again["seen"] == {"a": False, "c": True} and again["written"] == [True]
    mine.close()


def test_shared_slab_full_and_overwritten_bytes_are_misses(shm_name):
    tier = HostTier(LAYOUT, 2, shared_name=shm_name, pin=False)
    ks = keys("x", "y", "z")
    assert tier.put(ks, [block_for(k, LAYOUT) for k in ks]) == [True, True, False]
    # Another process reusing a slot under a reader is caught by the checksum, never returned.
    tier.slab[tier.slot_of(ks[0])].view(torch.uint8).view(-1)[100] ^= 0xFF
    dst = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    assert tier.get([ks[0]], [dst]) == [False]
    assert tier.get([ks[1]], [dst]) == [True] and same_bytes(dst, block_for(ks[1], LAYOUT))


def test_later_openers_use_the_shared_slab_as_the_first_sized_it(shm_name):
    small = HostTier(LAYOUT, 2, shared_name=shm_name, pin=False)
    # Another process asks for 8 blocks: it must not hand out slots this process cannot map.
    other = run_worker("shm", name=shm_name, capacity=8, expect=[], put=["p0", "p1", "p2"])
    assert other["written"] == [True, True, False] and other["used"] == 2
    assert small.capacity == 2 and small.used == 2
    dst = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    for label in ("p0", "p1"):
        assert small.get(keys(label), [dst]) == [True] and same_bytes(dst, block_for(keys(label)[0], LAYOUT))
    small.close()


def test_a_slot_reserved_by_a_writer_that_died_is_written_again(shm_name):
    tier = HostTier(LAYOUT, 2, shared_name=shm_name, pin=False)
    (k,) = keys("orphan")
    tier._slots.reserve(k)  # what a writer killed between reserve and commit leaves behind
    dst = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    assert tier.get([k], [dst]) == [False]
    assert tier.put([k], [block_for(k, LAYOUT)]) == [True]
    assert tier.get([k], [dst]) == [True] and same_bytes(dst, block_for(k, LAYOUT))
    assert tier.used == 1
    tier.close()


def test_a_closed_shared_slab_can_be_opened_again_in_this_process(shm_name):
    first = HostTier(LAYOUT, 2, shared_name=shm_name, pin=False)
    (k,) = keys("again")
    first.put([k], [block_for(k, LAYOUT)])
    first.close()
    second = HostTier(LAYOUT, 2, shared_name=shm_name, pin=False)
    dst = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    assert second.get([k], [dst]) == [True] and same_bytes(dst, block_for(k, LAYOUT))
    second.close()


def test_stores_in_two_processes_hit_each_others_shared_l2_blocks(shm_name):
    import dataclasses

    from _kv import prompt, save_prompt, store_config
    from tierkv.index import Tier
    from tierkv.store import TierKVStore

    cfg = store_config(LAYOUT, 4, 0, "/nonexistent")
    cfg = dataclasses.replace(cfg, l2=dataclasses.replace(cfg.l2, shared_name=shm_name))
    with TierKVStore(cfg, LAYOUT, l1_blocks=2) as store:
        save_prompt(store, prompt(1, 2, LAYOUT))
        save_prompt(store, prompt(2, 2, LAYOUT))   # prompt 1 goes down to the shared L2
        assert store.index.match(store.hash(prompt(1, 2, LAYOUT))) == [Tier.L2] * 2
        seen = run_worker("shm_store_lookup", name=shm_name, seeds=[1, 2], num_blocks=2)
        assert seen["1"] == {"tiers": [Tier.L2] * 2, "num_ok": 2, "correct": True}
        assert seen["2"]["tiers"] == []  # only in this process's L1
