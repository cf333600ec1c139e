"""bench/fleet_real.py's trace-to-prompt mapping (no servers): shared trace blocks give shared token
prefixes exactly, and nothing else does, so the real nodes' hits are the trace's prefix reuse."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fleet_real  # noqa: E402

from tools.fleet import Request, scale_keys  # noqa: E402


def _request(hash_ids: list[int], n_tokens: int, at: float = 0.0) -> Request:
    keys = scale_keys([i.to_bytes(8, "little") for i in hash_ids], 1, n_tokens // 16)
    return Request(at, n_tokens, keys, 4)


def test_shared_trace_blocks_share_exactly_their_tokens():
    a, b, c = _request([1, 2, 3], 40), _request([1, 2, 7], 48), _request([9, 2, 3], 40)
    pa, pb, pc = (fleet_real.prompt_ids(r, i) for i, r in enumerate((a, b, c)))
    assert (len(pa), len(pb), len(pc)) == (40, 48, 40)
    assert pa[:32] == pb[:32] and pa[32:40] != pb[32:40]  # blocks 1, 2 shared; then b's own block 7
    assert pa[:16] != pc[:16]  # a different first block: no shared prefix (the chained key differs too)
    assert fleet_real.prompt_ids(a, 0) == pa  # deterministic
    assert all(fleet_real.VOCAB[0] <= t < fleet_real.VOCAB[1] for t in pa + pb + pc)


def test_reuse_ceiling_counts_leading_blocks_seen_before():
    rs = [_request([1, 2, 3], 48), _request([1, 2, 4], 48), _request([5, 2], 32), _request([1, 2, 3], 48)]
    assert fleet_real.reuse_ceiling(rs) == (0 + 2 + 0 + 3) / 11
