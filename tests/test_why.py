"""``why.explain`` on a real store: evictions the vLLM worker's store logs (``acquire_store``), and
blocks held under another request's extra keys (cache_salt, LoRA) named without the salt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _kv import LAYOUT, block_for, store_config

from tierkv.connectors.vllm.shared_store import acquire_store, release_store
from tierkv.identity import ModelIdentity, lora_key, salt_keys
from tierkv.seeds import SEEDS_FILE
from tierkv.store import TierKVStore
from tierkv.why import EVICTION_LOG_FILE, explain

IDENTITY = ModelIdentity.of({"model_id": "m", "weights": "w1"})
A = list(range(3, 3 + 4 * LAYOUT.block_size))      # 4 full blocks
B = list(range(100, 100 + 4 * LAYOUT.block_size))  # 4 more: with L3 of 4 blocks, A is evicted
C = list(range(200, 200 + 4 * LAYOUT.block_size))


def put(store: TierKVStore, tokens: list[int], extra_keys: tuple[str, ...] = ()) -> list[bytes]:
    keys = store.hash(tokens, None, extra_keys)
    assert all(store.put_blocks(keys, [block_for(k, LAYOUT) for k in keys]))
    store.flush()
    return keys


def test_a_vllm_workers_store_logs_its_l3_evictions_for_why(tmp_path: Path):
    """The worker's full store keeps the eviction log: A evicted from L3 reads "evicted from l3",
    in the process and, after the worker closed, in a store a later process opens; the
    scheduler's view keeps none (it would save an empty log over the worker's)."""
    cfg = store_config(LAYOUT, 0, 4, tmp_path / "l3")
    worker = acquire_store(cfg, LAYOUT, "worker", IDENTITY)
    try:
        put(worker, A)
        put(worker, B)
        assert [(b.status, b.tier) for b in explain(worker, A)] == [("evicted", "l3")] * 4
        assert [(b.status, b.tier) for b in explain(worker, B)] == [("held", "l3")] * 4
    finally:
        release_store(worker)
    assert (tmp_path / "l3" / EVICTION_LOG_FILE).exists()
    view = acquire_store(cfg, LAYOUT, "scheduler", IDENTITY)
    try:
        assert view.evictions is None
    finally:
        release_store(view)
    later = TierKVStore(cfg, LAYOUT, identity=IDENTITY)
    try:
        later.keep_eviction_log()
        assert [(b.status, b.tier) for b in explain(later, A)] == [("evicted", "l3")] * 4
    finally:
        later.close()


SALTED = salt_keys("tenant-1")
LORA_C = lora_key("sql", "c" * 32)


def statuses(store: TierKVStore, tokens: list[int], extra_keys: tuple[str, ...] = (), other_salts: bool = False):
    return {(b.status, b.tier, b.differs) for b in explain(store, tokens, None, extra_keys, other_salts)}


@pytest.fixture
def seeded(tmp_path: Path):
    """A store that keeps a seed log, with A stored under the salt tenant-1 and under LoRA sql."""
    store = TierKVStore(store_config(LAYOUT, 0, 64, tmp_path / "l3"), LAYOUT, identity=IDENTITY)
    store.keep_seed_log()
    put(store, A, SALTED)
    put(store, B, (LORA_C,))
    yield store
    store.close()


def test_a_prompt_under_another_salt_is_named_without_the_salt(seeded, tmp_path: Path):
    got = statuses(seeded, A, other_salts=True)
    assert got == {("other_request_keys", "l3", ("cache_salt set → (none)",))}
    assert statuses(seeded, A, salt_keys("tenant-2"), other_salts=True) == {
        ("other_request_keys", "l3", ("cache_salt another one → this one",))}
    assert statuses(seeded, A, SALTED) == {("held", "l3", ())}
    # A server's answer (other_salts off) never says another tenant computed it.
    assert statuses(seeded, A) == statuses(seeded, A, salt_keys("tenant-2")) == {("not_computed", None, ())}
    seeded.close()
    text = (tmp_path / "l3" / SEEDS_FILE).read_text()
    assert "tenant-1" not in text and len(json.loads(text)["seeds"]) == 2
    later = TierKVStore(store_config(LAYOUT, 0, 64, tmp_path / "l3"), LAYOUT, identity=IDENTITY)
    try:
        later.keep_seed_log()
        assert statuses(later, A, other_salts=True) == {("other_request_keys", "l3", ("cache_salt set → (none)",))}
        assert "tenant-1" not in explain(later, A, other_salts=True)[0].describe()
    finally:
        later.close()


def test_an_unsalted_prompt_asked_with_a_salt_is_named_even_for_a_server(seeded):
    put(seeded, C)
    assert statuses(seeded, C, SALTED) == {("other_request_keys", "l3", ("cache_salt (none) → set",))}


def test_a_prompt_under_another_lora_names_its_name_or_content(seeded):
    assert statuses(seeded, B, (lora_key("sql", "d" * 32),)) == {
        ("other_request_keys", "l3", ("LoRA sql content cccccccc… → dddddddd…",))}
    assert statuses(seeded, B) == {("other_request_keys", "l3", ("LoRA sql → (none)",))}
    assert statuses(seeded, B, (lora_key("chat", "c" * 32),)) == {("other_request_keys", "l3", ("LoRA sql → chat",))}
    assert statuses(seeded, B, (LORA_C,)) == {("held", "l3", ())}
    assert explain(seeded, B)[0].describe() == "held in l3 under another request's extra keys: LoRA sql → (none)"


def test_lora_and_salt_together_name_only_what_differs(seeded):
    put(seeded, C, (LORA_C, *SALTED))
    same_salt = statuses(seeded, C, (lora_key("sql", "d" * 32), *SALTED), other_salts=True)
    assert same_salt == {("other_request_keys", "l3", ("LoRA sql content cccccccc… → dddddddd…",))}
    other_salt = statuses(seeded, C, (LORA_C, *salt_keys("tenant-2")), other_salts=True)
    assert other_salt == {("other_request_keys", "l3", ("cache_salt another one → this one",))}


def test_only_the_first_blocks_held_under_other_keys_are_named(seeded):
    """A held prefix under other keys, then blocks no chain holds: the rest is not computed."""
    longer = A + list(range(500, 500 + 2 * LAYOUT.block_size))
    got = [b.status for b in explain(seeded, longer, other_salts=True)]
    assert got == ["other_request_keys"] * 4 + ["not_computed"] * 2
