"""Which CPUs tierkv's threads in vLLM's worker run on (``vllm.io_cpus``).

vLLM's CPU worker binds its OpenMP threads, the main thread included, to the
cores named by ``VLLM_CPU_OMP_THREADS_BIND``; a thread started later inherits
the main thread's core, so without this the connector's copies and saves
would queue behind the forward on that one core while the cores vLLM left
free idle. vLLM's own NIXL connector keeps a core aside for transfers the
same way.

``auto``: the CPUs this process may use that the starting thread is not bound
to (none when vLLM binds nothing: then nothing moves). ``inherit``: leave
threads where they start. A list (``"2,3"``, ``"4-7"``): those CPUs.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("tierkv.connectors.vllm")

MODES = ("auto", "inherit")


def parse_cpus(spec: str) -> set[int] | None:
    """The CPU set ``spec`` names (None for ``auto`` / ``inherit``); ValueError naming the field."""
    if spec in MODES:
        return None
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi if dash else lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"vllm.io_cpus: expected 'auto', 'inherit' or a CPU list such as '2,3' or '4-7', "
                         f"got {spec!r}") from None
    return cpus


def io_cpus(spec: str) -> set[int] | None:
    """The CPUs a thread started now should move to under ``spec``; None to leave it where it is."""
    if spec == "inherit":
        return None
    named = parse_cpus(spec)
    if named is not None:
        return named
    free = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    return free or None


def pin_thread(spec: str) -> None:
    """Move the calling thread to ``io_cpus(spec)``; a set the kernel refuses leaves it in place."""
    cpus = io_cpus(spec)
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # none of them is allowed to this process (a cgroup cpuset)
        log.warning("tierkv: cannot move a connector thread to CPUs %s (%s); it stays on %s",
                    sorted(cpus), exc, sorted(os.sched_getaffinity(0)))


class ThreadPinner:
    """Moves the process's ``tierkv-*`` threads (the store's IO, copy, L3 reader and verifier
    threads, the connector's own) to ``io_cpus(spec)``, each once. The store starts some of them
    before vLLM binds its threads and some later from a bound thread; calling ``pin_new`` after
    each step that may have started one catches both. vLLM's worker thread only."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._done: set[int] = set()
        self._count = -1

    def pin_new(self) -> None:
        if self.spec == "inherit" or threading.active_count() == self._count:
            return
        self._count = threading.active_count()
        cpus = None
        for thread in threading.enumerate():
            tid = thread.native_id
            if tid is None or tid in self._done or not thread.name.startswith("tierkv"):
                continue
            self._done.add(tid)
            if cpus is None:
                cpus = io_cpus(self.spec)  # from this (vLLM's bound) thread: what its binding leaves
                if cpus is None:
                    return
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread ended, or none of the CPUs is allowed
                pass
