"""Helpers shared by the tests and their subprocess workers.

Blocks are derived from their key, so any process can recompute the bytes a
block must hold and a checker needs no record of what was written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash

from tierkv.config import CostConfig, L2Config, L3Config, PolicyConfig, StoreConfig
from tierkv.layout import KVLayout

# 2 x 2 x 8 x 2 x 32 fp16 = 4096 bytes: one page, so L3 reads land in L1 slots with O_DIRECT.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8)
# 3 x 2 x 4 x 1 x 24 fp16 = 1152 bytes: not a page multiple, so L3 goes through its bounce buffer.
ODD_LAYOUT = KVLayout(num_layers=3, num_kv_heads=1, head_dim=24, block_size=4)


def key_of(*parts: object) -> bytes:
    """A 16-byte key named by ``parts`` (for tier tests that need no chain)."""
    return xxhash.xxh3_128_digest("|".join(map(str, parts)).encode())


def block_for(key: bytes, layout: KVLayout) -> torch.Tensor:
    """The block a key stands for: random bytes seeded by the key (NaN patterns included)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    raw = bytearray(rng.bytes(layout.block_bytes))
    return torch.frombuffer(raw, dtype=torch.uint8).view(layout.torch_dtype).view(layout.block_shape)


def as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (fp16 NaNs compare unequal as numbers, so never compare values)."""
    return a.shape == b.shape and torch.equal(as_u8(a), as_u8(b))


def store_config(layout: KVLayout, l2: int, l3: int, path: str | Path, **fields) -> StoreConfig:
    """A StoreConfig with L2/L3 capacities given in blocks of ``layout`` (0 disables the tier).

    Unless given, the policy is LRU with write-back and recompute is priced so high
    that the cost model never cuts a match: tests then know exactly what is where.
    """
    fields.setdefault("policy", PolicyConfig(name="lru", write="write_back"))
    fields.setdefault("cost", CostConfig(recompute_us_per_token=1e6))
    return StoreConfig(
        l2=L2Config(capacity=l2 * layout.block_bytes, pin=False),
        l3=L3Config(path=str(path), capacity=max(l3, 1) * layout.block_bytes),
        l3_enabled=l3 > 0,
        **fields,
    )


def prompt(seed: int, num_blocks: int, layout: KVLayout, tail: int = 0) -> list[int]:
    """Token ids of ``num_blocks`` full blocks (+ ``tail`` tokens), distinct per seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, num_blocks * layout.block_size + tail).tolist()


def save_prompt(store, token_ids: Sequence[int], namespace: str | None = None) -> list[bytes]:
    """What an engine does with a new prompt: look it up (a miss, which advances the
    index clock), prefill into fresh L1 slots (here: write each block's bytes), save, release."""
    keys = store.hash(token_ids, namespace)
    m = store.lookup_keys(keys)
    slots = store.allocate(len(keys))
    for key, slot in zip(keys, slots):
        store.l1.block(slot).copy_(block_for(key, store.layout))
    adopted = store.save(keys, slots, 0, m)
    store.release(m)
    if not all(adopted):
        store.free([s for s, a in zip(slots, adopted) if not a])
    return keys
