"""Byte-plane shuffle + zstd (tierkv.compress) and compressed L3: round trips of every dtype and
layout, damaged stored bytes found before decoding (a counted miss), a mixed raw + compressed L3,
the auto rule, and the config fields."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading

import lmdb
import numpy as np
import pytest
import torch

from _kv import key_of
from test_tiers_disk import Hook, aligned_block, plain_block
from tierkv.compress import FLAG_SHUFFLE, FLAG_ZSTD, WIN, AutoChooser, BlockCodec, choose, shuffle, unshuffle
from tierkv.config import L3Config, L4Config
from tierkv.layout import DTYPES, KVLayout
from tierkv.tiers.base import Lineage
from tierkv.tiers.disk import DiskTier

# (layers, kv heads, head dim, block size): a page multiple, and one that is not (bounce reads).
SHAPES = [(4, 2, 64, 16), (3, 1, 40, 12)]


def layout_of(shape, dtype: str) -> KVLayout:
    layers, heads, dim, size = shape
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=size, dtype=dtype)


def kv_block(key: bytes, layout: KVLayout) -> torch.Tensor:
    """KV-like values seeded by the key: small, on a coarse grid, so every dtype compresses."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    values = torch.round(torch.randn(layout.block_shape, generator=g) * 4) / 16
    return values.to(layout.torch_dtype)


