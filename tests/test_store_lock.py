"""No disk write, fsync or network call runs while the store lock is held.

Every call that writes to disk (``os.pwritev``/``pwrite``/``fdatasync``/``fsync``,
the L3 tier's ``put``/``remove``, which end in an LMDB commit) or talks to the
pool (every L4 method) is wrapped to record whether the calling thread holds
the store's lock. A workload that exercises every write the store makes —
demotions L1 -> L2 -> L3 -> L4 under pressure, write-through, persist to L3
and L4, ``put_blocks`` straight into L3, loads from L3 and L4, L4 probes —
must record none, and must have made each kind of call.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from _kv import block_for, prompt, same_bytes, save_prompt, store_config
from _servers import redis_server  # noqa: F401

from tierkv.config import L4Config, PolicyConfig
from tierkv.index import Tier
from tierkv.store import TierKVStore

pytestmark = pytest.mark.timeout(180)


class LockWatch:
    """Wraps callables so each call records (name, held) where held = the store lock's owner is this thread."""

    def __init__(self, monkeypatch) -> None:
        self.mp = monkeypatch
        self.locks: list = []
        self.calls: dict[str, int] = {}
        self.violations: list[str] = []
        self._mu = threading.Lock()

    def held(self) -> bool:
        return any(lock._is_owned() for lock in self.locks)

    def wrap(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def watched(*args, **kwargs):
            with self._mu:
                self.calls[label] = self.calls.get(label, 0) + 1
                if self.held():
                    self.violations.append(f"{label} on {threading.current_thread().name}")
            return real(*args, **kwargs)

        self.mp.setattr(owner, name, watched)

    def watch_os(self) -> None:
        for name in ("pwritev", "pwrite", "fdatasync", "fsync"):
            self.wrap(os, name, f"os.{name}")

    def watch_store(self, store: TierKVStore) -> None:
        self.locks.append(store._lock)
        for name in ("put", "remove"):
            self.wrap(store.tiers[Tier.L3], name, f"l3.{name}")
        if Tier.L4 in store.tiers:
            for name in ("put", "get", "contains", "remove"):
                self.wrap(store.tiers[Tier.L4], name, f"l4.{name}")


def load_all(store, keys):
    m = store.lookup_keys(keys)
    dst = [torch.empty(store.layout.block_shape, dtype=store.layout.torch_dtype) for _ in m.to_load]
    result = store.load(m, dst).wait(30)
    for j, i in enumerate(m.to_load):
        assert result.ok[i] and same_bytes(dst[j], block_for(m.keys[i], store.layout))
    store.release(m)
    return m


def test_the_watch_sees_a_write_under_the_lock(monkeypatch, make_store, layout):
    """The detector can fail: a put made while holding the lock is recorded."""
    store = make_store(l1=4, l2=4, l3=16)
    watch = LockWatch(monkeypatch)
    watch.watch_os()
    watch.watch_store(store)
    key = store.hash(prompt(1, 1, layout))[0]
    with store._lock:
        store.tiers[Tier.L3].put([key], [block_for(key, layout)])
    assert any(v.startswith("l3.put") for v in watch.violations)
    assert any(v.startswith("os.fdatasync") for v in watch.violations)


def test_no_disk_or_network_write_under_the_store_lock(monkeypatch, tmp_path, layout, redis_server):  # noqa: F811
    watch = LockWatch(monkeypatch)
    watch.watch_os()
    l4 = L4Config(url=redis_server.url, timeout_ms=2000)
    back = TierKVStore(store_config(layout, 4, 8, tmp_path / "a", l4=l4), layout, l1_blocks=4)
    cfg = store_config(layout, 4, 16, tmp_path / "b", l4=l4, policy=PolicyConfig(name="lru", write="write_through"))
    through = TierKVStore(cfg, layout, l1_blocks=4)
    no_l2 = TierKVStore(store_config(layout, 0, 16, tmp_path / "c"), layout, l1_blocks=4)
    stores = (back, through, no_l2)
    for s in stores:
        watch.watch_store(s)
    try:
        # Write-back under pressure: 6 prompts of 4 blocks through L1 (4), L2 (4) and L3 (8) into L4.
        chains = [save_prompt(back, prompt(10 + i, 4, layout)) for i in range(6)]
        back.flush()
        assert back.l4.contains(chains[0]) == [True] * 4        # L3's victims went on to L4
        load_all(back, chains[0])                               # from L4
        load_all(back, chains[3])                               # from L3
        assert back.persist(chains[5]) == 4                     # L1 -> L3, synchronous
        assert back.persist(chains[5], Tier.L4) == 4            # queued for L4
        # Write-through: every save copies down to L2, L3 and L4 on the IO thread.
        wt = []
        for i in range(3):
            wt.append(save_prompt(through, prompt(20 + i, 4, layout)))
            through.flush()  # the copies pin their sources until they land: L1 holds one prompt
        assert through.l4.contains(wt[0]) == [True] * 4 and through.l3.contains(wt[0]) == [True] * 4
        # No L2: put_blocks goes straight to L3.
        keys = no_l2.hash(prompt(30, 4, layout))
        assert no_l2.put_blocks(keys, [block_for(k, layout) for k in keys]) == [True] * 4
        assert no_l2.l3.contains(keys) == [True] * 4
        load_all(no_l2, keys)
        for s in stores:
            s.flush()
    finally:
        for s in stores:
            s.close()
    assert watch.violations == []
    for label in ("os.pwritev", "os.fdatasync", "l3.put", "l3.remove", "l4.put", "l4.get", "l4.contains"):
        assert watch.calls.get(label, 0) > 0, (label, watch.calls)


def test_an_l1_hit_lookup_does_not_wait_for_a_demotion_to_disk(monkeypatch, make_store, layout):
    """While the IO thread is stuck in an L3 write, other threads' lookups, saves and L1 allocations
    that need no slow tier go on."""
    store = make_store(l1=8, l2=4, l3=16)
    hot = save_prompt(store, prompt(40, 2, layout))
    held = store.lookup_keys(hot)                   # pinned: the pusher cannot evict it
    gate, writing = threading.Event(), threading.Event()
    real_put = store.tiers[Tier.L3].put

    def stuck_put(*args, **kwargs):
        writing.set()
        assert gate.wait(30)
        return real_put(*args, **kwargs)

    monkeypatch.setattr(store.tiers[Tier.L3], "put", stuck_put)
    pusher = threading.Thread(target=lambda: [save_prompt(store, prompt(41 + i, 2, layout)) for i in range(6)])
    pusher.start()
    try:
        assert writing.wait(30)                     # a demotion to L3 is being written
        m = store.lookup_keys(hot)                  # the lock is free meanwhile
        assert m.tiers == [Tier.L1, Tier.L1]
        store.release(m)
        assert store.stats()["index_entries"] > 0
    finally:
        gate.set()
        pusher.join(30)
    store.flush()
    assert not pusher.is_alive()
    store.release(held)
