"""tools/tracegen.py: seeded Mooncake-format traces whose shared prefixes mean shared content."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _env import ROOT, load_tool

tracegen = load_tool("tracegen")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_same_seed_same_trace_other_seed_other_trace(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    tracegen.write(tracegen.generate("mixed", 3, 400), a)
    tracegen.write(tracegen.generate("mixed", 3, 400), b)
    tracegen.write(tracegen.generate("mixed", 4, 400), c)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("workload", tracegen.WORKLOADS)
def test_rows_are_mooncake_format_in_time_order(tmp_path, workload):
    path = tmp_path / "t.jsonl"
    tracegen.write(tracegen.generate(workload, 1, 300), path)
    data = rows(path)
    assert len(data) == 300
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in data)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in data)
    stamps = [r["timestamp"] for r in data]
    assert stamps == sorted(stamps) and all(r["output_length"] >= 1 for r in data)


def test_a_chat_turn_extends_the_previous_turn_and_scans_share_nothing():
    reqs = tracegen.generate("chat", 2, 2000)
    ids = tracegen.BlockIds()
    rendered = [(r, ids.render(r.segments)[0]) for r in reqs]
    by_session: dict[object, list[list[int]]] = {}
    seen_scan: set[int] = set()
    for r, hash_ids in rendered:
        first = r.segments[-1][0]
        if first[0] == "scan":
            assert not seen_scan & set(hash_ids)
            seen_scan |= set(hash_ids)
            continue
        by_session.setdefault(first[0], []).append(hash_ids)
    multi = [turns for turns in by_session.values() if len(turns) > 2]
    assert len(multi) > 50
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:]):
            full = prev[:-1]  # the last block may be partial: it matches nothing later
            assert nxt[: len(full)] == full and len(nxt) >= len(prev)


def test_equal_streams_get_equal_ids_and_a_partial_block_its_own():
    ids = tracegen.BlockIds()
    a, n = ids.render([("sys", 700), ("q1", 400)])
    b, _ = ids.render([("sys", 700), ("q2", 400)])
    c, _ = ids.render([("sys", 700), ("q1", 400), ("more", 1)])
    assert n == 1100 and len(a) == 3
    assert a[0] == b[0] and a[1] != b[1]      # block 1 holds sys's tail and the question
    assert c[:2] == a[:2] and c[2] != a[2]    # a's partial block 2 is not c's


def test_command_line_and_bad_arguments(tmp_path):
    out = tmp_path / "t.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tracegen.py"), "--workload", "rag", "--seed", "5",
                           "--requests", "50", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "50 requests" in proc.stdout and len(rows(out)) == 50
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tracegen.py"), "--requests", "0", "--out",
                           str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "requests: expected >= 1, got 0" in proc.stderr
    with pytest.raises(ValueError, match=r"^workload: expected one of"):
        tracegen.generate("batch", 0, 10)
