"""The engine on the real SmolLM2-135M-Instruct: equal to transformers, and to itself from every tier.

fp32 throughout. Prompts are chats rendered with the model's own chat template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import smollm2_dir  # noqa: E402,F401  (fixture)
from _servers import redis_server  # noqa: E402,F401  (fixture)
from engine_helpers import engine_logits, hf_logits  # noqa: E402

from tierkv.config import L2Config, L3Config, L4Config, StoreConfig  # noqa: E402
from tierkv.engine import LLM, EngineConfig, SamplingParams  # noqa: E402

import transformers  # noqa: E402

SYSTEM = ("You are a concise assistant for a European travel agency. Answer in one or two sentences, "
          "name the city or country you mean, and never invent prices. The agency covers France, Italy, "
          "Spain, Portugal, Germany and the Netherlands; it books trains, hotels and museum tickets, "
          "and it can advise on the best season to travel and on local food.")
QUESTIONS = ("What is the capital of France?", "Which Italian city is famous for its canals?",
             "What food is Spain known for?")
GREEDY = SamplingParams(max_tokens=24)


def chat_ids(model_dir: Path, question: str) -> list[int]:
    from tokenizers import Tokenizer

    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    text = jinja2.Environment().from_string(tcfg["chat_template"]).render(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        add_generation_prompt=True)
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


@pytest.fixture(scope="module")
def chats(smollm2_dir) -> list[list[int]]:
    return [chat_ids(smollm2_dir, q) for q in QUESTIONS]


def engine(model_dir, store: StoreConfig, enable_cache: bool = True) -> LLM:
    return LLM(model_dir, store, EngineConfig(num_blocks=96, num_threads=1), enable_cache)


def local(l3: Path | None = None, l2: str | int = 0, **kw) -> StoreConfig:
    if l3 is None:
        return StoreConfig(l2=L2Config(capacity=l2), l3_enabled=False, **kw)
    return StoreConfig(l2=L2Config(capacity=l2), l3=L3Config(path=str(l3), capacity="128MiB"), **kw)


def cached_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // 16 * 16


def flush_l1(llm) -> None:
    llm.store.free(llm.store.allocate(llm.store.l1.capacity))
    assert llm.store.index.counts[0] == 0


@pytest.fixture(scope="module")
def baseline(smollm2_dir, chats) -> list[list[int]]:
    with engine(smollm2_dir, local(), enable_cache=False) as llm:
        outs = llm.generate(chats, GREEDY)
    assert "Paris" in outs[0].text  # a real model answering, not noise
    return [o.token_ids for o in outs]


def test_logits_match_transformers(smollm2_dir, chats):
    """Prefill logits and 20 greedy decode steps within 1e-4 of transformers (relative to the logit range)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    batch = [chats[0], chats[1][:40]]
    with engine(smollm2_dir, local(), enable_cache=False) as llm:
        ours, seqs = engine_logits(llm, batch, steps=20)
    for prompt, got, seq in zip(batch, ours, seqs):
        want = hf_logits(hf, seq[:-1])
        assert got.shape == want.shape == (len(prompt) + 20, 49152)
        scale = want.abs().max().item()
        assert scale > 10.0
        assert (got - want).abs().max().item() <= 1e-4 * scale
        assert seq[len(prompt):] == want[len(prompt) - 1:].argmax(-1).tolist()  # the same greedy path


def test_greedy_text_equals_transformers_generate(smollm2_dir, chats, baseline):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([chats[0]]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          eos_token_id=2, pad_token_id=2)
    assert out[0, len(chats[0]):].tolist() == baseline[0]


def test_l1_hits_give_the_same_text(smollm2_dir, chats, baseline):
    with engine(smollm2_dir, local()) as llm:
        assert [o.token_ids for o in llm.generate(chats, GREEDY)] == baseline
        warm = llm.generate(chats, GREEDY)
    assert [o.token_ids for o in warm] == baseline
    assert [o.hit_tokens["l1"] for o in warm] == [cached_tokens(c) for c in chats]


