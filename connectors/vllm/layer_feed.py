"""Writes a step's synchronous loads into vLLM's cache layer by layer, beside the forward.

vLLM calls ``wait_for_layer_load(layer)`` as each attention layer starts. On a
CPU cache the worker hands a step's synchronous loads to one feed thread (on
the cores ``vllm.io_cpus`` picks) that writes layer 0 of every load, then
layer 1, and so on; layer l's attention waits only for layer l, so the copy
runs while the earlier layers compute instead of before all of them.

Contract: ``start(job)`` runs ``job(ready)`` on the feed thread; the job calls
``ready(n)`` once layers ``[0, n)`` of every load are written. ``wait(l)``
returns once layer l is written or the job has ended (finished or failed;
``join`` tells which). ``join()`` waits for the job and returns its result,
its exception, and the layers the forward waited for: a layer it did not wait
for may have been read before it was written, so the caller must treat the
loads as failed then. One job at a time; ``start``, ``wait`` and ``join`` are
called from vLLM's worker thread only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tierkv.connectors.vllm.cpus import pin_thread


class LayerFeed:
    def __init__(self, io_cpus: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierkv-vllm-feed",
                                        initializer=pin_thread, initargs=(io_cpus,))
        self._cond = threading.Condition()
        self._ready = 0
        self._ended = True
        self._future: Future | None = None
        self._waited: set[int] = set()

    @property
    def active(self) -> bool:
        return self._future is not None

    def start(self, job: Callable[[Callable[[int], None]], Any]) -> None:
        """Run ``job(ready)`` on the feed thread; the previous job must have been joined."""
        if self._future is not None:
            raise RuntimeError("LayerFeed.start: the previous job was not joined")
        with self._cond:
            self._ready, self._ended = 0, False
        self._waited = set()
        self._future = self._pool.submit(self._run, job)

    def _run(self, job: Callable[[Callable[[int], None]], Any]) -> Any:
        try:
            return job(self._set_ready)
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _set_ready(self, n: int) -> None:
        with self._cond:
            self._ready = n
            self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Block until ``layer`` is written (or the job ended); no-op without a job."""
        if self._future is None:
            return
        self._waited.add(layer)
        with self._cond:
            while self._ready <= layer and not self._ended:
                self._cond.wait()

    def join(self) -> tuple[Any, BaseException | None, set[int]]:
        """(result, exception, layers waited for) of the job; (None, None, set()) without one."""
        future, self._future = self._future, None
        if future is None:
            return None, None, set()
        exc = future.exception()
        return (None if exc is not None else future.result()), exc, self._waited

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn`` on the feed thread (threads it starts inherit its CPUs)."""
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
