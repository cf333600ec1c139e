"""A Llama GGUF file -> a Hugging Face Llama model directory the engine (and transformers) load.

``convert_gguf(src, out_dir)`` reads the file with ``gguf`` (ggml's own
reader), dequantizes every tensor to ``dtype`` and writes:

- ``model.safetensors`` with Hugging Face ``LlamaForCausalLM`` names; q/k rows
  are put back in Hugging Face's rotate-half order (llama.cpp's converter
  interleaves each head's two rotary halves; see ``unpermute_rows``);
- ``config.json`` from the ``llama.*`` metadata;
- ``tokenizer.json`` built with ``tokenizers`` from ``tokenizer.ggml.*``
  (byte-level BPE, the pre-tokenizer llama.cpp uses for the file's ``pre``);
- ``tokenizer_config.json`` (chat template, bos/eos/pad/unk) and
  ``generation_config.json``.

Only ``general.architecture == "llama"`` and the tensor types in
``SUPPORTED_TYPES`` are accepted; anything else fails with one line naming
what was found and what is supported, before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SUPPORTED_ARCHS = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TOKENIZERS = ("gpt2",)
#: llama.cpp's pre-tokenizers that split digits one by one before the GPT-2 regex (llama-vocab.cpp).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2_PRE = ("gpt2", "default", "mpt", "olmo", "jais")
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into a model: the message is one line."""


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """An opened, validated Llama GGUF: its metadata and the reader over its tensors."""

    path: Path
    reader: Any
    meta: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)


