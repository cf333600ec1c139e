"""Checkpoints, the loader's errors and the tokenizer.json path."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from tierkv.engine.checkpoint import main as checkpoint_main
from tierkv.engine.loader import read_config, weight_files

from engine_helpers import GREEDY


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_checkpoint_cli_is_seeded_and_shards(tmp_path, capsys):
    checkpoint_main([str(tmp_path / "a"), "--preset", "tiny", "--seed", "5"])
    checkpoint_main([str(tmp_path / "b"), "--preset", "tiny", "--seed", "5"])
    checkpoint_main([str(tmp_path / "c"), "--preset", "tiny", "--seed", "6", "--shards", "2"])
    assert "0.8M parameters" in capsys.readouterr().out
    assert digest(tmp_path / "a" / "model.safetensors") == digest(tmp_path / "b" / "model.safetensors")
    assert [f.name for f in weight_files(tmp_path / "c")] == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors"]
    cfg = read_config(tmp_path / "c")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 2, 16)


def test_loader_names_what_is_missing(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_config(tmp_path)
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        weight_files(tmp_path)
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text().replace('"llama"', '"gpt2"'))
    with pytest.raises(ValueError, match="model_type"):
        read_config(tmp_path)


def test_load_model_fuses_the_checkpoint_and_names_a_missing_weight(tmp_path, tiny_dir):
    import torch
    from safetensors.torch import load_file, save_file

    from tierkv.engine.loader import load_model

    tensors = load_file(str(tiny_dir / "model.safetensors"))
    model = load_model(tiny_dir, torch.float32, torch.device("cpu"))
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn."
    # Hugging Face's separate q/k/v and gate/up are the engine's fused matrices, in that order.
    assert torch.equal(params["layers.1.self_attn.qkv_proj.weight"],
                       torch.cat([tensors[attn + p + "_proj.weight"] for p in "qkv"]))
    assert torch.equal(params["layers.1.mlp.gate_up_proj.weight"],
                       torch.cat([tensors[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]))
    assert torch.equal(params["embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny_dir / "config.json", broken / "config.json")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^model_dir: checkpoint lacks \['layers\.1\.mlp\.down_proj\.weight'\]"):
        load_model(broken, torch.float32, torch.device("cpu"))


def test_tokenizer_json_is_used_when_present(tmp_path, tiny_dir, make_llm):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_dir, model_dir)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]"])
    tok.train_from_iterator(["the tiered cache serves the prefix", "a prompt whose prefix is cached"] * 20, trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    llm = make_llm(model_dir=model_dir)
    assert not llm.tokenizer.is_bytes
    ids = tok.encode("the prefix is cached").ids
    by_text = llm.generate(["the prefix is cached"], GREEDY)[0]
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    assert by_text.text == tok.decode(by_text.token_ids)
