"""Two engines ("nodes") sharing one L4 pool: node B's greedy output equals node A's, served from L4."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tierkv.engine as engine
from tierkv.config import L2Config, L3Config, L4Config, StoreConfig

pytestmark = pytest.mark.timeout(180)
BLOCK = 16


@pytest.fixture(params=["redis", "mooncake"])
def pool(request):
    return request.getfixturevalue("redis_server" if request.param == "redis" else "mooncake_pool")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("remote-ckpt") / "tiny"
    subprocess.run([sys.executable, "-m", "tierkv.engine.checkpoint", str(out), "--preset", "tiny"],
                   check=True, capture_output=True, timeout=120)
    return out


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(7)
    shared = [rng.randrange(3, 256) for _ in range(2 * BLOCK)]
    return [shared + [rng.randrange(3, 256) for _ in range(20 + 11 * i)] for i in range(3)]


def test_node_b_greedy_output_equals_node_a_from_l4(pool, tiny_checkpoint, tmp_path):
    params = engine.SamplingParams(max_tokens=10, ignore_eos=True)
    cfg = engine.EngineConfig(num_blocks=64, num_threads=1, block_size=BLOCK)
    l4 = L4Config(url=pool.url, timeout_ms=2000)
    # Node A: L1 and L4 only, so every block it evicts from L1 goes to the pool.
    with engine.LLM(tiny_checkpoint, StoreConfig(l2=L2Config(capacity=0), l3_enabled=False, l4=l4), cfg) as a:
        outs_a = a.generate(prompts(), params)
        a.store.free(a.store.allocate(a.store.l1.capacity))
        a.store.transfer.io(lambda: None).result(timeout=60)  # the L4 puts queued by the eviction
        assert a.stats()["bytes"].get("l4_write", 0) > 0
    # Node B: its own L2 and L3 directory, the same pool.
    cfg_b = StoreConfig(l2=L2Config(capacity="4MiB"), l3=L3Config(path=str(tmp_path / "b-l3"), capacity="8MiB"),
                        l4=l4)
    with engine.LLM(tiny_checkpoint, cfg_b, cfg) as b:
        outs_b = b.generate(prompts(), params)
        assert [o.token_ids for o in outs_b] == [o.token_ids for o in outs_a]
        assert outs_b[0].hit_tokens["l4"] == (len(outs_b[0].prompt_token_ids) - 1) // BLOCK * BLOCK
        assert b.stats()["l4"]["hits"] > 0
