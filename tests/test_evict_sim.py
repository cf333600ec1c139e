"""tools/evict_sim.py: the stripped-down simulator decides like the replay's real index where both apply."""

from __future__ import annotations


from _env import load_tool, write_trace

evict_sim = load_tool("evict_sim")
replay_tool = load_tool("replay")
tracegen = load_tool("tracegen")


def run(requests: list[list[int]], spec: str, capacity: int) -> float:
    return evict_sim.Sim(requests, capacity, evict_sim.make(spec, requests, capacity)).run()


def test_prefix_rule_and_leaves_only_as_in_the_replay(tmp_path):
    # The replay's hand-made case: capacity 3, LRU: r2 hits 1,2 and evicts leaf 3; r3 evicts 4;
    # r4 hits 1,2. Ids that name contents only are chained: "2" after "3" is another block.
    requests = evict_sim.load_ids(write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]))
    assert run(requests, "lru", 3) == 0.4
    assert evict_sim.load_ids(write_trace(tmp_path / "u.jsonl", [[1, 2], [3, 2]])) == [[0, 1], [2, 3]]


def test_blocks_used_once_go_first_under_thresh(tmp_path):
    # Capacity 2: at r3 LRU drops 1 (used at r0, r1) for being older than 2; thresh:2 keeps 1
    # (used twice) and drops 2, so r4 hits.
    requests = evict_sim.load_ids(write_trace(tmp_path / "t.jsonl", [[1], [1], [2], [3], [1]]))
    assert (run(requests, "lru", 2), run(requests, "thresh:2", 2)) == (0.2, 0.4)


def test_lru_and_the_reuse_bound_match_the_real_index(tmp_path):
    path = tmp_path / "mixed.jsonl"
    tracegen.write(tracegen.generate("mixed", 3, 400), path)
    ids, keys = evict_sim.load_ids(path), replay_tool.load_trace(path)
    for cap in (50, 200, 800):
        assert run(ids, "lru", cap) == replay_tool.replay(keys, "lru", [cap]).hit_rate
        assert run(ids, "reuse", cap) == replay_tool.replay(keys, "reuse_oracle", [cap]).hit_rate


def test_every_documented_policy_runs(tmp_path):
    requests = evict_sim.load_ids(write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3]] * 3))
    specs = ["lru", "reuse", "reuse_seen", "thresh:3", "lfu:3", "lfu", "lfu_halve:10", "lfuda", "hot:hash",
             "hot:mru", "hot:nextgap::1", "hot:overdue:2", "sticky:root:0.5:0.25", "sticky:new:0.5:0.25:nhf",
             "sticky:block:0.5:0.25", "learned:tpm:5", "bigtail:4:mru"]
    for spec in specs:
        assert 0.0 <= run(requests, spec, 3) <= run(requests, "reuse", 100), spec