def open_gguf(path: str | Path) -> GGUFModel:
    """Read and validate ``path``: a GGUF of a supported architecture whose tensors are all there.

    Raises ``GGUFError`` (one line) for a missing, truncated or foreign file, another
    architecture, an unsupported tensor type or tokenizer. Reads metadata only.
    """
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading a GGUF needs the `gguf` package: pip install 'tierkv[model]'") from None
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF {path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"GGUF {path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader fails in many ways on a cut file: all mean the same to a user
        raise GGUFError(f"GGUF {path}: truncated or damaged ({size} bytes; the reader says: "
                        f"{type(exc).__name__}: {exc})") from None
    ends = [t.data_offset + t.n_bytes for t in reader.tensors]
    if ends and max(ends) > size:
        raise GGUFError(f"GGUF {path}: truncated ({size} bytes, its tensors need {max(ends)})")
    meta = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            continue  # read on demand: converting 49k strings costs seconds
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: S112  (a field type this gguf version cannot decode: not one we read)
            continue
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"GGUF {path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TYPES))
    if bad:
        first = next(t.name for t in reader.tensors if t.tensor_type.name in bad)
        raise GGUFError(f"GGUF {path}: tensor type {', '.join(bad)} (e.g. {first}) is not supported "
                        f"(supported: {', '.join(SUPPORTED_TYPES)})")
    tok = meta.get("tokenizer.ggml.model")
    if tok not in SUPPORTED_TOKENIZERS:
        raise GGUFError(f"GGUF {path}: tokenizer {tok!r} is not supported (supported: {', '.join(SUPPORTED_TOKENIZERS)})")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLIT_PRE + _GPT2_PRE:
        raise GGUFError(f"GGUF {path}: pre-tokenizer {pre!r} is not supported "
                        f"(supported: {', '.join(_DIGIT_SPLIT_PRE + _GPT2_PRE)})")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError(f"GGUF {path}: per-dimension rope_freqs (llama3 rope scaling) is not supported "
                        "(supported: default and linear rope)")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GGUFError(f"GGUF {path}: rope scaling {scaling!r} is not supported (supported: none, linear)")
    return GGUFModel(path, reader, meta)


def hf_config(m: GGUFModel, dtype: str) -> dict[str, Any]:
    """The ``config.json`` dict for this GGUF (Hugging Face ``LlamaConfig`` field names)."""
    a = m.get("general.architecture")
    heads = int(m.get(f"{a}.attention.head_count"))
    hidden = int(m.get(f"{a}.embedding_length"))
    names = {t.name for t in m.reader.tensors}
    vocab = m.get(f"{a}.vocab_size") or len(m.reader.fields["tokenizer.ggml.tokens"].data)
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(m.get(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(m.get(f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(m.get(f"{a}.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(m.get(f"{a}.context_length", 2048)),
        "rms_norm_eps": _f32(m.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(m.get(f"{a}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": dtype,
        "bos_token_id": _opt_int(m.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _opt_int(m.get("tokenizer.ggml.eos_token_id")),
    }
    if m.get(f"{a}.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(m.get(f"{a}.rope.scaling.factor"))}
    if m.get("tokenizer.ggml.padding_token_id") is not None:
        cfg["pad_token_id"] = int(m.get("tokenizer.ggml.padding_token_id"))
    return cfg


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (j, half) -> (half, j).

    llama.cpp's converter stores each head's rows as interleaved rotary pairs
    (GPT-J style); Hugging Face's rotate-half layout keeps the first half of
    the head's rows, then the second. ``w`` is [n_head * head_dim, in].
    """
    rows, cols = w.shape
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_tensors(m: GGUFModel, cfg: dict[str, Any], dtype: torch.dtype):
    """Yield ``(hf_name, tensor)`` for every weight, dequantized to ``dtype``, q/k unpermuted."""
    import gguf

    for t in m.reader.tensors:
        name = _hf_name(t.name, m.path)
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))  # a copy: F32 ones are views of the mmap
        expect = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 (the fastest dim) first
        w = w.reshape(expect)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
        yield name, w.to(dtype).contiguous()


def build_tokenizer(m: GGUFModel):
    """A ``tokenizers.Tokenizer`` equal to llama.cpp's for this file: byte-level BPE, its merges,
    its pre-tokenizer, control tokens as special added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    fields = m.reader.fields
    tokens = _strings(fields["tokenizer.ggml.tokens"])
    merges = [tuple(s.split(" ", 1)) for s in _strings(fields["tokenizer.ggml.merges"])]
    types = list(fields["tokenizer.ggml.token_type"].contents()) if "tokenizer.ggml.token_type" in fields else []
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = m.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(m.get("tokenizer.ggml.add_space_prefix", False)),
                                          use_regex=True)
    if m.get("tokenizer.ggml.pre", "default") in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                                                     byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    plain = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok, tokens


def tokenizer_config(m: GGUFModel, tokens: list[str], max_len: int) -> dict[str, Any]:
    """``tokenizer_config.json``: the chat template and the special tokens, as transformers reads them."""
    def token(key: str) -> str | None:
        i = m.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(m.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    if m.get("tokenizer.chat_template"):
        out["chat_template"] = m.get("tokenizer.chat_template")
    return out


def convert_gguf(src: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the model directory for GGUF ``src`` into ``out_dir`` (created; files overwritten).

    Not atomic by itself: callers write into a temporary directory and rename it
    (``tierkv.models.pull`` does). Validates everything before writing anything.
    """
    from safetensors.torch import save_file

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected one of ['float32', 'bfloat16', 'float16'], got {dtype!r}")
    m = open_gguf(src)
    cfg = hf_config(m, dtype)
    tok, tokens = build_tokenizer(m)
    tensors = dict(hf_tensors(m, cfg, getattr(torch, dtype)))
    missing = _missing(tensors, cfg)
    if missing:
        raise GGUFError(f"GGUF {m.path}: lacks tensors {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tcfg = tokenizer_config(m, tokens, cfg["max_position_embeddings"])
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: tcfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tcfg[k]}, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    if "pad_token_id" in cfg:
        gen["pad_token_id"] = cfg["pad_token_id"]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFError(f"GGUF {path}: tensor {name!r} has no Llama counterpart (expected token_embd, output_norm, "
                    "output, blk.N.{attn_*,ffn_*})")


def _missing(tensors: dict[str, torch.Tensor], cfg: dict[str, Any]) -> list[str]:
    want = ["model.embed_tokens.weight", "model.norm.weight"]
    want += [f"model.layers.{i}.{n}" for i in range(cfg["num_hidden_layers"]) for n in _LAYER_NAMES.values()]
    if not cfg["tie_word_embeddings"]:
        want.append("lm_head.weight")
    return [n for n in want if n not in tensors]


def _strings(field) -> list[str]:
    """A GGUF string array as Python strings (one decode per element; ~0.1 s for 49k tokens)."""
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _f32(x) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _opt_int(x) -> int | None:
    return None if x is None else int(x)
