"""``why.explain`` on a real store: evictions the vLLM worker's store logs (``acquire_store``), and
blocks held under another request's extra keys (cache_salt, LoRA) named without the salt."""

from __future__ import annotations

from pathlib import Path

from _kv import LAYOUT, block_for, store_config

from tierkv.connectors.vllm.shared_store import acquire_store, release_store
from tierkv.identity import ModelIdentity
from tierkv.store import TierKVStore
from tierkv.why import EVICTION_LOG_FILE, explain

IDENTITY = ModelIdentity.of({"model_id": "m", "weights": "w1"})
A = list(range(3, 3 + 4 * LAYOUT.block_size))      # 4 full blocks
B = list(range(100, 100 + 4 * LAYOUT.block_size))  # 4 more: with L3 of 4 blocks, A is evicted


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
