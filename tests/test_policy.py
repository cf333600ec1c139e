"""Eviction policies on small hand-built trees: exact eviction order for cost_aware, lfu, lru; hit_density's learning."""

from __future__ import annotations

import hashlib
import random

import pytest
from _kv import prompt, save_prompt

from tierkv.config import CostConfig, PolicyConfig
from tierkv.cost import CostModel
from tierkv.index import PrefixIndex, Tier
from tierkv.policy import DEFAULT_POLICY, POLICIES, CostAwarePolicy, HitDensityPolicy, LFUPolicy, LRUPolicy, make_policy
from tierkv.policy.hit_density import BANDS, age_bin, block_class, output_band

L1, L2 = Tier.L1, Tier.L2


def k(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def index_with(policy_name: str, **context) -> PrefixIndex:
    return PrefixIndex([make_policy(policy_name, t, **context) for t in (L1, L2, Tier.L3)])


def chain(index: PrefixIndex, names: str, tier: int = L1, parent: str | None = None, depth: int = 0) -> None:
    prev = k(parent) if parent else None
    for i, name in enumerate(names):
        index.add(k(name), prev, depth + i, tier)
        prev = k(name)


def use(index: PrefixIndex, names: str) -> None:
    """One lookup that hits the blocks named by ``names``."""
    index.touch([index.get(k(n)) for n in names])


def drain(index: PrefixIndex, tier: int = L1) -> list[str]:
    out = []
    while (entry := index.victim(tier)) is not None:
        out.append(entry.key.rstrip(b".").decode())
        index.drop(entry.key, tier)
    return out


def test_registry_names_and_default():
    assert sorted(POLICIES) == ["cost_aware", "hit_density", "lfu", "lru"]
    assert PolicyConfig().name == DEFAULT_POLICY == "hit_density"
    assert isinstance(make_policy("hit_density", L1), HitDensityPolicy)
    assert isinstance(make_policy("cost_aware", L1), CostAwarePolicy)
    assert isinstance(make_policy("lfu", L1, half_life=10.0), LFUPolicy)
    assert isinstance(make_policy("lru", L1, cost=None, lower=None), LRUPolicy)
    with pytest.raises(ValueError, match=r"^policy\.name: expected one of \['cost_aware', 'hit_density', 'lfu', 'lru'\], got 'mru'"):
        make_policy("mru", L1)
    with pytest.raises(ValueError, match=r"^policy\.reuse_exponent: expected > 0"):
        CostAwarePolicy(L1, reuse_exponent=0.0)


@pytest.mark.parametrize("name", ["cost_aware", "hit_density", "lfu", "lru"])
def test_every_policy_evicts_leaves_first_and_never_pinned(name):
    index = index_with(name)
    chain(index, "abc")
    chain(index, "de", parent="a", depth=1)
    use(index, "abcde")
    index.pin([index.get(k("c"))])
    order = drain(index)
    assert "c" not in order and "b" not in order and "a" not in order  # c pinned keeps b and a inner
    assert order.index("e") < order.index("d")
    index.unpin([index.get(k("c"))])
    assert drain(index) == ["c", "b", "a"]


def test_deep_expensive_leaf_outlives_shallow_cheap_one_at_equal_reuse():
    index = index_with("cost_aware")  # abstract units: a block at depth d costs 1 + 0.5 d
    chain(index, "a")       # leaf at depth 0
    chain(index, "bcd")     # leaf d at depth 2
    chain(index, "ef")      # leaf f at depth 1
    use(index, "abcdef")    # one use each, at the same time
    # a (cost 1) first; then f (1.5) before d (2); e (1) becomes a leaf and goes
    # before d; then the deep chain unwinds from its tail: d, c, b.
    assert drain(index) == ["a", "f", "e", "d", "c", "b"]


def test_more_reuse_beats_more_depth_only_up_to_the_cost_ratio():
    index = index_with("cost_aware")
    chain(index, "a")       # depth 0, cost 1
    chain(index, "bc")      # leaf c at depth 1, cost 1.5
    use(index, "abc")
    use(index, "a")         # a: reuse 1 + 1.999 ~ 3 uses, worth 3 > 1.5 * 2
    use(index, "a")
    assert drain(index) == ["c", "b", "a"]


def test_recency_wins_over_cost_in_the_long_run():
    index = index_with("cost_aware")
    chain(index, "bcd")     # leaf d at depth 2 (cost 2), used at clock 1
    use(index, "bcd")
    for _ in range(10):     # ten lookups that hit nothing else
        use(index, "")
    chain(index, "a")       # a fresh shallow block, used now
    use(index, "a")
    assert drain(index)[0] == "d"


def test_a_cheap_reload_from_the_tier_below_makes_depth_irrelevant():
    # L2 reloads cost 0.1 units/block, far below any recompute: keeping a block in
    # L1 saves the same 0.1 at every depth, so L1 evicts by recency alone.
    cost = CostModel((0.0, 0.1 / 512, 0.0, 0.0), 1.0 / 512, 0.5 / 512, 512, 1)
    index = index_with("cost_aware", cost=cost, lower=L2)
    chain(index, "bcd")
    chain(index, "a")
    use(index, "bcd")
    use(index, "a")
    assert drain(index) == ["d", "c", "b", "a"]
    index = index_with("cost_aware", cost=cost, lower=None)  # nothing below: depth counts
    chain(index, "bcd")
    chain(index, "a")
    use(index, "bcd")
    use(index, "a")
    assert drain(index)[0] == "a"


@pytest.mark.parametrize("seed", range(5))
def test_cost_aware_is_exactly_lru_when_all_blocks_are_worth_the_same(seed):
    # One depth, and rounds in which every block is used once (in a random order,
    # one block per lookup, no decay): equal worth everywhere, so recency decides.
    rng = random.Random(seed)
    a = PrefixIndex([make_policy("cost_aware", t) for t in (L1, L2, Tier.L3)], half_life=1e12)
    b = PrefixIndex([make_policy("lru", t) for t in (L1, L2, Tier.L3)], half_life=1e12)
    names = [chr(ord("A") + i) for i in range(40)]
    for index in (a, b):
        for n in names:
            chain(index, n)
    for _ in range(5):
        for n in rng.sample(names, len(names)):
            for index in (a, b):
                use(index, n)
    order = drain(a)
    assert order == drain(b) and len(order) == 40


def test_threshold_rekeys_are_amortised_over_evictions():
    index = index_with("cost_aware")
    policy = index.policies[L1]
    rng = random.Random(7)
    evictions = 0
    for i in range(5000):
        depth = rng.randrange(8)
        prev = None
        for d in range(depth + 1):
            key = k(f"{i}.{d}")
            index.add(key, prev, d, L1)
            prev = key
        index.touch([index.get(k(f"{i}.{d}")) for d in range(depth + 1)])
        while index.counts[L1] > 500:
            entry = index.victim(L1)
            index.drop(entry.key, L1)
            evictions += 1
    assert index.counts[L1] == 500 and evictions > 10_000
    # O(n) re-keys cost, over the run, at most a few key computations per eviction.
    assert policy.rekeyed < 3 * evictions, (policy.rekeys, policy.rekeyed, evictions)


def test_lfu_keeps_the_more_used_leaf_and_breaks_ties_by_age():
    index = index_with("lfu", half_life=100.0)
    chain(index, "a")
    chain(index, "b")
    chain(index, "c")
    use(index, "abc")
    use(index, "b")
    use(index, "b")
    use(index, "c")
    assert drain(index) == ["a", "c", "b"]


def test_lfu_forgets_old_uses_by_the_half_life():
    index = index_with("lfu", half_life=1.0)
    chain(index, "a")
    chain(index, "b")
    for _ in range(4):
        use(index, "a")       # a: 4 uses long ago
    for _ in range(12):
        use(index, "")
    use(index, "b")           # b: one use now outweighs a's decayed count
    assert drain(index) == ["a", "b"]


def test_lru_order_is_plain_recency():
    index = index_with("lru")
    chain(index, "a")
    chain(index, "bcd")
    use(index, "a")
    use(index, "bcd")
    use(index, "a")
    assert drain(index) == ["d", "c", "b", "a"]


@pytest.mark.parametrize("name,survivor", [("cost_aware", "deep"), ("lru", "shallow")])
def test_the_store_evicts_by_its_configured_policy(make_store, layout, name, survivor):
    # No lower tier, recompute grows 10 % per token of context: the deep chain's
    # leaf is worth 2.6x the lone block, so cost_aware drops the lone block; LRU
    # drops the older leaf (the deep chain's, saved first).
    store = make_store(l1=4, l2=0, l3=0, policy=PolicyConfig(name=name), cost=CostConfig(recompute_growth=0.1))
    deep = save_prompt(store, prompt(21, 3, layout))
    shallow = save_prompt(store, prompt(22, 1, layout))
    store.free(store.allocate(1))
    kept = {"deep": deep, "shallow": shallow}[survivor]
    gone = {"deep": shallow, "shallow": deep[-1:]}[survivor]
    assert all(store.index.get(key) is not None for key in kept)
    assert all(store.index.get(key) is None for key in gone)


# -- hit_density: learns from what the index sees -----------------------------------


def run_stream(index: PrefixIndex, stream: list[bytes], capacity: int, outputs: list[int] | None = None) -> int:
    """Single-block lookups as the store makes them (pin, touch, save, trim, unpin); returns the hits.

    ``outputs``: each request's generated tokens, told to the index as it finishes (None: never)."""
    hits = 0
    for i, key in enumerate(stream):
        entry = index.get(key)
        if entry is not None:
            hits += 1
            index.pin([entry])
            index.touch([entry])
        else:
            index.touch([])
            entry = index.add(key, None, 0, L1, pin=True)
        while index.counts[L1] > capacity:
            index.drop(index.victim(L1).key, L1)
        index.unpin([entry])
        if outputs is not None:
            index.finished([entry], outputs[i])
    return hits


@pytest.mark.parametrize("seed", range(3))
def test_hit_density_is_exactly_lru_before_it_has_data(seed):
    rng = random.Random(seed)
    a, b = index_with("hit_density"), index_with("lru")
    names = [chr(ord("A") + i) for i in range(40)]
    for index in (a, b):
        for n in names:
            chain(index, n)
    for n in rng.choices(names, k=100):
        for index in (a, b):
            use(index, n)
    assert a.policies[L1].updates == 0
    order = drain(a)
    assert order == drain(b) and len(order) == 40


def test_hit_density_learns_that_reused_blocks_outlive_a_scan():
    # A hot set of 300 blocks, each reused every ~1,200 lookups on average (randomly), under
    # a scan of one-off blocks (3 per hot lookup), in a cache of 400: LRU keeps mostly the
    # scan's last blocks and hits only short reuses (~30 %); hit_density learns that hit
    # blocks come back and one-offs do not, and keeps the hot set.
    rng = random.Random(1)
    hot = [k(f"hot{i}") for i in range(300)]
    stream, n = [], 0
    for _ in range(12_000):
        stream.append(rng.choice(hot))
        for _ in range(3):
            stream.append(k(f"scan{n}"))
            n += 1
    lru = run_stream(index_with("lru"), stream, 400)
    index = index_with("hit_density")
    learned = run_stream(index, stream, 400)
    policy = index.policies[L1]
    assert policy.updates > 10 and policy.ghost_hits > 100
    assert lru < 0.35 * 12_000 and learned > 0.85 * 12_000, (lru, learned)


def test_a_ghost_comes_back_with_its_hits():
    index = index_with("hit_density")
    chain(index, "a")
    use(index, "a")
    use(index, "a")
    index.finished([index.get(k("a"))], 500)         # a request that used it generated 500 tokens
    assert divmod(block_class(index.get(k("a"))), BANDS) == (3, 3)  # hit twice; output >= 128
    drain(index)
    assert index.get(k("a")) is None and k("a") in index.policies[L1].ghosts
    chain(index, "a")                                     # a new entry for the same block
    entry = index.get(k("a"))
    assert entry.hits == 0 and divmod(block_class(entry), BANDS) == (3, 3)  # its hits, the return, its band
    assert k("a") not in index.policies[L1].ghosts and index.policies[L1].ghost_hits == 1


def test_output_bands_are_sixteenfold():
    assert [output_band(n) for n in (0, 1, 7, 8, 127, 128, 2047, 2048, 10**6)] == [1, 1, 1, 2, 2, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="output_tokens"):
        output_band(-1)


@pytest.mark.parametrize("native", [False, None])
def test_finished_changes_a_blocks_class_not_its_age(native):
    index = PrefixIndex([make_policy("hit_density", t) for t in (L1, L2, Tier.L3)], native=native)
    chain(index, "ab")
    use(index, "ab")
    a, b = index.get(k("a")), index.get(k("b"))
    last, hits, clock = b.last_access, b.hits, index.clock
    assert block_class(b) % BANDS == 0                   # no request has finished: band unknown
    index.finished([a, b], 3)
    assert block_class(b) == 2 * BANDS + 1 and block_class(a) == 2 * BANDS + 1
    assert (b.last_access, b.hits, index.clock) == (last, hits, clock)
    policy = index.policies[L1]
    assert len(policy._queues[2 * BANDS + 1]) == 1 and len(policy) == 1  # the leaf, listed under its new class
    index.finished([b], 4000)
    assert block_class(b) == 2 * BANDS + 3 and len(policy._queues[2 * BANDS + 3]) == 1
    assert drain(index) == ["b", "a"]
    lru = index_with("lru")
    chain(lru, "a")
    lru.finished([lru.get(k("a"))], 10)                   # policies that do not learn from it ignore it
    assert drain(lru) == ["a"]


def test_hit_density_learns_which_output_bands_come_back():
    """Requests with short outputs come back once, 600 lookups later; long ones never do.

    A 400-block tier cannot keep everything for 600 lookups (LRU keeps nothing
    that long); told each request's output, hit_density learns that only the
    short ones return and keeps them (half the arrivals: 300 blocks at a time).
    """
    rng = random.Random(3)
    short = [rng.random() < 0.5 for _ in range(8000)]
    stream, outs = [], []
    for i in range(8000):
        stream.append(k(f"r{i}"))
        outs.append(4 if short[i] else 900)
        j = i - 600
        if j >= 0 and short[j]:
            stream.append(k(f"r{j}"))
            outs.append(4)
    returns = sum(short[:7400])

    told = run_stream(index_with("hit_density"), stream, 400, outs)
    untold = run_stream(index_with("hit_density"), stream, 400)
    lru = run_stream(index_with("lru"), stream, 400, outs)
    assert lru == 0
    assert told > 0.8 * returns and told > untold + 0.3 * returns, (told, untold, returns)


def test_ghosts_are_bounded_by_the_tier_size():
    index = index_with("hit_density")
    policy = index.policies[L1]
    run_stream(index, [k(f"x{i}") for i in range(5000)], 50)
    from tierkv.policy.hit_density import GHOST_FACTOR
    assert 0 < len(policy.ghosts) <= GHOST_FACTOR * 51 + 64  # counted while the new block is in


def test_age_bins_are_half_octaves():
    assert [age_bin(a) for a in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 16)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 8]


