"""L3 disk tier: slot file + LMDB index, O_DIRECT, checksums, corruption, truncation, full disk."""

from __future__ import annotations

import mmap
import os
import subprocess
from pathlib import Path

import pytest
import torch

from _kv import LAYOUT, ODD_LAYOUT, block_for, key_of, same_bytes
from tierkv.layout import KVLayout
from tierkv.tiers.base import Lineage
from tierkv.tiers.disk import DiskTier


class Hook:
    """Records failure reports: (tier, reason, blocks, detail)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, str]] = []

    def __call__(self, tier: str, reason: str, n: int, detail: str) -> None:
        self.calls.append((tier, reason, n, detail))

    def count(self, reason: str) -> int:
        return sum(n for _, r, n, _ in self.calls if r == reason)


def aligned_block(layout: KVLayout) -> torch.Tensor:
    """A page-aligned block tensor, as an L1 slot is (O_DIRECT reads land in it directly)."""
    mm = mmap.mmap(-1, layout.block_bytes)
    t = torch.frombuffer(mm, dtype=layout.torch_dtype).view(layout.block_shape)
    assert t.data_ptr() % 4096 == 0
    return t


def plain_block(layout: KVLayout) -> torch.Tensor:
    """A block tensor that is not page-aligned, so reads go through the bounce buffer."""
    buf = torch.empty(layout.block_bytes + 2 * 4096, dtype=torch.uint8)
    offset = (64 - buf.data_ptr()) % 4096  # 64 bytes past a page boundary, wherever buf landed
    t = buf[offset : offset + layout.block_bytes].view(layout.torch_dtype).view(layout.block_shape)
    assert t.data_ptr() % 4096 == 64
    return t


def put_keys(tier: DiskTier, labels, layout: KVLayout = LAYOUT) -> list[bytes]:
    keys = [key_of("disk", label) for label in labels]
    lineage = [Lineage(keys[i - 1] if i else None, i) for i in range(len(keys))]
    assert tier.put(keys, [block_for(k, layout) for k in keys], lineage) == [True] * len(keys)
    return keys


def read_ok(tier: DiskTier, keys, layout: KVLayout = LAYOUT, aligned: bool = True) -> list[bool]:
    dst = [aligned_block(layout) if aligned else plain_block(layout) for _ in keys]
    flags = tier.get(keys, dst)
    return [f and same_bytes(d, block_for(k, layout)) for f, d, k in zip(flags, dst, keys)]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("layout", [LAYOUT, ODD_LAYOUT], ids=["4KiB", "odd"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "bounce"])
@pytest.mark.parametrize("direct_io", [True, False], ids=["odirect", "buffered"])
def test_round_trip(tmp_path, layout, aligned, direct_io):
    tier = DiskTier(tmp_path / "l3", layout, 16, direct_io=direct_io)
    assert tier.direct is direct_io
    keys = put_keys(tier, range(10), layout)
    assert tier.used == 10 and tier.capacity == 16
    assert tier.contains(keys + [key_of("absent")]) == [True] * 10 + [False]
    # Out of order, with a gap and a missing key: runs of consecutive slots and singles.
    order = [keys[7], keys[0], keys[1], keys[2], key_of("absent"), keys[9], keys[4]]
    assert read_ok(tier, order, layout, aligned) == [True] * 4 + [False, True, True]
    # The same block read twice in one batch.
    assert read_ok(tier, [keys[3], keys[3]], layout, aligned) == [True, True]
    tier.close()


def test_records_keep_lineage_and_survive_reopening(tmp_path):
    tier = DiskTier(tmp_path / "l3", LAYOUT, 8, meta={"model_id": "m1"})
    keys = put_keys(tier, "abc")
    tier.close()
    again = DiskTier(tmp_path / "l3", LAYOUT, 4, meta={"model_id": "other"})
    assert again.capacity == 8  # capacity never shrinks under existing slots
    recs = {r.key: r for r in again.records()}
    assert set(recs) == set(keys)
    assert [(recs[k].parent, recs[k].depth) for k in keys] == [(None, 0), (keys[0], 1), (keys[1], 2)]
    assert sorted(r.slot for r in recs.values()) == [0, 1, 2]
    assert read_ok(again, keys) == [True] * 3
    assert again.meta()["model_id"] == "m1" and again.meta()["layout_fingerprint"] == LAYOUT.fingerprint
    assert again.read_raw(keys[1]) == bytes(block_for(keys[1], LAYOUT).view(torch.uint8).reshape(-1).numpy())
    again.close()


def test_other_layout_is_refused_naming_the_path(tmp_path):
    DiskTier(tmp_path / "l3", LAYOUT, 4).close()
    with pytest.raises(ValueError, match=r"^l3\.path: .* holds blocks of layout"):
        DiskTier(tmp_path / "l3", ODD_LAYOUT, 4)
    with pytest.raises(FileNotFoundError, match=r"^l3\.path: "):
        DiskTier(tmp_path / "nothing", LAYOUT, 4, create=False)


def test_full_tier_counts_and_freed_slots_are_reused(tmp_path):
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", LAYOUT, 3, on_failure=hook)
    keys = [key_of("full", i) for i in range(5)]
    assert tier.put(keys[:4], [block_for(k, LAYOUT) for k in keys[:4]]) == [True, True, True, False]
    assert hook.calls[0][:3] == ("l3", "full", 1)
    assert tier.put([keys[0]], [block_for(keys[0], LAYOUT)]) == [True]  # already held: no slot needed
    slot1 = {r.key: r.slot for r in tier.records()}[keys[1]]
    tier.remove([keys[1], key_of("absent")])
    assert tier.used == 2
    assert tier.put([keys[4]], [block_for(keys[4], LAYOUT)]) == [True]
    assert {r.key: r.slot for r in tier.records()}[keys[4]] == slot1
    assert read_ok(tier, [keys[0], keys[2], keys[4]]) == [True] * 3
    assert read_ok(tier, [keys[1]]) == [False]
    tier.close()


def test_a_key_twice_in_one_put_takes_one_slot(tmp_path):
    tier = DiskTier(tmp_path / "l3", LAYOUT, 2)
    k, other = key_of("dup"), key_of("dup", "other")
    assert tier.put([k, k], [block_for(k, LAYOUT)] * 2) == [True, True]
    assert tier.used == 1
    tier.remove([k])
    assert tier.put([k, other], [block_for(k, LAYOUT), block_for(other, LAYOUT)]) == [True, True]
    assert read_ok(tier, [k, other]) == [True, True]
    tier.close()


def test_a_stale_bad_read_never_frees_a_slot_another_block_now_holds(tmp_path):
    """A reader's record goes stale when another process removes the block, reuses its slot and
    puts the same key again elsewhere (same key and bytes: same checksum). Removing the stale
    record must not free the slot the newer block lives in: a later put would overwrite it."""
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", LAYOUT, 3, on_failure=hook)
    k, other, later = key_of("stale"), key_of("stale", "other"), key_of("stale", "later")
    put_keys_as = lambda keys: tier.put(keys, [block_for(x, LAYOUT) for x in keys])
    assert put_keys_as([k]) == [True]
    stale = next(r for r in tier.records() if r.key == k)
    tier.remove([k])
    assert put_keys_as([other, k]) == [True, True]       # other takes k's old slot, k a new one
    slots = {r.key: r.slot for r in tier.records()}
    assert slots[other] == stale.slot != slots[k]
    tier._remove_if_unchanged([stale])                      # what a read of the stale record does
    assert put_keys_as([later]) == [True]
    slots = {r.key: r.slot for r in tier.records()}
    assert len(set(slots.values())) == 3, f"two records share a slot: {slots}"
    assert read_ok(tier, [k, other, later]) == [True, True, True]
    assert hook.count("corrupt") == 0
    tier.close()


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "bounce"])
def test_flipped_bytes_are_counted_misses_and_removed(tmp_path, aligned):
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", LAYOUT, 8, on_failure=hook)
    keys = put_keys(tier, range(6))
    slots = {r.key: r.slot for r in tier.records()}
    for k, offset in ((keys[1], 0), (keys[4], LAYOUT.block_bytes - 1), (keys[5], 1234)):
        flip_byte(tier.path / "slots.bin", slots[k] * tier.stride + offset)
    assert read_ok(tier, keys, aligned=aligned) == [True, False, True, True, False, False]
    assert hook.count("corrupt") == 3
    assert tier.contains(keys) == [True, False, True, True, False, False]
    assert read_ok(tier, keys, aligned=aligned) == [True, False, True, True, False, False]
    assert hook.count("corrupt") == 3  # removed blocks are plain misses afterwards
    # Their slots went back to the free list.
    fresh = put_keys(tier, ["n1", "n2", "n3", "n4"])[:3]
    assert sorted({r.key: r.slot for r in tier.records()}[k] for k in fresh) == sorted(
        slots[k] for k in (keys[1], keys[4], keys[5]))
    tier.close()


def test_truncated_slot_file_gives_counted_misses_then_heals_on_reopen(tmp_path):
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", LAYOUT, 8, on_failure=hook)
    keys = put_keys(tier, range(6))
    slots = {r.key: r.slot for r in tier.records()}
    os.truncate(tier.path / "slots.bin", 3 * tier.stride + 100)
    ok = read_ok(tier, keys)
    assert ok == [slots[k] < 3 for k in keys] and ok.count(True) == 3
    assert hook.count("corrupt") == 3
    tier.close()
    # Reopened: the records past the end are dropped (and counted) at open, and the file is
    # grown back to capacity for new blocks.
    os.truncate(tmp_path / "l3" / "slots.bin", 4096)
    hook2 = Hook()
    again = DiskTier(tmp_path / "l3", LAYOUT, 8, on_failure=hook2)
    assert hook2.count("corrupt") == 2 and again.used == 1
    assert os.path.getsize(again.path / "slots.bin") == 8 * again.stride
    assert read_ok(again, keys) == [slots[k] == 0 for k in keys]
    assert hook2.count("corrupt") == 2
    assert put_keys(again, ["n1", "n2"]) and again.used == 3
    again.close()


def test_verify_finds_and_repairs_bad_blocks(tmp_path):
    tier = DiskTier(tmp_path / "l3", LAYOUT, 8)
    keys = put_keys(tier, range(4))
    slot = {r.key: r.slot for r in tier.records()}[keys[2]]
    flip_byte(tier.path / "slots.bin", slot * tier.stride + 7)
    assert tier.verify() == (4, [keys[2]])
    assert tier.used == 4
    assert tier.verify(repair=True) == (4, [keys[2]])
    assert tier.used == 3 and tier.verify() == (3, [])
    tier.close()


def test_strided_destination_reads_right_values(tmp_path):
    tier = DiskTier(tmp_path / "l3", LAYOUT, 4)
    (k,) = put_keys(tier, ["s"])
    shape = LAYOUT.block_shape
    buf = torch.zeros(shape[:-1] + (shape[-1] * 2,), dtype=LAYOUT.torch_dtype)
    dst = buf[..., ::2]
    assert tier.get([k], [dst]) == [True]
    assert same_bytes(dst.contiguous(), block_for(k, LAYOUT))
    tier.close()


def test_disk_full_fails_puts_gracefully(small_tmpfs):
    hook = Hook()
    tier = DiskTier(small_tmpfs / "l3", LAYOUT, 1024, on_failure=hook)  # 4 MiB of slots on 1 MiB
    keys = [key_of("enospc", i) for i in range(400)]
    flags = []
    for k in keys:
        flags += tier.put([k], [block_for(k, LAYOUT)])
    stored = [k for k, f in zip(keys, flags) if f]
    assert 0 < len(stored) < 256
    assert flags == [True] * len(stored) + [False] * (len(keys) - len(stored))
    assert hook.count("full") + hook.count("index") == len(keys) - len(stored)
    assert tier.used == len(stored)
    assert read_ok(tier, stored) == [True] * len(stored)
    # The index lives on the same full disk: a remove may fail too, counted and harmless.
    before = hook.count("index")
    tier.remove(stored[:2])
    assert tier.used in (len(stored), len(stored) - 2)
    assert hook.count("index") == before + (2 if tier.used == len(stored) else 0)
    assert read_ok(tier, stored[2:]) == [True] * (len(stored) - 2)
    tier.close()


def test_blocks_past_this_process_capacity_written_by_a_larger_opener_are_read_not_destroyed(tmp_path):
    import json
    import sys

    hook = Hook()
    small = DiskTier(tmp_path / "l3", LAYOUT, 4, on_failure=hook)
    mine = put_keys(small, ["m0", "m1"])
    # Another process opens the same directory with 12 slots and fills slots 2..9.
    labels = [f"big{i}" for i in range(8)]
    worker = str(Path(__file__).parent / "_workers.py")
    out = subprocess.run([sys.executable, worker, "l3_fill", json.dumps(
        {"path": str(tmp_path / "l3"), "capacity": 12, "labels": labels})], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["slots"] == list(range(10))
    theirs = [key_of("disk", label) for label in labels]
    assert read_ok(small, mine + theirs) == [True] * 10
    assert read_ok(small, theirs, aligned=False) == [True] * 8
    assert hook.calls == [] and small.used == 10
    assert small.capacity == 12  # the directory's capacity, not this opener's
    small.close()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", [LAYOUT, ODD_LAYOUT], ids=["4KiB", "odd"])
def test_random_flips_anywhere_hit_exactly_the_blocks_they_land_in(tmp_path, seed, layout):
    import random

    rng = random.Random(seed)
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", layout, 24, on_failure=hook)
    keys = put_keys(tier, range(16), layout)
    slot = {r.key: r.slot for r in tier.records()}
    size = os.path.getsize(tier.path / "slots.bin")
    offsets = rng.sample(range(size), 12)  # distinct bytes: no flip undoes another
    for off in offsets:
        flip_byte(tier.path / "slots.bin", off)
    # A flip matters only inside a block's bytes (not in a free slot or a slot's padding).
    hit = {k for k in keys if any(slot[k] * tier.stride <= o < slot[k] * tier.stride + layout.block_bytes
                                  for o in offsets)}
    expected = [k not in hit for k in keys]
    assert read_ok(tier, keys, layout, aligned=rng.random() < 0.5) == expected
    assert hook.count("corrupt") == len(hit)
    assert tier.contains(keys) == expected
    tier.close()


_FSIZE_WORKER = r"""
import resource, sys
sys.path.insert(0, sys.argv[2])
from _kv import LAYOUT, block_for, key_of, same_bytes
from tierkv.tiers.disk import DiskTier
limit = 16 * LAYOUT.block_bytes
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
reasons = []
tier = DiskTier(sys.argv[1], LAYOUT, 64, on_failure=lambda t, r, n, d: reasons.append((r, n)))
keys = [key_of("fsize", i) for i in range(32)]
flags = []
for k in keys:
    flags += tier.put([k], [block_for(k, LAYOUT)])
