"""Real model weights for tests: the pulled SmolLM2 directory, and tiny GGUF files written here.

Use the fixture from any test directory with ``pytest_plugins = ["_models"]`` in a
test module (tests/ is on sys.path via tests/conftest.py) or ``from _models import
smollm2_dir``. ``smollm2_dir`` pulls ``smollm2-135m-instruct`` into the models
directory (``$TIERKV_MODELS_DIR`` or ``~/.cache/tierkv/models``) once: the first
pull on a machine converts the GGUF (~20 s), every later one returns at once.
It fails (never skips) when the weights cannot be had: `make setup` installs them.

``write_llama_gguf`` writes a complete small Llama GGUF (F32 weights, q/k rows in
llama.cpp's order, a byte-level vocabulary) from a Hugging Face state dict, so
the converter is checked against weights whose true layout the test knows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The pulled SmolLM2-135M-Instruct model directory (fp32 safetensors, tokenizer, chat template)."""
    from tierkv.models import pull

    return pull(SMOLLM2)


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's HF -> GGUF q/k row order (the inverse of ``gguf_convert.unpermute_rows``), written
    independently here from its definition: per head, row (half h, j) moves to (j, half h)."""
    rows, cols = w.shape
    d = rows // n_head
    out = torch.empty_like(w)
    for head in range(n_head):
        for h in range(2):
            for j in range(d // 2):
                out[head * d + 2 * j + h] = w[head * d + h * (d // 2) + j]
    return out


def byte_vocab() -> list[str]:
    """The 256 GPT-2 byte-level symbols (any order makes a valid base vocabulary)."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def write_llama_gguf(path: Path, cfg: dict, state: dict[str, torch.Tensor], arch: str = "llama",
                     raw_type=None) -> Path:
    """A GGUF of ``state`` (HF Llama names, fp32) with ``cfg``'s hyperparameters, under ``arch``.

    ``raw_type`` (a ``GGMLQuantizationType``) stores the first layer's attn_norm with that type
    instead of F32, to check the unsupported-type error.
    """
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    symbols = byte_vocab()
    extra = ["ab", "abc"]
    specials = [f"<|s{i}|>" for i in range(cfg["vocab_size"] - len(symbols) - len(extra))]
    w.add_token_list(symbols + extra + specials)
    w.add_token_types([1] * (len(symbols) + len(extra)) + [3] * len(specials))
    w.add_token_merges(["a b", "ab c"])
    w.add_bos_token_id(len(symbols) + len(extra))
    w.add_eos_token_id(len(symbols) + len(extra) + 1)
    w.add_chat_template("{% for m in messages %}<|s0|>{{ m['content'] }}<|s1|>{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in state.items():
        if name in names:
            gname = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{layer[rest]}"
        t = t.float()
        if gname.endswith("attn_q.weight"):
            t = permute_rows(t, cfg["num_attention_heads"])
        elif gname.endswith("attn_k.weight"):
            t = permute_rows(t, cfg["num_key_value_heads"])
        if raw_type is not None and gname == "blk.0.attn_norm.weight":
            w.add_tensor(gname, np.zeros(t.numel(), dtype=np.int32), raw_dtype=raw_type)
        else:
            w.add_tensor(gname, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fine_tune_in_place(model_dir: Path) -> None:
    """Rewrite the k_proj stored last in ``model_dir``'s safetensors file as a merged fine-tune would:
    same size, the first MiB untouched, other values (what a size + head fingerprint cannot see)."""
    import json

    from safetensors.torch import load_file, save_file

    f = next(Path(model_dir).glob("*.safetensors"))
    raw = f.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    name = max((n for n in header if n.endswith("k_proj.weight")), key=lambda n: header[n]["data_offsets"][0])
    tensors = load_file(str(f))
    tensors[name] = (tensors[name] * 1.5).contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    new = f.read_bytes()
    assert len(new) == len(raw) and new != raw
    if len(raw) > 1 << 20:
        assert new[: 1 << 20] == raw[: 1 << 20]
