"""One TierKVStore per process and (config, layout), shared by the connector's two roles.

vLLM builds the scheduler-side and the worker-side connector separately; with
one GPU (UniProcExecutor) both live in the engine-core process. Sharing the
store there means one index, one L2 slab and one handle on the L3 directory,
so what a worker saves the scheduler finds at once. Across processes the
tiers themselves are shared (L2 via ``l2.shared_name``, L3 by directory, L4
by URL). Thread-safe; the store is closed when its last user releases it.
"""

from __future__ import annotations

import threading

from tierkv.config import StoreConfig
from tierkv.layout import KVLayout
from tierkv.store import TierKVStore

_lock = threading.Lock()
_stores: dict[tuple[StoreConfig, KVLayout], tuple[TierKVStore, int]] = {}


def acquire_store(config: StoreConfig, layout: KVLayout) -> TierKVStore:
    """The process's store for ``(config, layout)``, opened on first use. Pair with ``release_store``."""
    key = (config, layout)
    with _lock:
        store, users = _stores.get(key, (None, 0))
        if store is None:
            store = TierKVStore(config, layout)
        _stores[key] = (store, users + 1)
        return store


def release_store(store: TierKVStore) -> None:
    """Drop one use of ``store``; the last one closes it (finishes transfers, closes files)."""
    with _lock:
        for key, (s, users) in list(_stores.items()):
            if s is store:
                if users > 1:
                    _stores[key] = (s, users - 1)
                    return
                del _stores[key]
                break
        else:
            return
    store.close()
