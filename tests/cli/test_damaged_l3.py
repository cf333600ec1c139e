"""The offline commands on a damaged L3 directory, through the real `tierkv` command.

The directory is written by a real store (``populate``) and damaged with file
operations or a real LMDB write; the commands run in their own processes, so a
reader killed by LMDB shows as a negative exit status instead of killing pytest.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import lmdb
from cli_helpers import cache, populate, run_tierkv  # noqa: F401  (fixtures)


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
