"""Mooncake under memory pressure: objects the master evicts after a successful put are misses, never wrong data."""

from __future__ import annotations

import time

import pytest
import torch
from _kv import block_for, key_of, same_bytes

from tierkv.config import L4Config
from tierkv.layout import KVLayout
from tierkv.tiers.remote import open_remote

pytestmark = pytest.mark.timeout(120)

# 256 KiB blocks: a 16 MiB segment (Mooncake's minimum) holds about 60 of them.
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=64)


def test_evicted_objects_are_misses_never_wrong_data(make_mooncake_pool):
    pool = make_mooncake_pool(str(16 << 20), "--eviction_high_watermark_ratio=0.6", "--eviction_ratio=0.3",
                              "--default_kv_lease_ttl=200")
    failures = []
    tier = open_remote(L4Config(url=pool.url, timeout_ms=2000), BIG, lambda *a: failures.append(a))
    try:
        keys = [key_of("pressure", i) for i in range(240)]
        stored = []
        for start in range(0, len(keys), 8):
            batch = keys[start:start + 8]
            # The master evicts on its own thread: a batch refused for space (all False) is retried
            # a few times so that eviction, not the put rate, decides what is kept (on a loaded host
            # 23 of 30 batches in a row were refused before its thread ran).
            for _ in range(20):
                ok = tier.put(batch, [block_for(k, BIG) for k in batch])
                if any(ok):
                    break
                time.sleep(0.05)
            stored += [k for k, flag in zip(batch, ok) if flag]
        assert len(stored) > 100, f"the pool took only {len(stored)} of {len(keys)} puts"
        dst = [torch.full(BIG.block_shape, 7.0, dtype=BIG.torch_dtype) for _ in keys]
        got = []
        for start in range(0, len(keys), 16):
            got += tier.get(keys[start:start + 16], dst[start:start + 16])
        hits = [k for k, flag in zip(keys, got) if flag]
        # Eviction happened: most successful puts are gone, yet some recent ones are still readable.
        assert 0 < len(hits) < len(stored) // 2, (len(hits), len(stored))
        for key, flag, out in zip(keys, got, dst):
            if flag:
                assert key in stored and same_bytes(out, block_for(key, BIG))
        assert tier.stats()["misses"] == len(keys) - len(hits)
        assert tier.contains(keys).count(True) == len(hits)
    finally:
        tier.close()
