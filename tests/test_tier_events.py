"""Tier events: the store reports every block arriving in or leaving a tier, batched, off its lock."""

from __future__ import annotations

import random
import sys
import threading

import pytest

from _kv import block_for, prompt, save_prompt
from tierkv import alarm
from tierkv.events import DeferredRecords, TierEvents
from tierkv.index import Tier

L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3


class Recorder:
    """A listener that keeps every batch it was given and the store state it could see."""

    def __init__(self) -> None:
        self.batches: list[tuple[list, list]] = []
        self.lock = threading.Lock()

    def __call__(self, stored, removed) -> None:
        with self.lock:
            self.batches.append((list(stored), list(removed)))

    def net(self) -> set[tuple[bytes, int]]:
        """What the listener believes each tier holds, applying removed before stored per batch."""
        held: set[tuple[bytes, int]] = set()
        for stored, removed in self.batches:
            assert not set(stored) & set(removed)
            held -= set(removed)
            held |= set(stored)
        return held


def held_by_index(store) -> set[tuple[bytes, int]]:
    return {(e.key, t) for e in store.index.entries() for t in (L1, L2, L3) if e.in_tier(t)}


def test_listeners_see_saves_demotions_and_persists_as_the_index_does(make_store, layout):
    store = make_store(l1=4, l2=4, l3=16)
    rec = Recorder()
    store.add_tier_listener(rec)
    a = save_prompt(store, prompt(1, 4, layout))
    store.flush()
    assert rec.net() == {(k, L1) for k in a}
    b = save_prompt(store, prompt(2, 4, layout))  # a: L1 -> L2
    c = save_prompt(store, prompt(3, 4, layout))  # a: L2 -> L3, b: L1 -> L2
    store.flush()
    assert rec.net() == held_by_index(store)
    assert {(k, L3) for k in a} | {(k, L2) for k in b} | {(k, L1) for k in c} == rec.net()
    removed = [item for _, gone in rec.batches for item in gone]
    assert {(k, L1) for k in a} <= set(removed)  # (its pass through L2 may net out within one batch)
    assert store.persist(c) == 4
    store.flush()
    assert {(k, L3) for k in c} <= rec.net() == held_by_index(store)
    store.remove_tier_listener(rec)
    n = len(rec.batches)
    save_prompt(store, prompt(4, 4, layout))
    store.flush()
    assert len(rec.batches) == n


def test_a_blocked_listener_delays_no_lookup_or_save(make_store, layout):
    store = make_store(l1=8, l2=4, l3=0)
    gate, entered = threading.Event(), threading.Event()

    def slow(stored, removed):
        entered.set()
        gate.wait(30)

    store.add_tier_listener(slow)
    save_prompt(store, prompt(5, 4, layout))
    assert entered.wait(10)          # the listener is stuck inside a batch
    keys = save_prompt(store, prompt(6, 4, layout))
    m = store.lookup_keys(keys)
    assert m.tiers == [L1] * 4
    store.release(m)
    assert not store.events.flush(0.2)  # the stuck batch: a flush times out rather than hang
    gate.set()
    assert store.events.flush(10)


def test_a_listener_may_call_the_store_and_its_errors_are_counted(make_store, layout):
    store = make_store(l1=4, l2=4, l3=0)
    seen = []

    def calls_back(stored, removed):
        seen.append(store.stats()["index_entries"])
        raise RuntimeError("listener bug")

    store.add_tier_listener(calls_back)
    save_prompt(store, prompt(7, 4, layout))
    store.flush()
    save_prompt(store, prompt(8, 4, layout))
    store.flush()
    assert seen and store.events.errors == len(seen)


def test_a_batch_is_the_net_change():
    events = TierEvents()
    got = []
    gate, entered = threading.Event(), threading.Event()
    events.add_listener(lambda s, r: (entered.set(), gate.wait(10), got.append((s, r))))
    with events.lock:
        events.stored(b"x", L1)      # the first batch: delivery blocks on the gate
    assert entered.wait(10)
    with events.lock:                # recorders hold the lock a store passes in (here: its own)
        events.stored(b"a", L1)
        events.removed(b"a", L1)     # stored then removed: nothing
        events.removed(b"b", L2)
        events.stored(b"b", L2)      # removed then stored: nothing
        events.removed(b"c", L1)
        events.stored(b"c", L2)      # a demotion: both
        events.stored(b"d", Tier.L4)
        events.stored(b"d", Tier.L4)  # the same arrival twice: once
    gate.set()
    assert events.flush(10)
    events.close()
    assert got == [([(b"x", L1)], []), ([(b"c", L2), (b"d", Tier.L4)], [(b"c", L1)])]


