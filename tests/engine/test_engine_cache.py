"""Prefix reuse through the store gives exactly the tokens of a cold run, from every tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_helpers import GREEDY, prompts, store_config


def cached_tokens(prompt: list[int]) -> int:
    """Prompt tokens a full hit serves: whole blocks, leaving the last token to compute."""
    return (len(prompt) - 1) // 16 * 16


def assert_hits(outs, tier: str) -> None:
    """The first request is served from ``tier`` alone; later ones may already find the
    shared prefix back in L1 (adopted from the first one's load), but all are fully served."""
    assert outs[0].hit_tokens[tier] == cached_tokens(outs[0].prompt_token_ids)
    for o in outs:
        assert o.hit_tokens[tier] > 0
        assert sum(o.hit_tokens.values()) == cached_tokens(o.prompt_token_ids)


def flush_l1(llm) -> None:
    """Demote every cached L1 block one tier down (allocating all of L1 evicts them)."""
    slots = llm.store.allocate(llm.store.l1.capacity)
    llm.store.free(slots)
    assert llm.store.index.counts[0] == 0


@pytest.fixture(scope="module")
def baseline(tiny_dir) -> list[list[int]]:
    from tierkv.engine import LLM, EngineConfig

    with LLM(tiny_dir, store_config(None), EngineConfig(num_blocks=128, num_threads=1), enable_cache=False) as llm:
        outs = llm.generate(prompts(), GREEDY)
        assert all(sum(o.hit_tokens.values()) == 0 for o in outs)
        assert llm.store.index.counts == [0, 0, 0]  # the no-cache engine never saved a block
        return [o.token_ids for o in outs]


def test_cold_and_l1_hits_match_no_cache(make_llm, baseline):
    llm = make_llm(store_config(None))
    cold = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in cold] == baseline
    # The shared 32-token prefix is computed once the first prompt saved it; batch-mates arrive together.
    assert all(o.hit_tokens["l1"] == 0 for o in cold)
    warm = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in warm] == baseline
    for o in warm:
        assert o.hit_tokens["l1"] == cached_tokens(o.prompt_token_ids)
        assert o.ttft_s is not None and o.ttft_s > 0


def test_l2_hits_match_no_cache(make_llm, baseline):
    llm = make_llm(store_config(None, l2="8MiB"))
    llm.generate(prompts(), GREEDY)
    flush_l1(llm)
    warm = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in warm] == baseline
    assert_hits(warm, "l2")
    stats = llm.stats()
    assert stats["load_count"] >= 1 and stats["bytes"]["l2_read"] > 0


def test_l3_hits_in_a_fresh_engine_match_no_cache(make_llm, baseline, tmp_path):
    first = make_llm(store_config(tmp_path / "l3", l2=0))
    first.generate(prompts(), GREEDY)
    flush_l1(first)  # no L2: L1 demotes straight to disk
    first.close()
    llm = make_llm(store_config(tmp_path / "l3", l2=0))
    warm = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in warm] == baseline
    assert_hits(warm, "l3")


def test_corrupt_l3_block_is_recomputed(make_llm, baseline, tmp_path):
    first = make_llm(store_config(tmp_path / "l3", l2=0))
    first.generate(prompts(), GREEDY)
    flush_l1(first)
    # Corrupt block 1 of the shared prefix: every prompt loads block 0 and recomputes from block 1.
    key = first.store.hash(prompts()[0])[1]
    slot = next(rec.slot for rec in first.store.l3.records() if rec.key == key)
    stride = first.store.l3.stride
    first.close()
    with open(tmp_path / "l3" / "slots.bin", "r+b") as fh:
        fh.seek(slot * stride)
        fh.write(b"\xff" * 4096)
    llm = make_llm(store_config(tmp_path / "l3", l2=0))
    warm = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in warm] == baseline
    assert llm.stats()["failures"].get("l3_corrupt", 0) >= 1
    assert warm[0].hit_tokens["l3"] == 16 and all(sum(o.hit_tokens.values()) == 16 for o in warm)


