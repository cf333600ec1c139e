"""The routers and the TTFT cost model they share with tools/fleet.py: exact picks from known numbers."""

from __future__ import annotations

import pytest

from tierkv.cost import CostModel
from tierkv.route import Candidate, Prompt, estimate_ttft_us, make_router
from tierkv.route.ttft import recompute_us

# µs per token: L1 free, L2 5, L3 60, L4 10; recompute 40, no growth unless a test sets it.
COST = CostModel((0.0, 5.0, 60.0, 10.0), 40.0, 0.0, 16, 1)
N = 4096


def cand(name: str, l1: int = 0, l2: int = 0, l3: int = 0, l4: int = 0, depth: int = 0,
         queue_us: float = 0.0, cost: CostModel = COST) -> Candidate:
    return Candidate(name, (l1, l2, l3, l4), depth, queue_us, cost)


def test_ttft_is_the_linear_formula_without_growth():
    # Σ m_i c_i + (N − Σ m_i)·r + q, with L3 dearer than recompute dropped.
    assert estimate_ttft_us(COST, (1000, 500, 0, 200), N, 7.0) == 1000 * 0 + 500 * 5 + 200 * 10 + (N - 1700) * 40 + 7
    assert estimate_ttft_us(COST, (0, 0, 3000, 0), N) == N * 40  # an L3 slower than recompute is a miss


def test_recompute_grows_with_depth():
    grown = CostModel((0.0, 5.0, 60.0, 10.0), 40.0, 1e-3, 16, 1)
    assert recompute_us(grown, 0, 3) == pytest.approx(40 * (3 + 1e-3 * (0 + 1 + 2)))
    assert recompute_us(grown, 100, 100) == 0.0
    # Deep enough, L3 (60 µs) beats recompute (40·(1 + 1e-3·p) > 60 once p > 500).
    assert estimate_ttft_us(grown, (600, 0, 1000, 0), N) < estimate_ttft_us(grown, (600, 0, 0, 0), N)


def test_cost_model_prefers_short_l1_over_long_l3_when_l3_is_slower_than_recompute():
    router = make_router("cost_model")
    short_l1, long_l3 = cand("a", l1=1024), cand("b", l3=3072)
    assert router.pick(Prompt(N, []), [long_l3, short_l1]) == 1
    assert make_router("longest_prefix").pick(Prompt(N, []), [long_l3, short_l1]) == 0


def test_cost_model_prefers_long_l3_when_l3_loads_faster_than_recompute():
    fast_l3 = CostModel((0.0, 5.0, 20.0, 10.0), 40.0, 0.0, 16, 1)
    router = make_router("cost_model")
    short_l1, long_l3 = cand("a", l1=1024, cost=fast_l3), cand("b", l3=3072, cost=fast_l3)
    # 1024 in L1: 3072·40 = 122,880 µs; 3072 in L3: 3072·20 + 1024·40 = 102,400 µs.
    assert router.pick(Prompt(N, []), [short_l1, long_l3]) == 1


def test_cost_model_weighs_queue_delay_against_a_match():
    router = make_router("cost_model")
    busy, idle = cand("a", l1=N, queue_us=N * 40 + 1), cand("b")
    assert router.pick(Prompt(N, []), [busy, idle]) == 1
    busy = cand("a", l1=N, queue_us=N * 40 - 1)
    assert router.pick(Prompt(N, []), [busy, idle]) == 0


def test_tier_weighted_scores_tiers_and_queue_depth():
    router = make_router("tier_weighted", queue_weight=0.1)
    # 0.3 of the prompt in L3 scores 0.09; 0.1 in L1 scores 0.1.
    assert router.pick(Prompt(1000, []), [cand("a", l3=300), cand("b", l1=100)]) == 1
    # Two queued requests cost 0.2: a full L1 match (1.0) still wins over an idle node with nothing.
    assert router.pick(Prompt(1000, []), [cand("a"), cand("b", l1=1000, depth=2)]) == 1
    assert router.pick(Prompt(1000, []), [cand("a", l4=1000), cand("b", l2=1000)]) == 1
    with pytest.raises(ValueError, match="route.tier_weights"):
        make_router("tier_weighted", weights=(1.0, 0.5))


def test_longest_prefix_breaks_ties_by_queue_then_rotation():
    router = make_router("longest_prefix")
    assert router.pick(Prompt(100, []), [cand("a", l2=50, depth=3), cand("b", l3=50, depth=1)]) == 1
    even = [cand("a"), cand("b"), cand("c")]
    assert [router.pick(Prompt(100, []), even) for _ in range(4)] == [2, 0, 1, 2]


def test_round_robin_rotates():
    router = make_router("round_robin")
    nodes = [cand("a", l1=99), cand("b"), cand("c")]
    assert [router.pick(Prompt(100, []), nodes) for _ in range(4)] == [0, 1, 2, 0]


def test_hash_is_consistent_and_moves_only_a_dead_nodes_prompts():
    router = make_router("hash")
    nodes = [cand(f"n{i}") for i in range(4)]
    prompts = [Prompt(10, [i.to_bytes(8, "little")]) for i in range(400)]
    first = [nodes[router.pick(p, nodes)].name for p in prompts]
    assert first == [nodes[router.pick(p, nodes)].name for p in prompts]
    assert len(set(first)) == 4
    alive = [c for c in nodes if c.name != "n2"]
    after = [alive[router.pick(p, alive)].name for p in prompts]
    assert all(a == b for a, b in zip(first, after) if a != "n2")
    assert "n2" not in after


def test_bad_input_fails_naming_what_is_allowed():
    with pytest.raises(ValueError, match="route.policy: expected one of"):
        make_router("random")
    with pytest.raises(ValueError, match="no live node"):
        make_router("cost_model").pick(Prompt(10, []), [])
    with pytest.raises(ValueError, match="matched 20 tokens of a 10-token prompt"):
        estimate_ttft_us(COST, (20, 0, 0, 0), 10)


def test_a_node_counts_its_own_requests_exactly_and_others_as_last_polled():
    from tierkv.route.nodes import Node
    from tierkv.route.ttft import recompute_us

    node = Node("http://n", cost=COST, block_size=16)
    node.external_depth, node.inflight = 1, 2
    c = node.candidate([b"k"], 100)
    assert c.queue_depth == 3 and c.queue_us == 3 * recompute_us(COST, 0, 100)
    node.inflight = 0  # our requests ended since the poll: the node is not busy with them any more
    assert node.candidate([b"k"], 100).queue_depth == 1
    assert node.candidate([b"k"], 100).matched == (0, 0, 0, 0)  # no subscriber yet: nothing known held