dst = [block_for(k, LAYOUT) * 0 for k in keys]
got = tier.get(keys, dst)
ok = all(g == f for g, f in zip(got, flags))
same = all(same_bytes(d, block_for(k, LAYOUT)) for k, d, g in zip(keys, dst, got) if g)
print(sum(flags), sum(n for r, n in reasons if r == "full"), ok, same)
"""


def test_file_size_limit_opens_and_fails_puts_past_it(tmp_path):
    """Under RLIMIT_FSIZE the slot file cannot reach its size: the tier still opens, puts
    past the limit are counted as full, and every block it did store reads back exactly."""
    res = subprocess.run([os.sys.executable, "-c", _FSIZE_WORKER, str(tmp_path / "l3"), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    stored, full, consistent, same = res.stdout.split()
    assert 0 < int(stored) <= 16
    assert int(full) == 32 - int(stored)
    assert consistent == "True" and same == "True"


@pytest.mark.parametrize("read_depth", [1, 4])
def test_reads_in_flight_verify_each_block_of_every_piece(tmp_path, read_depth):
    """A get of more blocks than one ~4 MiB piece reads several pieces at once (read_depth); a
    flipped byte still costs exactly its own block, wherever its piece sits."""
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", LAYOUT, 200, on_failure=hook, read_depth=read_depth)
    keys = put_keys(tier, range(200))  # one run of 200 slots: pieces of 64 blocks (a preadv's most)
    slot = {r.key: r.slot for r in tier.records()}
    assert sorted(slot.values()) == list(range(200))
    damaged = {3, 63, 64, 199}  # either side of the first cut between pieces, and the ends
    for i in damaged:
        flip_byte(tier.path / "slots.bin", slot[keys[i]] * tier.stride + 17)
    expected = [i not in damaged for i in range(len(keys))]
    assert read_ok(tier, keys) == expected
    assert hook.count("corrupt") == len(damaged)
    assert tier.contains(keys) == expected
    assert read_ok(tier, keys[::-1]) == expected[::-1]  # asked for out of slot order: same blocks
    tier.close()


def test_read_depth_outside_its_range_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"l3.read_depth: expected an integer in 1..64, got 0"):
        DiskTier(tmp_path / "l3", LAYOUT, 8, read_depth=0)


SLICED = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=8)  # 4 KiB per layer


@pytest.mark.parametrize("read_depth", [1, 4])
def test_a_read_in_parts_lands_slice_by_slice_then_verifies_each_block(tmp_path, read_depth):
    """get_in_parts reads slice 0 of every block first; progress(n) comes only once slices [0, n) of
    every block are in place; the result is get's, a flipped byte costing exactly its block."""
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", SLICED, 40, on_failure=hook, read_depth=read_depth)
    keys = put_keys(tier, range(20), SLICED)
    slot = {r.key: r.slot for r in tier.records()}
    damaged = {2: 10, 11: SLICED.block_bytes - 5}  # block -> byte flipped (first and last slice)
    for i, offset in damaged.items():
        flip_byte(tier.path / "slots.bin", slot[keys[i]] * tier.stride + offset)
    dst = [aligned_block(SLICED) for _ in keys]
    part = SLICED.block_bytes // 4
    seen, wrong = [], []

    def progress(n: int) -> None:
        seen.append(n)
        for i, (d, k) in enumerate(zip(dst, keys)):
            got = d.view(torch.uint8).view(-1)[: n * part]
            want = block_for(k, SLICED).view(torch.uint8).view(-1)[: n * part]
            if i not in damaged and not torch.equal(got, want):
                wrong.append((n, i))

    flags = tier.get_in_parts(keys, dst, 4, progress)
    assert flags == [i not in damaged for i in range(len(keys))]
    assert all(same_bytes(d, block_for(k, SLICED)) for i, (d, k) in enumerate(zip(dst, keys)) if flags[i])
    assert seen == sorted(set(seen)) and all(1 <= n < 4 for n in seen) and wrong == []
    assert hook.count("corrupt") == len(damaged)
    assert tier.contains(keys) == flags  # the bad ones were removed
    tier.close()


def test_a_read_in_parts_that_cannot_be_cut_is_a_plain_get(tmp_path):
    """Slices that are not whole O_DIRECT units (or a destination that is not page-aligned): the
    same result as get, no progress before the end."""
    tier = DiskTier(tmp_path / "l3", LAYOUT, 8)
    keys = put_keys(tier, range(4))
    seen = []
    for parts, aligned in ((2, True), (1, True), (2, False)):
        dst = [aligned_block(LAYOUT) if aligned else plain_block(LAYOUT) for _ in keys]
        assert tier.get_in_parts(keys, dst, parts, seen.append) == [True] * 4
        assert all(same_bytes(d, block_for(k, LAYOUT)) for d, k in zip(dst, keys))
    assert seen == []
    tier.close()