def _batch_after(ops, bulk: bool, deferred: bool = False, before=()) -> tuple:
    """The pending batch a TierEvents holds after ``before`` then ``ops`` ((stored?, keys, tier) each),
    recorded key by key or one call per op (``stored_keys``/``removed_keys``); ``deferred``: ``ops``
    through a DeferredRecords, told in one ``record_deferred``. The thread never delivers (long window)."""
    events = TierEvents(window_s=3600)
    events.add_listener(lambda s, r: None, by_tier=True)
    with events.lock:
        for is_stored, keys, tier in before:
            for key in keys:
                (events.stored if is_stored else events.removed)(key, tier)
        recorder = events.deferred() if deferred else events
        for is_stored, keys, tier in ops:
            if bulk:
                (recorder.stored_keys if is_stored else recorder.removed_keys)(keys, tier)
            else:
                for key in keys:
                    (recorder.stored if is_stored else recorder.removed)(key, tier)
        if deferred:
            events.record_deferred(recorder)
    new, gone = events._batch
    batch = [list(d.items()) for d in new], [list(d.items()) for d in gone]  # contents and order
    events.close()
    return batch


def test_recording_a_chain_in_one_call_nets_out_as_key_by_key():
    rng = random.Random(5)
    keys = [bytes([i]) * 16 for i in range(12)]  # few keys: stores and removals of one key meet often
    for _ in range(200):
        ops = [(rng.random() < 0.5, [rng.choice(keys) for _ in range(rng.randrange(0, 6))], rng.randrange(4))
               for _ in range(rng.randrange(1, 12))]
        assert _batch_after(ops, bulk=True) == _batch_after(ops, bulk=False), ops


def test_an_operation_told_in_one_go_nets_out_as_told_key_by_key():
    rng = random.Random(11)
    keys = [bytes([i]) * 16 for i in range(12)]

    def some_ops():
        return [(rng.random() < 0.5, [rng.choice(keys) for _ in range(rng.randrange(0, 6))], rng.randrange(4))
                for _ in range(rng.randrange(0, 12))]

    for _ in range(200):
        before, ops = some_ops(), some_ops()  # (what the batch held already: the cancels reach into it)
        want = _batch_after(ops, bulk=False, before=before)
        assert _batch_after(ops, bulk=False, deferred=True, before=before) == want, (before, ops)
        assert _batch_after(ops, bulk=True, deferred=True, before=before) == want, (before, ops)


def test_nothing_is_deferred_without_a_listener_and_a_bad_tier_raises_before_any_record():
    events = TierEvents(window_s=3600)
    assert events.deferred() is None
    events.add_listener(lambda s, r: None)
    deferred = events.deferred()
    with pytest.raises(IndexError):
        deferred.stored(b"k", 7)
    deferred.removed(b"k", L2)
    assert deferred.records == [b"k", 4 + L2]
    events.close()


def test_a_put_tells_its_stores_and_evictions_in_one_go_and_gives_the_index_its_events_back(make_store, layout):
    store = make_store(l1=4, l2=4, l3=0)     # no L3: a put lands in L2 and, once it is full, evicts
    rec = Recorder()
    store.add_tier_listener(rec)
    told = []
    record_deferred = store.events.record_deferred
    store.events.record_deferred = lambda d: (told.append(list(d.records)), record_deferred(d))
    tokens = prompt(3, 6, layout)
    keys = store.hash(tokens)
    assert store.put_blocks(keys[:4], [block_for(k, layout) for k in keys[:4]]) == [True] * 4
    assert store.put_blocks(keys, [block_for(k, layout) for k in keys[4:]], start=4) == [True] * 2  # evicts 2
    assert store.index.events is store.events
    store.flush()
    assert rec.net() == held_by_index(store) == {(k, L2) for k in store.index._entries}
    assert len(told) == 2 and [told[0][1::2], len(told[1])] == [[L2] * 4, 8]
    assert sorted(told[1][1::2]) == [L2, L2, 4 + L2, 4 + L2]  # two stores, two evictions, one call
    store.events.record_deferred = record_deferred


