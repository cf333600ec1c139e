"""policy/age_queue.py: oldest-first order, FIFO ties, lazy deletion and its sweep; and the index's
batch calls (use, evict, match_entries) against the one-block calls they replace."""

from __future__ import annotations

import hashlib
import random

import pytest

from tierkv.index import Entry, PrefixIndex, Tier
from tierkv.policy import make_policy
from tierkv.policy.age_queue import TAG_BITS, AgeQueue

L1 = Tier.L1


def entry(name: str, last: int) -> Entry:
    return Entry(name.encode(), None, 0, last_access=last, mask=1)


def names(queue: AgeQueue) -> list[str]:
    out = []
    while (e := queue.pop()) is not None:
        out.append(e.key.decode())
    return out


def test_oldest_first_and_equal_ages_in_listing_order():
    q = AgeQueue(L1)
    for name, last in [("c", 5), ("a", 2), ("d", 5), ("b", 2), ("e", 1)]:
        q.add(entry(name, last))
    assert len(q) == 5 and names(q) == ["e", "a", "b", "c", "d"] and len(q) == 0


def test_discard_and_touch_move_blocks_and_the_handle_names_the_queue():
    q = AgeQueue(L1, tag=3)
    es = {n: entry(n, i) for i, n in enumerate("abcd")}
    for e in es.values():
        q.add(e)
    assert es["b"].handles[L1] == 1 << TAG_BITS | 3
    q.discard(es["a"])
    q.discard(es["a"])  # unlisted: ignored
    es["b"].last_access = 9
    q.touch(es["b"])
    assert es["a"].handles[L1] is None and len(q) == 3
    assert names(q) == ["c", "d", "b"]


def test_a_block_listed_again_under_the_same_age_leaves_once():
    q = AgeQueue(L1)
    a, b = entry("a", 1), entry("b", 1)
    q.add(a)
    q.add(b)
    q.discard(a)
    q.add(a)  # a stale occurrence stays ahead of b
    assert len(q) == 2 and names(q) == ["a", "b"]


def test_sweep_keeps_order_and_bounds_dead_occurrences():
    q = AgeQueue(L1)
    es = [entry(f"{i:03}", i // 3) for i in range(30)]
    for e in es:
        q.add(e)
    for _ in range(40):  # churn one block: dead occurrences pile up until a sweep
        q.discard(es[0])
        q.add(es[0])
    assert q.stored <= 4 * q.live + 64 + 1
    assert names(q) == [e.key.decode() for e in es]


def test_pop_after_is_add_then_pop_and_lists_nothing_it_takes():
    q = AgeQueue(L1)
    old, same, new = entry("old", 1), entry("same", 5), entry("new", 9)
    q.add(old)
    assert q.pop_after(entry("x", 3)).key == b"old"  # an older block leads: listed, and old taken
    q.add(same)
    parent = entry("p", 5)
    assert q.pop_after(parent).key == b"x"  # x (age 3) is still older
    assert q.pop_after(new).key == b"same"  # equal ages leave in listing order: same, then p
    lone = entry("lone", 2)
    assert q.pop_after(lone) is lone and lone.handles[L1] is None  # the oldest: taken unlisted
    assert names(q) == ["p", "new"]


def test_bad_tag_fails_naming_the_field():
    with pytest.raises(ValueError, match="age_queue.tag"):
        AgeQueue(L1, tag=1 << TAG_BITS)


def _keys(path: list[str]) -> list[bytes]:
    return [hashlib.blake2b("/".join(path[: i + 1]).encode()).digest()[:16] for i in range(len(path))]


@pytest.mark.parametrize("name", ["lru", "hit_density", "lfu", "cost_aware"])
def test_batch_calls_are_the_one_block_calls(name):
    # Random requests over a shared prefix tree, run with match_entries/use/evict in one index
    # and match/get/pin/touch/victim/drop in the other: same state, same victims, same order.
    rng = random.Random(5)
    a, b = (PrefixIndex([make_policy(name, t) for t in (L1, Tier.L2, Tier.L3)]) for _ in range(2))
    victims_a, victims_b = [], []
    for _ in range(400):
        keys = _keys([f"{rng.randrange(3)}{rng.randrange(2) if d > 1 else 0}" for d in range(rng.randrange(1, 8))])
        held = a.match_entries(keys)
        a.use(held, True)
        new = a.save_chain(keys, len(held), L1)
        victims_a += [e.key for e in a.evict(L1, max(a.counts[L1] - 15, 0))]
        a.unpin(held + new)

        hit = b.match(keys)
        held = [b.get(key) for key in keys[: len(hit)]]
        b.pin(held)
        b.touch(held)
        new = b.save_chain(keys, len(hit), L1)
        while b.counts[L1] > 15:
            victim = b.victim(L1)
            victims_b.append(victim.key)
            b.drop(victim.key, L1)
        b.unpin(held + new)
    assert victims_a == victims_b and len(victims_a) > 100
    assert a.counts == b.counts and a.clock == b.clock
    assert sorted((e.key, e.hits, e.last_access) for e in a.entries()) == \
        sorted((e.key, e.hits, e.last_access) for e in b.entries())
    rest_b = []
    while (victim := b.victim(L1)) is not None:
        rest_b.append(victim.key)
        b.drop(victim.key, L1)
    assert [e.key for e in a.evict(L1, 1000)] == rest_b
