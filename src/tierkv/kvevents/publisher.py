"""Publish a store's tier changes as vLLM KV events over ZMQ, with replay and snapshots (issue 16).

Wire (what vLLM's ``ZmqEventPublisher`` sends, so its consumers read it):

- PUB socket, one multipart message per batch: ``(topic, seq, payload)``;
  ``topic`` is ``"<topic>@<instance_id>"``, ``seq`` an 8-byte big-endian
  integer counting this instance's batches from 0 without gaps, ``payload``
  a msgpack ``KVEventBatch`` (``tierkv.kvevents.wire``). ``instance_id`` is
  new each time a publisher is made, so a restarted node is told apart.
- ROUTER socket (replay): a request ``(b"", seq)`` asks for every batch from
  ``seq`` on; the answer is those batches, as published, then
  ``(topic, END_SEQ, b"")``. When ``seq`` is older than the bounded ring
  keeps, the answer starts with one snapshot batch instead — an
  ``AllBlocksCleared`` then a ``BlockStored`` per tier with every key it
  holds — numbered with the last published ``seq``, so applying it and then
  every later batch gives the node's inventory.

Threading: ``publish`` and ``on_tier_change`` (the store listener) only hand
the change to a queue and ring an inproc socket; one thread
``tierkv-kv-events`` owns both ZMQ sockets, numbers and encodes batches,
keeps the ring and the inventory, and answers replays. Nothing here takes the
store's lock or waits for a consumer; a slow subscriber loses messages at the
PUB high-water mark and resyncs through replay.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from tierkv.kvevents.inventory import Inventory
from tierkv.kvevents.wire import (
    END_SEQ, MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, seq_bytes, seq_of,
)

log = logging.getLogger("tierkv")

Change = tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]
_SNAPSHOT_CHUNK = 65536  # keys per BlockStored in a snapshot


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how a store's KV events go out."""

    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str = "tcp://127.0.0.1:0"
    topic: str = "tierkv"
    block_size: int = 16
    ring_batches: int = 10_000
    hwm: int = 100_000
    max_batch_events: int = 4096

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f"events.{name}: expected a ZMQ endpoint like 'tcp://127.0.0.1:5557', got {value!r}")
        if not isinstance(self.topic, str) or "@" in self.topic:
            raise ValueError(f"events.topic: expected a string without '@', got {self.topic!r}")
        for name in ("block_size", "ring_batches", "hwm", "max_batch_events"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"events.{name}: expected an integer >= 1, got {value!r}")