def test_the_index_appends_to_a_deferred_log_and_its_c_paths_call_it(make_store):
    from tierkv.index import PrefixIndex
    from tierkv.policy import make_policy

    chain = [bytes([i]) * 16 for i in range(4)]
    for native in (False, None):
        index = PrefixIndex([make_policy("lru", t, lower=t + 1 if t < 2 else None) for t in (L1, L2, Tier.L3)],
                            native=native)
        index.events = deferred = DeferredRecords()
        index.add(chain[0], None, 0, L1)          # Python: two appends
        index.save_chain(chain, 0, L2)           # C (or Python): one stored_keys
        index.drop(chain[0], L1)
        want = [chain[0], L1, *[x for k in chain for x in (k, L2)], chain[0], 4 + L1]
        assert deferred.records == want, native


def test_nothing_is_recorded_in_bulk_without_a_listener():
    events = TierEvents(window_s=3600)
    with events.lock:
        events.stored_keys([b"a" * 16], L1)
        events.removed_keys([b"b" * 16], L2)
    assert not events._pending() and not events._armed
    events.close()


def test_a_save_tells_the_events_its_chain_in_one_call_in_c_and_python():
    from tierkv.policy import make_policy
    from tierkv.index import PrefixIndex

    class Calls:
        _listeners = (1,)

        def __init__(self):
            self.calls = []

        def stored(self, key, tier):
            self.calls.append(("stored", key, tier))

        def stored_keys(self, keys, tier):
            self.calls.append(("stored_keys", list(keys), tier))

    chain = [bytes([i]) * 16 for i in range(5)]
    for native in (False, None):
        index = PrefixIndex([make_policy("lru", t, lower=t + 1 if t < 2 else None) for t in (L1, L2, Tier.L3)],
                            native=native)
        index.events = Calls()
        index.save_chain(chain[:2], 0, L2)
        index.save_chain(chain, 0, L2)      # the first two are held already: only the rest are news
        index.events._listeners = ()        # nobody listens: no list is gathered, no call made
        index.save_chain(chain, 0, L1)
        assert index.events.calls == [("stored_keys", chain[:2], L2), ("stored_keys", chain[2:], L2)], native


def test_a_by_tier_listener_gets_the_same_batches_as_key_lists(make_store, layout):
    store = make_store(l1=4, l2=4, l3=16)
    pairs, lists = Recorder(), []
    store.add_tier_listener(pairs)
    store.add_tier_listener(lambda s, r: lists.append((s, r)), by_tier=True)
    for i in range(1, 4):
        save_prompt(store, prompt(i, 4, layout))
    store.flush()
    assert len(lists) == len(pairs.batches) >= 1
    for (stored, removed), (s, r) in zip(pairs.batches, lists):
        assert len(s) == len(r) == 4  # L1..L4
        assert stored == [(k, t) for t, keys in enumerate(s) for k in keys]
        assert removed == [(k, t) for t, keys in enumerate(r) for k in keys]
    assert pairs.net() == held_by_index(store)


ALARMS = [pytest.param(alarm.TimerAlarm, id="timerfd",
                        marks=pytest.mark.skipif(alarm._TIMERFD is None, reason="no timerfd (not Linux)")),
          pytest.param(alarm.LockAlarm, id="locks")]


@pytest.mark.parametrize("make_alarm", ALARMS)
def test_an_armed_alarm_wakes_its_waiter_later_and_a_fired_one_at_once(make_alarm):
    a = make_alarm()
    woke = threading.Event()

    def waiter():
        a.wait()
        woke.set()

    for arm in (lambda: a.arm(0.001), a.fire):  # a short window runs out; a fire needs no window
        woke.clear()
        thread = threading.Thread(target=waiter)
        thread.start()
        arm()
        assert woke.wait(10)
        thread.join(10)
    woke.clear()
    thread = threading.Thread(target=waiter)
    thread.start()
    a.arm(60)                        # a long window: the waiter stays asleep...
    assert not woke.wait(0.3)
    a.fire()                         # ...until a fire (a flush, a close) replaces it
    assert woke.wait(10)
    thread.join(10)


