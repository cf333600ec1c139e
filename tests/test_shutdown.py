"""Shutdown: what ``close`` lands, writes down and drops, and a process that exits without it.

A store's queued writes (demotions written behind) and the blocks that live
only in L1/L2 reach L3 at ``close`` within ``io.shutdown_flush_s``; past it
they are dropped with one counted log line and L3 stays consistent. A program
that never calls ``close`` gets the same at interpreter exit, before
``concurrent.futures`` stops the IO threads, and prints nothing.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from _kv import LAYOUT, block_for, prompt, same_bytes, save_prompt, store_config
from tierkv.config import IOConfig
from tierkv.index import Tier
from tierkv.store import TierKVStore

TESTS = str(Path(__file__).parent)

EXIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from _kv import LAYOUT, prompt, save_prompt, store_config
from tierkv.config import IOConfig
from tierkv.store import TierKVStore

store = TierKVStore(store_config(LAYOUT, 4, 400, {path!r}, io=IOConfig(shutdown_flush_s={flush})),
                    LAYOUT, l1_blocks=8)
for seed in range({prompts}):
    save_prompt(store, prompt(seed, 4, LAYOUT))
print("saved", flush=True)
# no close(): the interpreter exits with demotions queued and 12 blocks only in L1/L2
"""


def exit_without_close(path: Path, prompts: int, flush: float) -> subprocess.CompletedProcess:
    script = EXIT_SCRIPT.format(tests=TESTS, path=str(path), flush=flush, prompts=prompts)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def reopen(path: Path, l3: int = 400) -> TierKVStore:
    return TierKVStore(store_config(LAYOUT, 0, l3, path), LAYOUT, l1_blocks=8)


def held_in_l3(store: TierKVStore, seeds) -> list[int]:
    """Per prompt: how many of its leading blocks the L3 serves, each checked against its bytes."""
    out = []
    for seed in seeds:
        m = store.lookup(prompt(seed, 4, LAYOUT))
        n = 0
        for i, tier in enumerate(m.tiers):
            if tier != Tier.L3:
                break
            buf = block_for(m.keys[i], LAYOUT).clone().zero_()
            assert store.tiers[Tier.L3].get([m.keys[i]], [buf]) == [True]
            assert same_bytes(buf, block_for(m.keys[i], LAYOUT))
            n += 1
        store.release(m)
        out.append(n)
    return out


def test_a_process_that_exits_without_close_lands_every_block_in_l3_and_prints_nothing(tmp_path):
    """60 prompts of 4 blocks through L1 (8) and L2 (4) into L3, then exit without ``close``: the
    exit hook lands the queued demotions and writes the 12 blocks left in L1/L2 down; stderr is
    empty (before, a queued write raised "cannot schedule new futures after shutdown"); the next
    open finds all 240 blocks, every one verifies."""
    path = tmp_path / "l3"
    proc = exit_without_close(path, 60, 10.0)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "saved"
    assert proc.stderr == ""
    with reopen(path) as store:
        assert held_in_l3(store, range(60)) == [4] * 60
        assert store.tiers[Tier.L3].verify() == (240, [])


def test_exit_with_no_flush_time_drops_the_in_memory_blocks_and_l3_stays_consistent(tmp_path):
    """``io.shutdown_flush_s`` 0: nothing more is written at exit. What landed is whole chains'
    prefixes that verify; what did not is a miss, never an error."""
    path = tmp_path / "l3"
    proc = exit_without_close(path, 20, 0)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr.lower(), proc.stderr
    for line in proc.stderr.splitlines():  # at most the one line that counts what was dropped
        assert "close dropped" in line and "io.shutdown_flush_s" in line, proc.stderr
    with reopen(path) as store:
        found = held_in_l3(store, range(20))
        checked, bad = store.tiers[Tier.L3].verify()
        assert bad == [] and checked == sum(found)
        assert sum(found) <= 80 - 12  # the blocks left in L1/L2 were not written


def test_close_writes_blocks_that_live_only_in_l1_and_l2_down_to_l3(tmp_path):
    """Under the default write-back nothing reaches L3 before an eviction from L2; ``close`` writes
    those blocks down, so a restart hits all of them (before: 0 hits)."""
    path = tmp_path / "l3"
    store = TierKVStore(store_config(LAYOUT, 4, 64, path), LAYOUT, l1_blocks=8)
    for seed in range(3):
        save_prompt(store, prompt(seed, 4, LAYOUT))  # 12 blocks: 8 in L1, 4 in L2
    assert store.tiers[Tier.L3].used + store.mover.pending_l3 == 0
    store.close()
    with reopen(path, 64) as again:
        assert held_in_l3(again, range(3)) == [4, 4, 4]


def test_close_with_an_l3_smaller_than_memory_keeps_whole_prefixes(tmp_path):
    """L3 of 6 blocks, 12 in memory: the write-down goes shallowest first, so what L3 keeps is the
    first blocks of the chains, each of which a restart can match (no orphaned deep block)."""
    path = tmp_path / "l3"
    store = TierKVStore(store_config(LAYOUT, 4, 6, path), LAYOUT, l1_blocks=8)
    for seed in range(3):
        save_prompt(store, prompt(seed, 4, LAYOUT))
    store.close()
    with reopen(path, 6) as again:
        found = held_in_l3(again, range(3))
        assert sum(found) == 6 and found == [2, 2, 2]
        assert len(list(again.tiers[Tier.L3].records())) == 6


def test_close_past_its_deadline_drops_the_queued_writes_with_one_counted_line(tmp_path, caplog):
    """The IO thread is held busy while 40 prompts queue their demotions; ``close`` with a 0.3 s
    deadline gives up on them: it returns once the busy job ends, says how many it dropped in one
    warning, counts them, and the L3 left behind verifies and serves what it lists."""
    path = tmp_path / "l3"
    store = TierKVStore(store_config(LAYOUT, 4, 400, path, io=IOConfig(shutdown_flush_s=0.3)), LAYOUT,
                        l1_blocks=8)
    gate = threading.Event()
    store.transfer.io(gate.wait, 30)
    for seed in range(40):
        save_prompt(store, prompt(seed, 4, LAYOUT))
    threading.Timer(1.0, gate.set).start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tierkv.store"):
        store.close()
    assert time.monotonic() - t0 < 10
    lines = [r.getMessage() for r in caplog.records if "close dropped" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    dropped = store.mover.dropped
    assert dropped >= 40 * 4 - 12 and f"dropped {dropped} queued" in lines[0]
    assert store.metrics.failures[("store", "shutdown")] == dropped
    with reopen(path) as again:
        found = held_in_l3(again, range(40))
        assert again.tiers[Tier.L3].verify() == (sum(found), [])
        assert sum(found) == 0  # everything was queued behind the busy job
