"""match_tiers on a real store: per-tier counts, the cost cut, and that a probe pins and touches nothing."""

from __future__ import annotations

import pytest

from _kv import prompt, save_prompt
from tierkv.config import CostConfig
from tierkv.index import Tier
from tierkv.route.match import match_tiers


def test_per_tier_counts_follow_demotions(make_store, layout):
    store = make_store(l1=4, l2=4, l3=16)
    a = prompt(1, 4, layout, tail=3)
    save_prompt(store, a)
    save_prompt(store, prompt(2, 4, layout))  # a's blocks: L1 -> L2
    m = match_tiers(store, a)
    bs = layout.block_size
    assert m.prompt_tokens == 4 * bs + 3 and m.block_size == bs and len(m.keys) == 4
    assert m.matched_tokens == (0, 4 * bs, 0, 0) == m.loaded_tokens
    assert m.est_load_us == pytest.approx(store.cost.load_us[Tier.L2] * 4 * bs)
    assert m.est_recompute_us > 0  # the 3-token tail
    body = m.to_json()
    assert body["matched_tokens"] == {"L1": 0, "L2": 4 * bs, "L3": 0, "L4": 0}
    assert body["keys"] == [k.hex() for k in store.hash(a)]
    miss = match_tiers(store, prompt(3, 2, layout))
    assert miss.matched_tokens == (0, 0, 0, 0) and miss.est_load_us == 0
    assert miss.est_recompute_us == pytest.approx(store.cost.estimate_us([], 2, bs)[1])


def test_a_probe_does_not_pin_touch_or_count(make_store, layout):
    store = make_store(l1=4, l2=4, l3=16)
    keys = save_prompt(store, prompt(1, 4, layout))
    before = [(store.index.get(k).ref_count, store.index.get(k).freq, store.index.get(k).last_access) for k in keys]
    lookups = store.stats().get("lookups")
    clock = store.index.clock
    match_tiers(store, prompt(1, 4, layout))
    after = [(store.index.get(k).ref_count, store.index.get(k).freq, store.index.get(k).last_access) for k in keys]
    assert after == before and store.index.clock == clock and store.stats().get("lookups") == lookups


def test_the_cost_cut_drops_a_tier_slower_than_recompute(make_store, layout):
    # L2 loads cost 10 µs per token, recompute 1 µs: the store would recompute, so nothing is loaded.
    store = make_store(l1=4, l2=4, l3=16, cost=CostConfig(recompute_us_per_token=1.0, l2_us_per_token=10.0))
    a = prompt(1, 4, layout)
    save_prompt(store, a)
    save_prompt(store, prompt(2, 4, layout))
    m = match_tiers(store, a)
    assert m.matched_tokens[Tier.L2] == 4 * layout.block_size and m.loaded_tokens == (0, 0, 0, 0)
    assert m.est_load_us == 0