def real_like_block(key: bytes, layout: KVLayout) -> torch.Tensor:
    """Values of full precision, as real KV holds: the exponent planes compress, the low mantissa
    planes do not (they are stored raw inside the compressed block)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return (torch.randn(layout.block_shape, generator=g) * 0.7).to(layout.torch_dtype)


def noise_block(key: bytes, layout: KVLayout) -> torch.Tensor:
    """Random bytes: nothing to compress, so the tier keeps them raw."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return torch.frombuffer(bytearray(rng.bytes(layout.block_bytes)), dtype=torch.uint8).view(
        layout.torch_dtype).view(layout.block_shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def put(tier: DiskTier, keys, make=kv_block) -> None:
    lineage = [Lineage(keys[i - 1] if i else None, i) for i in range(len(keys))]
    assert tier.put(keys, [make(k, tier.layout) for k in keys], lineage) == [True] * len(keys)


def read_back(tier: DiskTier, keys, aligned: bool, make=kv_block) -> list[bool]:
    dst = [aligned_block(tier.layout) if aligned else plain_block(tier.layout) for _ in keys]
    flags = tier.get(keys, dst)
    return [f and same(d, make(k, tier.layout)) for f, d, k in zip(flags, dst, keys)]


# -- the codec ------------------------------------------------------------------------------------

@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_shuffle_is_byte_planes_and_unshuffle_inverts_it(itemsize):
    src = np.random.default_rng(itemsize).integers(0, 256, 96 * itemsize, dtype=np.uint8)
    planes = shuffle(src, itemsize, np.empty_like(src))
    assert np.array_equal(planes.reshape(itemsize, -1), src.reshape(-1, itemsize).T)
    assert np.array_equal(unshuffle(planes, itemsize, np.empty_like(src)), src)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shuffled", [True, False])
def test_codec_round_trips_every_dtype(dtype, shuffled):
    layout = layout_of(SHAPES[0], dtype)
    block = kv_block(key_of("codec", dtype), layout)
    codec = BlockCodec(layout.itemsize, layout.block_bytes, level=3, threads=2, shuffled=shuffled)
    stored = codec.encode_many([block.view(torch.uint8).reshape(-1).numpy()] * 2)
    assert all(s is not None and len(s) < layout.block_bytes for s in stored)
    assert codec.flags == FLAG_ZSTD | (FLAG_SHUFFLE if shuffled and layout.itemsize > 1 else 0)
    dst = [bytearray(layout.block_bytes) for _ in stored]
    assert codec.decode_many([(s, codec.flags, d) for s, d in zip(stored, dst)]) == [True, True]
    assert all(bytes(d) == block.view(torch.uint8).numpy().tobytes() for d in dst)
    codec.close()


def test_codec_keeps_noise_raw_and_rejects_a_cut_frame():
    layout = layout_of(SHAPES[0], "float16")
    codec = BlockCodec(layout.itemsize, layout.block_bytes)
    assert codec.encode(noise_block(key_of("noise"), layout).view(torch.uint8).reshape(-1).numpy()) is None
    stored = codec.encode(kv_block(key_of("cut"), layout).view(torch.uint8).reshape(-1).numpy())
    assert not codec.decode_into(stored[:-7], codec.flags, bytearray(layout.block_bytes))
    assert not codec.decode_into(b"not a zstd frame", codec.flags, bytearray(layout.block_bytes))


def test_codec_decodes_a_frame_lying_at_the_start_of_its_own_destination():
    """An L4 value lands its stored bytes at its block's start and is decoded there."""
    layout = layout_of(SHAPES[0], "bfloat16")
    for shuffled, make in ((True, kv_block), (True, real_like_block), (False, kv_block)):
        codec = BlockCodec(layout.itemsize, layout.block_bytes, shuffled=shuffled)
        block = make(key_of("alias", shuffled), layout).view(torch.uint8).reshape(-1)
        stored = codec.encode(block.numpy())
        raw_planes = [int.from_bytes(stored[4 * k:4 * k + 4], "little") == layout.block_bytes // 2
                      for k in range(2)]
        assert not shuffled or raw_planes == [make is real_like_block, False]
        dst = bytearray(layout.block_bytes)
        dst[:len(stored)] = stored
        assert codec.decode_into(memoryview(dst)[:len(stored)], codec.flags, dst)
        assert bytes(dst) == block.numpy().tobytes()


def test_choose_needs_a_gain_of_win():
    assert choose(1.5, 3.0, 0.125).on  # 1 Gbit/s: fewer bytes over a slow link win
    assert not choose(1.5, 3.0, 1.25).on  # 10 Gbit/s: decoding costs more than the bytes saved
    assert not choose(1.0, 100.0, 0.1).on
    slow = choose(2.0, 1e9, 1.0)
    assert slow.on and slow.gain == pytest.approx(2.0, rel=1e-6) and slow.gain >= WIN


def test_auto_chooser_is_off_until_measured_then_follows_the_link():
    layout = layout_of(SHAPES[0], "bfloat16")
    block = kv_block(key_of("auto"), layout).view(torch.uint8).reshape(-1).numpy()
    slow, fast = (AutoChooser(BlockCodec(layout.itemsize, layout.block_bytes)) for _ in range(2))
    for chooser in (slow, fast):
        for _ in range(AutoChooser.MIN_SAMPLES):
            assert not chooser.choice.on
            chooser.sample(block)
    slow.raw_read(AutoChooser.MIN_RAW_BYTES, 1000.0)  # 8 KB/s: any ratio > 1 wins
    fast.raw_read(AutoChooser.MIN_RAW_BYTES, 1e-9)    # faster than any decoder
    assert slow.choice.on and slow.choice.why.startswith("zstd")
    assert not fast.choice.on and fast.choice.why.startswith("off")


@pytest.mark.parametrize("field, value, allowed", [
    ("compress", "lz4", "['off', 'zstd', 'auto']"),
    ("compress_level", 23, "[-7, 22]"),
    ("compress_threads", 0, "[1, 64]"),
])
def test_config_names_the_field_and_what_is_allowed(field, value, allowed):
    for cls, section in ((L3Config, "l3"), (L4Config, "l4")):
        with pytest.raises(ValueError, match=rf"^{section}\.{field}: expected .*{allowed}".replace("[", r"\[")):
            cls(**{field: value})
    with pytest.raises(ValueError, match="l4.compress: expected 'off' with a mooncake"):
        L4Config(url="mooncake://127.0.0.1:50051", compress="zstd")
    with pytest.raises(ValueError, match="l3.compress: expected one of"):
        DiskTier(tempfile.mkdtemp(), layout_of(SHAPES[0], "float16"), 4, compress="on")


# -- compressed L3 --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_l3_round_trips_compressed_blocks_of_every_dtype_and_layout(tmp_path, dtype, shape):
    layout = layout_of(shape, dtype)
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", layout, 32, on_failure=hook, compress="zstd", compress_threads=2)
    keys = [key_of("l3", dtype, shape, i) for i in range(6)]
    noise = [key_of("l3 noise", dtype, shape, i) for i in range(2)]
    put(tier, keys)
    put(tier, noise, noise_block)
    recs = {r.key: r for r in tier.records()}
    saves_a_page = tier.stride - 4096 > 0
    for k in keys:  # KV that saves a page is stored compressed, its size recorded
        assert bool(recs[k].flags) == saves_a_page
        assert recs[k].stored < layout.block_bytes if recs[k].flags else recs[k].stored == layout.block_bytes
    assert all(recs[k].flags == 0 for k in noise)  # noise stays raw
    real = [key_of("l3 real", dtype, shape, i) for i in range(3)]
    put(tier, real, real_like_block)
    for aligned in (True, False):
        assert read_back(tier, keys, aligned) == [True] * len(keys)
        assert read_back(tier, noise, aligned, noise_block) == [True, True]
        assert read_back(tier, real, aligned, real_like_block) == [True] * 3
    full = torch.empty(layout.block_shape, dtype=layout.torch_dtype)
    *lead, dim = layout.block_shape
    strided = torch.empty((*lead, 2 * dim), dtype=layout.torch_dtype)[..., :dim]  # not contiguous
    assert tier.get(keys[:1], [full]) == [True] and same(full, kv_block(keys[0], layout))
    assert tier.get(keys[2:3], [strided]) == [True] and same(strided, kv_block(keys[2], layout))
    assert tier.verify() == (11, [])
    assert tier.read_raw(keys[1]) == kv_block(keys[1], layout).view(torch.uint8).numpy().tobytes()
    assert hook.calls == []
    tier.close()


def test_l3_get_in_parts_of_compressed_blocks_is_a_whole_get(tmp_path):
    layout = layout_of(SHAPES[0], "bfloat16")
    tier = DiskTier(tmp_path / "l3", layout, 16, compress="zstd")
    keys = [key_of("parts", i) for i in range(4)]
    put(tier, keys)
    dst = [aligned_block(layout) for _ in keys]
    seen = []
    assert tier.get_in_parts(keys, dst, 2, seen.append) == [True] * 4
    assert all(same(d, kv_block(k, layout)) for d, k in zip(dst, keys))
    tier.close()


def _stored_offset(tier: DiskTier, key: bytes) -> tuple[int, int]:
    rec = next(r for r in tier.records() if r.key == key)
    assert rec.flags, "the block must be stored compressed for this test"
    return rec.slot * tier.stride, rec.stored


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_l3_damaged_compressed_bytes_are_a_counted_miss_never_wrong_kv(tmp_path, where):
    layout = layout_of(SHAPES[0], "bfloat16")
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", layout, 16, on_failure=hook, compress="zstd", direct_io=False)
    keys = [key_of("damage", where, i) for i in range(3)]
    put(tier, keys)
    offset, stored = _stored_offset(tier, keys[1])
    at = {"first": 0, "middle": stored // 2, "last": stored - 1}[where]
    with open(tmp_path / "l3" / "slots.bin", "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)[0]
        f.seek(offset + at)
        f.write(bytes([byte ^ 0x40]))
    dst = [aligned_block(layout) for _ in keys]
    before = [d.clone() for d in dst]
    flags = tier.get(keys, dst)
    assert flags == [True, False, True]
    assert same(dst[0], kv_block(keys[0], layout)) and same(dst[2], kv_block(keys[2], layout))
    assert not same(dst[1], kv_block(keys[1], layout)) and same(dst[1], before[1])  # never decoded
    assert hook.count("corrupt") == 1
    assert tier.contains(keys) == [True, False, True]  # the bad record is removed
    tier.close()


def test_l3_record_whose_stored_size_was_changed_is_a_counted_miss(tmp_path):
    """An index entry damaged to claim other stored bytes fails the checksum: nothing is decoded."""
    layout = layout_of(SHAPES[0], "float32")
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", layout, 16, on_failure=hook, compress="zstd")
    keys = [key_of("size", i) for i in range(2)]
    put(tier, keys)
    _stored_offset(tier, keys[0])
    tier.close()
    env = lmdb.open(str(tmp_path / "l3" / "index"), max_dbs=4, subdir=True, lock=True)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(keys[0], db=blocks))
        stored = int.from_bytes(raw[24:28], "little")
        raw[24:28] = (stored - 100).to_bytes(4, "little")
        txn.put(keys[0], bytes(raw), db=blocks)
    env.close()
    tier = DiskTier(tmp_path / "l3", layout, 16, on_failure=hook, compress="zstd")
    assert read_back(tier, keys, aligned=True) == [False, True]
    assert hook.count("corrupt") == 1
    tier.close()


def test_mixed_l3_old_raw_and_new_compressed_blocks_read_by_any_opener(tmp_path):
    layout = layout_of(SHAPES[0], "float16")
    path = tmp_path / "l3"
    old = [key_of("mixed raw", i) for i in range(4)]
    new = [key_of("mixed zstd", i) for i in range(4)]
    tier = DiskTier(path, layout, 16)  # what an earlier tierkv wrote: raw 24/40-byte records
    put(tier, old)
    tier.close()
    tier = DiskTier(path, layout, 16, compress="zstd")
    put(tier, new)
    recs = {r.key: r for r in tier.records()}
    assert all(recs[k].flags == 0 for k in old) and all(recs[k].flags for k in new)
    both = [k for pair in zip(old, new) for k in pair]  # interleaved in one batch
    for aligned in (True, False):
        assert read_back(tier, both, aligned) == [True] * 8
    tier.close()
    tier = DiskTier(path, layout, 16)  # compress off still reads what zstd wrote
    assert read_back(tier, both, aligned=True) == [True] * 8
    assert tier.verify() == (8, [])
    tier.remove(new[:2])  # a compressed block's slot goes back to the free list
    put(tier, [key_of("mixed again", i) for i in range(2)])
    assert tier.used == 8
    tier.close()


def test_l3_codes_a_put_before_taking_the_directory_writer_lock(tmp_path):
    """zstd runs outside LMDB's write transaction: while one put codes its blocks, another writer
    of the directory (here a remove on another thread) gets the lock and commits."""
    layout = layout_of(SHAPES[0], "bfloat16")
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", layout, 16, compress="zstd", on_failure=hook)
    put(tier, [key_of("probe victim")])
    codec, committed = tier._codec, []
    encode_many = codec.encode_many

    def probing(views, limit=None):
        other = threading.Thread(target=lambda: committed.append(tier.remove([key_of("probe victim")])))
        other.start()
        other.join(60)  # generous: on the old order it waits for this very put, and never gets in
        committed.append(not other.is_alive())
        return encode_many(views, limit)

    codec.encode_many = probing
    keys = [key_of("probe", i) for i in range(3)]
    put(tier, keys)
    codec.encode_many = encode_many
    assert committed == [None, True]  # the remove ran to its end while the put was coding
    assert read_back(tier, keys, aligned=True) == [True] * 3
    assert tier.contains([key_of("probe victim")]) == [False] and tier.used == 3
    assert all(r.flags for r in tier.records()) and hook.calls == []
    tier.close()


def test_l3_puts_from_threads_on_one_directory_code_and_read_back_correctly(tmp_path):
    """Four threads put compressed blocks into one L3 store (overlapping keys) and read what the
    others wrote: every block reads back exactly, none is lost or stored twice."""
    layout = layout_of(SHAPES[0], "float16")
    path = tmp_path / "l3"
    hook = Hook()
    tier = DiskTier(path, layout, 256, compress="zstd", compress_threads=2, on_failure=hook)
    keys = [[key_of("threads", w, i) for i in range(40)] + [key_of("threads shared", i) for i in range(20)]
            for w in range(4)]
    wrong, barrier = [], threading.Barrier(4)

    def work(w: int) -> None:
        barrier.wait(60)
        mine = keys[w]
        for i in range(0, len(mine), 3):
            batch = mine[i:i + 3]
            put(tier, batch)
            theirs = [k for k in keys[(w + 1) % 4][:i + 3] if tier.contains([k])[0]]
            wrong.extend(k for k, ok in zip(theirs, read_back(tier, theirs, aligned=w % 2 == 0)) if not ok)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a put deadlocked"
    assert wrong == [] and hook.calls == []
    every = sorted({k for ks in keys for k in ks})
    assert tier.used == len(every) == 4 * 40 + 20
    assert read_back(tier, every, aligned=True) == [True] * len(every)
    assert len({r.slot for r in tier.records()}) == len(every)  # one slot per block
    assert all(r.flags for r in tier.records())
    tier.close()


def test_l3_auto_stays_raw_on_a_fast_disk_and_records_its_choice(tmp_path):
    """The page cache (buffered IO) reads far faster than zstd decodes: auto must stay off."""
    layout = layout_of(SHAPES[0], "bfloat16")
    tier = DiskTier(tmp_path / "l3", layout, 512, compress="auto", direct_io=False)
    keys = [key_of("auto l3", i) for i in range(384)]
    for i in range(0, len(keys), 32):
        put(tier, keys[i:i + 32])
    for _ in range(2):
        assert read_back(tier, keys, aligned=True) == [True] * len(keys)
    tier._auto.raw_read(AutoChooser.MIN_RAW_BYTES, 1e-9)  # and whatever this machine's disk did: fast
    put(tier, [key_of("auto l3 after")])
    choice = tier.compression()["auto"]
    assert choice is not None and choice["on"] is False
    assert all(r.flags == 0 for r in tier.records())
    assert tier.meta()["compress_auto"].startswith("off")
    tier.close()
    assert os.path.exists(tmp_path / "l3" / "slots.bin")


@pytest.mark.parametrize("flags, stored", [(0, 100), (3, 0), (3, 1 << 20)])
def test_l3_compressed_record_that_cannot_be_one_is_dropped_at_open_and_counted(tmp_path, flags, stored):
    """A 32-byte record without flags, or claiming no bytes or more than a block, is malformed."""
    layout = layout_of(SHAPES[0], "bfloat16")
    tier = DiskTier(tmp_path / "l3", layout, 16, compress="zstd")
    keys = [key_of("malformed", i) for i in range(2)]
    put(tier, keys)
    tier.close()
    env = lmdb.open(str(tmp_path / "l3" / "index"), max_dbs=4, subdir=True, lock=True)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(keys[0], db=blocks))
        raw[24:32] = stored.to_bytes(4, "little") + flags.to_bytes(4, "little")
        txn.put(keys[0], bytes(raw), db=blocks)
    env.close()
    hook = Hook()
    tier = DiskTier(tmp_path / "l3", layout, 16, on_failure=hook, compress="zstd")
    assert hook.count("corrupt") == 1
    assert tier.contains(keys) == [False, True]
    assert read_back(tier, keys[1:], aligned=True) == [True]
    tier.close()


def test_a_store_with_l3_compress_zstd_writes_compressed_blocks_that_a_raw_store_reads(tmp_path):
    """``l3.compress`` reaches the store's L3 (tierset): compressed records on disk, and a store with
    compression off, restarted on the same directory, loads every block byte for byte."""
    from _kv import prompt, same_bytes, store_config

    from tierkv.config import L3Config
    from tierkv.store import TierKVStore

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=64, dtype="bfloat16")  # 64 KiB
    tokens = prompt(5, 4, layout)
    g = torch.Generator().manual_seed(3)
    written = [(torch.randn(layout.block_shape, generator=g) * 0.2).to(torch.bfloat16) for _ in range(4)]

    def store(compress: str) -> TierKVStore:
        cfg = store_config(layout, 0, 16, tmp_path / "l3")
        cfg = dataclasses.replace(cfg, l3=L3Config(path=str(tmp_path / "l3"), capacity=16 * layout.block_bytes,
                                                   compress=compress))
        return TierKVStore(cfg, layout, l1_blocks=8)

    first = store("zstd")
    keys = first.hash(tokens)
    m = first.lookup_keys(keys)
    slots = first.allocate(len(keys))
    for slot, block in zip(slots, written):
        first.l1.block(slot).copy_(block)
    first.save(keys, slots, 0, m)
    first.release(m)
    assert first.persist(keys) == 4
    assert first.l3.compression()["mode"] == "zstd"
    recs = {r.key: r for r in first.l3.records()}
    assert all(recs[k].flags != 0 and recs[k].stored < layout.block_bytes for k in keys)
    first.close()
    second = store("off")
    m = second.lookup(tokens)
    assert m.num_blocks == 4
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in m.to_load]
    assert second.load(m, dst).wait(30).ok == [True] * 4
    assert all(same_bytes(d, written[i]) for d, i in zip(dst, m.to_load))
    second.release(m)
    second.close()
