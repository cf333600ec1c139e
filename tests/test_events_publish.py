"""KV events on the wire: a real store's tier changes over real ZMQ sockets, replay, snapshots, restarts."""

from __future__ import annotations

import threading
from collections import Counter
import time

import msgspec
import pytest
import zmq

from _kv import prompt, save_prompt
from tierkv.index import Tier
from tierkv.kvevents import KVEventPublisher, KVEventSubscriber, PublisherConfig
from tierkv.kvevents.inventory import TierKeySets
from tierkv.kvevents.wire import BlockRemoved, BlockStored, KVEventBatch, seq_of

L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3
MEDIUM = {"L1": L1, "L2": L2, "L3": L3, "L4": Tier.L4}


class Tap:
    """A raw SUB socket that keeps every (topic, seq, batch) it receives, in order."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.got: list[tuple[bytes, int, KVEventBatch]] = []
        self.decode = msgspec.msgpack.Decoder(KVEventBatch).decode

    def ready(self, pub: KVEventPublisher) -> None:
        """Beat ZMQ's slow-joiner window: wait until a probe batch arrives, then forget it."""
        deadline = time.monotonic() + 5
        while not self.got and time.monotonic() < deadline:
            pub.on_tier_change([(b"probe", 0)], [])
            pub.flush()
            self.drain(0.05)
        assert self.got, "no batch reached the tap"
        pub.on_tier_change([], [(b"probe", 0)])
        pub.flush()
        self.drain(0.2)
        self.got.clear()

    def drain(self, wait: float = 0.3) -> None:
        while self.sock.poll(int(wait * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.got.append((topic, seq_of(seq), self.decode(payload)))

    def changes(self) -> list[tuple[str, bytes, int]]:
        out = []
        for _, _, batch in self.got:
            for ev in batch.events:
                kind = "stored" if isinstance(ev, BlockStored) else "removed"
                out.extend((kind, k, MEDIUM[ev.medium]) for k in ev.block_hashes)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


class Recorder:
    def __init__(self) -> None:
        self.changes: list[tuple[str, bytes, int]] = []
        self.lock = threading.Lock()

    def __call__(self, stored, removed) -> None:
        with self.lock:
            self.changes.extend(("removed", k, int(t)) for k, t in removed)
            self.changes.extend(("stored", k, int(t)) for k, t in stored)


def held_by_index(store) -> dict[bytes, int]:
    out: dict[bytes, int] = {}
    for e in store.index.entries():
        for t in (L1, L2, L3):
            if e.in_tier(t):
                out[e.key] = out.get(e.key, 0) | 1 << t
    return out


@pytest.fixture
def publisher():
    made: list[KVEventPublisher] = []

    def make(**kw) -> KVEventPublisher:
        made.append(KVEventPublisher(PublisherConfig(**kw)))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


def test_every_tier_change_of_a_store_is_one_event_in_numbered_batches(make_store, layout, publisher):
    store = make_store(l1=4, l2=4, l3=16)
    pub = publisher(block_size=layout.block_size)
    tap = Tap(pub.endpoint)
    tap.ready(pub)
    pub.attach(store)
    rec = Recorder()
    store.add_tier_listener(rec)
    for i in range(1, 5):  # each save of 4 blocks demotes the one before: L1 -> L2 -> L3
        save_prompt(store, prompt(i, 4, layout))
        store.flush()  # a batch is a net change: let each arrival go out before the next save moves it on
    store.persist(save_prompt(store, prompt(9, 4, layout)))
    store.flush()
    assert pub.flush()
    tap.drain()
    seqs = [seq for _, seq, _ in tap.got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and len(seqs) >= 2
    assert {topic for topic, _, _ in tap.got} == {f"tierkv@{pub.instance_id}".encode()}
    # Exactly the store's own changes, each once (grouped by tier within a batch).
    assert Counter(tap.changes()) == Counter(rec.changes)
    assert len(tap.changes()) == len(rec.changes) > 20
    assert any(kind == "removed" and tier == L1 for kind, _, tier in rec.changes)
    assert pub.inventory.holds() == held_by_index(store)
    ev = tap.got[0][2].events[0]
    assert isinstance(ev, (BlockStored, BlockRemoved)) and len(ev.block_hashes[0]) == 16
    tap.close()


def _publish_rounds(pub: KVEventPublisher, rounds: range, per: int = 20) -> None:
    """Each round stores ``per`` new keys in L1, demotes the previous round's to L2, drops the one before."""
    for r in rounds:
        new = [(f"k{r}-{i}".encode(), 0) for i in range(per)]
        old = [(f"k{r - 1}-{i}".encode(), 0) for i in range(per)] if r >= 1 else []
        older = [(f"k{r - 2}-{i}".encode(), 1) for i in range(per)] if r >= 2 else []
        pub.on_tier_change(new + [(k, 1) for k, _ in old], old + older)


def test_subscribers_that_lose_batches_resync_to_the_same_inventory(publisher):
    # Both ends queue at most 4 messages per subscriber, so a consumer that falls behind loses batches.
    pub = publisher(ring_batches=100_000, hwm=4)  # one batch per change (each fits max_batch_events)
    full = KVEventSubscriber(pub.endpoint, pub.replay_endpoint).start()
    assert full.wait_for(-1)
    _publish_rounds(pub, range(0, 50))
    assert pub.flush()
    assert full.wait_for(pub.last_seq)
    # Joins after 50 batches: misses them all, replays them from the ring.
    late = KVEventSubscriber(pub.endpoint, pub.replay_endpoint).start()
    # A slow consumer (1 ms per batch): the PUB drops most of the next 2,000 batches meant for it.
    slow = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, rcvhwm=4, on_change=lambda: time.sleep(0.001))
    slow.start()
    assert slow.wait_for(pub.last_seq) and late.wait_for(pub.last_seq)
    _publish_rounds(pub, range(50, 2050), per=100)
    assert pub.flush()
    for sub in (full, late, slow):
        assert sub.wait_for(pub.last_seq, timeout=20), (sub.last_seq, pub.last_seq)
    want = pub.inventory.holds()
    assert len(want) == 200 and full.inventory.holds() == want
    assert late.inventory.holds() == want and slow.inventory.holds() == want
    assert full.restarts == 0 and slow.restarts == 0
    assert slow.gaps >= 1 and late.resyncs >= 1
    for sub in (full, late, slow):
        sub.close()


def test_replay_older_than_the_ring_sends_a_snapshot(publisher):
    pub = publisher(ring_batches=8)
    _publish_rounds(pub, range(0, 30))
    assert pub.flush()
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint).start()
    assert sub.wait_for(pub.last_seq)
    assert sub.inventory.holds() == pub.inventory.holds() and len(sub.inventory) == 40
    assert sub.snapshots == 1 and pub.snapshots == 1 and sub.last_seq == 29
    _publish_rounds(pub, range(30, 33))
    assert pub.flush() and sub.wait_for(32)
    assert sub.inventory.holds() == pub.inventory.holds()
    assert sub.inventory.counts == [20, 20, 0, 0]
    sub.close()


def test_a_restarted_publisher_is_a_new_instance_and_the_subscriber_follows_it(publisher):
    pub = publisher()
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    sub = KVEventSubscriber(endpoint, replay).start()
    _publish_rounds(pub, range(0, 5))
    assert pub.flush() and sub.wait_for(pub.last_seq)
    first = pub.instance_id
    pub.close()
    deadline = time.monotonic() + 10
    while True:  # ZMQ unbinds a closed socket on its I/O thread, a moment later
        try:
            again = publisher(endpoint=endpoint, replay_endpoint=replay)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert again.instance_id != first
    again.on_tier_change([(b"only", 2)], [])
    assert again.flush()
    deadline = time.monotonic() + 10
    while sub.instance_id != again.instance_id and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sub.wait_for(again.last_seq)
    assert sub.instance_id == again.instance_id and sub.restarts >= 1
    assert sub.inventory.holds() == {b"only": 1 << 2}
    sub.close()


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="events.endpoint: expected a ZMQ endpoint"):
        PublisherConfig(endpoint="localhost:5557")
    with pytest.raises(ValueError, match="events.ring_batches: expected an integer >= 1"):
        PublisherConfig(ring_batches=0)
    with pytest.raises(ValueError, match="events.topic"):
        PublisherConfig(topic="a@b")


