"""The engine's Llama matches transformers' LlamaForCausalLM on the same checkpoint (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tierkv.engine.checkpoint import write_checkpoint
from tierkv.engine.kv_cache import KVCacheManager
from tierkv.engine.loader import weight_files
from tierkv.engine.scheduler import Scheduled
from tierkv.engine.sequence import Sequence

from engine_helpers import GREEDY, prompts

transformers = pytest.importorskip("transformers")


def engine_logits(llm, batch_prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt, logits of every prompt position then of ``steps`` greedy decode steps (all
    prompts in one batch), and each prompt's tokens after those steps."""
    kv = KVCacheManager(llm.store, enable_cache=False)
    seqs = [Sequence(p, GREEDY, None, 10_000) for p in batch_prompts]
    for seq in seqs:
        assert kv.admit(seq)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    batch = [Scheduled(s, s.num_tokens) for s in seqs]
    for step in range(steps + 1):
        logits = llm.runner.logits(batch)
        starts = [0]
        for item in batch:
            starts.append(starts[-1] + item.num_tokens)
        for i, item in enumerate(batch):
            rows[i].append(logits[starts[i]:starts[i + 1]])
            item.seq.num_computed += item.num_tokens
            item.seq.token_ids.append(int(logits[starts[i + 1] - 1].argmax()))
            assert kv.ensure_slots(item.seq, item.seq.num_tokens)
        batch = [Scheduled(s, 1) for s in seqs]
    for seq in seqs:
        kv.release(seq)
    return [torch.cat(r) for r in rows], [s.token_ids for s in seqs]


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


@pytest.mark.parametrize("variant", ["gqa", "llama3_tied_sharded"])
def test_logits_match_transformers(tmp_path, make_llm, variant):
    if variant == "gqa":
        model_dir = write_checkpoint(tmp_path / "m", "tiny", seed=3)
    else:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        model_dir = write_checkpoint(tmp_path / "m", "tiny", seed=4, shards=3, rope_scaling=scaling,
                                     tie_word_embeddings=True, rope_theta=500000.0)
        assert len(weight_files(model_dir)) == 3
    llm = make_llm(model_dir=model_dir, num_blocks=64)
    assert (llm.model_config.num_attention_heads, llm.model_config.num_key_value_heads) == (8, 2)
    batch = [p[:n] for p, n in zip(prompts(4, 20), (5, 37, 16, 70))]
    ours, sequences = engine_logits(llm, batch, steps=20)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for prompt, got, seq in zip(batch, ours, sequences):
        assert got.shape[0] == len(prompt) + 20
        want = hf_logits(hf, seq[:-1])
        assert want.abs().max().item() > 1.0  # the comparison is not between two near-zero tensors
        assert (got - want).abs().max().item() <= 1e-4
