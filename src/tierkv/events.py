"""Tier events: which blocks arrived in or left each tier, batched, delivered off the hot path.

The store records an event wherever a commit changes what a tier holds (the
index adding or dropping a local tier, an L4 put landing); a demotion is a
removal from one tier plus an arrival in another. Recording happens under the
store's lock, which already serialises every commit: it is a dict operation
or two on the pending batch (no lock of its own, no object per event), and
nothing at all when no listener is registered. The first record of a batch
arms an alarm (``tierkv.alarm``: on Linux a timerfd, which wakes nobody now)
for ``window_s`` later, or for ``min_interval_s`` after the previous batch
went out if that is later; when it goes off, the delivery thread
``tierkv-events`` wakes, once per batch, swaps in an empty batch without
taking any lock (a flag the recorder raises while it writes tells the thread
when the old batch is complete), and hands it to the listeners, so neither a
slow listener nor the delivery itself ever waits for, or holds up, a lookup
or a save.

A batch costs its delivery about the same whatever it carries (a wake, an
encode, the sends, ZMQ's I/O thread's send, all on cold caches), so the
batch rate sets the events' cost. ``window_s`` (25 ms) is how late a change
may reach a listener when changes are sparse; ``min_interval_s`` (100 ms)
caps the rate under a steady stream of them (10 batches a second, where
the window alone let 40 through), which is when their cost shows.

A batch is a net change: a block stored into a tier and removed from it again
before the batch went out appears in neither list (and the other way round).
Listeners apply ``removed`` before ``stored`` or treat the lists as disjoint;
they are.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from tierkv.alarm import Alarm

log = logging.getLogger("tierkv")

TierListener = Callable[[list, list], None]
"""``listener(stored, removed)``: lists of ``(block key, tier)`` (``tier`` the int of a
``tierkv.index.Tier``), or with ``by_tier`` one list of keys per tier L1..L4. The lists are shared
by every listener (and a publisher keeps them for its snapshots): read them, never change them."""

NUM_TIERS = 4  # L1..L4, the int values of tierkv.index.Tier
# A deferred record's code: the tier it arrived in, or NUM_TIERS + the tier it left.
_STORED = tuple(range(NUM_TIERS))
_REMOVED = tuple(range(NUM_TIERS, 2 * NUM_TIERS))
WINDOW_S = 0.025  # how long a batch fills after its first record: one delivery per window, not per burst
MIN_INTERVAL_S = 0.1  # how long after the previous batch the next goes out at the earliest (a steady stream's rate)


def _empty() -> tuple[dict[bytes, bool], ...]:
    return {}, {}, {}, {}  # NUM_TIERS of them, spelt out: built once a batch, on the delivery thread


class TierEvents:
    """Collects tier arrivals and departures and delivers them, batched, on its own thread.

    ``stored``/``removed`` must be called with ``lock`` held, so that no two
    run at once (the store's lock, under which every commit runs; a
    ``TierEvents`` made without one has its own, which callers then take).
    They take no lock themselves; the first of a batch arms the alarm (one
    syscall, no wake). The delivery thread never takes ``lock``. Listeners
    run one at a time on the thread ``tierkv-events``; an exception one
    raises is counted in ``errors`` and logged once, never seen by the store.
    ``flush`` cuts the window short. ``batches`` counts the batches delivered.
    ``deferred`` / ``record_deferred`` record one operation's changes in one
    go (see ``DeferredRecords``). A batch goes out ``window_s`` after its first record or ``min_interval_s``
    after the batch before it went out, whichever is later.
    """

    records = None  # (a DeferredRecords has its log here: recorders that look append to it instead of calling)

    def __init__(self, lock: threading.RLock | None = None, window_s: float = WINDOW_S,
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        for name, value in (("window_s", window_s), ("min_interval_s", min_interval_s)):
            if not value >= 0:
                raise ValueError(f"events.{name}: expected seconds >= 0, got {value!r}")
        self.lock = lock if lock is not None else threading.RLock()
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self._earliest = 0.0  # time.monotonic() before which the next batch does not go out (set by the thread)
        self._listeners: tuple[tuple[TierListener, bool], ...] = ()  # copy-on-write: read without the lock
        self._admin = threading.Lock()  # listeners, the flush count, close
        # The pending batch: per tier, keys stored / removed, in arrival order. Swapped whole (one
        # attribute store) by the delivery thread; _recording is up while a recorder writes into it.
        self._batch = (_empty(), _empty())
        self._recording = False
        self._alarm = Alarm()
        self._armed = False  # the alarm is set for the pending batch (cleared by the thread before a swap)
        self._delivering = False
        self._flushing = 0  # threads in flush (changed under _admin)
        # A binary semaphore, held while nobody rings it: the thread rings it after a delivery while
        # anyone flushes (a raw lock: one wake for the flusher, where a Condition took three switches).
        self._done = threading.Lock()
        self._done.acquire()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.batches = 0

    @property
    def active(self) -> bool:
        """Whether anyone listens (the store skips building events when nobody does)."""
        return bool(self._listeners)

    def add_listener(self, listener: TierListener, by_tier: bool = False) -> None:
        """Deliver every later batch to ``listener`` (events before registration are not replayed);
        ``by_tier``: as two lists of 4 key lists (index = tier) instead of ``(key, tier)`` pairs."""
        with self._admin:
            if self._closed:
                raise RuntimeError("tier events: the store is closed")
            self._listeners = (*self._listeners, (listener, bool(by_tier)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-events", daemon=True)
                self._thread.start()

    def remove_listener(self, listener: TierListener) -> None:
        """Stop delivering to ``listener``; unknown ones are ignored. A batch being delivered may still reach it."""
        with self._admin:
            self._listeners = tuple(item for item in self._listeners if item[0] != listener)

    def stored(self, key: bytes, tier: int) -> None:
        """``tier`` now holds ``key`` (a ``bytes`` block key). Caller holds ``lock``."""
        if self._listeners:
            self._recording = True  # before reading _batch: see _take
            try:
                new, gone = self._batch
                if gone[tier].pop(key, None) is None:  # removed, then stored again: no change
                    new[tier][key] = True
            finally:  # (a bad tier raises to the caller; the delivery thread must not wait for it)
                self._recording = False
            if not self._armed:  # the batch's first record (callers are serialised); after the write: see _run
                self._arm()

    def removed(self, key: bytes, tier: int) -> None:
        """``tier`` no longer holds ``key``. Caller holds ``lock``."""
        if self._listeners:
            self._recording = True
            try:
                new, gone = self._batch
                if new[tier].pop(key, None) is None:  # stored, then removed again: no change
                    gone[tier][key] = True
            finally:
                self._recording = False
            if not self._armed:
                self._arm()

    def stored_keys(self, keys: list[bytes], tier: int) -> None:
        """``stored`` of every key of ``keys``, in order (one call for a save's whole chain). Caller
        holds ``lock``."""
        self._record_keys(keys, tier, 0)

    def removed_keys(self, keys: list[bytes], tier: int) -> None:
        """``removed`` of every key of ``keys``, in order. Caller holds ``lock``."""
        self._record_keys(keys, tier, 1)

    def _record_keys(self, keys: list[bytes], tier: int, side: int) -> None:
        """Record ``keys`` on ``side`` of the batch (0: stored, 1: removed), each cancelling a pending
        record of the other side, as ``stored`` / ``removed`` do one key at a time."""
        if self._listeners and keys:
            self._recording = True
            try:
                batch = self._batch
                add, cancel = batch[side][tier], batch[1 - side][tier]
                if not cancel or cancel.keys().isdisjoint(keys):  # the common case: nothing nets out
                    add.update(dict.fromkeys(keys, True))
                else:
                    pop = cancel.pop
                    for key in keys:
                        if pop(key, None) is None:
                            add[key] = True
            finally:
                self._recording = False
            if not self._armed:
                self._arm()

    def deferred(self) -> DeferredRecords | None:
        """A recorder for one operation made under ``lock``, to hand to ``record_deferred`` at its end;
        None when nobody listens (then nothing needs recording)."""
        return DeferredRecords() if self._listeners else None

    def record_deferred(self, deferred: DeferredRecords) -> None:
        """Record what ``deferred`` logged, in order, as ``stored`` / ``removed`` would have one by one.
        Caller holds ``lock``."""
        records = deferred.records
        if self._listeners and records:
            self._recording = True
            try:
                new, gone = self._batch
                it = iter(records)
                for key, code in zip(it, it):  # (key, code) pairs, flat
                    if code < NUM_TIERS:
                        if gone[code].pop(key, None) is None:
                            new[code][key] = True
                    elif new[code - NUM_TIERS].pop(key, None) is None:
                        gone[code - NUM_TIERS][key] = True
            finally:
                self._recording = False
            if not self._armed:
                self._arm()

    def _arm(self) -> None:
        """Set the alarm for the pending batch (its first record; the caller holds ``lock``)."""
        self._armed = True
        delay = max(self.window_s, self._earliest - time.monotonic())
        self._alarm.arm(math.ceil(delay * 1000) / 1000)  # whole ms: the alarm keeps a timespec per delay

    def _pending(self) -> bool:
        new, gone = self._batch
        return any(new) or any(gone)

    def _take(self) -> tuple[tuple[dict[bytes, bool], ...], tuple[dict[bytes, bool], ...]]:
        """Swap in an empty batch and return the full one, complete.

        Recorders are serialised (``lock``) and raise ``_recording`` before they
        read ``_batch``; this thread replaces ``_batch`` before it reads the
        flag. So a recorder that still holds the old batch has the flag up, and
        once it is down every write to the old batch has been made. (This leans
        on the GIL ordering attribute reads and writes across threads; a
        free-threaded CPython would need a lock here.)
        """
        batch = self._batch
        self._batch = ({}, {}, {}, {}), ({}, {}, {}, {})  # _empty() twice, inlined
        while self._recording:  # only when a GIL switch fell inside a record: let it finish
            time.sleep(0)
        return batch

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every event recorded so far has been delivered; False on timeout.
        Not from a listener (it would wait for itself). Any number of threads may flush at once."""
        if not self._pending() and not self._delivering:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._admin:
            self._flushing += 1  # before the look below: the thread, done, looks at this and rings _done
        try:
            while self._pending() or self._delivering:
                self._alarm.fire()
                left = -1 if deadline is None else deadline - time.monotonic()
                if deadline is not None and left <= 0:
                    return False
                self._done.acquire(timeout=left)  # a ring left from earlier only costs one more look
            return True
        finally:
            with self._admin:
                self._flushing -= 1
            _ring(self._done)  # pass the wake on: another flusher may be waiting for the same delivery

    def close(self) -> None:
        """Deliver what is pending, then stop the thread."""
        with self._admin:
            self._closed = True
            thread = self._thread
        self._alarm.fire()
        if thread is not None:
            thread.join(timeout=10)

    def _run(self) -> None:
        alarm = self._alarm
        while True:
            if not ((self._flushing or self._closed) and self._pending()):
                alarm.wait()  # the window of the batch's first record, or a flush or close
            # Clear the flag before the swap: a record into the new batch then finds it down and arms
            # the alarm again; one into the old batch that arms it too only costs an empty wake. The
            # next batch's earliest time is set first, so that any arming after this sees it.
            self._earliest = time.monotonic() + self.min_interval_s
            self._armed = False
            self._delivering = True  # before the swap: flush must never see neither pending nor delivering
            listeners = self._listeners
            new, gone = self._take()
            self.batches += self._deliver(listeners, new, gone)  # (only this thread writes it)
            self._delivering = False  # before the look at _flushing: see flush
            if self._flushing:
                _ring(self._done)
            if self._closed and not self._pending():
                return

    def _deliver(self, listeners, new: tuple[dict[bytes, bool], ...], gone: tuple[dict[bytes, bool], ...]) -> bool:
        """Hand one batch to every listener; False when it was empty (everything netted out)."""
        if not any(new) and not any(gone):
            return False
        stored, removed = list(map(list, new)), list(map(list, gone))  # (no comprehension: no function object)
        pairs = None
        for listener, by_tier in listeners:
            if by_tier:
                args = (stored, removed)
            else:
                if pairs is None:
                    pairs = ([(k, t) for t, keys in enumerate(stored) for k in keys],
                             [(k, t) for t, keys in enumerate(removed) for k in keys])
                args = pairs
            try:
                listener(*args)
            except Exception:  # a listener's bug must not stop the events
                self.errors += 1
                if self.errors == 1:
                    log.warning("tierkv: tier listener %r failed; further failures are only counted "
                                "(tier events errors)", listener, exc_info=True)
        return True


class DeferredRecords:
    """Stands in for a store's ``TierEvents`` while one operation under its lock changes many blocks
    (a put of many blocks: a store and an eviction each), so that the changes are told in one call.

    The cost of recording a change one call at a time is not the dict work
    but the call and the cold ``TierEvents`` state behind it, paid again after
    every block's copy has emptied the caches. Here a change is two appends to
    ``records`` (key, then code: ``_STORED`` / ``_REMOVED`` of the tier); the
    index appends to it directly, without a call, when it finds it there.
    ``TierEvents.record_deferred`` then nets them in order, in one go. Same
    methods as ``TierEvents``'s recorders; not thread-safe (one operation,
    under the store's lock).
    """

    __slots__ = ("records",)
    _listeners = (True,)  # (the C index paths gather a save's keys only for events someone listens to)

    def __init__(self) -> None:
        self.records: list = []

    def stored(self, key: bytes, tier: int) -> None:
        self.records += (key, _STORED[tier])

    def removed(self, key: bytes, tier: int) -> None:
        self.records += (key, _REMOVED[tier])

    def stored_keys(self, keys: list[bytes], tier: int) -> None:
        self._keys(keys, _STORED[tier])

    def removed_keys(self, keys: list[bytes], tier: int) -> None:
        self._keys(keys, _REMOVED[tier])

    def _keys(self, keys: list[bytes], code: int) -> None:
        pairs = [code, code] * len(keys)
        pairs[::2] = keys
        self.records += pairs


def _ring(bell: threading.Lock) -> None:
    """Release a binary semaphore; ringing one already rung changes nothing."""
    try:
        bell.release()
    except RuntimeError:
        pass
