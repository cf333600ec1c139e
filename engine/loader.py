"""Load a local Hugging Face Llama directory: ``config.json`` plus ``*.safetensors``.

Single files and sharded checkpoints (``model.safetensors.index.json``) both
load through ``safetensors``; nothing is downloaded. Hugging Face's separate
q/k/v and gate/up matrices are fused into the engine's ``qkv_proj`` and
``gate_up_proj`` on the way in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tierkv.identity import ModelIdentity, weights_digest

from tierkv.engine.models.llama import LlamaConfig, LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}
_PLAIN = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight")


def read_config(model_dir: str | Path, hf_overrides: Mapping[str, Any] | None = None) -> LlamaConfig:
    """The model's config: ``config.json`` with ``hf_overrides`` (top-level keys replaced) applied."""
    return LlamaConfig.from_hf(effective_config(model_dir, hf_overrides))


def effective_config(model_dir: str | Path, hf_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` as a dict, with ``hf_overrides``' top-level keys replacing its own."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model_dir: no config.json in {model_dir}")
    raw = json.loads(path.read_text())
    if hf_overrides:
        raw.update(hf_overrides)
    return raw


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors shards of ``model_dir``, from the index file when there is one."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_dir: no *.safetensors in {model_dir}")
    return files


def engine_identity(model_dir: str | Path, dtype: str, kv_dtype: str,
                    hf_overrides: Mapping[str, Any] | None = None) -> ModelIdentity:
    """What fixes the KV this engine computes from ``model_dir``: the full content of every weight
    file (remembered per file by stat, ``identity.file_digests``), the effective config
    (``config.json`` + ``hf_overrides``: rope, head sizes, norms, sliding window...), the weight and
    KV dtypes, and the runtime (another runtime's kernels round differently)."""
    return ModelIdentity.of({
        "weights": weights_digest(weight_files(model_dir)),
        "config": effective_config(model_dir, hf_overrides),
        "hf_overrides": dict(hf_overrides or {}),
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "runtime": "tierkv.engine",
    })


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               hf_overrides: Mapping[str, Any] | None = None) -> LlamaForCausalLM:
    """Build the model from ``model_dir`` (config overridden by ``hf_overrides``) in ``dtype`` on
    ``device``, in eval mode, no grads."""
    from safetensors.torch import load_file

    cfg = read_config(model_dir, hf_overrides)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        tensors.update(load_file(str(f)))
    state = _to_engine_names(tensors, cfg)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gave lm_head a storage of its own: share embed_tokens' again
        model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, _ in model.named_parameters() if n not in state]
    if missing:
        raise ValueError(f"model_dir: checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    model.to(device=device, dtype=dtype)
    model.rotary.reset(device)
    return model.eval().requires_grad_(False)


def _to_engine_names(tensors: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list] = {}
    for name, t in tensors.items():
        m = _LAYER.match(name)
        if m:
            layer, rest = m.groups()
            prefix = f"layers.{layer}."
            if rest in _FUSED:
                target, i = _FUSED[rest]
                parts.setdefault(prefix + target, [None] * (3 if "qkv" in target else 2))[i] = t
            elif rest in _PLAIN:
                out[prefix + rest] = t
        elif name == "model.embed_tokens.weight":
            out["embed_tokens.weight"] = t
        elif name == "model.norm.weight":
            out["norm.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
    for target, pieces in parts.items():
        if any(p is None for p in pieces):
            raise ValueError(f"model_dir: checkpoint has only some of the matrices fused into {target}")
        out[target] = torch.cat(pieces, dim=0)
    if "lm_head.weight" not in out and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out