@pytest.mark.parametrize("name", ["lru", "hit_density"])
def test_save_chain_is_the_add_and_pin_loop(name):
    # Random requests over a shared prefix tree, saved either block by block or as one
    # chain; the indexes, their pins and the policies' eviction orders must agree.
    rng = random.Random(3)
    a, b = index_with(name), index_with(name)
    for _ in range(300):
        path = [f"{rng.randrange(3)}{rng.randrange(2) if d > 1 else 0}" for d in range(rng.randrange(1, 7))]
        keys = [k(hashlib.blake2b("/".join(path[: i + 1]).encode()).hexdigest()[:16]) for i in range(len(path))]
        for index in (a, b):
            hit = index.match(keys)
            held = [index.get(key) for key in keys[: len(hit)]]
            index.pin(held)
            index.touch(held)
            if index is a:
                new = index.save_chain(keys, len(hit), L1)
            else:
                new, parent = [], keys[len(hit) - 1] if hit else None
                for depth in range(len(hit), len(keys)):
                    new.append(index.add(keys[depth], parent, depth, L1, pin=True))
                    parent = keys[depth]
            while index.counts[L1] > 12:
                index.drop(index.victim(L1).key, L1)
            index.unpin(held + new)
    assert a.counts == b.counts and sorted(e.key for e in a.entries()) == sorted(e.key for e in b.entries())
    assert all(e.ref_count == 0 for e in a.entries())
    assert drain(a) == drain(b)


