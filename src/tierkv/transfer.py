"""Moves bytes between tiers and signals completion; owns no cache state (docs/design.md §9).

On CUDA: one stream for host->device copies, an event per batch; a load's
``ready`` is set once its event has completed, so the engine waits only just
before the first layer that needs the blocks. Device->host copies (demotions,
write-through) run on the caller's stream and are synchronised with
``d2h_sync`` before their source is reused. Disk and remote IO, reads and
writes, run in order on one IO thread (the store's writes never run under its
lock), so an L3 read of block k+1 overlaps the device copy of block k. Without CUDA the same handles complete on threads, with every CPU
copy a single-threaded memmove (see ``tiers.base.copy_block``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tierkv.tiers.base import leading_ok


@dataclass
class LoadResult:
    """Per block of the match: loaded (or already in L1) or not. ``num_ok`` counts the leading run."""

    ok: list[bool]
    seconds: float = 0.0
    adopted: list[bool] = field(default_factory=list)

    @property
    def num_ok(self) -> int:
        return leading_ok(self.ok)


class LoadHandle:
    """Completion of one batched load.

    ``ready`` (a threading.Event) is set when every copy has landed in its L1
    slot; ``wait()`` blocks for it and returns the LoadResult. A load started
    with ``parts`` > 1 also says how far it got: ``wait_part(p)`` returns once
    slice p of every block has landed (or the load ended); those bytes are not
    verified yet: only ``wait()``'s result says which blocks are good. Thread-safe.
    """

    def __init__(self, parts: int = 1) -> None:
        self.ready = threading.Event()
        self.parts = parts
        self._result: LoadResult | None = None
        self._error: BaseException | None = None
        self._landed = 0
        self._cond = threading.Condition()

    def _finish(self, result: LoadResult | None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._cond:
            self._landed = self.parts
            self.ready.set()
            self._cond.notify_all()

    def _part_landed(self, n: int) -> None:
        """Slices ``[0, n)`` of every block have landed."""
        with self._cond:
            if n > self._landed:
                self._landed = n
                self._cond.notify_all()

    def wait_part(self, p: int) -> None:
        """Block until slice ``p`` of every block has landed, or the load has ended."""
        with self._cond:
            while self._landed <= p and not self.ready.is_set():
                self._cond.wait()

    def done(self) -> bool:
        return self.ready.is_set()

    def wait(self, timeout: float | None = None) -> LoadResult:
        if not self.ready.wait(timeout):
            raise TimeoutError("load did not complete in time")
        if self._error is not None:
            raise self._error
        return self._result

    @classmethod
    def completed(cls, result: LoadResult) -> LoadHandle:
        h = cls()
        h._finish(result)
        return h


class TransferEngine:
    """Worker threads (and CUDA streams) that run tier copies. Thread-safe."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._io = ThreadPoolExecutor(1, thread_name_prefix="tierkv-io")
        self._copy = ThreadPoolExecutor(1, thread_name_prefix="tierkv-copy")
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)

    def io(self, fn: Callable, *args) -> Future:
        """Run ``fn`` on the IO thread (disk and remote tiers)."""
        return self._io.submit(fn, *args)

    def copy(self, fn: Callable, *args) -> Future:
        """Run ``fn`` on the copy thread; on CUDA inside the host->device stream, synchronised."""
        if not self.cuda:
            return self._copy.submit(fn, *args)

        def on_stream():
            with torch.cuda.stream(self.h2d):
                out = fn(*args)
                event = torch.cuda.Event()
                event.record(self.h2d)
            event.synchronize()
            return out

        return self._copy.submit(on_stream)

    def d2h_sync(self) -> None:
        """Make host copies issued on the current stream visible (no-op on CPU)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._copy.shutdown(wait=True)


def gather_futures(futures: list[Future], done: Callable[[], None]) -> None:
    """Call ``done`` on a helper thread once every future in ``futures`` finished."""
    if not futures:
        done()
        return
    remaining = [len(futures)]
    lock = threading.Lock()

    def one(_f):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            done()

    for f in futures:
        f.add_done_callback(one)


def now() -> float:
    return time.perf_counter()
