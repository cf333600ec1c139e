"""Background IO yields to foreground work: a duty-cycle pacer with three ranks (docs/design.md §9).

Work has a rank. ``COMPUTE``: the engine's step, what every request in the
batch waits for. ``TRANSFER``: a caller's ``put_blocks`` copying blocks into
L2 (the vLLM connector's saves, ``tierkv warm``). ``BACKGROUND``: what nobody
waits for right now — demotions written behind, write-through and persist
copies, L4 sends. A section of rank r announces itself with ``with
pacer.foreground(r):`` (reentrant, from any number of threads); work that
should yield runs in pieces, each inside ``with pacer.piece(r):`` — one run
of a plan's ops, one slice of a disk write, one block's checksum, one put's
copies.

The rule: while a section of higher rank than a piece is open, pieces of
that rank are spaced so that they fill at most ``share`` of wall time — a
piece that took d seconds is followed by a pause of d × (1 − share) / share,
cut short the moment no higher-rank section is open. Opening a section counts
as the end of such a piece: lower ranks wait the pause their longest piece of
the last 100 ms would have earned, so a short section (a 2 ms put) is not overlapped by a piece
that starts just after it opened. With nothing above it, a piece runs at once. d is wall time, device waits included: what slows the
forward is the whole write-back stream (the tenant's copies that feed it, the
device's DMA, the Python around it), not only the piece's own CPU time
(charging CPU time alone left the engine 1.5x slower in bench/contention.py).
A piece that mostly waits on a device (the mover's run around an L3 write:
its fdatasync and LMDB commit) is charged its thread's CPU time instead.

A load queued behind a background piece (L3 reads share the IO thread with
writes) is counted as ``urgent`` and ends every pause at once, so pacing never
delays a read a request waits for.

Thread-safety: every method is safe from any thread; one condition guards
the state. Nothing here touches tiers or the index; a piece must never be
entered with the store lock held (it may wait).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

BACKGROUND, TRANSFER, COMPUTE = 0, 1, 2
_RANKS = 3
_RECENT_S = 0.1  # how long the longest piece of a rank sets the pause a section's opening imposes


class Pacer:
    """Spaces lower-rank pieces while higher-rank sections run. See the module docstring."""

    def __init__(self, share: float = 1.0, clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share: expected a number in (0, 1], got {share!r}")
        self.share = share
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._open = [0] * _RANKS  # foreground sections open now, per rank
        self._urgent = 0  # loads queued behind background work, not started yet
        self._resume_at = [0.0] * _RANKS  # per piece rank: no start before this while a higher rank runs
        self._last = [(0.0, 0.0)] * _RANKS  # per piece rank: (longest recent charge, when it was made)
        self._nested = threading.local()  # per thread: wall and CPU seconds of the pieces inside the open one
        self.paused_s = 0.0  # total time pieces waited (a counter for stats and benchmarks)

    @property
    def enabled(self) -> bool:
        return self.share < 1.0

    def resume_at(self, rank: int = BACKGROUND) -> float:
        """When the next piece of ``rank`` may start if a higher-rank section is still open."""
        return self._resume_at[rank]

    def open_sections(self, rank: int = COMPUTE) -> int:
        """Foreground sections of ``rank`` open now."""
        return self._open[rank]

    @contextmanager
    def foreground(self, rank: int = COMPUTE) -> Iterator[None]:
        """Mark the enclosed work as foreground of ``rank`` (TRANSFER or COMPUTE): lower-rank pieces
        are paced while it runs. Reentrant; any thread."""
        with self._cond:
            self._open[rank] += 1
            if self.enabled:
                now = self._clock()
                for low in range(rank):
                    self._resume_at[low] = max(self._resume_at[low], now + self._pause(self._last[low][0]))
        try:
            yield
        finally:
            with self._cond:
                self._open[rank] -= 1
                if not self._open[rank]:
                    self._cond.notify_all()

    def urgent(self, fn: Callable[..., T]) -> Callable[..., T]:
        """Count ``fn`` (a load about to be queued on a thread that also runs background pieces) as
        urgent until it starts; while any is, no piece waits. Returns the wrapper to queue instead
        of ``fn``; call it exactly once."""
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

    def _above(self, rank: int) -> bool:
        return any(self._open[rank + 1:])

    def _must_wait(self, rank: int) -> bool:
        return self._above(rank) and not self._urgent and self._clock() < self._resume_at[rank]

    def gate(self, rank: int = BACKGROUND) -> None:
        """Block until a piece of ``rank`` may start: at once with no higher-rank section open, else
        once the pause the last such piece earned has passed (or the sections closed, or a load
        became urgent)."""
        if not self.enabled:
            return
        with self._cond:
            if not self._must_wait(rank):
                return
            start = self._clock()
            while self._must_wait(rank):
                self._cond.wait(max(self._resume_at[rank] - self._clock(), 0.0))
            self.paused_s += self._clock() - start

    def charge(self, seconds: float, rank: int = BACKGROUND) -> None:
        """Record a piece of ``rank`` that took ``seconds``: if a higher-rank section is open now, the
        next piece of that rank waits ``seconds × (1 − share) / share`` from now."""
        if not self.enabled:
            return
        with self._cond:
            now = self._clock()
            longest, when = self._last[rank]
            if seconds >= longest or now - when > _RECENT_S:  # tiny checksums do not hide a long write
                self._last[rank] = (seconds, now)
            if self._above(rank):
                self._resume_at[rank] = max(self._resume_at[rank], self._clock() + self._pause(seconds))

    def _pause(self, seconds: float) -> float:
        return seconds * (1.0 - self.share) / self.share

    @contextmanager
    def piece(self, rank: int = BACKGROUND, cpu: bool = False) -> Iterator[None]:
        """Run the enclosed piece of ``rank`` after ``gate(rank)``, then ``charge`` its duration: wall
        time (a copy, a checksum, an O_DIRECT write that holds the memory bus until its DMA ends), or
        with ``cpu`` the thread's CPU time (a step that mostly waits on a device: an fdatasync, an
        LMDB commit, which slow nobody). Pieces nest (a mover's run around a tier's slices of one
        write): the inner ones gate and charge their own time, the outer one only the rest."""
        if not self.enabled:
            yield
            return
        self.gate(rank)
        outer = getattr(self._nested, "spent", None)
        self._nested.spent = [0.0, 0.0]  # wall, CPU time of the pieces inside this one
        wall, cpu_time = self._clock(), time.thread_time()
        try:
            yield
        finally:
            wall, cpu_time = self._clock() - wall, time.thread_time() - cpu_time
            inner = self._nested.spent
            self.charge(max(cpu_time - inner[1] if cpu else wall - inner[0], 0.0), rank)
            self._nested.spent = None if outer is None else [outer[0] + wall, outer[1] + cpu_time]


UNPACED = Pacer(1.0)  # the no-op pacer for tiers and movers built without a store
