"""Code that tests run in other processes: ``python tests/_workers.py CMD ARGS`` or forkserver targets.

Every block is ``block_for(key)``, so a worker and its checker agree on the
bytes without sharing any state but the tier under test.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _kv import LAYOUT, block_for, key_of, prompt, same_bytes, save_prompt, store_config  # noqa: E402


# -- shared-memory L2 -----------------------------------------------------------

def shm_exchange(name: str, capacity: int, expect: list[str], put: list[str]) -> dict:
    """Open the shared L2 ``name``; read ``expect`` keys, then put ``put`` keys."""
    from tierkv.tiers.host import HostTier

    tier = HostTier(LAYOUT, capacity, shared_name=name, pin=False)
    seen = {}
    for label in expect:
        key = key_of("shm", label)
        dst = block_for(key_of("other"), LAYOUT).clone()
        ok = tier.get([key], [dst])[0]
        seen[label] = bool(ok and same_bytes(dst, block_for(key, LAYOUT)))
    keys = [key_of("shm", label) for label in put]
    written = tier.put(keys, [block_for(k, LAYOUT) for k in keys])
    return {"seen": seen, "written": written, "used": tier.used}


def shm_store_lookup(name: str, seeds: list[int], num_blocks: int) -> dict:
    """A store whose L2 is the shared slab ``name`` (no L3): look up and load each prompt."""
    import dataclasses

    from tierkv.store import TierKVStore

    cfg = store_config(LAYOUT, 4, 0, "/nonexistent")
    cfg = dataclasses.replace(cfg, l2=dataclasses.replace(cfg.l2, shared_name=name))
    with TierKVStore(cfg, LAYOUT, l1_blocks=8) as store:
        return _lookup_and_load(store, seeds, num_blocks)


# -- L3 persistence -------------------------------------------------------------

def l3_lookup(path: str, seeds: list[int], num_blocks: int, model_id: str = "unknown-model") -> dict:
    """Open a store on ``path`` (a fresh process) and look up and load each prompt."""
    from tierkv.store import TierKVStore

    cfg = store_config(LAYOUT, 0, 64, path, model_id=model_id)
    with TierKVStore(cfg, LAYOUT, l1_blocks=16) as store:
        out = _lookup_and_load(store, seeds, num_blocks)
        out["stats"] = store.stats()
    return out


def _lookup_and_load(store, seeds: list[int], num_blocks: int) -> dict:
    """Per prompt seed: the tiers matched, the blocks loaded, and whether every loaded byte is right."""
    out = {}
    for seed in seeds:
        m = store.lookup(prompt(seed, num_blocks, LAYOUT))
        slots = store.allocate(len(m.to_load))
        result = store.load(m, slots).wait(30)
        correct = [same_bytes(store.l1.block(m.entries[i].l1_slot), block_for(m.keys[i], LAYOUT))
                   for i in range(result.num_ok)]
        out[seed] = {"tiers": m.tiers, "num_ok": result.num_ok, "correct": all(correct)}
        store.release(m)
    return out


def l3_save(path: str, seeds: list[int], num_blocks: int) -> None:
    """Save prompts through a store with a tiny L1 and no L2, so they land in L3."""
    from tierkv.store import TierKVStore

    cfg = store_config(LAYOUT, 0, 64, path)
    with TierKVStore(cfg, LAYOUT, l1_blocks=num_blocks) as store:
        for seed in seeds:
            save_prompt(store, prompt(seed, num_blocks, LAYOUT))
        store.free(store.allocate(num_blocks))  # push L1 down to L3 before exiting


def l3_fill(path: str, capacity: int, labels: list[str]) -> dict:
    """Open the L3 directory with ``capacity`` slots and put one block per label."""
    from tierkv.tiers.disk import DiskTier

    tier = DiskTier(path, LAYOUT, capacity)
    keys = [key_of("disk", label) for label in labels]
    ok = tier.put(keys, [block_for(k, LAYOUT) for k in keys])
    slots = sorted(r.slot for r in tier.records())
    tier.close()
    return {"ok": ok, "slots": slots}


# -- L3 crash safety --------------------------------------------------------------

def crash_writer(path: str, trial: int, capacity: int, progress) -> None:
    """Put (and, when full, remove) batches of blocks forever, counting puts in ``progress``.

    The test SIGKILLs this process at a random moment.
    """
    from tierkv.tiers.base import Lineage
    from tierkv.tiers.disk import DiskTier

    import mmap

    import torch

    tier = DiskTier(path, LAYOUT, capacity)
    rng = random.Random(trial)
    # Page-aligned sources (like L1 slots) are written straight from memory in runs of
    # consecutive slots; the others go through the bounce buffer. Use both.
    pool = torch.frombuffer(mmap.mmap(-1, 4 * LAYOUT.block_bytes), dtype=LAYOUT.torch_dtype)
    pool = pool.view(LAYOUT.pool_shape(4))
    live: list[bytes] = [r.key for r in tier.records()]
    i = 0
    while True:
        batch = [key_of("crash", trial, i + j) for j in range(rng.randint(1, 4))]
        i += len(batch)
        while len(live) + len(batch) > capacity:
            tier.remove([live.pop(rng.randrange(len(live)))])
        blocks = [block_for(k, LAYOUT) for k in batch]
        if rng.random() < 0.5:
            for j, block in enumerate(blocks):
                pool[j].copy_(block)
            blocks = [pool[j] for j in range(len(batch))]
        ok = tier.put(batch, blocks, [Lineage(None, n) for n in range(len(batch))])
        live.extend(k for k, flag in zip(batch, ok) if flag)
        with progress.get_lock():
            progress.value += 1


# -- two processes on one L3 --------------------------------------------------------

def l3_mixed(path: str, worker: int, lookups: int, universe: int, num_blocks: int, out_file: str,
             start, done, writers) -> None:
    """Look up, load, verify and save random prompts of a shared universe, alongside another worker.

    Both workers begin together (``start``, a barrier) and each sets its ``done[worker - 1]`` event
    once it has made ``lookups`` lookups and hit a block the other one wrote; each keeps going
    until both are done, so the two run concurrently from the first lookup to the last. A 300 s
    safety stop only keeps a broken store from hanging the test (whose assertions then fail).
    ``writers`` (a shared array, one entry per prompt of the universe) holds the last worker that
    saved blocks of each prompt: a hit on a prompt the other worker saved last counts as foreign,
    at any point of the run (not only on a prompt's first lookup, which a slow start could miss).
    """
    from tierkv.store import TierKVStore

    rng = random.Random(worker)
    cfg = store_config(LAYOUT, 2, 24, path)
    counts = {"lookups": 0, "loaded": 0, "wrong": 0, "saved": 0, "l3_loaded": 0, "foreign": 0}
    with TierKVStore(cfg, LAYOUT, l1_blocks=2 * num_blocks) as store:
        start.wait(120)
        safety = time.monotonic() + 300
        while not all(event.is_set() for event in done) and time.monotonic() < safety:
            seed = rng.randrange(universe)
            tokens = prompt(seed, num_blocks, LAYOUT)
            m = store.lookup(tokens)
            counts["lookups"] += 1
            slots = store.allocate(len(m.to_load))
            result = store.load(m, slots).wait(30)
            store.free([s for j, s in enumerate(slots) if not result.adopted[m.to_load[j]]])
            for i in range(result.num_ok):
                block = store.l1.block(m.entries[i].l1_slot)
                counts["wrong"] += not same_bytes(block, block_for(m.keys[i], LAYOUT))
                counts["loaded"] += 1
                counts["l3_loaded"] += m.tiers[i] == 2
            keys = m.keys
            rest = list(range(result.num_ok, len(keys)))
            fresh = store.allocate(len(rest))
            for i, slot in zip(rest, fresh):
                store.l1.block(slot).copy_(block_for(keys[i], LAYOUT))
            adopted = store.save(keys, fresh, result.num_ok, m)
            store.free([s for s, a in zip(fresh, adopted) if not a])
            counts["saved"] += sum(adopted)
            counts["foreign"] += result.num_ok > 0 and writers[seed] not in (0, worker)
            if any(adopted):
                writers[seed] = worker
            store.release(m)
            if counts["lookups"] >= lookups and counts["foreign"] > 0:
                done[worker - 1].set()
        counts["stats"] = store.stats()
    Path(out_file).write_text(json.dumps(counts))


def run(cmd: str, **args) -> dict:
    """Run ``cmd`` of this file in a fresh interpreter (as another process would) and return its JSON."""
    import subprocess

    out = subprocess.run([sys.executable, __file__, cmd, json.dumps(args)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}


if __name__ == "__main__":
    cmd, args = sys.argv[1], json.loads(sys.argv[2])
    result = {"shm": shm_exchange, "l3_lookup": l3_lookup, "l3_save": l3_save, "l3_fill": l3_fill,
              "shm_store_lookup": shm_store_lookup}[cmd](**args)
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
