"""Compressed L4 values on a real redis-server (and a Redis Cluster): round trips of every dtype and
layout, damaged stored bytes found before decoding (a counted miss), old raw values beside new
compressed ones, and the trailer recording the stored size and how it was coded."""

from __future__ import annotations

import pytest
import torch

from _kv import key_of
from test_compress import SHAPES, kv_block, layout_of, noise_block, real_like_block, same
from test_tiers_disk import Hook
from tierkv.compress import FLAG_SHUFFLE, FLAG_ZSTD
from tierkv.config import L4Config
from tierkv.layout import DTYPES
from tierkv.tiers.remote import open_remote
from tierkv.tiers.remote.codec import CODED_SHIFT, FLAG_MAC, TRAILER_BYTES

pytestmark = pytest.mark.timeout(120)


def tier_for(url, layout, hook=None, **fields):
    fields.setdefault("timeout_ms", 2000)
    return open_remote(L4Config(url=url, **fields), layout, hook)


def stored_value(server, tier, key: bytes) -> bytes:
    return server.client().get(tier.key_name(key))


def trailer_flags(value: bytes) -> tuple[int, int]:
    """(flags, payload length) of a stored value's trailer."""
    tail = value[-TRAILER_BYTES:]
    return int.from_bytes(tail[6:8], "little"), int.from_bytes(tail[32:40], "little")


