"""The offline commands on a damaged L3 directory, and `tierkv info` on what starts moved aside.

The directory is written by a real store (``populate``) and damaged with file
operations or a real LMDB write; the commands run in their own processes, so a
reader killed by LMDB shows as a negative exit status instead of killing pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import lmdb
import pytest
from cli_helpers import LAYOUT, cache, populate, run_tierkv, store_config  # noqa: F401  (fixtures)

from tierkv import TierKVStore
from tierkv.cli.common import human_bytes


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_truncated_index_is_one_error_naming_the_path_not_a_crash(cache, tmp_path):
    """Cut after its two header pages, the index's tree is past the end of the file: LMDB
    reading the meta table there dies of SIGBUS (exit -7 before the check existed)."""
    populate(cache)
    l3 = cache / "l3"
    data = l3 / "index" / "data.mdb"
    os.truncate(data, 2 * 4096)
    before = sha(data)
    for cmd in (["ls"], ["info"], ["verify"], ["export", str(tmp_path / "snap.tar")]):
        r = run_tierkv(*cmd, "--cache-dir", str(cache))
        assert r.code == 1, (cmd, r.code, r.err[-2000:])
        assert r.err.startswith(f"error: l3.path: {l3} is damaged (index/data.mdb is truncated: 8192 bytes, "), r.err
        assert r.err.rstrip().endswith("a store started on it moves the damaged files aside"), r.err
        assert r.err.count("\n") == 1 and "Traceback" not in r.err
    # An offline command never moves or rewrites the damaged files.
    assert sha(data) == before and sorted(p.name for p in l3.iterdir()) == ["catalog", "index", "open.lock",
                                                                             "slots.bin"]
    assert not (tmp_path / "snap.tar").exists()


def test_an_unreadable_layout_record_is_one_error_naming_the_path(cache):
    populate(cache)
    l3 = cache / "l3"
    env = lmdb.open(str(l3 / "index"), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"layout", b"{'num_layers': 2, garbage", db=env.open_db(b"meta", txn=txn))
    env.close()
    r = run_tierkv("ls", "--cache-dir", str(cache))
    assert r.code == 1, r.err
    assert r.err.strip() == (f"error: l3.path: {l3} is damaged (meta record 'layout' is unreadable: "
                             "\"{'num_layers': 2, garbage\"); a store started on it moves the damaged files aside")


def test_info_lists_the_directories_damaged_files_were_moved_into(cache):
    populate(cache)
    l3 = cache / "l3"
    r = run_tierkv("info", "--json", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    assert r.json()["tiers"]["l3"]["damaged"] == {"count": 0, "bytes": 0, "dirs": []}
    assert "damaged" not in run_tierkv("info", "--cache-dir", str(cache)).out
    for _ in range(2):  # two starts on a damaged index: two directories
        with open(l3 / "index" / "data.mdb", "r+b") as fh:
            fh.write(bytes(range(256)) * 32)  # both header pages
        store = TierKVStore(store_config(cache), LAYOUT, l1_blocks=0)
        assert store.stats()["failures"] == {"l3_damaged_index": 0}
        store.close()
    aside = sorted(p for p in l3.iterdir() if p.name.startswith("damaged-"))
    assert len(aside) == 2
    total = sum(f.stat().st_size for d in aside for f in d.rglob("*") if f.is_file())
    assert total > 0
    r = run_tierkv("info", "--json", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    l3_info = r.json()["tiers"]["l3"]
    assert l3_info["damaged"] == {"count": 2, "bytes": total, "dirs": [p.name for p in aside]}
    assert l3_info["present"] and l3_info["used_blocks"] == 0  # the fresh L3 the second start left
    r = run_tierkv("info", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    line = next(x for x in r.out.splitlines() if "damaged" in x)
    assert line == (f"l3: 2 directories of damaged files moved aside at start ({human_bytes(total)}) in {l3}: "
                    f"{aside[0].name}, {aside[1].name}; delete them once inspected")


def test_evict_all_clears_a_damaged_directory(cache):
    # --all exists to clear L3: damage must not stand in its way (it used to be the one error).
    populate(cache)
    l3 = cache / "l3"
    os.truncate(l3 / "index" / "data.mdb", 2 * 4096)
    r = run_tierkv("evict", "--all", "--json", "--cache-dir", str(cache))
    assert r.code == 0, r.err
    report = r.json()
    assert report["removed"] == 0 and report["left"] == 0 and "is damaged" in report["damaged"]
    assert sorted(p.name for p in l3.iterdir()) == ["open.lock"]
    # The directory is usable again at once: a store fills it without moving anything aside.
    store = TierKVStore(store_config(cache), LAYOUT, l1_blocks=0)
    assert store.stats()["failures"] == {} and store.l3.used == 0
    store.close()
    r = run_tierkv("ls", "--cache-dir", str(cache))
    assert r.code == 0, r.err


@pytest.mark.slow
def test_run_on_a_damaged_l3_moves_it_aside_and_completes(cache, tmp_path):
    """`tierkv run` is the one command that starts a store: the damage is moved aside, not an error."""
    populate(cache)
    l3 = cache / "l3"
    os.truncate(l3 / "index" / "data.mdb", 2 * 4096)
    out = tmp_path / "run.json"
    r = run_tierkv("run", "--quick", "--model", "tiny", "--json", str(out), "--cache-dir", str(cache),
                   env={"TIERKV_L3_CAPACITY": "256MiB"}, timeout=600)
    assert r.code == 0, r.err[-2000:]
    fresh, restarted = json.loads(out.read_text())["passes"]
    assert fresh["hit_tokens_by_tier"]["l3"] == 0 and restarted["hit_tokens_by_tier"]["l3"] > 0
    aside = [p for p in l3.iterdir() if p.name.startswith("damaged-")]
    assert len(aside) == 1 and (aside[0] / "index" / "data.mdb").stat().st_size == 2 * 4096
