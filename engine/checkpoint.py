"""Write a seeded random Llama checkpoint in Hugging Face's on-disk format.

``python -m tierkv.engine.checkpoint DIR --preset tiny|small`` writes
``config.json`` and ``model.safetensors`` (or shards plus
``model.safetensors.index.json`` with ``--shards N``), so tests and benchmarks
always go through the real loader. ``tiny`` (~0.8M parameters, GQA 8:2) is for
tests; ``small`` (~57M parameters, GQA 8:2, 32k vocabulary) for demos and
benchmarks. The same seed always gives the same bytes. Weights are drawn wider
than a trained model's (``initializer_range`` 0.1 / 0.05) so that greedy
outputs depend on the whole context instead of repeating one token: a test
that compares outputs then notices a wrong KV block.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                 initializer_range=0.1),
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                  initializer_range=0.05),
}
_BASE: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
    rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    torch_dtype="float32", bos_token_id=1, eos_token_id=2, initializer_range=0.02,
)


def make_config(preset: str, **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` dict of ``preset`` with ``overrides`` applied."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    return {**_BASE, **PRESETS[preset], **overrides}


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named Llama weights drawn from N(0, initializer_range²); norms are ones."""
    gen = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    out = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal(q_out, hidden)
        out[p + "self_attn.k_proj.weight"] = normal(kv_out, hidden)
        out[p + "self_attn.v_proj.weight"] = normal(kv_out, hidden)
        out[p + "self_attn.o_proj.weight"] = normal(hidden, q_out)
        out[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        out[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        out[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        out[p + "input_layernorm.weight"] = torch.ones(hidden)
        out[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    out["model.norm.weight"] = torch.ones(hidden)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = normal(cfg["vocab_size"], hidden)
    return out


def num_parameters(cfg: dict[str, Any]) -> int:
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    attn = 2 * hidden * cfg["num_attention_heads"] * d + 2 * hidden * cfg["num_key_value_heads"] * d
    layer = attn + 3 * hidden * inter + 2 * hidden
    heads = vocab * hidden * (1 if cfg["tie_word_embeddings"] else 2)
    return cfg["num_hidden_layers"] * layer + heads + hidden


def write_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, shards: int = 1,
                     **overrides: Any) -> Path:
    """Write ``config.json`` and the weights of ``preset`` into ``out_dir``; returns the directory."""
    from safetensors.torch import save_file

    if shards < 1:
        raise ValueError(f"shards: expected an integer >= 1, got {shards!r}")
    cfg = make_config(preset, **overrides)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    dtype = getattr(torch, cfg["torch_dtype"])
    weights = {k: v.to(dtype).contiguous() for k, v in random_weights(cfg, seed).items()}
    if shards == 1:
        save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = list(weights)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, str(root / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return root


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tierkv.engine.checkpoint", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="output directory (created if missing)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    path = write_checkpoint(args.dir, args.preset, args.seed, args.shards, torch_dtype=args.dtype)
    print(f"wrote {args.preset} checkpoint ({num_parameters(make_config(args.preset)) / 1e6:.1f}M parameters) to {path}")


if __name__ == "__main__":
    main()
