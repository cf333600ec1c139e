"""index_native: the index's C loops decide exactly as its Python ones (same victims, same state, every step)."""

from __future__ import annotations

import gc
import hashlib
import random

import pytest
from _env import load_tool

from tierkv import index_native
from tierkv.index import PrefixIndex, Tier
from tierkv.policy import make_policy
from tierkv.policy.age_queue import AgeQueue
from tierkv.policy.base import HeapPolicy
from tierkv.policy.hit_density import HitDensityPolicy

pytestmark = pytest.mark.skipif(index_native.load() is None, reason="the C loops are unavailable here (no compiler or Python headers, or TIERKV_NATIVE=0)")

L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3
POLICIES = ["lru", "hit_density", "cost_aware", "lfu"]


def _keys(path: list[str]) -> list[bytes]:
    return [hashlib.blake2b("/".join(path[: i + 1]).encode()).digest()[:16] for i in range(len(path))]


def _handle(h):
    return (h[0], h[1], h[2].key if h[2] is not None else None) if isinstance(h, list) else h


def _entry(e) -> tuple:
    return (e.key, e.parent, e.depth, e.mask, e.best, e.l1_slot, e.ref_count, e.last_access, e.freq, e.hits,
            e.tag, list(e.children), [_handle(h) for h in e.handles])


def _queue(q: AgeQueue) -> tuple:
    return ({k: [e.key for e in b] for k, b in q.buckets.items()}, sorted(q.keys), q.live, q.stored)


def _policy(p) -> tuple:
    if p is None:
        return ()
    if isinstance(p, HitDensityPolicy):
        return ([_queue(q) for q in p._queues], p.hit_hist, p.end_hist, p.density, list(p.ghosts.items()),
                p._events, p._period, p.updates, p.ghost_hits, p._scores, p._scored_clock,
                [e.key if e is not None else None for e in p._scored])
    if isinstance(p, HeapPolicy):
        return (sorted(_handle(i) for i in p._heap if i[2] is not None), len(p), getattr(p, "theta", None))
    return (_queue(p._queue),)


def snapshot(index: PrefixIndex) -> tuple:
    return (sorted(_entry(e) for e in index.entries()), sorted(_entry(e) for e in index._uncached_parents.values()),
            list(index.counts), index.clock, [_policy(p) for p in index.policies])


class Recorder:
    """Stands in for tierkv.events.TierEvents: records what the index reports."""

    records = None  # (no DeferredRecords log: the index calls the methods)

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def stored(self, key, tier) -> None:
        self.calls.append(("stored", key, int(tier)))

    def stored_keys(self, keys, tier) -> None:  # a save's chain, in one call
        self.calls.extend(("stored", key, int(tier)) for key in keys)

    def removed(self, key, tier) -> None:
        self.calls.append(("removed", key, int(tier)))


def _step(index: PrefixIndex, rng: random.Random, out: list) -> None:
    """One random operation (the same under the same rng state), results appended to ``out``."""
    keys = _keys([f"{rng.randrange(3)}{rng.randrange(3) if d > 1 else 0}" for d in range(rng.randrange(1, 9))])
    op = rng.random()
    if op < 0.6:  # a request, as the store and the replay run it
        held = index.match_entries(keys)
        index.use(held, rng.random() < 0.85)
        pinned = held if held and held[0].ref_count else []
        tier = rng.choice([L1, L1, L2, L3])
        new = index.save_chain(keys, rng.choice([0, len(held)]), tier)
        n = max(index.counts[tier] - rng.choice([6, 12, 20]), 0)
        out.append([e.key for e in index.evict(tier, n)])
        index.unpin(pinned + new)
        out.append(len(new))
        if rng.random() < 0.7:  # the request finishes (hit_density's output bands; Python, between C calls)
            index.finished(held + new, rng.choice([0, 5, 40, 600]))
    elif op < 0.7:  # one-block calls in Python, interleaved with the C ones
        tier = rng.choice([L1, L2, L3])
        for i, key in enumerate(keys):
            index.add(key, keys[i - 1] if i else None, i, tier)
    elif op < 0.8:
        victim = index.victim(rng.choice([L1, L2, L3]))
        out.append(None if victim is None else victim.key)
        if victim is not None:
            index.drop(victim.key, victim.best if victim.best >= 0 else L1)
            for t in (L1, L2, L3):
                if victim.mask >> t & 1 and victim.handles[t] is None and not victim.children[t] \
                        and not victim.ref_count:
                    index.policies[t].add(victim)
    elif op < 0.9:
        held = index.match_entries(keys)
        index.touch(held)
        out.append(len(held))
    else:
        index.drop(keys[-1], rng.choice([L1, L2, L3]))


