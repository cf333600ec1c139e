"""The scheduler half under tensor parallelism: every rank's shard, every rank's report (design §13).

Two rank stores (the shard layouts of KV heads 0 and 1 of 2, their own L3
directories under one ``l3.path``) stand where two workers' stores would; the
scheduler sees them through ``ShardedView`` and hears their reports through
``TierKVWorkerMetadata`` as vLLM aggregates them. The real TP=2 engine runs in
``test_e2e_tp.py``.
"""

from __future__ import annotations

import pytest
import torch
from harness import BLOCK, EOS, prompt
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from tierkv.config import L2Config, L3Config, StoreConfig
from tierkv.connectors.vllm.config import VllmSettings
from tierkv.connectors.vllm.metadata import SaveSpec, TierKVWorkerMetadata
from tierkv.connectors.vllm.scheduler import ConnectorScheduler
from tierkv.connectors.vllm.shards import Cover, ShardedView, best, covers, is_primary, rank_config, rank_layouts
from tierkv.layout import KVLayout
from tierkv.store import TierKVStore

RANK_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, block_size=BLOCK, dtype="float16")


def request(req_id: str, tokens: list[int]) -> Request:
    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=2)
    sp.update_from_generation_config({}, EOS)
    return Request(req_id, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


@pytest.fixture
def ranks(tmp_path):
    shards = rank_layouts(RANK_LAYOUT, 2, 2)
    cfg = StoreConfig(model_id="tp-test", l2=L2Config(capacity=0), l3=L3Config(path=str(tmp_path / "l3"),
                                                                              capacity=16 << 20))
    stores = [TierKVStore(rank_config(cfg, lay), lay, l1_blocks=0) for lay in shards]
    yield stores
    for s in stores:
        s.close()


def _put(store: TierKVStore, keys: list[bytes]) -> None:
    blocks = [torch.zeros(store.layout.block_shape, dtype=store.layout.torch_dtype) for _ in keys]
    assert all(store.put_blocks(keys, blocks))


def test_rank_layouts_give_each_rank_its_heads_and_a_slab_of_its_own():
    shards = rank_layouts(RANK_LAYOUT, 2, 2)
    assert [(s.kv_head_start, s.num_kv_heads, s.kv_heads_total) for s in shards] == [(0, 1, 2), (1, 1, 2)]
    assert rank_layouts(RANK_LAYOUT, 1, 1) == [RANK_LAYOUT]
    replicated = rank_layouts(RANK_LAYOUT, 4, 2)  # 2 KV heads over 4 ranks: rank r holds head r // 2
    assert [s.kv_head_start for s in replicated] == [0, 0, 1, 1] and replicated[1] == shards[0]
    assert [is_primary(replicated, r) for r in range(4)] == [True, False, True, False]
    assert rank_layouts(RANK_LAYOUT, 2, 1) == [RANK_LAYOUT, RANK_LAYOUT], "MQA: every rank the one head"
    cfg = StoreConfig(l2=L2Config(capacity=1 << 20, shared_name="node"))
    assert [rank_config(cfg, s).l2.shared_name for s in shards] == ["node.h0-1of2", "node.h1-2of2"]
    assert rank_config(cfg, RANK_LAYOUT) is cfg


def test_a_block_counts_only_where_every_rank_holds_its_shard(ranks):
    view = ShardedView(ranks)
    sched = ConnectorScheduler(view, VllmSettings())
    tokens = prompt(1, 4 * BLOCK + 1)
    req = request("a", tokens)
    sched.on_new_request(req)
    keys = view.hasher.hash_blocks(tokens, BLOCK, view.seed())[:4]
    assert keys == ranks[1].hash(tokens)[:4], "one chain of keys on every rank"
    _put(ranks[0], keys)
    _put(ranks[1], keys[:1] + keys[2:])  # rank 1 lacks block 1
    assert sched.get_num_new_matched_tokens(req, 0) == (BLOCK, False)
    m = view.lookup_keys(keys, pin=True)
    assert m.num_blocks == 1 and [p.num_blocks for p in m.parts] == [4, 1]
    view.release(m)
    assert all(not p.pinned for p in m.parts)
    _put(ranks[1], keys[1:2])
    sched.request_finished(req, [])
    again = request("b", tokens)
    sched.on_new_request(again)
    assert sched.get_num_new_matched_tokens(again, 0) == (4 * BLOCK, False)
    sched.request_finished(again, [])


def test_a_save_is_announced_once_every_rank_reported_it(ranks):
    view = ShardedView(ranks)
    sched = ConnectorScheduler(view, VllmSettings())
    tokens = prompt(2, 3 * BLOCK)
    keys = view.hasher.hash_blocks(tokens, BLOCK, view.seed())
    for save_id in (7, 8):  # what _plan_saves records for a step's save
        sched._saves[save_id] = ("r", SaveSpec(save_id, "r", keys, 0, [0, 1, 2]), tokens)

    def report(*metas: TierKVWorkerMetadata) -> list:
        wm = metas[0]
        for m in metas[1:]:
            wm = wm.aggregate(m)  # as vLLM's KVOutputAggregator folds one step's reports
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=wm))
        return sched.take_events()

    assert report(TierKVWorkerMetadata(saves_done={7: 3}, rank=0)) == []  # rank 1 still saving
    (stored,) = report(TierKVWorkerMetadata(saves_done={7: 2}, rank=1))
    assert stored.block_hashes == keys[:2], "the fewest blocks any rank stored"
    (stored,) = report(TierKVWorkerMetadata(saves_done={8: 3}, rank=1), TierKVWorkerMetadata(saves_done={8: 3}))
    assert stored.block_hashes == keys
    (removed,) = report(TierKVWorkerMetadata(removed=[keys[2]], rank=1))  # gone on one rank: gone
    assert removed.block_hashes == [keys[2]]


