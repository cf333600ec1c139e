"""PrefixIndex on small hand-built trees: match, leaves first, pins, children per tier, LRU order."""

from __future__ import annotations

import pytest

from tierkv.index import MISS, PrefixIndex, Tier
from tierkv.policy import LRUPolicy, make_policy

L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3


def k(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def new_index() -> PrefixIndex:
    return PrefixIndex([LRUPolicy(t) for t in (L1, L2, L3)])


def chain(index: PrefixIndex, names: str, tier: int, parent: str | None = None, depth: int = 0) -> None:
    """Add blocks named by the characters of ``names`` as one chain under ``parent``."""
    prev = k(parent) if parent else None
    for i, name in enumerate(names):
        index.add(k(name), prev, depth + i, tier)
        prev = k(name)


def drain(index: PrefixIndex, tier: int) -> list[str]:
    """Evict everything evictable from ``tier`` in policy order, as eviction would."""
    out = []
    while (entry := index.victim(tier)) is not None:
        out.append(entry.key.rstrip(b".").decode())
        index.drop(entry.key, tier)
    return out


def evict_one(index: PrefixIndex, tier: int) -> str | None:
    entry = index.victim(tier)
    if entry is None:
        return None
    index.drop(entry.key, tier)
    return entry.key.rstrip(b".").decode()


def test_match_returns_fastest_tier_and_stops_at_first_miss():
    index = new_index()
    chain(index, "abcd", L3)
    index.add(k("a"), None, 0, L1)
    index.add(k("b"), k("a"), 1, L2)
    index.add(k("b"), k("a"), 1, L1)
    assert index.match([k("a"), k("b"), k("c"), k("d")]) == [L1, L1, L3, L3]
    assert index.match([k("a"), k("x"), k("c")]) == [L1]
    assert index.match([k("x"), k("a")]) == []
    assert index.match([]) == []
    index.drop(k("c"), L3)
    assert index.match([k("a"), k("b"), k("c"), k("d")]) == [L1, L1]
    assert index.get(k("c")) is None and k("c") not in index


def test_leaves_first_in_exact_lru_order():
    index = new_index()
    #      a - b - c
    #       \- d - e
    #           \- f
    chain(index, "abc", L1)
    chain(index, "de", L1, parent="a", depth=1)
    chain(index, "f", L1, parent="d", depth=2)
    # Only leaves are candidates; all were added at clock 0, so insertion order breaks the tie.
    index.touch([index.get(k("c"))])   # c most recently used
    assert drain(index, L1) == ["e", "f", "d", "c", "b", "a"]
    assert len(index) == 0 and index.counts == [0, 0, 0]


def test_lru_order_follows_touches():
    index = new_index()
    for name in "pqrs":
        index.add(k(name), None, 0, L2)
    for name in "sqpr":
        index.touch([index.get(k(name))])
    index.touch([index.get(k("q"))])
    assert drain(index, L2) == ["s", "p", "r", "q"]


def test_pinned_blocks_are_never_victims_until_unpinned():
    index = new_index()
    chain(index, "abc", L1)
    chain(index, "x", L1)
    entries = [index.get(k(n)) for n in "abc"]
    index.pin(entries)
    assert index.victim(L1).key == k("x")
    index.drop(k("x"), L1)
    assert index.victim(L1) is None
    index.pin([entries[2]])          # c pinned twice
    index.unpin(entries)
    assert index.victim(L1) is None  # c still pinned once, so b and a are inner blocks
    index.unpin([entries[2]])
    assert drain(index, L1) == ["c", "b", "a"]
    with pytest.raises(RuntimeError, match="unpin of an unpinned block"):
        index.unpin([entries[0]])


def test_pinned_inner_block_is_kept_when_its_children_go():
    index = new_index()
    chain(index, "abc", L2)
    index.pin([index.get(k("b"))])
    assert drain(index, L2) == ["c"]
    assert index.match([k("a"), k("b")]) == [L2, L2]


def test_children_are_counted_per_tier():
    index = new_index()
    chain(index, "ab", L1)
    index.add(k("c"), k("a"), 1, L2)
    index.add(k("c"), k("a"), 1, L3)
    index.add(k("a"), None, 0, L3)
    a = index.get(k("a"))
    assert a.children == [1, 1, 1]
    assert index.counts == [2, 1, 2]
    # In L3 'a' has a child (c); in L2 it is not held at all; in L1 b is its child.
    assert not index.evictable(a, L1) and not index.evictable(a, L2) and not index.evictable(a, L3)
    assert evict_one(index, L3) == "c"
    assert a.children == [1, 1, 0]
    assert index.evictable(a, L3)
    assert evict_one(index, L3) == "a"
    assert evict_one(index, L3) is None
    assert index.match([k("a"), k("c")]) == [L1, L2]
    assert drain(index, L2) == ["c"]
    assert a.children == [1, 0, 0]
    assert drain(index, L1) == ["b", "a"]
    assert len(index) == 0


def test_a_block_leaving_one_tier_stays_matched_in_another():
    index = new_index()
    chain(index, "ab", L1)
    chain(index, "ab", L3)
    index.drop(k("b"), L1)
    entry = index.get(k("b"))
    assert entry.in_tier(L3) and not entry.in_tier(L1) and entry.best == L3
    assert entry.l1_slot is None
    assert index.match([k("a"), k("b")]) == [L1, L3]
    assert index.drop(k("b"), L1) is None  # already gone from L1: no-op
    index.drop(k("b"), L3)
    assert index.get(k("b")) is None
    assert index.get(k("a")).children == [0, 0, 0]


def test_adding_a_held_block_twice_counts_once():
    index = new_index()
    chain(index, "ab", L2)
    chain(index, "ab", L2)
    assert index.counts == [0, 2, 0]
    assert index.get(k("a")).children == [0, 1, 0]
    assert len(index.policies[L2]) == 1


def test_match_of_a_dropped_entry_reports_miss_constant():
    index = new_index()
    assert MISS == -1
    chain(index, "a", L1)
    assert index.get(k("a")).best == L1
    index.drop(k("a"), L1)
    assert index.match([k("a")]) == []


def test_absent_tier_has_no_policy_and_no_victim():
    index = PrefixIndex([LRUPolicy(L1), None, None])
    chain(index, "ab", L1)
    assert index.victim(L2) is None and index.victim(L3) is None
    assert index.victim(L1).key == k("b")


def test_bad_construction_and_policy_names_fail_naming_the_field():
    with pytest.raises(ValueError, match=r"^index\.policies:"):
        PrefixIndex([None, None])
    with pytest.raises(ValueError, match=r"^index\.half_life:"):
        PrefixIndex([None, None, None], half_life=0)
    with pytest.raises(ValueError, match=r"^policy\.name: expected one of .*'lru'"):
        make_policy("mru", L1)


def test_touch_decays_frequency_by_half_life():
    index = PrefixIndex([LRUPolicy(t) for t in (L1, L2, L3)], half_life=2.0)
    chain(index, "a", L1)
    a = index.get(k("a"))
    index.touch([a])
    assert a.freq == pytest.approx(1.0) and a.last_access == 1
    index.touch([])
    index.touch([])
    index.touch([a])  # two half-lives later... minus the touch itself: 3 clock ticks
    assert a.freq == pytest.approx(1.0 * 0.5 ** (3 / 2.0) + 1.0)
    assert a.last_access == 4


def test_a_parent_forgotten_and_added_again_still_counts_its_children():
    # p left its only tier while its child c stayed cached elsewhere (a store without
    # L1 puts c into L2 while p sits in L3; L3 pressure then takes p). When p is
    # cached again it must not be evicted before c, and no count may go negative.
    index = new_index()
    chain(index, "p", L3)
    index.add(k("c"), k("p"), 1, L2)
    assert evict_one(index, L3) == "p"
    assert index.get(k("p")) is None
    assert index.match([k("p"), k("c")]) == []
    index.touch([index.get(k("c"))])
    index.add(k("p"), None, 0, L2)
    index.touch([index.get(k("c"))])  # c is now the most recently used block in L2
    assert index.get(k("p")).children == [0, 1, 0]
    assert index.match([k("p"), k("c")]) == [L2, L2]
    assert drain(index, L2) == ["c", "p"]
    assert len(index) == 0


def test_removal_listener_hears_each_full_removal_once_not_demotions():
    index = new_index()
    heard: list[str] = []
    index.add_removal_listener(lambda key: heard.append(key.rstrip(b".").decode()))
    chain(index, "ab", L1)
    index.add(k("b"), k("a"), 1, L2)  # demotion: the lower tier is added first ...
    index.drop(k("b"), L1)  # ... then the upper one dropped
    index.drop(k("x"), L1)  # not held at all
    index.drop(k("a"), L2)  # not held in that tier
    assert heard == []
    assert drain(index, L2) == ["b"]
    assert heard == ["b"]
    index.drop(k("b"), L2)  # already gone: no second call
    assert drain(index, L1) == ["a"]
    assert heard == ["b", "a"] and len(index) == 0


def test_removal_listener_errors_are_swallowed_counted_and_logged_once(caplog):
    index = new_index()
    heard: list[bytes] = []

    def broken(key: bytes) -> None:
        raise ValueError("listener bug")

    index.add_removal_listener(broken)
    index.add_removal_listener(heard.append)
    chain(index, "abc", L2)
    with caplog.at_level("WARNING", logger="tierkv"):
        assert drain(index, L2) == ["c", "b", "a"]
    assert heard == [k("c"), k("b"), k("a")]  # a failing listener does not starve the next one
    assert index.listener_errors == 3 and len(index) == 0
    (record,) = caplog.records
    assert "removal listener" in record.message and "listener bug" in record.exc_text
    index.remove_removal_listener(broken)
    index.remove_removal_listener(broken)  # unknown now: ignored
    chain(index, "d", L3)
    index.drop(k("d"), L3)
    assert index.listener_errors == 3 and heard[-1] == k("d")


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_children_and_candidates_exact(seed):
    """Random add/drop/pin/unpin/evict on a fixed tree, checked against a brute-force model."""
    import random

    rng = random.Random(seed)
    names = [f"n{i}" for i in range(24)]
    parent = {names[0]: None}
    for i, name in enumerate(names[1:], 1):
        parent[name] = names[rng.randrange(i)] if rng.random() < 0.8 else None
    depth = {}
    for name in names:
        d, p = 0, parent[name]
        while p is not None:
            d, p = d + 1, parent[p]
        depth[name] = d
    index = new_index()
    held: set[tuple[str, int]] = set()
    pins: dict[str, int] = {}
    for _ in range(400):
        op = rng.random()
        name, tier = rng.choice(names), rng.choice((L1, L2, L3))
        if op < 0.45:
            index.add(k(name), k(parent[name]) if parent[name] else None, depth[name], tier)
            held.add((name, tier))
        elif op < 0.65:
            if not pins.get(name):
                index.drop(k(name), tier)
                held.discard((name, tier))
        elif op < 0.75:
            entry = index.get(k(name))
            if entry is not None:
                index.pin([entry])
                pins[name] = pins.get(name, 0) + 1
        elif op < 0.85:
            if pins.get(name):
                index.unpin([index.get(k(name))])
                pins[name] -= 1
        else:
            victim = index.victim(tier)
            if victim is not None:
                vname = victim.key.rstrip(b".").decode()
                assert (vname, tier) in held and not pins.get(vname)
                assert not any((c, tier) in held for c in names if parent[c] == vname)
                index.drop(victim.key, tier)
                held.discard((vname, tier))
        for name in names:
            entry = index.get(k(name))
            tiers_held = [t for t in (L1, L2, L3) if (name, t) in held]
            if not tiers_held:
                assert entry is None
                continue
            assert entry is not None and [entry.in_tier(t) for t in (L1, L2, L3)] == [
                (name, t) in held for t in (L1, L2, L3)]
            for t in (L1, L2, L3):
                kids = sum((c, t) in held for c in names if parent[c] == name)
                assert entry.children[t] == kids, (name, t)
                listed = entry.handles[t] is not None
                should = (name, t) in held and kids == 0 and not pins.get(name)
                assert listed == should, (name, t)
        assert index.counts == [sum(t == x for _, t in held) for x in (L1, L2, L3)]