def test_l2_hits_give_the_same_text(smollm2_dir, chats, baseline):
    with engine(smollm2_dir, local(l2="96MiB")) as llm:
        llm.generate(chats, GREEDY)
        flush_l1(llm)
        warm = llm.generate(chats, GREEDY)
    assert [o.token_ids for o in warm] == baseline
    assert warm[0].hit_tokens["l2"] == cached_tokens(chats[0])
    assert all(sum(o.hit_tokens.values()) == cached_tokens(c) for o, c in zip(warm, chats))


def test_l3_hits_in_a_fresh_engine_give_the_same_text(smollm2_dir, chats, baseline, tmp_path):
    with engine(smollm2_dir, local(tmp_path / "l3")) as first:
        first.generate(chats, GREEDY)
        flush_l1(first)  # no L2: straight to disk
    with engine(smollm2_dir, local(tmp_path / "l3")) as llm:
        warm = llm.generate(chats, GREEDY)
    assert [o.token_ids for o in warm] == baseline
    assert warm[0].hit_tokens["l3"] == cached_tokens(chats[0])


def test_l4_redis_hits_give_the_same_text(smollm2_dir, chats, baseline, redis_server):
    cfg = local(l4=L4Config(url=redis_server.url, timeout_ms=5000))
    with engine(smollm2_dir, cfg) as first:
        first.generate(chats, GREEDY)
        flush_l1(first)  # no L2, no L3: demoted to redis; close() waits until the puts are sent
    with engine(smollm2_dir, cfg) as llm:
        warm = llm.generate(chats, GREEDY)
        assert llm.stats()["bytes"]["l4_read"] > 0
    assert [o.token_ids for o in warm] == baseline
    assert warm[0].hit_tokens["l4"] == cached_tokens(chats[0])


_CHILD = """
import json, sys
from tierkv.config import L2Config, L3Config, StoreConfig
from tierkv.engine import LLM, EngineConfig, SamplingParams
model_dir, l3, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = StoreConfig(l2=L2Config(capacity=0), l3=L3Config(path=l3, capacity="128MiB"))
with LLM(model_dir, cfg, EngineConfig(num_blocks=96, num_threads=1)) as llm:
    outs = llm.generate(prompts, SamplingParams(max_tokens=24))
print(json.dumps([[o.token_ids, o.hit_tokens] for o in outs]))
"""


def test_after_a_restart_l3_gives_the_same_text(smollm2_dir, chats, baseline, tmp_path):
    with engine(smollm2_dir, local(tmp_path / "l3")) as first:
        first.generate(chats, GREEDY)
        flush_l1(first)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(smollm2_dir), str(tmp_path / "l3"), json.dumps(chats)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "1"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r[0] for r in result] == baseline
    assert result[0][1]["l3"] == cached_tokens(chats[0])


@pytest.mark.parametrize("write", ["write_back", "write_through"])
def test_close_leaves_every_cached_block_in_l3_for_the_next_engine(smollm2_dir, chats, baseline, tmp_path,
                                                                   write):
    """L2 64 MiB, L3 256 MiB, the prompts run once and the engine closes with its blocks in L1 (and,
    under write-through, copied down already): the next engine hits every full block of each prompt
    in L3 and answers the same. Under the default write-back ``close`` writes them down (before it
    lost them all: 0 L3 hits on restart)."""
    from tierkv.config import PolicyConfig

    cfg = StoreConfig(l2=L2Config(capacity="64MiB"), l3=L3Config(path=str(tmp_path / "l3"), capacity="256MiB"),
                      policy=PolicyConfig(write=write))
    with engine(smollm2_dir, cfg) as first:
        first.generate(chats, GREEDY)
        if write == "write_back":
            assert first.store.l3.used == 0  # nothing was evicted: L3 would have nothing without close
    with engine(smollm2_dir, cfg) as again:
        outs = again.generate(chats, GREEDY)
    assert [o.token_ids for o in outs] == baseline
    for chat, out in zip(chats, outs):
        assert out.hit_tokens["l3"] + out.hit_tokens["l1"] == cached_tokens(chat)
    assert outs[0].hit_tokens["l3"] == cached_tokens(chats[0])