@pytest.mark.parametrize("name", POLICIES)
def test_c_and_python_loops_leave_the_same_state_after_every_step(name):
    runs = []
    for native in (False, None):
        rng = random.Random(11)
        index = PrefixIndex([make_policy(name, t, lower=t + 1 if t < 2 else None) for t in (L1, L2, L3)],
                            half_life=50.0, native=native)
        assert (index._c is None) == (native is False)
        index.events = Recorder()
        removed: list[bytes] = []
        index.add_removal_listener(removed.append)
        out: list = []
        states = []
        for _ in range(700):
            _step(index, rng, out)
            states.append(snapshot(index))
        runs.append((out, states, index.events.calls, removed, index))
    (out_a, states_a, events_a, removed_a, a), (out_b, states_b, events_b, removed_b, b) = runs
    assert out_a == out_b and sum(len(v) for v in out_a if isinstance(v, list)) > 300
    for i, (sa, sb) in enumerate(zip(states_a, states_b)):
        assert sa == sb, f"step {i}"
    assert events_a == events_b and removed_a == removed_b and removed_a
    if name == "hit_density":
        assert all(p.updates > 0 and p.ghost_hits > 0 for p in a.policies)


def test_unpin_of_an_unpinned_block_fails_the_same_way():
    messages = []
    for native in (False, None):
        index = PrefixIndex([make_policy("lru", t) for t in (L1, L2, L3)], native=native)
        entries = index.save_chain(_keys(["a", "b"]), 0, L1)
        index.unpin(entries)
        with pytest.raises(RuntimeError, match="unpin of an unpinned block") as err:
            index.unpin(entries)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_keyword_arguments_reach_the_c_loops():
    index = PrefixIndex([make_policy("hit_density", t) for t in (L1, L2, L3)])
    new = index.save_chain(keys=_keys(["a", "b", "c"]), start=0, tier=L1)
    index.use(entries=new[:1], pin=False)
    index.unpin(entries=new)
    assert [e.depth for e in index.evict(tier=L1, n=2)] == [2, 1]
    with pytest.raises(TypeError, match="unexpected"):
        index.use(new, pim=True)


def test_entries_of_int_handle_policies_stay_out_of_the_collector():
    # lru and hit_density keep ints in Entry.handles: such an entry can be in no cycle.
    # A heap policy's handle is a list holding the entry: those stay tracked.
    for name, tracked in (("lru", False), ("hit_density", False), ("cost_aware", True)):
        index = PrefixIndex([make_policy(name, t) for t in (L1, L2, L3)])
        (entry,) = index.save_chain(_keys(["x"]), 0, L1)
        assert gc.is_tracked(entry) is tracked and gc.is_tracked(entry.handles) is tracked, name
        assert not gc.is_tracked(entry.children)
        assert PrefixIndex([make_policy(name, L1), None, None], native=False).save_chain(_keys(["x"]), 0, L1)


@pytest.mark.parametrize("name", ["lru", "hit_density", "cost_aware", "belady"])
def test_replay_results_are_the_same_with_and_without_c(tmp_path, name):
    replay = load_tool("replay")
    tracegen = load_tool("tracegen")
    path = tmp_path / "mixed.jsonl"
    tracegen.write(tracegen.generate("mixed", 3, 900), path)
    requests, outputs = replay.load_trace(path), replay.load_outputs(path)
    for caps in ([150], [400], [60, 200, 600]):
        a, b = (replay.replay(requests, name, caps, native=native, outputs=outputs) for native in (False, None))
        for r in (a, b):
            r.seconds = r.cpu_seconds = 0.0
        assert a == b, caps
        assert a.hit_rate > 0


def test_indexes_on_two_threads_decide_as_each_alone():
    # Listeners run Python inside the C evict, where the interpreter may switch threads:
    # another index's evict then runs meanwhile. Each must still decide as it does alone.
    import sys
    import threading

    def run(seed: int, out: list) -> None:
        rng = random.Random(seed)
        index = PrefixIndex([make_policy(n, t) for n, t in (("hit_density", L1), ("cost_aware", L2), ("lru", L3))],
                            half_life=50.0)
        removed: list[bytes] = []
        index.add_removal_listener(lambda key: removed.append(hashlib.blake2b(key).digest()[:4]))
        steps: list = []
        for _ in range(400):
            _step(index, rng, steps)
        out.extend([steps, removed, snapshot(index)])

    alone = [[], []]
    for seed, out in zip((3, 4), alone):
        run(seed, out)
    together = [[], []]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(seed, out)) for seed, out in zip((3, 4), together)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert together == alone


def test_c_and_python_loops_keep_a_policys_own_ghost_factor():
    # hit_density's ghosts per block are a per-policy slot (policy.metadata_share): the C loops
    # read it, not the module's GHOST_FACTOR, and trim where the Python ones do.
    runs = []
    for native in (False, None):
        rng = random.Random(5)
        index = PrefixIndex([make_policy("hit_density", t, lower=t + 1 if t < 2 else None, ghost_factor=1)
                             for t in (L1, L2, L3)], half_life=50.0, native=native)
        assert (index._c is None) == (native is False)
        out: list = []
        for _ in range(2000):
            _step(index, rng, out)
        runs.append((out, [list(p.ghosts.items()) for p in index.policies], index))
    (out_a, ghosts_a, a), (out_b, ghosts_b, b) = runs
    assert out_a == out_b and ghosts_a == ghosts_b
    for p in b.policies:
        assert len(p.ghosts) <= 1 * (b.counts[p.tier] + 1) + 64
    assert sum(map(len, ghosts_b)) > 64  # ghosts were made, and trimmed at the small factor