def test_covers_assemble_finer_shards_and_slice_a_coarser_layout():
    s0, s1 = rank_layouts(RANK_LAYOUT, 2, 2)
    full = s0.logical  # 2 KV heads
    assert covers(full, [s0, s1]) == [[(s0, 0, 1, 0), (s1, 0, 1, 1)]]
    assert covers(full, [s0]) == [], "a partition counts only when every piece is stored"
    assert covers(s1, [full, s0]) == [[(full, 1, 2, 0)]]
    assert covers(s1, [s0, s1]) == [], "its own width: its own directory"
    other_model = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=BLOCK, dtype="float16")
    assert covers(full, [other_model]) == []


def test_a_tp1_rank_reads_a_tp2_save_from_both_shards_byte_for_byte(ranks, tmp_path):
    """What a TP=1 worker does with blocks only a TP=2 instance saved: each head from its shard."""
    tokens = prompt(3, 2 * BLOCK)
    keys = ranks[0].hash(tokens)
    values = []
    for r, store in enumerate(ranks):
        blocks = [torch.full(store.layout.block_shape, float(10 * r + i), dtype=store.layout.torch_dtype)
                  for i in range(len(keys))]
        assert all(store.put_blocks(keys, blocks))
        values.append(blocks)
    full = ranks[0].layout.logical
    (pieces,) = covers(full, [s.layout for s in ranks])
    cover = Cover([(ranks[r], a, b, at) for r, (_, a, b, at) in enumerate(pieces)])
    solo = TierKVStore(StoreConfig(model_id="tp-test", l2=L2Config(capacity=0),
                                   l3=L3Config(path=str(tmp_path / "l3"), capacity=16 << 20)), full, l1_blocks=0)
    try:
        assert solo.hash(tokens) == keys and solo.lookup_keys(keys, pin=False).num_blocks == 0
        m, chosen = best(solo, keys, [cover], pin=True)
        assert chosen is cover and m.num_blocks == 2
        dst = torch.zeros((2, *full.block_shape), dtype=full.torch_dtype)
        assert cover.load(m, 0, dst).wait().ok == [True, True]
        for i in range(2):
            assert torch.equal(dst[i], torch.cat([values[0][i], values[1][i]], dim=3))
        assert all(not p.pinned for p in m.parts)
    finally:
        solo.close()