def test_ghosts_have_an_absolute_cap(monkeypatch):
    import tierkv.policy.hit_density as hd

    monkeypatch.setattr(hd, "MAX_GHOSTS", 100)
    index = index_with("hit_density")
    run_stream(index, [k(f"y{i}") for i in range(3000)], 500)  # 4 x 500 would allow 2,064
    assert len(index.policies[L1].ghosts) == 100


def policy_state_bytes(policy: HitDensityPolicy) -> int:
    """What hit_density keeps per block, walked object by object: its ghosts (dict, keys, values;
    a ghost's key outlives the block) and its class queues (bucket dicts, deques, key heaps)."""
    import sys

    ghosts = policy.ghosts
    n = sys.getsizeof(ghosts) + sum(sys.getsizeof(key) + sys.getsizeof(v) for key, v in ghosts.items())
    for q in policy._queues:
        n += sys.getsizeof(q.buckets) + sys.getsizeof(q.keys)
        n += sum(sys.getsizeof(key) + sys.getsizeof(bucket) for key, bucket in q.buckets.items())
    return n


@pytest.mark.parametrize("share", [0.01, 0.02])
def test_the_policy_state_stays_within_its_share_of_the_tier_at_smollm2_block_size(share):
    # SmolLM2-135M's bf16 block of 16 tokens: 30 layers x 2 x 3 KV heads x 64 x 16 x 2 bytes.
    from tierkv.policy.hit_density import GHOST_BYTES, ghosts_for

    block_bytes, capacity = 30 * 2 * 3 * 64 * 16 * 2, 400
    factor = ghosts_for(block_bytes, share)
    assert factor == (11 if share == 0.01 else 27)
    index = PrefixIndex([make_policy("hit_density", t, ghost_factor=factor) for t in (L1, L2, Tier.L3)])
    policy = index.policies[L1]
    # Single-block requests, each at its own clock (a queue bucket per block, the worst case),
    # with a tail of returns so that ghosts are made, kept and found.
    stream = [k(f"s{i - 2000}" if i % 4 == 0 and i >= 2000 else f"s{i}") for i in range(30000)]
    run_stream(index, stream, capacity)
    # Full (the bound is what is measured): trimmed while a new block is in, so one block more.
    assert factor * capacity + 64 <= len(policy.ghosts) <= factor * (capacity + 1) + 64
    used = policy_state_bytes(policy)
    # The 64 ghosts every tier may keep above the factor (and the new block's) are the only allowance.
    assert used <= share * block_bytes * capacity + (64 + factor) * GHOST_BYTES, (used, share * block_bytes * capacity)
    unbounded = PrefixIndex([make_policy("hit_density", t) for t in (L1, L2, Tier.L3)])
    run_stream(unbounded, stream, capacity)
    assert policy_state_bytes(unbounded.policies[L1]) > share * block_bytes * capacity  # 64 would not fit


def test_the_store_sets_ghosts_from_policy_metadata_share(make_store):
    from _kv import LAYOUT

    from tierkv.policy.hit_density import GHOST_FACTOR, ghosts_for

    for share, expect in ((1.0, min(GHOST_FACTOR, ghosts_for(LAYOUT.block_bytes, 1.0))), (0.0, 0)):
        store = make_store(l1=4, l2=4, l3=0, policy=PolicyConfig(name="hit_density", metadata_share=share))
        assert [p.ghost_factor for p in store.index.policies if p is not None] == [expect, expect]
    for bad in (-0.1, 1.5, "1%", True):
        with pytest.raises(ValueError, match="policy.metadata_share"):
            PolicyConfig(metadata_share=bad)
    with pytest.raises(ValueError, match="ghost_factor"):
        make_policy("hit_density", L1, ghost_factor=65)
