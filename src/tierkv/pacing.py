"""Background IO yields to foreground work: a duty-cycle pacer (docs/design.md §9).

Foreground work is what a request waits for: the engine's forward pass, a
caller's ``put_blocks``, a load. It announces itself with ``with
pacer.foreground():`` (reentrant, from any number of threads). Background
work is what nobody waits for right now: demotions written behind,
write-through and persist copies, L4 sends. It runs in pieces (one run of a
plan's ops, one slice of a disk write), each inside ``with pacer.piece():``.

The rule: while foreground work is active, background pieces are spaced so
that they fill at most ``share`` of wall time — a piece that took d seconds
is followed by a pause of d × (1 − share) / share, cut short the moment the
foreground ends. d is wall time, waits on the device included: what slows
the foreground is the whole stream (the tenant's copies that feed it, the
device's DMA, the Python around it), not only the piece's own CPU time
(charging CPU time alone left the engine 1.5x slower in bench/contention.py). With no foreground work, background runs flat out. A load
queued behind a background piece (L3 reads share the IO thread with writes)
is counted as ``urgent`` and ends every pause at once, so pacing never delays
a read a request waits for.

Why: on a small host the engine's forward is bound by memory bandwidth and
by the GIL, and a thread that moves gigabytes per second or runs Python
beside it slows it by 1.3–2× (bench/contention.py). Pacing trades background
throughput for foreground latency; ``share = 1.0`` turns it off.

Thread-safety: every method is safe from any thread; one condition guards
the state. Nothing here touches tiers or the index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class Pacer:
    """Spaces background pieces while foreground work runs. See the module docstring."""

    def __init__(self, share: float = 1.0, clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share: expected a number in (0, 1], got {share!r}")
        self.share = share
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._foreground = 0  # foreground sections open now
        self._urgent = 0  # foreground jobs queued behind background work, not started yet
        self._resume_at = 0.0  # the clock time before which the next piece waits (while foreground)
        self._nested = threading.local()  # per thread: seconds charged by pieces inside the open one
        self.paused_s = 0.0  # total time pieces waited (a counter for stats and benchmarks)

    @property
    def enabled(self) -> bool:
        return self.share < 1.0

    @property
    def resume_at(self) -> float:
        """When the next background piece may start if foreground work is still active."""
        return self._resume_at

    @contextmanager
    def foreground(self) -> Iterator[None]:
        """Mark the enclosed work as foreground (a request waits for it). Reentrant; any thread."""
        with self._cond:
            self._foreground += 1
        try:
            yield
        finally:
            with self._cond:
                self._foreground -= 1
                if not self._foreground:
                    self._cond.notify_all()

    def urgent(self, fn: Callable[..., T]) -> Callable[..., T]:
        """Count ``fn`` (a foreground job about to be queued on a thread that also runs background
        pieces) as urgent until it starts; while any is, pieces do not wait. Returns the wrapper
        to queue instead of ``fn``; call it exactly once."""
        if not self.enabled:
            return fn
        with self._cond:
            self._urgent += 1
            self._cond.notify_all()

        def run(*args, **kwargs):
            with self._cond:
                self._urgent -= 1
            return fn(*args, **kwargs)

        return run

    def _must_wait(self) -> bool:
        return bool(self._foreground) and not self._urgent and self._clock() < self._resume_at

    def gate(self) -> None:
        """Block until a background piece may start: at once without foreground work, else once the
        pause the last piece earned has passed (or the foreground ended, or a job became urgent)."""
        if not self.enabled:
            return
        with self._cond:
            if not self._must_wait():
                return
            start = self._clock()
            while self._must_wait():
                self._cond.wait(max(self._resume_at - self._clock(), 0.0))
            self.paused_s += self._clock() - start

    def charge(self, seconds: float) -> None:
        """Record a background piece that took ``seconds``: if foreground work is active now, the next
        piece waits ``seconds × (1 − share) / share`` from now."""
        if not self.enabled:
            return
        with self._cond:
            if self._foreground:
                pause = seconds * (1.0 - self.share) / self.share
                self._resume_at = max(self._resume_at, self._clock() + pause)

    @contextmanager
    def piece(self) -> Iterator[None]:
        """Run the enclosed background piece after ``gate()``, then ``charge`` its duration. Pieces nest (a mover's run around a tier's slices of one write): the inner
        ones gate and charge their own time, the outer one charges only the rest."""
        if not self.enabled:
            yield
            return
        self.gate()
        outer = getattr(self._nested, "charged", None)
        self._nested.charged = 0.0
        start = self._clock()
        try:
            yield
        finally:
            used = self._clock() - start
            self.charge(max(used - self._nested.charged, 0.0))
            self._nested.charged = None if outer is None else outer + used


UNPACED = Pacer(1.0)  # the no-op pacer for tiers and movers built without a store
