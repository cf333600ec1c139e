"""A damaged L3 directory: its files are moved aside and the store starts with an empty L3.

Each case writes a real L3 with a store (12 blocks in slots 0-11), closes it, damages
the files with plain file operations (or, for a meta record, a real LMDB write) and
starts a store on the directory again. Openings that LMDB itself would not survive
(a truncated index: SIGBUS; a garbled leaf page: abort()) run in a child process, so a
regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import torch

import _workers
from _kv import LAYOUT, ODD_LAYOUT, block_for, key_of, prompt, same_bytes, save_prompt
from _prom import value
from tierkv.index import Tier

L3_BLOCKS = 64
TESTS = str(Path(__file__).parent)


def write_l3(make_store) -> tuple[list[list[int]], dict[bytes, int]]:
    """Three 4-block prompts persisted to L3; returns them and each block's slot."""
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    prompts = [prompt(300 + i, 4, LAYOUT) for i in range(3)]
    for p in prompts:
        save_prompt(store, p)
    for p in prompts:
        store.persist(store.hash(p))
    slots = {r.key: r.slot for r in store.l3.records()}
    assert sorted(slots.values()) == list(range(12))
    store.close()
    return prompts, slots


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def set_meta(l3_dir: Path, name: bytes, value: bytes) -> None:
    env = lmdb.open(str(l3_dir / "index"), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(name, value, db=env.open_db(b"meta", txn=txn))
    env.close()


def put_records(l3_dir: Path, records: dict[bytes, bytes]) -> None:
    env = lmdb.open(str(l3_dir / "index"), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        db = env.open_db(b"blocks", txn=txn)
        for key, raw in records.items():
            txn.put(key, raw, db=db)
    env.close()


def load_exact(store, m) -> bool:
    """Load every matched block into plain tensors: all usable, every byte right."""
    dst = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in m.to_load]
    result = store.load(m, dst).wait(30)
    return result.num_ok == m.num_blocks and all(
        same_bytes(d, block_for(m.keys[i], LAYOUT)) for d, i in zip(dst, m.to_load))


def damaged_dirs(l3_dir: Path) -> list[Path]:
    return sorted(l3_dir.glob("damaged-*"))


def check_fresh_l3(make_store, store, l3_dir: Path, prompts, moved: list[str]) -> Path:
    """``store`` started on the moved-aside directory: old prompts miss, new blocks persist."""
    (aside,) = damaged_dirs(l3_dir)
    assert re.fullmatch(r"damaged-\d{8}T\d{6}Z", aside.name)
    assert sorted(os.listdir(aside)) == moved
    assert store.l3.used == 0
    assert [store.lookup(p, pin=False).num_blocks for p in prompts] == [0, 0, 0]
    fresh = prompt(350, 4, LAYOUT)
    save_prompt(store, fresh)
    assert store.persist(store.hash(fresh)) == 4
    store.close()
    again = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    m = again.lookup(fresh)
    assert m.tiers == [Tier.L3] * 4 and load_exact(again, m)
    again.release(m)
    assert [again.lookup(p, pin=False).num_blocks for p in prompts] == [0, 0, 0]
    assert again.stats()["failures"] == {} and damaged_dirs(l3_dir) == [aside]
    again.close()
    return aside


def header_garbage(l3_dir: Path) -> None:
    with open(l3_dir / "index" / "data.mdb", "r+b") as fh:
        fh.write(bytes(range(256)) * 32)  # both meta pages


def index_truncated_to_zero(l3_dir: Path) -> None:
    os.truncate(l3_dir / "index" / "data.mdb", 0)  # LMDB takes it for a new, empty index


def capacity_garbage(l3_dir: Path) -> None:
    set_meta(l3_dir, b"capacity", b"\xff\xfe12")


def fingerprint_garbage(l3_dir: Path) -> None:
    set_meta(l3_dir, b"layout_fingerprint", b"\x00\x01 no layout")


def index_is_a_file(l3_dir: Path) -> None:
    shutil.rmtree(l3_dir / "index")
    (l3_dir / "index").write_bytes(b"not an LMDB directory")


@pytest.mark.parametrize("damage, lost", [
    (header_garbage, 0), (index_truncated_to_zero, 0), (capacity_garbage, 12), (fingerprint_garbage, 12),
    (index_is_a_file, 0),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_damaged_index_is_moved_aside_and_the_store_starts_empty(make_store, l3_dir, caplog, damage, lost):
    prompts, _ = write_l3(make_store)
    from tierkv.catalog import Catalog

    catalog = Catalog(l3_dir)  # what `tierkv run` writes beside L3: labels for the blocks moved below
    catalog.label([key_of("root")], "old")
    catalog.close()
    damage(l3_dir)
    index = l3_dir / "index"
    before = sha(index) if index.is_file() else sha(index / "data.mdb")
    slots_before = sha(l3_dir / "slots.bin")
    caplog.set_level(logging.WARNING, logger="tierkv")
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    assert store.stats()["failures"] == {"l3_damaged_index": lost}
    # Exposed to Prometheus: the blocks lost (0 where unknown) and, always 1, the damage itself.
    text = store.metrics.exposition()
    assert value(text, "tierkv_failures_total", tier="l3", reason="damaged_index") == lost
    assert value(text, "tierkv_failure_events_total", tier="l3", reason="damaged_index") == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "damaged_index" in warnings[0] and str(l3_dir) in warnings[0], warnings
    aside = check_fresh_l3(make_store, store, l3_dir, prompts, ["catalog", "index", "slots.bin"])
    assert not (l3_dir / "catalog").exists()  # no stale labels for blocks that are gone
    # Moved, never rewritten: the damaged bytes are all still there.
    moved = aside / "index"
    assert (sha(moved) if moved.is_file() else sha(moved / "data.mdb")) == before
    assert sha(aside / "slots.bin") == slots_before


def test_without_a_child_process_the_open_still_moves_a_damaged_index_aside(make_store, l3_dir, monkeypatch):
    """Where no interpreter can be started (embedded Python) the check runs in-process:
    what LMDB reports as damage is still moved aside."""
    prompts, _ = write_l3(make_store)
    header_garbage(l3_dir)
    monkeypatch.setattr(sys, "executable", "")
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    assert store.stats()["failures"] == {"l3_damaged_index": 0}
    check_fresh_l3(make_store, store, l3_dir, prompts, ["index", "slots.bin"])


_OPENER = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from _kv import LAYOUT, prompt, store_config
from tierkv.store import TierKVStore
store = TierKVStore(store_config(LAYOUT, 0, 64, sys.argv[1]), LAYOUT, l1_blocks=4)
hits = [store.lookup(prompt(300 + i, 4, LAYOUT), pin=False).num_blocks for i in range(3)]
print(json.dumps({"failures": store.stats()["failures"], "hits": hits, "used": store.l3.used}))
store.close()
"""


def open_in_child(l3_dir: Path) -> dict:
    res = subprocess.run([sys.executable, "-c", _OPENER, str(l3_dir), TESTS], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, f"the opener died ({res.returncode}): {res.stderr[-2000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def index_truncated_in_half(l3_dir: Path) -> None:
    data = l3_dir / "index" / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2)


def last_leaf_garbled(l3_dir: Path, keys: list[bytes]) -> None:
    """Zero the page flags of the leaf holding the greatest key: a cursor stepping onto it
    fails LMDB's assertion IS_LEAF and abort()s the process."""
    data = l3_dir / "index" / "data.mdb"
    raw = data.read_bytes()
    pages = {m.start() // 4096 for m in re.finditer(re.escape(max(keys)), raw)} - {0, 1}
    leaves = [p for p in pages if struct.unpack_from("<H", raw, p * 4096 + 10)[0] & 0x02]
    assert leaves, pages
    with open(data, "r+b") as fh:
        for page in leaves:
            fh.seek(page * 4096 + 10)
            fh.write(b"\0\0")


@pytest.mark.parametrize("damage", ["truncated_in_half", "last_leaf_garbled"])
def test_an_index_that_would_kill_its_reader_is_moved_aside(make_store, l3_dir, damage):
    if damage == "truncated_in_half":
        prompts, _ = write_l3(make_store)
        index_truncated_in_half(l3_dir)
        lost = 0
    else:
        # Enough records for several leaves, so that the damaged one is reached by stepping.
        from tierkv.tiers.disk import DiskTier

        prompts = [prompt(300 + i, 4, LAYOUT) for i in range(3)]
        tier = DiskTier(l3_dir, LAYOUT, L3_BLOCKS * 8)
        keys = [key_of("leaf", i) for i in range(300)]
        assert tier.put(keys, [block_for(k, LAYOUT) for k in keys]) == [True] * 300
        tier.close()
        last_leaf_garbled(l3_dir, keys)
        lost = 300
    seen = open_in_child(l3_dir)
    assert seen == {"failures": {"l3_damaged_index": lost}, "hits": [0, 0, 0], "used": 0}
    assert len(damaged_dirs(l3_dir)) == 1
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    assert store.stats()["failures"] == {}
    check_fresh_l3(make_store, store, l3_dir, prompts, ["index", "slots.bin"])


def test_a_truncated_slot_file_keeps_its_intact_blocks_and_drops_the_rest(make_store, l3_dir):
    prompts, slots = write_l3(make_store)
    cut = 5
    os.truncate(l3_dir / "slots.bin", cut * LAYOUT.block_bytes + 100)  # slot 5 is cut short
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    assert store.stats()["failures"] == {"l3_corrupt": 12 - cut}  # dropped at start, not read
    assert store.l3.used == cut and damaged_dirs(l3_dir) == []
    assert os.path.getsize(l3_dir / "slots.bin") == L3_BLOCKS * store.l3.stride  # grown back
    for p in prompts:
        keys = store.hash(p)
        intact = next((i for i, k in enumerate(keys) if slots[k] >= cut), 4)
        m = store.lookup(p)
        assert m.num_blocks == intact and load_exact(store, m)
        store.release(m)
    assert store.stats()["failures"] == {"l3_corrupt": 12 - cut}  # nothing read was bad


def test_records_past_the_slot_file_or_malformed_are_dropped_at_start(make_store, l3_dir):
    prompts, slots = write_l3(make_store)
    raw = struct.Struct("<IIQd").pack
    bogus = {
        key_of("bogus", "far"): raw(10_000, 0, 1, 0.0),                      # past the end of slots.bin
        key_of("bogus", "short"): b"abc",                                   # not a record
        key_of("bogus", "self"): raw(3, 1, 1, 0.0) + key_of("bogus", "self"),  # its own parent
    }
    put_records(l3_dir, bogus)
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    assert store.stats()["failures"] == {"l3_corrupt": 3}
    assert store.l3.contains(list(bogus)) == [False] * 3 and store.l3.used == 12
    for p in prompts:
        m = store.lookup(p)
        assert m.tiers == [Tier.L3] * 4 and load_exact(store, m)
        store.release(m)
    # No dropped record's slot was handed out again: the tier fills to exactly its 64 slots.
    fill = [key_of("fill", i) for i in range(L3_BLOCKS - 12)]
    assert store.l3.put(fill, [block_for(k, LAYOUT) for k in fill]) == [True] * len(fill)
    assert store.l3.put([key_of("fill", "one more")], [block_for(fill[0], LAYOUT)]) == [False]
    taken = sorted(r.slot for r in store.l3.records())
    assert taken == list(range(L3_BLOCKS))
    assert damaged_dirs(l3_dir) == []


def test_a_slot_file_that_is_not_a_file_is_moved_aside(make_store, l3_dir):
    prompts, _ = write_l3(make_store)
    os.unlink(l3_dir / "slots.bin")
    (l3_dir / "slots.bin").mkdir()
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    assert store.stats()["failures"] == {"l3_damaged_slots": 0}
    check_fresh_l3(make_store, store, l3_dir, prompts, ["index", "slots.bin"])


def test_configuration_errors_still_fail_at_start_and_move_nothing(make_store, l3_dir, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"user data")
    with pytest.raises(ValueError, match=r"^l3\.path: "):
        make_store(l1=4, l2=0, l3=L3_BLOCKS, path=a_file)
    assert a_file.read_bytes() == b"user data"
    write_l3(make_store)
    before = sha(l3_dir / "index" / "data.mdb")
    # Another layout's blocks are not damage: that layout opens its own directory under l3.path
    # (docs/design.md §2: a block is never read under another layout), the root is left alone.
    odd = make_store(l1=4, l2=0, l3=L3_BLOCKS, layout=ODD_LAYOUT)
    assert odd.l3.path == l3_dir / "layouts" / ODD_LAYOUT.fingerprint and odd.l3.used == 0
    odd.close()
    assert damaged_dirs(l3_dir) == [] and sha(l3_dir / "index" / "data.mdb") == before
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    with pytest.raises(ValueError, match=r"^l3\.path: "):
        make_store(l1=4, l2=0, l3=L3_BLOCKS)  # already open in this process
    assert store.l3.used == 12 and store.stats()["failures"] == {}
    assert damaged_dirs(l3_dir) == []


_RACER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
from _kv import LAYOUT, prompt, save_prompt, store_config
from tierkv.store import TierKVStore
go, seed = sys.argv[3], int(sys.argv[4])
open(go + f".ready{seed}", "w").close()
while not os.path.exists(go):
    time.sleep(0.002)
store = TierKVStore(store_config(LAYOUT, 0, 64, sys.argv[1]), LAYOUT, l1_blocks=4)
tokens = prompt(seed, 4, LAYOUT)
save_prompt(store, tokens)
written = store.persist(store.hash(tokens))
print(json.dumps({"failures": store.stats()["failures"], "written": written}))
store.close()
"""


def test_two_processes_starting_on_one_damaged_directory_move_it_aside_once(make_store, l3_dir, tmp_path):
    prompts, _ = write_l3(make_store)
    header_garbage(l3_dir)  # found by the child-process check: the window where both see damage is widest
    go = str(tmp_path / "go")
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(l3_dir), TESTS, go, str(seed)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (401, 402)]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{go}.ready{seed}") for seed in (401, 402)) and time.monotonic() < deadline:
        time.sleep(0.01)
    Path(go).touch()  # both start their stores at once
    seen = []
    for proc in racers:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        seen.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(json.dumps(s["failures"]) for s in seen) == ['{"l3_damaged_index": 0}', "{}"]
    assert [s["written"] for s in seen] == [4, 4]
    assert len(damaged_dirs(l3_dir)) == 1
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    for seed in (401, 402):
        m = store.lookup(prompt(seed, 4, LAYOUT))
        assert m.tiers == [Tier.L3] * 4 and load_exact(store, m)
        store.release(m)
    assert [store.lookup(p, pin=False).num_blocks for p in prompts] == [0, 0, 0]
    assert store.stats()["failures"] == {} and len(damaged_dirs(l3_dir)) == 1


def test_another_process_shares_the_recreated_directory_with_the_one_that_moved_it(make_store, l3_dir):
    write_l3(make_store)
    header_garbage(l3_dir)
    store = make_store(l1=4, l2=0, l3=L3_BLOCKS)
    assert store.stats()["failures"] == {"l3_damaged_index": 0}
    for seed in (11, 12):
        tokens = prompt(seed, 4, LAYOUT)
        save_prompt(store, tokens)
        store.persist(store.hash(tokens))
    # While this store runs, another process opens the directory: no second move, and each
    # sees the other's blocks (one index, not two).
    seen = _workers.run("l3_lookup", path=str(l3_dir), seeds=[11, 12], num_blocks=4)
    for seed in ("11", "12"):
        assert seen[seed] == {"tiers": [Tier.L3] * 4, "num_ok": 4, "correct": True}
    assert seen["stats"]["failures"] == {}
    _workers.run("l3_save", path=str(l3_dir), seeds=[13], num_blocks=4)
    m = store.lookup(prompt(13, 4, LAYOUT))
    assert m.tiers == [Tier.L3] * 4 and load_exact(store, m)
    store.release(m)
    assert len(damaged_dirs(l3_dir)) == 1


def test_offline_tools_get_an_error_naming_the_path_and_nothing_is_moved(tmp_path):
    """``create=False`` (``tierkv ls``/``verify``/``export``) reports damage instead of moving files."""
    from tierkv.tiers.disk import DiskTier

    path = tmp_path / "l3"
    tier = DiskTier(path, LAYOUT, 8)
    tier.put([key_of("offline")], [block_for(key_of("offline"), LAYOUT)])
    tier.close()
    header_garbage(path)
    before = sha(path / "index" / "data.mdb")
    with pytest.raises(ValueError, match=r"^l3\.path: .* is damaged \(InvalidError: .*moves the damaged files aside"):
        DiskTier(path, LAYOUT, 8, create=False)
    assert damaged_dirs(path) == [] and sha(path / "index" / "data.mdb") == before
