"""The connector's store per process: the worker's full store, or the scheduler's view.

vLLM builds the scheduler-side and the worker-side connector separately. They
may share a process (UniProcExecutor: one GPU today) or not (the
multi-process executor: vLLM on CPU always, TP > 1). Nothing here relies on
either:

- the **worker** opens the full store of the config: its own L2 (private, or
  the ``l2.shared_name`` slab), the L3 directory, the L4 pool;
- the **scheduler** needs only what it can read durably from any process:
  the L3 index (LMDB), a shared L2 slab's index, L4 membership. Its *view*
  is the same config without a private L2 (a view never writes; a private
  slab there would be memory no one reads).

In one process both roles use one store (one index, one handle on the L3
directory, which LMDB allows once per process): whichever role comes first
opens it, the worker's kind when the worker comes first (vLLM 0.32.0's
order); a worker that finds a scheduler's view adopts it and then saves
straight to L3. The worker's full store keeps the eviction log (``why.EvictionLog``,
saved in the L3 directory on close) that ``tierkv why`` reads; a view keeps none (it
evicts nothing, and saving an empty log would replace the worker's). Both keep a seed
log (``seeds.SeedLog``: what the extra keys of each request's seed named; the scheduler
computes the seeds, and the file merges what each process noted). Thread-safe; the
store is closed when its last user releases it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from tierkv.config import L2Config, StoreConfig
from tierkv.identity import ModelIdentity
from tierkv.layout import KVLayout
from tierkv.store import TierKVStore

log = logging.getLogger("tierkv.connectors.vllm")
_lock = threading.Lock()
_stores: dict[tuple[StoreConfig, KVLayout, str], list] = {}  # key -> [store, users, is_view]


def view_config(config: StoreConfig) -> StoreConfig:
    """``config`` as the scheduler's view opens it: no private L2 (a shared slab stays)."""
    if config.l2.shared_name:
        return config
    return replace(config, l2=L2Config(capacity=0, shared_name="", pin=False))


def acquire_store(config: StoreConfig, layout: KVLayout, role: str, identity: ModelIdentity) -> TierKVStore:
    """This process's store for ``(config, layout, identity)``; ``role`` "worker" or "scheduler"
    says what to open when none is open yet. Pair with ``release_store``."""
    key = (config, layout, identity.digest)
    with _lock:
        entry = _stores.get(key)
        if entry is None:
            view = role == "scheduler"
            store = TierKVStore(view_config(config) if view else config, layout, identity=identity)
            if not view:  # the store that evicts keeps the log `tierkv why` reads (a view never evicts)
                store.keep_eviction_log()
            store.keep_seed_log()  # the scheduler's seeds (LoRA, cache_salt), for `tierkv why`
            entry = _stores[key] = [store, 0, view]
        elif role == "worker" and entry[2]:
            log.warning("tierkv: the worker shares the scheduler's view of the store (it started "
                        "first in this process): saves go straight to L3, without L2")
        entry[1] += 1
        return entry[0]


def release_store(store: TierKVStore, deadline: float | None = None) -> None:
    """Drop one use of ``store``; the last one closes it (``TierKVStore.close(deadline)``: lands
    queued writes, writes L2-only blocks down to L3, closes files)."""
    with _lock:
        for key, entry in list(_stores.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _stores[key]
                break
        else:
            return
    store.close(deadline)