class KVEventPublisher:
    """Numbers, encodes and sends one store's tier changes; serves replays. Thread-safe to feed.

    Sockets are bound at construction (``endpoint`` / ``replay_endpoint``
    give the bound addresses, port 0 picking a free one). ``close`` stops the
    thread after sending what is queued.
    """

    def __init__(self, config: PublisherConfig | None = None) -> None:
        self.config = cfg = config or PublisherConfig()
        self.instance_id = uuid.uuid4().hex[:16]
        self.topic = f"{cfg.topic}@{self.instance_id}".encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        try:
            self._pub.set_hwm(cfg.hwm)
            self._pub.bind(cfg.endpoint)
            self._replay.setsockopt(zmq.SNDHWM, cfg.ring_batches + 2)  # a ROUTER drops what passes its HWM
            self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            self._replay.close(linger=0)
            raise OSError(f"events: cannot bind {cfg.endpoint} / {cfg.replay_endpoint}: {exc}") from exc
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        wake = f"inproc://tierkv-kv-events-{self.instance_id}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()
        self._queue: collections.deque[Change | None] = collections.deque()
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.ring_batches)
        self._seq = itertools.count()
        self.last_seq = -1
        self.inventory = Inventory()
        self.batches = self.events = self.replays = self.snapshots = 0
        self._idle = threading.Condition()
        self._queued = self._done = 0  # changes handed in / sent (flush waits for the one to reach the other)
        self._thread = threading.Thread(target=self._run, name="tierkv-kv-events", daemon=True)
        self._thread.start()

    # -- producers (any thread) ------------------------------------------------------

    def on_tier_change(self, stored: list[tuple[bytes, int]], removed: list[tuple[bytes, int]]) -> None:
        """A ``TierListener``: queue one store batch (removals apply before stores). Never blocks."""
        if stored or removed:
            with self._wake_lock:
                self._queued += 1
                self._queue.append((stored, removed))
            self._ring_bell()

    def attach(self, store) -> None:
        """Publish ``store``'s tier changes from now on, starting with what it holds now.

        Registers as a tier listener first, then publishes the current index
        (L1–L3) as stores, so no change falls between the two; a block changed
        in between appears twice, which applying events in order absorbs.
        """
        store.add_tier_listener(self.on_tier_change)
        with store._lock:  # the index is read under the store's own lock, once, at attach
            held = [(e.key, t) for e in store.index.entries() for t in range(3) if e.mask >> t & 1]
        self.on_tier_change(held, [])

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far has been sent; False on timeout."""
        target = self._queued
        with self._idle:
            return self._idle.wait_for(lambda: self._done >= target, timeout)

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._thread.is_alive():
            with self._wake_lock:
                self._queue.append(None)
            self._ring_bell()
            self._thread.join(timeout=10)
        for sock in (self._pub, self._replay, self._wake_rx, self._wake_tx):
            sock.close(linger=0)

    def _ring_bell(self) -> None:
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # the thread is far behind and already has a bell to answer
                pass
            except zmq.ZMQError:  # closed
                pass

    # -- the publisher thread -----------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        encode = msgspec.msgpack.Encoder().encode
        while True:
            ready = dict(poller.poll(1000))
            if self._wake_rx in ready:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if self._replay in ready:
                try:
                    self._serve_replay()
                except Exception:
                    log.warning("tierkv: kv event replay failed", exc_info=True)
            if not self._drain(encode):
                return

    def _drain(self, encode) -> bool:
        """Send every queued change, coalesced into batches; False once ``close`` was asked."""
        queue, limit = self._queue, self.config.max_batch_events
        while queue:
            events, n, changes, stop = [], 0, 0, False
            while queue and n < limit:
                change = queue.popleft()
                if change is None:
                    stop = True
                    break
                stored, removed = change
                events.extend(self._events(stored, removed))
                n += len(stored) + len(removed)
                changes += 1
            if events:
                self._send(KVEventBatch(time.time(), events), encode)
            with self._idle:
                self._done += changes
                self._idle.notify_all()
            if stop:
                return False
        return True

    def _events(self, stored: Sequence[tuple[bytes, int]], removed: Sequence[tuple[bytes, int]]) -> list:
        out: list = []
        for items, make in ((removed, self._removed), (stored, self._stored)):
            by_tier: dict[int, list[bytes]] = {}
            for key, tier in items:
                by_tier.setdefault(int(tier), []).append(bytes(key))
            out.extend(make(keys, tier) for tier, keys in sorted(by_tier.items()))
        return out

    def _stored(self, keys: list[bytes], tier: int) -> BlockStored:
        return BlockStored(keys, None, [], self.config.block_size, None, MEDIA[tier], None)

    @staticmethod
    def _removed(keys: list[bytes], tier: int) -> BlockRemoved:
        return BlockRemoved(keys, MEDIA[tier])

    def _send(self, batch: KVEventBatch, encode) -> None:
        seq = next(self._seq)
        payload = encode(batch)
        self.inventory.apply(batch.events)
        self._ring.append((seq, payload))
        self.last_seq = seq
        self.batches += 1
        self.events += len(batch.events)
        try:
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload), zmq.NOBLOCK)
        except zmq.Again:  # PUB never blocks at HWM, but be explicit: a lost message is resynced
            pass

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("tierkv: malformed kv event replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], seq_of(frames[2])
            self.replays += 1
            ring = self._ring
            if self.last_seq >= 0 and start <= self.last_seq and (not ring or start < ring[0][0]):
                self._send_snapshot(client)
            else:
                for seq, payload in ring:
                    if seq >= start:
                        self._replay.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", self.topic, seq_bytes(END_SEQ), b""))

    def _send_snapshot(self, client: bytes) -> None:
        self.snapshots += 1
        events: list = [AllBlocksCleared()]
        for tier, keys in enumerate(self.inventory.by_tier()):
            for i in range(0, len(keys), _SNAPSHOT_CHUNK):
                events.append(self._stored(keys[i:i + _SNAPSHOT_CHUNK], tier))
        payload = msgspec.msgpack.encode(KVEventBatch(time.time(), events))
        self._replay.send_multipart((client, b"", self.topic, seq_bytes(self.last_seq), payload))
