"""The engine's Llama matches transformers' LlamaForCausalLM on the same checkpoint (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tierkv.engine.checkpoint import write_checkpoint
from tierkv.engine.loader import weight_files

from engine_helpers import engine_logits, hf_logits, prompts

transformers = pytest.importorskip("transformers")


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
