"""Never the wrong KV: an L3 filled by an earlier process is found only under the same model identity.

An earlier process (a subprocess) runs the engine on a checkpoint with L3 and
write-through, then exits. This process changes one thing the KV depends on —
the weights rewritten in place (same size, same first MiB: a merged fine-tune
of k_proj), ``hf_overrides`` (rope_theta), another ``cache_salt`` — and must
load 0 tokens from tierkv with ids equal to a cache-less run of the changed
configuration, while ``why`` names the field that differs. The same
configuration restarted loads the prefix and gives the same ids. Another
dtype is another block layout: it opens its own directory under the same
``l3.path`` (``layouts/<fingerprint>``), loads 0 tokens, says once which field
differs, and each dtype restarted finds its own blocks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _models import fine_tune_in_place
from engine_helpers import GREEDY

from tierkv.config import L2Config, L3Config, PolicyConfig, StoreConfig
from tierkv.engine import LLM, EngineConfig

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(150)]  # 9 full blocks of 16


def l3_config(l3: Path) -> StoreConfig:
    return StoreConfig(l2=L2Config(capacity=0), l3=L3Config(path=str(l3), capacity="16MiB"),
                       policy=PolicyConfig(write="write_through"))


FILL = textwrap.dedent("""
    import json, sys
    from tierkv.config import L2Config, L3Config, PolicyConfig, StoreConfig
    from tierkv.engine import LLM, EngineConfig, SamplingParams
    model, l3, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = StoreConfig(l2=L2Config(capacity=0), l3=L3Config(path=l3, capacity="16MiB"),
                      policy=PolicyConfig(write="write_through"))
    with LLM(model, cfg, EngineConfig(num_blocks=128, num_threads=1)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        llm.store.flush()
        print(json.dumps({"ids": out.token_ids, "l3": llm.store.l3.used}))
""")


@pytest.fixture
def filled(tiny_dir: Path, tmp_path: Path, monkeypatch) -> dict:
    """A private copy of the checkpoint, an L3 filled from it by an earlier process, and that run's ids."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    monkeypatch.setenv("TIERKV_DIGEST_CACHE", str(tmp_path / "digests.json"))
    env = {**os.environ, "TIERKV_DIGEST_CACHE": str(tmp_path / "digests.json")}
    proc = subprocess.run([sys.executable, "-c", FILL, str(model), str(tmp_path / "l3"), json.dumps(PROMPT)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["l3"] >= 9
    return {"model": model, "l3": tmp_path / "l3", "ids": first["ids"]}


def run(model: Path, l3: Path | None, salt: str | None = None, **engine):
    """(ids, tokens loaded from tierkv, why) of one fresh engine on ``PROMPT``; no cache when ``l3`` is None."""
    engine.setdefault("num_blocks", 128)
    engine.setdefault("num_threads", 1)
    cfg = l3_config(l3) if l3 is not None else StoreConfig(l2=L2Config(capacity=0), l3_enabled=False)
    with LLM(model, cfg, EngineConfig(**engine), enable_cache=l3 is not None) as llm:
        why = llm.why(PROMPT, cache_salt=salt) if l3 is not None else []
        out = llm.generate([PROMPT], GREEDY, cache_salt=salt)[0]
    return out.token_ids, sum(n for t, n in out.hit_tokens.items() if t != "l1"), why


def test_the_same_configuration_restarted_loads_the_prefix(filled):
    ids, loaded, why = run(filled["model"], filled["l3"])
    assert ids == filled["ids"]
    assert loaded == 9 * 16
    assert [b.status for b in why] == ["held"] * 9 and {b.tier for b in why} == {"l3"}


@pytest.mark.parametrize("change", ["fine_tune", "hf_overrides", "cache_salt"])
def test_a_changed_identity_loads_nothing_and_why_names_the_field(filled, change):
    model, engine, salt = filled["model"], {}, None
    if change == "fine_tune":
        fine_tune_in_place(model)
        field = "weights"
    elif change == "hf_overrides":
        engine["hf_overrides"] = {"rope_theta": 1000.0}
        field = "config"
    else:
        salt = "tenant-2"
    ids, loaded, why = run(model, filled["l3"], salt, **engine)
    reference, _, _ = run(model, None, salt, **engine)
    assert loaded == 0
    assert ids == reference
    if change != "cache_salt":
        assert ids != filled["ids"]  # the change matters: the old KV would have been wrong
        assert {b.status for b in why} == {"other_identity"}
        assert all(any(d.startswith(field + " ") for d in b.differs) for b in why), why[0].differs
    else:  # held unsalted: named without showing the salt (a salted holder would not be, to a server)
        got = {(b.status, b.tier, b.differs) for b in why}
        assert got == {("other_request_keys", "l3", ("cache_salt (none) → set",))}
    # And the original configuration still finds its blocks, untouched by the other run.
    if change != "fine_tune":
        again, loaded, _ = run(model, filled["l3"])
        assert loaded == 9 * 16 and again == filled["ids"]


def test_another_dtype_loads_nothing_from_its_own_directory_and_why_names_dtype(filled, caplog):
    with caplog.at_level("WARNING", logger="tierkv"):
        ids, loaded, why = run(filled["model"], filled["l3"], dtype="bfloat16")
    reference, _, _ = run(filled["model"], None, dtype="bfloat16")
    assert loaded == 0 and ids == reference
    assert {b.status for b in why} == {"other_identity"}
    assert all(any(d.startswith("dtype ") for d in b.differs) for b in why), why[0].differs
    said = [r.getMessage() for r in caplog.records if "other layout" in r.getMessage()]
    assert len(said) == 1 and "float32" in said[0] and "dtype float32 → bfloat16" in said[0], said
    layouts = sorted(p.name for p in (filled["l3"] / "layouts").iterdir())
    assert len(layouts) == 1  # bf16's blocks in their own directory, the fp32 root untouched
    again, loaded, _ = run(filled["model"], filled["l3"])
    assert loaded == 9 * 16 and again == filled["ids"]
    again, loaded, _ = run(filled["model"], filled["l3"], dtype="bfloat16")  # and bf16 restarted hits its own
    assert loaded == 9 * 16 and again == reference


def test_a_rewritten_weight_file_is_hashed_again_and_an_unchanged_one_costs_a_stat(tmp_path, tiny_dir):
    from tierkv.identity import file_digests

    f = tmp_path / "w.safetensors"
    shutil.copy(next(tiny_dir.glob("*.safetensors")), f)
    cache = tmp_path / "digests.json"
    (d1, hashed1), = file_digests([f], cache).values()
    (d2, hashed2), = file_digests([f], cache).values()
    assert hashed1 and not hashed2 and d1 == d2
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # one byte near the end, same size
    f.write_bytes(bytes(data))
    (d3, hashed3), = file_digests([f], cache).values()
    assert hashed3 and d3 != d1


def test_why_names_another_cache_salt_to_the_operator_and_not_to_a_server(filled, tmp_path):
    """A prompt computed under the salt tenant-1, asked without it: the engine's ``why`` (what
    ``POST /v1/kv/why`` answers) says not computed; ``tierkv why`` on the L3 directory, in
    another process after the engine closed, says held under another cache_salt; neither shows it."""
    salted = [t + 1 for t in PROMPT]  # not the unsalted fill's tokens
    with LLM(filled["model"], l3_config(filled["l3"]), EngineConfig(num_blocks=128, num_threads=1)) as llm:
        llm.generate([salted], GREEDY, cache_salt="tenant-1")
        llm.store.flush()
        assert {b.status for b in llm.why(salted)} == {"not_computed"}
        assert {b.status for b in llm.why(salted, cache_salt="tenant-1")} == {"held"}
    ids = tmp_path / "salted.json"
    ids.write_text(json.dumps(salted))
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "why", "--model", str(filled["model"]), "--ids",
                           f"@{ids}", "--cache-dir", str(filled["l3"].parent), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    blocks = json.loads(proc.stdout)["blocks"]
    assert [(b["status"], b["tier"], b["differs"]) for b in blocks] == [
        ("other_request_keys", "l3", ["cache_salt set → (none)"])] * 9
    assert "tenant-1" not in proc.stdout
