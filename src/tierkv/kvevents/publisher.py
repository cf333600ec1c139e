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

Threading: ``on_tier_change`` (the store listener, called on the store's
``tierkv-events`` thread once per net batch) numbers, encodes and sends the
batch itself, under this publisher's own lock, with ``NOBLOCK``: a batch is
one encode and one send, so handing it to another thread would cost more
than doing it. The lock also guards the ring and the per-tier key sets. One
thread ``tierkv-kv-replay`` owns the ROUTER socket and answers replays,
taking the lock only to copy what it sends. Nothing here takes the store's
lock or waits for a consumer; a slow subscriber loses messages at the PUB
high-water mark and resyncs through replay.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from tierkv.kvevents.inventory import TierKeySets
from tierkv.kvevents.wire import (
    END_SEQ, MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, seq_bytes, seq_of,
)

log = logging.getLogger("tierkv")

_SNAPSHOT_CHUNK = 65536  # keys per BlockStored in a snapshot
_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)
# pyzmq's compiled send, under its Python wrapper (which only adds keyword handling: a third of a
# send's cost, three times a batch); called as _send(socket, frame, flags).
_send = zmq.backend.Socket.send


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how a store's KV events go out."""

    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str = "tcp://127.0.0.1:0"
    topic: str = "tierkv"
    block_size: int = 16
    ring_batches: int = 10_000
    hwm: int = 100_000
    max_batch_events: int = 4096  # block keys one batch carries at most; a larger change is split

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
    give the bound addresses, port 0 picking a free one). ``inventory`` holds
    the keys each tier holds as published (for snapshots and status).
    ``close`` stops the replay thread and closes the sockets.
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
        stop = f"inproc://tierkv-kv-replay-{self.instance_id}"
        self._stop_rx = self._ctx.socket(zmq.PULL)
        self._stop_rx.bind(stop)
        self._stop_tx = self._ctx.socket(zmq.PUSH)
        self._stop_tx.connect(stop)
        self._lock = threading.Lock()  # the PUB socket, the sequence, the ring, the inventory
        self._encode = msgspec.msgpack.Encoder().encode
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.ring_batches)
        self.last_seq = -1
        self.inventory = TierKeySets()
        self.batches = self.events = self.replays = self.snapshots = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tierkv-kv-replay", daemon=True)
        self._thread.start()

    # -- producers (any thread) ------------------------------------------------------

    def on_tier_change(self, stored: Sequence[tuple[bytes, int]], removed: Sequence[tuple[bytes, int]]) -> None:
        """A ``TierListener``: publish one net change of ``(key, tier)`` pairs now (removals before
        stores), as one batch or, past ``max_batch_events`` keys, several. Never waits for a consumer;
        a no-op once closed."""
        self.on_tier_keys(_by_tier(stored), _by_tier(removed))

    def on_tier_keys(self, stored: Sequence[Sequence[bytes]], removed: Sequence[Sequence[bytes]]) -> None:
        """``on_tier_change`` with the keys already grouped, one list per tier L1..L4 (the ``by_tier``
        listener ``attach`` registers: no per-block work before the encode). The lists are kept
        (for snapshots) and must not be changed afterwards."""
        # One frame, plain loops: this runs once a batch right after a put has streamed megabytes
        # through the caches, where every extra function object and call is a handful of misses.
        groups, events, n_keys = [], [], 0
        for tier in range(len(removed)):
            keys = removed[tier]
            if keys:
                groups.append((False, tier, keys))
                events.append(BlockRemoved(keys, MEDIA[tier]))
                n_keys += len(keys)
        size = self.config.block_size
        for tier in range(len(stored)):
            keys = stored[tier]
            if keys:
                groups.append((True, tier, keys))
                events.append(BlockStored(keys, None, [], size, None, MEDIA[tier], None))
                n_keys += len(keys)
        if not n_keys:
            return
        if n_keys <= self.config.max_batch_events:  # the common case: one batch
            self._publish(groups, events, n_keys)
            return
        for batch in _batches(groups, self.config.max_batch_events):
            self._publish(batch, [BlockStored(keys, None, [], size, None, MEDIA[tier], None) if is_stored
                                  else BlockRemoved(keys, MEDIA[tier]) for is_stored, tier, keys in batch],
                          sum(len(keys) for _, _, keys in batch))

    def attach(self, store) -> None:
        """Publish ``store``'s tier changes from now on, starting with what it holds now.

        Registers as a tier listener first, then publishes the current index
        (L1–L3) as stores, so no change falls between the two; a block changed
        in between appears twice, which applying events in order absorbs.
        """
        store.add_tier_listener(self.on_tier_keys, by_tier=True)
        with store._lock:  # the index is read under the store's own lock, once, at attach
            held = [[e.key for e in store.index.entries() if e.mask >> t & 1] for t in range(3)]
        self.on_tier_keys(held, [])

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every change handed in so far has been sent (one being sent now); False on timeout."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True

    def close(self) -> None:
        """Stop the replay thread, close the sockets. Idempotent; later changes are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_tx.send(b"")
        self._thread.join(timeout=10)
        for sock in (self._pub, self._replay, self._stop_rx, self._stop_tx):
            sock.close(linger=0)

    def _publish(self, groups: list[tuple[bool, int, list[bytes]]], events: list, n_keys: int) -> None:
        """Number, encode and send one batch: ``events`` built from ``(stored, tier, keys)`` ``groups``."""
        with self._lock:
            if self._closed:
                return
            payload = self._encode(KVEventBatch(time.time(), events))
            self.inventory.apply(groups, n_keys)
            self.last_seq = seq = self.last_seq + 1
            self._ring.append((seq, payload))
            self.batches += 1
            self.events += len(events)
            sock = self._pub
            try:  # three sends with int flags: send_multipart's checks and IntFlag arithmetic cost more
                _send(sock, self.topic, _MORE)
                _send(sock, seq.to_bytes(8, "big", signed=True), _MORE)  # seq_bytes, inlined
                _send(sock, payload, _LAST)
            except zmq.Again:  # PUB never blocks at HWM, but be explicit: a lost message is resynced
                pass

    # -- the replay thread ------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._stop_rx, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._stop_rx in ready:
                return
            try:
                self._serve_replay()
            except Exception:
                log.warning("tierkv: kv event replay failed", exc_info=True)

    def _serve_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("tierkv: malformed kv event replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], seq_of(frames[2])
            self.replays += 1
            with self._lock:
                ring, last = self._ring, self.last_seq
                if last >= 0 and start <= last and (not ring or start < ring[0][0]):
                    snapshot, answer = (last, self.inventory.by_tier()), []
                else:
                    snapshot, answer = None, [(seq, payload) for seq, payload in ring if seq >= start]
            if snapshot is not None:
                self._send_snapshot(client, *snapshot)
            for seq, payload in answer:
                self._replay.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
            self._replay.send_multipart((client, b"", self.topic, seq_bytes(END_SEQ), b""))

    def _send_snapshot(self, client: bytes, seq: int, by_tier: list[list[bytes]]) -> None:
        self.snapshots += 1
        size = self.config.block_size
        events: list = [AllBlocksCleared()]
        for tier, keys in enumerate(by_tier):
            for i in range(0, len(keys), _SNAPSHOT_CHUNK):
                events.append(BlockStored(keys[i:i + _SNAPSHOT_CHUNK], None, [], size, None, MEDIA[tier], None))
        payload = msgspec.msgpack.encode(KVEventBatch(time.time(), events))
        self._replay.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))


def _by_tier(items: Sequence[tuple[bytes, int]]) -> list[list[bytes]]:
    """The keys of ``items`` per tier L1..L4, in order."""
    out: list[list[bytes]] = [[] for _ in MEDIA]
    for key, tier in items:
        out[tier].append(key)
    return out


def _batches(groups: list[tuple[bool, int, list[bytes]]], limit: int) -> list[list[tuple[bool, int, list[bytes]]]]:
    """Pack ``groups`` in order into batches of at most ``limit`` keys, splitting a group that does not fit."""
    out: list[list] = [[]]
    room = limit
    for kind, tier, keys in groups:
        if len(keys) <= room:  # the common case: the whole change fits one batch
            out[-1].append((kind, tier, keys))
            room -= len(keys)
            continue
        at = 0
        while at < len(keys):
            if not room:
                out.append([])
                room = limit
            part = keys[at:at + room]
            out[-1].append((kind, tier, part))
            at += len(part)
            room -= len(part)
    return out
