"""Whole stores under the non-default settings: sha256 and keyed blake2b keys, the LFU policy.

The unit tests check the hash functions and the policies alone; here a real store
(L1, L2, an L3 directory, a restart) runs on them, so config -> store -> tiers wiring
is what fails if it breaks.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import xxhash

from _kv import block_for, prompt, same_bytes, save_prompt
from tierkv.config import HashingConfig, PolicyConfig
from tierkv.index import Tier

L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3
KEY_A, KEY_B = "0f" * 32, "f0" * 32


def reference_chain(algorithm: str, key: str, store, tokens: list[int]) -> list[bytes]:
    """docs/design.md §3 with hashlib alone: the seed from model, revision, layout and namespace."""
    def digest(data: bytes) -> bytes:
        if algorithm == "sha256":
            return hashlib.sha256(data).digest()[:16]
        return hashlib.blake2b(data, digest_size=16, key=bytes.fromhex(key)).digest()

    cfg = store.config
    # The identity a store declares from its config alone: these three fields, as sorted-key JSON.
    declared = json.dumps({"model_id": cfg.model_id, "model_revision": cfg.model_revision, "source": "declared"},
                          sort_keys=True, separators=(",", ":"))
    identity = xxhash.xxh3_128_hexdigest(declared.encode())
    parts = ("tierkv-v1", cfg.model_id, cfg.model_revision, store.layout.fingerprint, cfg.namespace,
             "identity:" + identity)
    prev = digest("\x1f".join(f"{len(p)}:{p}" for p in parts).encode())
    out, bs = [], store.block_size
    for i in range(len(tokens) // bs):
        prev = digest(prev + b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i * bs:(i + 1) * bs]))
        out.append(prev)
    return out


def load_exact(store, tokens: list[int]) -> list[int]:
    """Look ``tokens`` up, load what matched into plain tensors, check every byte; the tiers matched."""
    m = store.lookup(tokens)
    dst = [torch.empty(store.layout.block_shape, dtype=store.layout.torch_dtype) for _ in m.to_load]
    result = store.load(m, dst).wait(30)
    assert result.num_ok == m.num_blocks
    for j, i in enumerate(m.to_load):
        assert same_bytes(dst[j], block_for(m.keys[i], store.layout)), i
    store.release(m)
    return list(m.tiers)


@pytest.mark.parametrize("algorithm,key", [("sha256", ""), ("blake2b", KEY_A)], ids=["sha256", "blake2b"])
def test_a_store_keyed_by_a_slower_hash_works_end_to_end_and_across_a_restart(make_store, layout, algorithm, key):
    hashing = HashingConfig(algorithm=algorithm, key=key)
    store = make_store(l1=4, l2=2, l3=16, hashing=hashing)
    a, b = prompt(501, 4, layout, tail=3), prompt(502, 4, layout)
    keys = save_prompt(store, a)
    assert keys == store.hash(a) == reference_chain(algorithm, key, store, a)
    save_prompt(store, b)                     # pushes a down: 2 blocks to L2, the rest to L3
    assert sorted(load_exact(store, a)) == [L2, L2, L3, L3]
    store.persist(store.hash(a))              # L2 is memory: a's L2 blocks reach the disk too
    assert store.persist(store.hash(b)) == 4  # b was only in L1
    assert store.l3.used == 8
    store.close()
    again = make_store(l1=4, l2=2, l3=16, hashing=hashing)
    for tokens in (a, b):
        assert load_exact(again, tokens) == [L3] * 4
    again.close()
    # Keys are the hash's: another algorithm, or blake2b under another key, hits nothing there.
    others = [HashingConfig()] + ([HashingConfig(algorithm="blake2b", key=KEY_B)] if algorithm == "blake2b"
                                  else [HashingConfig(algorithm="blake2b", key=KEY_A)])
    for other in others:
        foreign = make_store(l1=4, l2=2, l3=16, hashing=other)
        assert foreign.l3.used == 8
        assert foreign.lookup(a, pin=False).num_blocks == 0 and foreign.lookup(b, pin=False).num_blocks == 0
        foreign.close()


def one_block_prompts(layout, n: int) -> list[list[int]]:
    return [prompt(600 + i, 1, layout) for i in range(n)]


@pytest.mark.parametrize("policy,victim", [("lfu", 1), ("lru", 0)])
def test_the_policy_named_in_config_picks_the_store_s_victims(make_store, layout, policy, victim):
    """Three one-block chains in a full L1: A used 3 times first, C twice, B once last.
    LFU evicts B (fewest uses), LRU evicts A (longest unused); the victim moves to L2."""
    store = make_store(l1=3, l2=8, l3=0, policy=PolicyConfig(name=policy, write="write_back"))
    chains = one_block_prompts(layout, 4)
    for tokens in chains[:3]:
        save_prompt(store, tokens)
    for i, uses in ((0, 3), (2, 2), (1, 1)):
        for _ in range(uses):
            assert load_exact(store, chains[i]) == [L1]
    save_prompt(store, chains[3])             # L1 is full: one of A, B, C goes down to L2
    where = [store.lookup(c, pin=False).tiers for c in chains]
    assert where[victim] == [L2]
    assert [w for i, w in enumerate(where) if i != victim] == [[L1]] * 3
    assert store.stats()["evictions"] == {"l1": 1}
    assert load_exact(store, chains[victim]) == [L2]


def test_lfu_keeps_a_hot_block_through_a_scan(make_store, layout):
    """The case LFU exists for: one block used often survives a scan of many used once (LRU would drop it)."""
    store = make_store(l1=4, l2=0, l3=0, policy=PolicyConfig(name="lfu", write="write_back"))
    chains = one_block_prompts(layout, 12)
    save_prompt(store, chains[0])
    for _ in range(5):
        assert load_exact(store, chains[0]) == [L1]
    for tokens in chains[1:]:                 # a scan: each block once, 11 blocks through 4 slots
        save_prompt(store, tokens)
    assert store.lookup(chains[0], pin=False).tiers == [L1]
    assert store.stats()["evictions"]["l1"] == 11 - 3
