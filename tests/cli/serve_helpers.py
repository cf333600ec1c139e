"""The chat model the `tierkv serve` tests run on (a module next to them; tests/cli has no conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    """The tiny random checkpoint with SmolLM2's chat template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("models") / "tiny-chat"
    subprocess.run([sys.executable, "-m", "tierkv.engine.checkpoint", str(out), "--preset", "tiny"],
                   check=True, capture_output=True, timeout=120)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "\u0002"}))
    return out
