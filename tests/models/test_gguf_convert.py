"""GGUF -> model directory: exact weights back (q/k order too), and one-line errors for bad files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import write_llama_gguf  # noqa: E402

from tierkv.engine.checkpoint import make_config, random_weights  # noqa: E402
from tierkv.models import resolve_model  # noqa: E402
from tierkv.models.gguf_convert import GGUFError, SUPPORTED_TYPES, convert_gguf  # noqa: E402

import gguf  # noqa: E402  (tierkv[model]; make setup installs it: a missing one fails, never skips)


@pytest.fixture(scope="module")
def tiny():
    cfg = make_config("tiny")
    return cfg, random_weights(cfg, seed=3)


def test_round_trip_gives_the_hf_weights_back(tmp_path, tiny):
    cfg, state = tiny
    src = write_llama_gguf(tmp_path / "tiny.gguf", cfg, state)
    out = convert_gguf(src, tmp_path / "out")
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(state)
    for name, t in state.items():
        assert torch.equal(got[name], t.float()), name  # F32 in, F32 out: bit-exact, q/k rows unpermuted
    written = json.loads((out / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps"):
        assert written[key] == cfg[key], key
    assert written["tie_word_embeddings"] is False
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"].startswith("{% for m in messages %}") and tcfg["eos_token"] == "<|s1|>"


def test_tokenizer_from_metadata(tmp_path, tiny):
    cfg, state = tiny
    out = convert_gguf(write_llama_gguf(tmp_path / "t.gguf", cfg, state), tmp_path / "out")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    ids = tok.encode("abc<|s0|>ab 12").ids
    assert ids[:2] == [vocab["abc"], vocab["<|s0|>"]]           # merges applied, control token whole
    assert ids[2] == vocab["ab"] and [tok.id_to_token(i) for i in ids[3:]] == ["Ġ", "1", "2"]  # digits split
    assert tok.decode(ids, skip_special_tokens=False) == "abc<|s0|>ab 12"


def test_resolve_model_converts_a_gguf_once(tmp_path, tiny):
    cfg, state = tiny
    src = write_llama_gguf(tmp_path / "tiny.gguf", cfg, state)
    first = resolve_model(src, tmp_path / "models")
    assert first.parent == tmp_path / "models" / "gguf" and (first / "config.json").is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(src), tmp_path / "models") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # not converted again
    assert resolve_model(first) == first                           # a directory is taken as it is


def test_truncated_file_is_one_line(tmp_path, tiny):
    cfg, state = tiny
    src = write_llama_gguf(tmp_path / "tiny.gguf", cfg, state)
    data = src.read_bytes()
    for cut in (len(data) // 2, 200):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=r"truncated") as e:
            convert_gguf(bad, tmp_path / "out")
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFError, match=r"not a GGUF file"):
        convert_gguf(notgguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written for a bad file


def test_other_architecture_is_one_line(tmp_path, tiny):
    cfg, state = tiny
    src = write_llama_gguf(tmp_path / "q.gguf", cfg, state, arch="qwen2")
    with pytest.raises(GGUFError) as e:
        convert_gguf(src, tmp_path / "out")
    msg = str(e.value)
    assert "architecture 'qwen2' is not supported (supported: llama)" in msg and "\n" not in msg


def test_unsupported_tensor_type_is_one_line(tmp_path, tiny):
    cfg, state = tiny
    src = write_llama_gguf(tmp_path / "i.gguf", cfg, state, raw_type=gguf.GGMLQuantizationType.I32)
    with pytest.raises(GGUFError) as e:
        convert_gguf(src, tmp_path / "out")
    msg = str(e.value)
    assert "tensor type I32 (e.g. blk.0.attn_norm.weight) is not supported" in msg
    assert f"(supported: {', '.join(SUPPORTED_TYPES)})" in msg and "\n" not in msg


def test_cli_errors_name_the_field(tmp_path, tiny):
    from tierkv.cli import main

    cfg, state = tiny
    src = write_llama_gguf(tmp_path / "q.gguf", cfg, state, arch="qwen2")
    assert main(["run", "--quick", "--model", str(src), "--cache-dir", str(tmp_path / "c")]) == 2
    assert main(["model", "pull", "no-such-model"]) == 2
    assert main(["run", "--quick", "--model", str(tmp_path / "missing"), "--cache-dir", str(tmp_path / "c")]) == 2
