"""L3 shared by real processes: persistence, SIGKILLed writers, two concurrent stores."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

import _l3_workers
import _workers
from _kv import LAYOUT, block_for, prompt, same_bytes, save_prompt
from tierkv.index import Tier
from tierkv.tiers.disk import DiskTier



@pytest.fixture(scope="module")
def forkserver():
    """Workers forked from a server that imported tierkv once (a fresh interpreter costs ~1.5 s)."""
    ctx = mp.get_context("forkserver")
    # Installed modules only: the 3.11 forkserver preloads before it applies the tests' sys.path.
    ctx.set_forkserver_preload(["tierkv.store", "tierkv.tiers.disk"])
    return ctx


def test_another_process_hits_what_this_one_saved_and_back(make_store, l3_dir):
    store = make_store(l1=4, l2=0, l3=64)
    for seed in (1, 2, 3):
        save_prompt(store, prompt(seed, 4, LAYOUT))   # 1 and 2 are pushed down to L3; 3 stays in L1
    seen = _workers.run("l3_lookup", path=str(l3_dir), seeds=[1, 2, 3], num_blocks=4)
    assert seen["1"] == {"tiers": [Tier.L3] * 4, "num_ok": 4, "correct": True}
    assert seen["2"] == {"tiers": [Tier.L3] * 4, "num_ok": 4, "correct": True}
    assert seen["3"]["tiers"] == []  # only in this process's L1
    assert seen["stats"]["hits"] == {"l3": 8}
    other_model = _workers.run("l3_lookup", path=str(l3_dir), seeds=[1], num_blocks=4, model_id="another")
    assert other_model["1"]["tiers"] == []
    # The other way round: blocks another process writes while this store is open are found.
    _workers.run("l3_save", path=str(l3_dir), seeds=[7, 8], num_blocks=4)
    for seed in (7, 8):
        m = store.lookup(prompt(seed, 4, LAYOUT))
        assert m.tiers == [Tier.L3] * 4
        slots = store.allocate(4)
        result = store.load(m, slots).wait(30)
        assert result.num_ok == 4
        assert all(same_bytes(store.l1.block(s), block_for(k, LAYOUT)) for s, k in zip(slots, m.keys))
        store.release(m)


def check_directory(path: Path) -> int:
    """Open the L3 directory afresh; every block it lists must read back byte-correct."""
    tier = DiskTier(path, LAYOUT, 32)
    try:
        buf = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
        n = 0
        for rec in list(tier.records()):
            assert tier.get([rec.key], [buf]) == [True], f"listed block {rec.key.hex()} unreadable"
            assert same_bytes(buf, block_for(rec.key, LAYOUT)), f"block {rec.key.hex()} has wrong bytes"
            n += 1
        assert tier.used == n <= tier.capacity
        return n
    finally:
        tier.close()


def test_sigkilled_writers_leave_only_correct_blocks(forkserver, tmp_path):
    path = tmp_path / "l3"
    rng = random.Random(20240611)
    checked = kills_mid_stream = 0
    for trial in range(24):
        progress = forkserver.Value("q", 0)
        proc = forkserver.Process(target=_workers.crash_writer, args=(str(path), trial, 32, progress))
        proc.start()
        target = rng.randint(2, 30)
        deadline = time.monotonic() + 60
        first = None
        while progress.value < target:
            assert proc.is_alive(), f"writer of trial {trial} died with {proc.exitcode}"
            assert time.monotonic() < deadline, f"writer of trial {trial} stuck at {progress.value} puts"
            if first is None and progress.value >= 1:
                first = (time.monotonic(), progress.value)
            time.sleep(0.0002)
        # Land anywhere in the next put cycle (remove, data write, fdatasync, index commit).
        cycle = 0.01 if first is None else (time.monotonic() - first[0]) / max(1, progress.value - first[1])
        time.sleep(rng.uniform(0, cycle))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        kills_mid_stream += 1
        checked += check_directory(path)
    assert kills_mid_stream == 24 and checked > 24 * 10


def test_two_processes_share_one_directory_concurrently(forkserver, tmp_path):
    """Two stores on one L3, started together, each doing 150+ lookups, loads and saves until
    both have hit blocks the other wrote: every byte right, no deadlock."""
    path, lookups = tmp_path / "l3", 150
    outs = [tmp_path / f"worker{w}.json" for w in (1, 2)]
    start, done = forkserver.Barrier(2), [forkserver.Event(), forkserver.Event()]
    writers = forkserver.Array("b", 10, lock=False)  # per prompt: the worker that saved it last
    procs = [forkserver.Process(target=_workers.l3_mixed,
                                args=(str(path), w, lookups, 10, 3, str(out), start, done, writers))
             for w, out in zip((1, 2), outs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)  # generous: the workers stop on their own (300 s safety stop at most)
    hung = [p for p in procs if p.exitcode is None]
    for p in hung:
        p.kill()
    assert not hung, "a worker deadlocked"
    assert [p.exitcode for p in procs] == [0, 0]
    results = [json.loads(out.read_text()) for out in outs]
    for r in results:
        assert r["wrong"] == 0
        assert r["lookups"] >= lookups and r["loaded"] > 0 and r["l3_loaded"] > 0
        assert r["foreign"] > 0   # each hit blocks the other process wrote meanwhile
    check_directory(path)


def test_two_processes_put_compressed_blocks_into_one_directory_concurrently(forkserver, tmp_path):
    """Two processes code (zstd) and put blocks into one full L3, removing each other's to make
    room and reading both: they take turns on the writer lock only for the index update, and
    every block read, and every block left, has its exact bytes."""
    path, capacity = tmp_path / "l3", 24
    outs = [tmp_path / f"coded{w}.json" for w in (1, 2)]
    start, done = forkserver.Barrier(2), [forkserver.Event(), forkserver.Event()]
    procs = [forkserver.Process(target=_l3_workers.coded_writer,
                                args=(str(path), w, capacity, 60, str(out), start, done))
             for w, out in zip((1, 2), outs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)  # generous: the workers stop on their own (300 s safety stop at most)
    hung = [p for p in procs if p.exitcode is None]
    for p in hung:
        p.kill()
    assert not hung, "a writer deadlocked"
    assert [p.exitcode for p in procs] == [0, 0]
    for r in (json.loads(out.read_text()) for out in outs):
        # "full": the other writer took the slots freed for a batch first (counted, not wrong)
        assert r["wrong"] == 0 and {reason for _, reason, _ in r["failures"]} <= {"full"}
        assert r["puts"] >= 60 and r["stored"] > 0 and r["foreign"] > 0
    tier = DiskTier(path, _l3_workers.CODED_LAYOUT, capacity)
    try:
        recs = list(tier.records())
        assert 0 < len(recs) == tier.used <= capacity and all(r.flags for r in recs)
        assert len({r.slot for r in recs}) == len(recs)
        buf = torch.empty(_l3_workers.CODED_LAYOUT.block_shape, dtype=torch.float16)
        for rec in recs:
            assert tier.get([rec.key], [buf]) == [True]
            assert torch.equal(buf.view(torch.uint8), _l3_workers.coded_block(rec.key).view(torch.uint8))
    finally:
        tier.close()
