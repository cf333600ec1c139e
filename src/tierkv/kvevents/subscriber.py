"""Follow one node's KV event stream into an ``Inventory``, resyncing on gaps and restarts (issue 16).

A ``KVEventSubscriber`` connects a SUB socket to the node's PUB endpoint and
a DEALER socket to its replay endpoint. Each batch's ``seq`` must be the one
after the last applied: an older one is a duplicate and skipped; a newer one
means batches were lost (a slow consumer, the PUB high-water mark, the ZMQ
slow-joiner window) and the subscriber asks the replay endpoint for
everything since the last it applied — the ring's batches, or a snapshot when
the ring no longer reaches back that far. A batch whose topic carries a new
instance id is a restarted node: the inventory is cleared and rebuilt from
that instance's batch 0 (or snapshot). The same happens once at ``start``,
so a router that starts after the node converges without waiting for traffic.

Threading: one thread ``tierkv-kv-sub`` owns both sockets and writes the
inventory; ``inventory.match`` may be called from any thread. ``synced``
tells whether the inventory is known to be current as of ``last_seq``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from tierkv.kvevents.inventory import Inventory
from tierkv.kvevents.wire import END_SEQ, AllBlocksCleared, KVEventBatch, seq_bytes, seq_of

log = logging.getLogger("tierkv")


def instance_of(topic: bytes) -> str:
    """The instance id in a ``"<topic>@<instance_id>"`` topic frame ('' if none)."""
    return topic.rpartition(b"@")[2].decode(errors="replace") if b"@" in topic else ""


class KVEventSubscriber:
    """Keeps ``inventory`` equal to one node's tier contents. Start with ``start``, stop with ``close``."""

    def __init__(self, endpoint: str, replay_endpoint: str, *, topic: str = "",
                 replay_timeout_s: float = 2.0, idle_check_s: float = 1.0,
                 rcvhwm: int = 100_000, on_change: Callable[[], None] | None = None) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.inventory = Inventory()
        self.instance_id = ""
        self.last_seq = -1
        self.synced = False
        self.applied = self.duplicates = self.gaps = self.resyncs = self.snapshots = self.restarts = 0
        self.replay_timeout_s = replay_timeout_s
        self.idle_check_s = idle_check_s
        self._on_change = on_change
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._dealer: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierkv-kv-sub", daemon=True)

    def start(self) -> KVEventSubscriber:
        """Begin following (a resync first); returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sub.close(linger=0)

    def wait_for(self, seq: int, timeout: float = 5.0) -> bool:
        """Wait until batches up to ``seq`` are applied and the inventory is synced; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.synced and self.last_seq >= seq:
                return True
            time.sleep(0.005)
        return False

    # -- the subscriber thread ------------------------------------------------------

    def _run(self) -> None:
        self._resync()
        checked = time.monotonic()
        while not self._stop.is_set():
            if not self._sub.poll(100):
                # Quiet: a lost tail batch shows no gap until the next one, so ask now and then.
                if not self.synced or time.monotonic() - checked > self.idle_check_s:
                    self._resync()
                    checked = time.monotonic()
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                continue
            self._on_batch(frames[0], seq_of(frames[1]), frames[2])
        if self._dealer is not None:
            self._dealer.close(linger=0)

    def _on_batch(self, topic: bytes, seq: int, payload: bytes) -> None:
        instance = instance_of(topic)
        if instance != self.instance_id:
            if self.instance_id:
                self.restarts += 1
            self._reset(instance)
            self._resync()
            if instance != self.instance_id:  # the replay did not answer: try again on the next batch
                return
        if seq <= self.last_seq:
            self.duplicates += 1
            return
        if seq != self.last_seq + 1:
            self.gaps += 1
            self._resync()
            if seq <= self.last_seq:
                return
            if seq != self.last_seq + 1:  # replay failed: wait for it on the next batch
                self.synced = False
                return
        self._apply(seq, payload)

    def _reset(self, instance: str) -> None:
        self.inventory.clear()
        self.instance_id = instance
        self.last_seq = -1
        self.synced = False

    def _apply(self, seq: int, payload: bytes | KVEventBatch) -> None:
        batch = self._decode(payload) if isinstance(payload, bytes) else payload
        events = batch.events
        if events and isinstance(events[0], AllBlocksCleared):
            self.snapshots += 1
        self.inventory.apply(events)
        self.last_seq = seq
        self.applied += 1
        if self._on_change is not None:
            self._on_change()

    def _drop_dealer(self) -> None:
        # A fresh socket next time, so a late or half-read answer cannot be taken for the next one's.
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _resync(self, again: bool = True) -> None:
        """Ask for everything after ``last_seq``; apply it. ``synced`` says whether that worked."""
        self.resyncs += 1
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)
        self._dealer.send_multipart((b"", seq_bytes(self.last_seq + 1)))
        deadline = time.monotonic() + self.replay_timeout_s
        complete = True
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._dealer.poll(int(left * 1000) + 1):
                self._drop_dealer()  # no answer: the node is down or restarting
                self.synced = False
                return
            frames = self._dealer.recv_multipart()
            if len(frames) != 4:
                continue
            _, topic, seq_frame, payload = frames
            instance, seq = instance_of(topic), seq_of(seq_frame)
            if instance != self.instance_id:
                known = bool(self.instance_id)
                self._reset(instance)
                if known:  # restarted since: what we asked for is the new instance's tail, ask from 0
                    self.restarts += 1
                    self._drop_dealer()
                    if again:
                        self._resync(again=False)
                    return
            if seq == END_SEQ:
                self.synced = complete
                return
            if seq <= self.last_seq or not complete:
                continue
            batch = self._decode(payload)
            if seq == self.last_seq + 1 or (batch.events and isinstance(batch.events[0], AllBlocksCleared)):
                self._apply(seq, batch)
            else:  # the answer lost a batch on the way (the replay socket's high-water mark): ask again later
                complete = False