def test_a_change_larger_than_max_batch_events_goes_out_as_consecutive_batches(publisher):
    pub = publisher(max_batch_events=3)
    tap = Tap(pub.endpoint)
    tap.ready(pub)
    stored = [(f"s{i}".encode(), L2) for i in range(5)]
    pub.on_tier_change(stored, [(b"r0", L1), (b"r1", L1)])
    assert pub.flush()
    tap.drain()
    seqs = [seq for _, seq, _ in tap.got]
    assert seqs == list(range(seqs[0], seqs[0] + 3))
    assert [[(type(e).__name__, e.medium, e.block_hashes) for e in batch.events] for _, _, batch in tap.got] == [
        [("BlockRemoved", "L1", [b"r0", b"r1"]), ("BlockStored", "L2", [b"s0"])],
        [("BlockStored", "L2", [b"s1", b"s2", b"s3"])],
        [("BlockStored", "L2", [b"s4"])],
    ]
    assert pub.inventory.holds() == {f"s{i}".encode(): 1 << L2 for i in range(5)}
    tap.close()


@pytest.mark.parametrize("fold_keys", [1, 3, 10_000])
def test_the_snapshot_key_sets_apply_queued_batches_in_order(fold_keys):
    # Batches are queued and folded many at a time; whenever they fold, a read sees every batch applied.
    sets = TierKeySets(fold_keys=fold_keys)
    sets.apply([(True, L2, [b"a", b"b"]), (True, L1, [b"a"])], 3)
    sets.apply([(False, L2, [b"a"])], 1)
    assert sets.by_tier() == [[b"a"], [b"b"], [], []]
    sets.apply([(True, L2, [b"a"]), (False, L2, [b"b"])], 2)  # stored again; b gone
    sets.apply([(False, L1, [b"a"]), (True, L3, [b"c"])], 2)
    assert sets.holds() == {b"a": 1 << L2, b"c": 1 << L3} and len(sets) == 2
    sets.apply([(False, L2, [b"a"]), (True, L2, [b"a"])], 2)  # removed then stored in one batch: held
    assert sets.holds() == {b"a": 1 << L2, b"c": 1 << L3}
