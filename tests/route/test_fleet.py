"""tools/fleet.py: exact routing on hand-made traces, the command line, and the shared trace's acceptance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _env import SYNTHETIC_TRACE as SYNTHETIC  # ../shared beside the checkout
from _env import ROOT, load_tool

fleet = load_tool("fleet")
COST = fleet.reference_cost("llama-3.1-8b", 400.0, fleet.DEFAULT_GBPS)


def write_trace(path: Path, rows: list[tuple[int, list[int]]]) -> Path:
    with open(path, "w") as fh:
        for ts, ids in rows:
            fh.write(json.dumps({"timestamp": ts, "input_length": 512 * len(ids), "output_length": 1,
                                 "hash_ids": ids}) + "\n")
    return path


def test_reference_cost_is_llama_8b_physics():
    # 128 KiB of KV per token; 2 x 8.03e9 FLOPs per token at 400 TFLOP/s; attention 4·32·32·128 per position.
    assert COST.load_us[1] == pytest.approx(131072 / 25e3)
    assert COST.recompute_us == pytest.approx(2 * 8.03e9 / 400e6, rel=1e-3)
    assert COST.growth == pytest.approx(4 * 32 * 32 * 128 / (2 * 8.03e9), rel=1e-3)


def test_prefix_routers_send_a_repeat_to_the_node_that_holds_it(tmp_path):
    # Five prompts 10 s apart (no queueing); the 5th repeats the 1st, which round robin sent elsewhere.
    rows = [(0, [1, 2, 3]), (10_000, [4, 5]), (20_000, [6, 7]), (30_000, [8]), (40_000, [1, 2, 3])]
    requests = fleet.load_requests(write_trace(tmp_path / "t.jsonl", rows))
    for name in ("longest_prefix", "tier_weighted", "cost_model", "hash"):
        result = fleet.simulate(requests, name, 3, [8, 0, 0], "lru", COST)
        assert result.hit_rate == 3 / 11, name
    rr = fleet.simulate(requests, "round_robin", 3, [8, 0, 0], "lru", COST)
    assert rr.hit_rate == 0.0 and rr.per_node == [2, 2, 1]


def test_queue_delays_the_next_request_and_cost_model_avoids_it(tmp_path):
    # Two different long prompts at once on two nodes, then a repeat of the first right away:
    # its holder is busy for the whole first prefill.
    first, second = list(range(100, 140)), list(range(200, 240))
    rows = [(0, first), (0, second), (1, first[:2] + [999])]
    requests = fleet.load_requests(write_trace(tmp_path / "t.jsonl", rows))
    lp = fleet.simulate(requests, "longest_prefix", 3, [100, 0, 0], "lru", COST)
    cm = fleet.simulate(requests, "cost_model", 3, [100, 0, 0], "lru", COST)
    assert lp.per_node == [2, 1, 0] and lp.hit_rate == 2 / 83
    assert cm.per_node == [1, 1, 1] and cm.hit_rate == 0.0
    assert cm.mean_ttft_ms < lp.mean_ttft_ms


def test_a_node_tells_its_index_what_each_request_generated(tmp_path):
    from tierkv.policy.hit_density import BANDS, block_class, output_band

    (request,) = fleet.load_requests(write_trace(tmp_path / "t.jsonl", [(0, [1, 2, 3])]))
    assert request.output_tokens == 1  # write_trace's output_length
    node = fleet.SimNode("n", [8, 0, 0], "hit_density", COST, 2000.0)
    node.serve(request)
    assert {block_class(node.index.get(k)) % BANDS for k in request.keys} == {output_band(1)}
    untold = fleet.SimNode("n", [8, 0, 0], "hit_density", COST, 2000.0)
    untold.serve(fleet.Request(request.arrival_us, request.n_tokens, request.keys))
    assert {block_class(untold.index.get(k)) % BANDS for k in request.keys} == {0}


def test_command_line_writes_one_row_per_router(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [(i * 100, [i % 3, 7, 8]) for i in range(30)])
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fleet.py"), str(trace), "--nodes", "2",
                           "--tiers", "l1=4,l2=8", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["router"] for r in rows] == ["round_robin", "hash", "longest_prefix", "tier_weighted", "cost_model"]
    assert all({"hit_rate", "mean_ttft_ms", "p90_ttft_ms"} <= set(r) for r in rows)
    assert json.loads(out.read_text())["output_hint"] is True
    subprocess.run([sys.executable, str(ROOT / "tools" / "fleet.py"), str(trace), "--nodes", "2", "--routers", "hash",
                    "--no-output-hint", "--json", str(out)], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.read_text())["output_hint"] is False
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "fleet.py"), str(trace), "--routers", "random"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected routers from" in bad.stderr


@pytest.mark.slow
@pytest.mark.skipif(not SYNTHETIC.exists(), reason="the shared synthetic trace is not on this machine")
def test_shared_trace_acceptance():
    requests = fleet.load_requests(SYNTHETIC)
    results = {name: fleet.simulate(requests, name, 4, fleet.DEFAULT_TIERS, fleet.DEFAULT_POLICY, COST)
               for name in fleet.ROUTERS}
    best = results["cost_model"]
    for name, r in results.items():
        if name != "cost_model":
            assert best.mean_ttft_ms < r.mean_ttft_ms and best.p90_ttft_ms < r.p90_ttft_ms, name
    rr = results["round_robin"].hit_rate
    assert results["longest_prefix"].hit_rate >= 1.5 * rr and best.hit_rate >= 1.5 * rr