@pytest.mark.parametrize("make_alarm", ALARMS)
def test_records_racing_the_delivery_thread_lose_none(make_alarm):
    # Thousands of batches swapped out while records keep coming (a GIL switch every microsecond):
    # the listener's view must end equal to what was recorded.
    events = TierEvents(window_s=0, min_interval_s=0)
    events._alarm = make_alarm()     # before the thread starts: each way of waking delivers everything
    seen: set[tuple[bytes, int]] = set()

    def apply(stored, removed):
        for tier, keys in enumerate(removed):
            seen.difference_update((k, tier) for k in keys)
        for tier, keys in enumerate(stored):
            seen.update((k, tier) for k in keys)

    events.add_listener(apply, by_tier=True)
    truth: set[tuple[bytes, int]] = set()
    rng = random.Random(7)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(40_000):
            item = (rng.randrange(64).to_bytes(2, "little"), rng.randrange(3))
            with events.lock:
                if item in truth:
                    events.removed(*item)
                    truth.discard(item)
                else:
                    events.stored(*item)
                    truth.add(item)
    finally:
        sys.setswitchinterval(interval)
    assert events.flush(10)
    events.close()
    assert events.batches > 100 and seen == truth


def test_a_batch_right_after_another_waits_out_the_interval_and_a_flush_does_not():
    class Alarm(alarm.LockAlarm):
        def __init__(self):
            super().__init__()
            self.delays = []

        def arm(self, delay):
            self.delays.append(delay)
            super().arm(delay)

    events = TierEvents(window_s=0.001, min_interval_s=60)
    events._alarm = ring = Alarm()   # before the thread starts
    got = []
    events.add_listener(lambda s, r: got.append(s), by_tier=True)
    with events.lock:
        events.stored(b"a", L1)      # nothing went out before: the window alone
    assert events.flush(10)
    with events.lock:
        events.stored(b"b", L1)      # a batch just went out: the next waits for the interval...
        events.stored(b"c", L1)      # ...and the batch's later records arm nothing
    assert ring.delays[0] == 0.001 and 59 < ring.delays[1] <= 60 and len(ring.delays) == 2
    assert events.flush(10)          # ...unless flushed
    events.close()
    assert got == [[[b"a"], [], [], []], [[b"b", b"c"], [], [], []]]


def test_bad_event_timings_name_the_field():
    for kwargs, field in (({"window_s": -1}, "window_s"), ({"min_interval_s": float("nan")}, "min_interval_s")):
        with pytest.raises(ValueError, match=field):
            TierEvents(**kwargs)


def test_taking_a_batch_waits_for_the_record_being_written():
    # The moment the lock-free swap guards: a recorder has read the batch (its flag is up) and is
    # switched out before its write; the delivery thread must not hand that batch on without it.
    events = TierEvents()
    events._recording = True
    batch = events._batch
    taken = []
    thread = threading.Thread(target=lambda: taken.append(events._take()))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and not taken
    batch[0][0][b"late"] = True      # the recorder's write lands in the batch it read...
    events._recording = False        # ...and its flag comes down
    thread.join(5)
    assert taken and taken[0] is batch and b"late" in taken[0][0][0]
    assert events._batch is not batch and not events._pending()


def test_a_bad_tier_raises_to_the_recorder_and_delivery_goes_on():
    events = TierEvents()
    got = []
    events.add_listener(lambda s, r: got.append(s), by_tier=True)
    with events.lock:
        with pytest.raises(IndexError):
            events.stored(b"k", 7)   # a programming error: raised, and the batch stays takeable
        events.stored(b"k", 1)
    assert events.flush(5)
    events.close()
    assert got == [[[], [b"k"], [], []]]


def test_flushes_from_many_threads_each_see_what_they_recorded_delivered():
    events = TierEvents()
    seen: set[bytes] = set()
    events.add_listener(lambda s, r: seen.update(k for keys in s for k in keys), by_tier=True)
    failures = []

    def worker(w: int) -> None:
        for i in range(200):
            key = f"{w}-{i}".encode()
            with events.lock:
                events.stored(key, L2)
            if not events.flush(10) or key not in seen:
                failures.append(key)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    events.close()
    assert not failures and len(seen) == 800