def destinations(layout, kind: str, n: int) -> list[torch.Tensor]:
    if kind == "dense":
        return list(torch.empty((n, *layout.block_shape), dtype=layout.torch_dtype))
    *lead, dim = layout.block_shape
    return [torch.empty((*lead, 2 * dim), dtype=layout.torch_dtype)[..., :dim] for _ in range(n)]  # strided


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_compressed_values_round_trip_every_dtype_and_layout(redis_server, dtype, shape):
    layout = layout_of(shape, dtype)
    hook = Hook()
    tier = tier_for(redis_server.url, layout, hook, compress="zstd", compress_threads=2)
    keys = [key_of("l4z", dtype, shape, i) for i in range(5)]
    noise = key_of("l4z noise", dtype, shape)
    blocks = [kv_block(k, layout) for k in keys] + [noise_block(noise, layout)]
    assert tier.put(keys + [noise], blocks) == [True] * 6
    for k in keys:
        value = stored_value(redis_server, tier, k)
        flags, size = trailer_flags(value)
        coded = FLAG_ZSTD | (FLAG_SHUFFLE if layout.itemsize > 1 else 0)
        assert flags >> CODED_SHIFT == coded and size == len(value) - TRAILER_BYTES < layout.block_bytes
    assert trailer_flags(stored_value(redis_server, tier, noise)) == (0, layout.block_bytes)  # kept raw
    real = [key_of("l4z real", dtype, shape, i) for i in range(3)]  # raw planes inside compressed values
    assert tier.put(real, [real_like_block(k, layout) for k in real]) == [True] * 3
    keys, blocks = keys + [noise] + real, blocks + [real_like_block(k, layout) for k in real]
    coded = sum(trailer_flags(stored_value(redis_server, tier, k))[0] != 0 for k in keys)
    for kind in ("dense", "strided"):
        dst = destinations(layout, kind, len(keys))
        assert tier.get(keys, dst) == [True] * len(keys)
        assert all(same(d, b) for d, b in zip(dst, blocks))
    assert hook.calls == []
    stats = tier.stats()
    assert coded >= 5 and stats["coded_hits"] == 2 * coded and stats["stored_bytes_written"] < stats["bytes_written"]
    tier.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_damaged_compressed_values_are_counted_misses_never_wrong_kv(redis_server, where):
    layout = layout_of(SHAPES[0], "bfloat16")
    hook = Hook()
    tier = tier_for(redis_server.url, layout, hook, compress="zstd")
    keys = [key_of("l4 damage", where, i) for i in range(3)]
    assert tier.put(keys, [kv_block(k, layout) for k in keys]) == [True] * 3
    value = bytearray(stored_value(redis_server, tier, keys[1]))
    stored = len(value) - TRAILER_BYTES
    at = {"first": 0, "middle": stored // 2, "last": stored - 1}[where]
    value[at] ^= 0x10
    redis_server.client().set(tier.key_name(keys[1]), bytes(value))
    dst = destinations(layout, "dense", 3)
    assert tier.get(keys, dst) == [True, False, True]
    assert same(dst[0], kv_block(keys[0], layout)) and same(dst[2], kv_block(keys[2], layout))
    assert hook.count("corrupt") == 1
    tier.close()


def test_a_trailer_that_lies_about_the_stored_size_is_a_miss(redis_server):
    layout = layout_of(SHAPES[0], "float16")
    hook = Hook()
    tier = tier_for(redis_server.url, layout, hook, compress="zstd")
    key = key_of("l4 cut")
    assert tier.put([key], [kv_block(key, layout)]) == [True]
    value = stored_value(redis_server, tier, key)
    redis_server.client().set(tier.key_name(key), value[:100] + value[-TRAILER_BYTES:])  # cut short
    assert tier.get([key], destinations(layout, "dense", 1)) == [False]
    assert hook.count("truncated") == 1
    tier.close()


def test_old_raw_values_and_new_compressed_ones_read_by_any_reader(redis_server):
    layout = layout_of(SHAPES[0], "float32")
    old, new = [key_of("old raw", i) for i in range(3)], [key_of("new zstd", i) for i in range(3)]
    raw_tier = tier_for(redis_server.url, layout)
    assert raw_tier.put(old, [kv_block(k, layout) for k in old]) == [True] * 3
    zstd_tier = tier_for(redis_server.url, layout, compress="zstd")
    assert zstd_tier.put(new, [kv_block(k, layout) for k in new]) == [True] * 3
    both = [k for pair in zip(old, new) for k in pair]
    for reader in (raw_tier, zstd_tier):
        dst = destinations(layout, "dense", 6)
        assert reader.get(both, dst) == [True] * 6
        assert all(same(d, kv_block(k, layout)) for d, k in zip(dst, both))
    raw_tier.close()
    zstd_tier.close()


def test_compressed_values_with_a_mac(redis_server):
    layout = layout_of(SHAPES[1], "bfloat16")
    hook = Hook()
    tier = tier_for(redis_server.url, layout, hook, compress="zstd", auth_key="secret")
    keys = [key_of("mac", i) for i in range(4)]
    assert tier.put(keys, [kv_block(k, layout) for k in keys]) == [True] * 4
    flags, _ = trailer_flags(stored_value(redis_server, tier, keys[0]))
    assert flags & FLAG_MAC and flags >> CODED_SHIFT
    dst = destinations(layout, "dense", 4)
    assert tier.get(keys, dst) == [True] * 4 and all(same(d, kv_block(k, layout)) for d, k in zip(dst, keys))
    other = tier_for(redis_server.url, layout, hook, auth_key="another")
    assert other.get(keys[:1], destinations(layout, "dense", 1)) == [False]
    assert hook.count("unauthenticated") == 1
    tier.close()
    other.close()


def test_compressed_values_through_a_cluster(redis_cluster):
    layout = layout_of(SHAPES[0], "bfloat16")
    tier = tier_for(redis_cluster.url, layout, compress="zstd")
    keys = [key_of("cluster z", i) for i in range(6)]
    assert tier.put(keys, [kv_block(k, layout) for k in keys]) == [True] * 6
    dst = destinations(layout, "dense", 6)
    assert tier.get(keys, dst) == [True] * 6 and all(same(d, kv_block(k, layout)) for d, k in zip(dst, keys))
    tier.close()


def test_a_store_with_l4_compress_zstd_saves_and_another_store_loads(redis_server, tmp_path):
    """Through the store: node A (l4.compress zstd) demotes KV into the pool, node B (compress off)
    loads it into its L1 byte for byte."""
    from _kv import prompt, store_config
    from tierkv.index import Tier
    from tierkv.store import TierKVStore

    layout = layout_of(SHAPES[0], "bfloat16")

    def node(name: str, compress: str) -> TierKVStore:
        l4 = L4Config(url=redis_server.url, timeout_ms=2000, compress=compress)
        return TierKVStore(store_config(layout, 0, 0, tmp_path / name / "l3", l4=l4), layout, l1_blocks=8)

    a, b = node("a", "zstd"), node("b", "off")
    try:
        tokens = prompt(5, 4, layout)
        keys = a.hash(tokens)
        m = a.lookup_keys(keys)
        slots = a.allocate(len(keys))
        for key, slot in zip(keys, slots):
            a.l1.block(slot).copy_(kv_block(key, layout))
        assert all(a.save(keys, slots, 0, m))
        a.release(m)
        for round_ in range(8):  # evict A's L1 until every block went down to L4
            a.free(a.allocate(a.l1.capacity))
            a.transfer.io(lambda: None).result(timeout=60)
            if all(a.l4.contains(keys)):
                break
            filler = a.hash(prompt(100 + round_, 2, layout), "filler")
            fm = a.lookup_keys(filler)
            fs = a.allocate(len(filler))
            a.save(filler, fs, 0, fm)
            a.release(fm)
        assert all(a.l4.contains(keys)), a.stats()
        assert a.stats()["l4"]["stored_bytes_written"] < a.stats()["l4"]["bytes_written"]
        m = b.lookup(tokens)
        assert m.tiers == [Tier.L4] * 4
        dst = b.allocate(4)
        assert b.load(m, dst).wait(30).ok == [True] * 4
        for key, slot in zip(keys, dst):
            assert same(b.l1.block(slot), kv_block(key, layout))
        assert b.stats()["l4"]["coded_hits"] == 4
        b.release(m)
    finally:
        a.close()
        b.close()
