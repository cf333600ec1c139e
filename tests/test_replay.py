"""tools/replay.py: replay semantics on hand-made traces, the command line, and the synthetic trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _env import SYNTHETIC_TRACE as SYNTHETIC  # ../shared beside the checkout
from _env import ROOT, load_tool, write_trace

from tierkv.policy.hit_density import BANDS, block_class

replay_tool = load_tool("replay")


TINY = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]


def test_a_block_hits_only_when_its_whole_prefix_is_cached(tmp_path):
    # Capacity 3, LRU: r2 hits 1,2 and evicts leaf 3; r3 evicts leaf 4; r4 hits 1,2 (3 is gone).
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", TINY))
    r = replay_tool.replay(requests, "lru", [3], depth_weight=0.5)
    assert (r.accesses, r.hit_rate) == (10, 0.4)
    # Cost 1 + 0.5 d: hits weigh (1 + 1.5) twice; all blocks weigh 4.5 + 4.5 + 1 + 4.5.
    assert r.saved_cost == pytest.approx(5.0 / 14.5)
    assert r.evictions == {"l1": 3}
    # Graded in FLOPs: hits are blocks 0 and 1 twice, of requests of 3, 3, 1 and 3 blocks.
    for name, m in replay_tool.REFERENCE_MODELS.items():
        b = [m.block_flops(d) for d in range(3)]
        expect = 2 * (b[0] + b[1]) / (3 * sum(b) + b[0])
        assert r.saved_flops_frac[name] == pytest.approx(expect, rel=1e-12), name


def test_depth_weight_changes_the_cost_of_deep_blocks(tmp_path):
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", TINY))
    r = replay_tool.replay(requests, "lru", [3], depth_weight=0.0)
    assert r.saved_cost == pytest.approx(r.hit_rate)


def test_unbounded_cache_hits_every_repeated_prefix(tmp_path):
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", TINY))
    r = replay_tool.replay(requests, "cost_aware", [100])
    assert r.hit_rate == 0.5 and r.evictions == {"l1": 0}  # 1,2 / 1,2 / - / 1,2,3


def test_multi_tier_demotes_victims_and_counts_hits_per_tier(tmp_path):
    # l1=2, l2=2, l3=4. r1 leaves 3 in L2 (L1 holds 1,2). r2 [4,5] pushes 2 then 1 to
    # L2, which demotes its leaf 3 to L3. r3 [1,2,3] then finds 1,2 in L2 and 3 in L3.
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [4, 5], [1, 2, 3]]))
    r = replay_tool.replay(requests, "lru", [2, 2, 4])
    assert r.hits_per_tier == {"l1": 0, "l2": 2, "l3": 1}
    # L1 evicts 3 (r1), 2 and 1 (r2), 5, 4 and 3 (r3, promoting 1,2,3 back).
    assert r.evictions["l1"] == 6
    model = replay_tool.reference_cost(0.5, 100.0, [5.0, 1.0])
    timed = replay_tool.replay(requests, "lru", [2, 2, 4], cost=model)
    assert 0 < timed.est_saved_prefill_s < timed.est_total_prefill_s


def test_the_oracle_keeps_the_block_used_soonest(tmp_path):
    # Capacity 2: at r3 LRU drops 1 (oldest) and then misses 1 and 2; the oracle drops
    # 2 (next used later than 1), hits 1 at r4, then drops 3 (never used again).
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", [[1], [2], [3], [1], [2]]))
    lru = replay_tool.replay(requests, "lru", [2])
    oracle = replay_tool.replay(requests, "belady", [2])
    assert (lru.hit_rate, oracle.hit_rate) == (0.0, 0.2)
    results = [lru, oracle, replay_tool.replay(requests, "lfu", [2])]
    replay_tool.add_headroom(results)
    assert [r.headroom for r in results] == [0.0, 1.0, 0.0]


def test_the_reuse_oracle_evicts_blocks_not_used_again_first(tmp_path):
    # Capacity 2: at r3 LRU drops 1 (oldest) and misses it at r4; the reuse oracle knows 2 is
    # never used again and drops it. Told only of reuses within 2 requests, 1 (back 3 later)
    # counts as not used again, and the order is LRU's.
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", [[1], [2], [3], [1]]))
    assert replay_tool.reuse_ranks(requests) == [[4.0], [1.0], [2.0], [3.0]]
    assert replay_tool.reuse_ranks(requests, 2) == [[0.0], [1.0], [2.0], [3.0]]
    assert replay_tool.replay(requests, "lru", [2]).hit_rate == 0.0
    assert replay_tool.replay(requests, "reuse_oracle", [2]).hit_rate == 0.25
    assert replay_tool.replay(requests, "reuse_oracle", [2], oracle_window=2).hit_rate == 0.0
    assert replay_tool.replay(requests, "reuse_oracle", [2], oracle_window=3).hit_rate == 0.25
    for native in (False, None):  # the index's Python and C loops decide alike
        r = replay_tool.replay(requests, "reuse_oracle", [2], native=native)
        assert (r.hit_rate, r.evictions) == (0.25, {"l1": 1})


def test_the_oracle_evicts_leaves_only(tmp_path):
    # Capacity 3: r2 needs room; 3 is never used again: dropped, and 1, 2 hit at r3 and r4.
    # At r5 the oracle keeps 4 (used at r6) and, leaves only, can drop 2 but not 1.
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [4], [1, 2], [1], [5], [4]]))
    r = replay_tool.replay(requests, "belady", [3])
    assert r.hit_rate == 4 / 9 and r.evictions == {"l1": 2}


def test_equal_ids_under_different_prefixes_are_different_blocks(tmp_path):
    # Ids that name block contents only: "2" after "3" is not the "2" after "1".
    requests = replay_tool.load_trace(write_trace(tmp_path / "t.jsonl", [[1, 2], [3, 2], [1, 2]]))
    assert requests[0][1] != requests[1][1] and requests[0] == requests[2]
    r = replay_tool.replay(requests, "lru", [10])
    assert r.hit_rate == 2 / 6


def test_bad_trace_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n{"input_length": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object with 'hash_ids'"):
        replay_tool.load_trace(path)


def test_command_line_writes_json_table_and_plot(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", (TINY + [[6], [7], [8], [6], [7]]) * 5)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "replay.py"), str(trace), "--capacity", "2,3",
         "--policy", "lru,cost_aware,belady", "--tiers", "l1=2,l2=4", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(out.read_text())
    res = data["results"]
    assert data["accesses_per_s"] == pytest.approx(sum(r["accesses"] for r in res) / sum(r["seconds"] for r in res))
    requests = replay_tool.load_trace(trace)
    for r in res:  # the command line's figures are the library's, for the same trace
        if len(r["tiers"]) == 1:
            assert r["hit_rate"] == replay_tool.replay(requests, r["policy"], [r["capacity"]]).hit_rate
    single = [(r["policy"], r["capacity"]) for r in data["results"] if len(r["tiers"]) == 1]
    assert single == [("lru", 2), ("lru", 3), ("cost_aware", 2), ("cost_aware", 3), ("belady", 2), ("belady", 3)]
    rows = {(r["policy"], r["capacity"]): r for r in data["results"] if len(r["tiers"]) == 1}
    for (policy, cap), r in rows.items():
        low, high = rows["lru", cap]["hit_rate"], rows["belady", cap]["hit_rate"]
        if cap == 2:  # the oracle beats LRU here (at 3 they tie: no gap to take, no headroom)
            assert high > low and r["headroom"] == pytest.approx((r["hit_rate"] - low) / (high - low))
        else:
            assert high == low and r["headroom"] is None
    assert all({"hit_rate", "saved_cost", "saved_flops_frac"} <= set(r) for r in data["results"])
    assert all(set(r["saved_flops_frac"]) >= {"llama-3.1-8b", "llama-3.1-70b"} for r in data["results"])
    multi = [r for r in data["results"] if len(r["tiers"]) > 1]
    assert [r["policy"] for r in multi] == ["lru", "cost_aware", "belady"] and multi[0]["hits_per_tier"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "cost_aware" in proc.stdout and "accesses/s" in proc.stdout


def test_output_hint_reaches_the_policy_and_can_be_left_out(tmp_path):
    # Each request's output_length is told to the index as it finishes: hit_density's classes
    # carry its band; --no-output-hint replays a store nobody tells.
    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as fh:
        for i, (ids, out) in enumerate([([1, 2], 3), ([7], 900), ([1, 2, 4], 40)]):
            fh.write(json.dumps({"timestamp": i, "input_length": 1024, "output_length": out, "hash_ids": ids}) + "\n")
    assert replay_tool.load_outputs(trace) == [3, 900, 40]
    requests = replay_tool.load_trace(trace)
    told = replay_tool.Replayer("hit_density", [10], replay_tool.CostModel.units(0.0), 2000.0)
    told.run(requests, False, replay_tool.load_outputs(trace))
    bands = {e.key: block_class(e) % BANDS for e in told.index.entries()}
    assert sorted(bands.values()) == [2, 2, 2, 3]   # [7]: 900 tokens; 1, 2 and 4 last used by the 40-token one
    untold = replay_tool.Replayer("hit_density", [10], replay_tool.CostModel.units(0.0), 2000.0)
    untold.run(requests, False)
    assert {block_class(e) % BANDS for e in untold.index.entries()} == {0}
    out = tmp_path / "r.json"
    for flag, want in (([], True), (["--no-output-hint"], False)):
        subprocess.run([sys.executable, str(ROOT / "tools" / "replay.py"), str(trace), "--capacity", "2",
                        "--policy", "hit_density", "--json", str(out), *flag],
                       capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(out.read_text())["output_hint"] is want


def test_command_line_rejects_bad_arguments(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    for args in (["--capacity", "0"], ["--policy", "mru"], ["--tiers", "l9=3"]):
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "replay.py"), str(trace), *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, args


@pytest.mark.skipif(not SYNTHETIC.exists(), reason="the shared synthetic trace is not on this machine")
def test_synthetic_trace_default_policy_keeps_lru_hits_and_takes_headroom():
    # The policy a store uses when its config names none, against LRU and the oracle.
    from tierkv.config import PolicyConfig

    requests, outputs = replay_tool.load_trace(SYNTHETIC), replay_tool.load_outputs(SYNTHETIC)
    results = [replay_tool.replay(requests, name, [cap], outputs=outputs)
               for name in ("lru", PolicyConfig().name, "belady") for cap in (1000, 3000)]
    replay_tool.add_headroom(results)
    lru, default, oracle = results[:2], results[2:4], results[4:]
    assert lru[0].accesses == 121_877
    assert round(lru[0].hit_rate, 4) == 0.0841  # leaves-only LRU (see docs/replay.md)
    assert [round(r.hit_rate, 3) for r in oracle] == [0.269, 0.444]
    for base, new in zip(lru, default):
        assert new.hit_rate >= base.hit_rate - 0.003
        assert new.headroom > 0.05, (new.capacity, new.headroom)
        assert new.saved_flops_frac["llama-3.1-8b"] >= base.saved_flops_frac["llama-3.1-8b"]
