"""`tierkv run --quick`: the main job end to end, in real processes (on the random `tiny` model: the SmolLM2
default is exercised by `make demo` and tests/engine/test_smollm2.py)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_tierkv


@pytest.mark.slow
def test_run_quick_second_pass_hits_l3(tmp_path):
    cache = tmp_path / "cache"
    out = tmp_path / "out" / "run.json"
    r = run_tierkv("run", "--quick", "--model", "tiny", "--json", str(out), "--cache-dir", str(cache),
                   env={"TIERKV_L3_CAPACITY": "256MiB"}, timeout=600)
    assert r.code == 0, r.err
    assert "pass 1: fresh process" in r.out and "pass 2: restarted process" in r.out
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    fresh, restarted = result["passes"]
    for ps in (fresh, restarted):
        assert len(ps["turns"]) == 4
        # Served from the cache, every turn starts with the very tokens the cold engine computes.
        for turn in ps["turns"]:
            first = turn["first_tokens"]
            assert len(first["cold"]) == 4 and first["cached"] == first["cold"], turn
        assert ps["first_tokens_match"] is True
        assert set(ps["hit_tokens_by_tier"]) == {"l1", "l2", "l3", "l4"}
        assert ps["ttft_cached_ms"] > 0 and ps["ttft_nocache_ms"] > 0
    assert fresh["hit_tokens_by_tier"]["l3"] == 0 and fresh["turns"][0]["hit_tokens"] == dict.fromkeys(("l1", "l2", "l3", "l4"), 0)
    assert restarted["hit_tokens_by_tier"]["l3"] > 0
    assert all(sum(t["hit_tokens"].values()) > 0 for t in restarted["turns"])  # every turn compared was cached
    # the restarted pass starts from disk: its first turn is served from L3
    assert restarted["turns"][0]["hit_tokens"]["l3"] >= result["workload"]["system_tokens"]
    assert result["model"].endswith("tiny")
    assert [t["question"] for t in fresh["turns"]] == [t["question"] for t in restarted["turns"]]


def test_run_refuses_a_model_dir_without_config(tmp_path):
    r = run_tierkv("run", "--quick", "--model", str(tmp_path), "--cache-dir", str(tmp_path / "c"))
    assert r.code == 2 and "has no config.json" in r.err
