"""L3's thread pools, one set per process: the put's checksum thread and the readers of each depth.

preadv, pwritev and xxh3 release the GIL, so these threads read, write and verify in
parallel with the caller. A forked child makes its own pools (a parent's threads do not
exist there). Thread-safe: pools are created under one lock.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from tierkv.pacing import UNPACED, Pacer
from tierkv.tiers.base import checksum

_pool: tuple[int, ThreadPoolExecutor] | None = None  # (owning pid, pool): a forked child makes its own
_pool_lock = threading.Lock()
_read_pools: tuple[int, dict[int, ThreadPoolExecutor]] = (0, {})  # (owning pid, {depth: pool})


def submit(pool: ThreadPoolExecutor, fn, *args) -> Future:
    """``pool.submit``, or, once the interpreter's exit has stopped the pool's thread (a store
    closing at exit still writes), ``fn`` run here: the same result, one thread."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done


def verifier() -> ThreadPoolExecutor:
    """One thread per process that checksums a put's blocks while they are written (xxh3 releases the GIL)."""
    global _pool
    pool = _pool
    if pool is None or pool[0] != os.getpid():
        with _pool_lock:
            if _pool is None or _pool[0] != os.getpid():
                _pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="tierkv-l3-verify"))
            pool = _pool
    return pool[1]


def readers(depth: int) -> ThreadPoolExecutor:
    """The process's ``depth`` L3 reader threads, shared by its stores of that depth; preadv and xxh3
    release the GIL, so they read and verify in parallel. A forked child makes its own."""
    global _read_pools
    pid, pools = _read_pools
    pool = pools.get(depth) if pid == os.getpid() else None
    if pool is None:
        with _pool_lock:
            if _read_pools[0] != os.getpid():
                _read_pools = (os.getpid(), {})
            pools = _read_pools[1]
            if depth not in pools:
                pools[depth] = ThreadPoolExecutor(depth, thread_name_prefix="tierkv-l3-read")
            pool = pools[depth]
    return pool


def checksums(items: list[tuple[bytes, memoryview]], pacer: Pacer = UNPACED) -> list[int]:
    """The checksum of each (key, bytes); paced, each one a background piece."""
    if not pacer.enabled:
        return [checksum(key, view) for key, view in items]
    out = []
    for key, view in items:
        with pacer.piece():
            out.append(checksum(key, view))
    return out
