"""Tier events: which blocks arrived in or left each tier, batched, delivered off the hot path.

The store records an event wherever a commit changes what a tier holds (the
index adding or dropping a local tier, an L4 put landing); a demotion is a
removal from one tier plus an arrival in another. Recording is a dict
operation under the store's lock, and nothing at all when no listener is
registered. A daemon thread hands the batches to the listeners with no store
lock held, so a slow listener delays only later batches, never a lookup or a
save.

A batch is a net change: a block stored into a tier and removed from it again
before the batch went out appears in neither list (and the other way round).
Listeners apply ``removed`` before ``stored`` or treat the lists as disjoint;
they are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("tierkv")

TierListener = Callable[[list[tuple[bytes, int]], list[tuple[bytes, int]]], None]
"""``listener(stored, removed)``: lists of ``(block key, tier)`` with ``tier`` a ``tierkv.index.Tier``."""

_STORED, _REMOVED = True, False
_COALESCE_S = 0.002  # how long the delivery thread lets a batch fill after its first event


class TierEvents:
    """Collects tier arrivals and departures and delivers them, batched, on its own thread.

    ``stored``/``removed`` may be called from any thread (the store calls them
    under its lock); they take this object's own small lock only when a
    listener is registered. Listeners run one at a time on the thread
    ``tierkv-events``; an exception one raises is counted in ``errors`` and
    logged once, never seen by the store.
    """

    def __init__(self) -> None:
        self._listeners: tuple[TierListener, ...] = ()  # copy-on-write: read without the lock
        self._cond = threading.Condition()
        self._pending: dict[tuple[bytes, int], bool] = {}  # (key, tier) -> stored?, in arrival order
        self._delivering = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.batches = 0

    @property
    def active(self) -> bool:
        """Whether anyone listens (the store skips building events when nobody does)."""
        return bool(self._listeners)

    def add_listener(self, listener: TierListener) -> None:
        """Deliver every later batch to ``listener`` (events before registration are not replayed)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("tier events: the store is closed")
            self._listeners = (*self._listeners, listener)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-events", daemon=True)
                self._thread.start()

    def remove_listener(self, listener: TierListener) -> None:
        """Stop delivering to ``listener``; unknown ones are ignored. A batch being delivered may still reach it."""
        with self._cond:
            listeners = list(self._listeners)
            if listener in listeners:
                listeners.remove(listener)
                self._listeners = tuple(listeners)

    def stored(self, key: bytes, tier: int) -> None:
        """``tier`` now holds ``key``."""
        if self._listeners:
            self._record(key, tier, _STORED)

    def removed(self, key: bytes, tier: int) -> None:
        """``tier`` no longer holds ``key``."""
        if self._listeners:
            self._record(key, tier, _REMOVED)

    def _record(self, key: bytes, tier: int, kind: bool) -> None:
        item = (bytes(key), int(tier))
        with self._cond:
            before = self._pending.get(item)
            if before is None:
                wake = not self._pending  # one wake-up per batch, not per block
                self._pending[item] = kind
                if wake:
                    self._cond.notify()
            elif before != kind:  # stored then removed (or removed then stored) in one batch: no change
                del self._pending[item]

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every event recorded so far has been delivered; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._delivering, timeout)

    def close(self) -> None:
        """Deliver what is pending, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending and self._closed:
                    return
                closed = self._closed
            if not closed:
                # Let the rest of a burst (a save of many blocks, an eviction run) join this batch:
                # waking per block costs the saving thread the GIL and this lock once per block.
                time.sleep(_COALESCE_S)
            with self._cond:
                batch, self._pending = self._pending, {}
                self._delivering = True
                listeners = self._listeners
            stored = [item for item, kind in batch.items() if kind]
            removed = [item for item, kind in batch.items() if not kind]
            for listener in listeners:
                try:
                    listener(stored, removed)
                except Exception:  # a listener's bug must not stop the events
                    self.errors += 1
                    if self.errors == 1:
                        log.warning("tierkv: tier listener %r failed; further failures are only counted "
                                    "(tier events errors)", listener, exc_info=True)
            with self._cond:
                self.batches += 1
                self._delivering = False
                self._cond.notify_all()