_CHILD = """
import json, sys
from tierkv.config import L2Config, L3Config, StoreConfig
from tierkv.engine import LLM, EngineConfig, SamplingParams
model_dir, l3, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = StoreConfig(l2=L2Config(capacity=0), l3=L3Config(path=l3, capacity="16MiB"))
with LLM(model_dir, cfg, EngineConfig(num_blocks=128, num_threads=1)) as llm:
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
print(json.dumps([[o.token_ids, o.hit_tokens] for o in outs]))
"""


def test_l3_hits_after_process_restart(make_llm, baseline, tmp_path, tiny_dir):
    first = make_llm(store_config(tmp_path / "l3", l2=0))
    first.generate(prompts(), GREEDY)
    flush_l1(first)
    first.close()
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tiny_dir), str(tmp_path / "l3"), json.dumps(prompts())],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r[0] for r in result] == baseline
    assert result[0][1]["l3"] == cached_tokens(prompts()[0])
    assert all(r[1]["l3"] > 0 for r in result)


def test_namespaces_do_not_share_blocks(make_llm, baseline):
    llm = make_llm(store_config(None))
    llm.generate(prompts(), GREEDY, namespace="tenant-a")
    other = llm.generate(prompts(), GREEDY, namespace="tenant-b")
    assert [o.token_ids for o in other] == baseline
    assert all(o.hit_tokens["l1"] == 0 for o in other[:1])


def test_write_through_saves_reach_l3_without_eviction(make_llm, baseline, tmp_path):
    import dataclasses

    from tierkv.config import PolicyConfig

    cfg = dataclasses.replace(store_config(tmp_path / "l3", l2=0), policy=PolicyConfig(write="write_through"))
    first = make_llm(cfg)
    first.generate(prompts(), GREEDY)
    first.store.flush()
    assert first.store.l3.used > 0 and first.store.index.counts[0] > 0  # copied down, still in L1
    first.close()
    warm = make_llm(cfg).generate(prompts(), GREEDY)
    assert [o.token_ids for o in warm] == baseline
    assert_hits(warm, "l3")


def test_a_prompt_waits_for_write_through_copies_that_pin_l1(make_llm, tmp_path) -> None:
    """Write-through pins a finished prompt's L1 blocks until their copies land. With L1 too small
    for the next prompt beside them, the engine waits for the copies (here held back 0.5 s behind a
    busy IO thread) instead of failing with "do not fit in L1"."""
    import dataclasses
    import threading

    from tierkv.config import PolicyConfig
    from tierkv.engine import SamplingParams

    cfg = dataclasses.replace(store_config(tmp_path / "l3", l2=0), policy=PolicyConfig(write="write_through"))
    llm = make_llm(cfg, num_blocks=10)
    first, second = prompts(2, base=90, seed=3)  # 6 blocks each with their output: 12 > 10
    gate = threading.Event()
    llm.store.transfer.io(gate.wait, 30)
    llm.generate([first], SamplingParams(max_tokens=4))
    assert llm.store.mover.queued  # its copies wait behind the gate, its blocks pinned
    threading.Timer(0.5, gate.set).start()
    out = llm.generate([second], SamplingParams(max_tokens=4))[0]
    assert len(out.token_ids) == 4 and gate.is_set()


def test_the_step_is_the_stores_foreground_work(make_llm) -> None:
    """Every forward runs inside ``store.foreground()``, so background IO is paced around it."""
    llm = make_llm()
    seen = []
    run = llm.runner.run

    def watched(batch):
        seen.append(llm.store.pacer.open_sections())
        return run(batch)

    llm.runner.run = watched
    llm.generate([prompts(1)[0]], GREEDY)
    assert seen and all(n == 1 for n in seen)
    assert llm.store.pacer.open_sections() == 0


def test_a_finished_sequence_tells_the_store_its_output_length(make_llm) -> None:
    """The eviction hint: a sequence's blocks take the band of the tokens it generated."""
    from tierkv.policy.hit_density import BANDS, block_class, output_band

    llm = make_llm()
    out = llm.generate([prompts(1)[0]], GREEDY)[0]
    keys = [k for k in llm.store.hash(out.prompt_token_ids + out.token_ids) if llm.store.index.get(k)]
    assert keys
    band = output_band(len(out.token_ids))
    assert {block_class(llm.store.index.get(k)) % BANDS for k in keys} == {band}
