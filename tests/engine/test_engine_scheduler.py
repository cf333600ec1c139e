"""Scheduling never changes greedy outputs: chunked prefill, preemption, loads beside running work."""

from __future__ import annotations

import pytest

from tierkv.engine import EngineConfig, SamplingParams

from engine_helpers import GREEDY, prompts, store_config

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_dir) -> list[list[int]]:
    """Unchunked, roomy, no cache: the plainest schedule."""
    from tierkv.engine import LLM

    cfg = EngineConfig(num_blocks=256, max_num_batched_tokens=4096, chunked_prefill=False, num_threads=1)
    with LLM(tiny_dir, store_config(None), cfg, enable_cache=False) as llm:
        return [o.token_ids for o in llm.generate(prompts(6), LONG)]


@pytest.mark.parametrize("enable_cache", [False, True])
def test_chunked_prefill_matches_unchunked(make_llm, reference, enable_cache):
    llm = make_llm(enable_cache=enable_cache, max_num_batched_tokens=24, chunked_prefill=True)
    assert [o.token_ids for o in llm.generate(prompts(6), LONG)] == reference


def test_unchunked_small_budget_runs_long_prompts_alone(make_llm, reference):
    llm = make_llm(enable_cache=False, max_num_batched_tokens=24, chunked_prefill=False)
    assert [o.token_ids for o in llm.generate(prompts(6), LONG)] == reference


@pytest.mark.parametrize("enable_cache", [False, True])
def test_preemption_under_l1_pressure_matches(make_llm, reference, enable_cache):
    # 6 sequences of up to 150 tokens need ~48 blocks; 16 force preemptions while they decode.
    llm = make_llm(enable_cache=enable_cache, num_blocks=16)
    outs = llm.generate(prompts(6), LONG)
    assert [o.token_ids for o in outs] == reference
    assert llm.stats()["preemptions"] > 0
    assert llm.store.l1.num_free + llm.store.index.counts[0] == 16  # every slot came back


def test_max_num_seqs_limits_the_batch(make_llm, reference):
    llm = make_llm(max_num_seqs=2)
    seen = []
    original = llm.runner.run

    def spy(batch):
        seen.append(len(batch))
        return original(batch)

    llm.runner.run = spy
    assert [o.token_ids for o in llm.generate(prompts(6), LONG)] == reference
    assert max(seen) == 2


def test_loading_request_waits_while_others_run(make_llm, reference):
    llm = make_llm(store_config(None, l2="8MiB"))
    llm.generate(prompts(6)[:1], LONG)
    slots = llm.store.allocate(llm.store.l1.capacity)  # demote everything to L2
    llm.store.free(slots)
    states = []
    original = llm.scheduler.schedule

    def spy():
        batch = original()
        states.append((len(llm.scheduler.loading), len(batch)))
        return batch

    llm.scheduler.schedule = spy
    outs = llm.generate(prompts(6), LONG)
    assert [o.token_ids for o in outs] == reference
    assert outs[0].hit_tokens["l2"] > 0
    assert any(loading for loading, _ in states)


def test_sampling_is_seeded_and_batch_independent(make_llm):
    llm = make_llm()
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate(prompts(1), params)[0].token_ids
    batched = llm.generate(prompts(4), [params] + [SamplingParams(max_tokens=5, temperature=1.0)] * 3)
    assert batched[0].token_ids == alone
    greedy = llm.generate(prompts(1), GREEDY)[0].token_ids
    top1 = llm.generate(prompts(1), SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))
    assert top1[0].token_ids == greedy
    assert alone != greedy[:10]


def test_stop_tokens_and_stream(make_llm, reference):
    llm = make_llm()
    stop = reference[0][5]
    out = llm.generate(prompts(1), SamplingParams(max_tokens=40, stop_token_ids=(stop,), ignore_eos=True))[0]
    first = reference[0].index(stop)
    assert out.token_ids == reference[0][: first + 1] and out.finish_reason == "stop"
    streamed = list(llm.stream(prompts(1)[0], LONG))
    assert [len(o.token_ids) for o in streamed] == list(range(1, 41))
    assert streamed[-1].token_ids == reference[0] and streamed[-1].finish_reason == "length"
    assert [o.finish_reason for o in streamed[:-1]] == [None] * 39


def test_text_prompts_use_bytes_without_tokenizer_json(make_llm):
    llm = make_llm()
    assert llm.tokenizer.is_bytes
    by_text = llm.generate(["hello tierkv"], GREEDY)[0]
    by_ids = llm.generate([list(b"hello tierkv")], GREEDY)[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt_token_ids == list(b"hello tierkv")
    assert isinstance(by_text.text, str)


@pytest.mark.parametrize("field,value", [("num_blocks", 0), ("dtype", "float64"), ("max_num_seqs", True),
                                         ("device", "tpu"), ("chunked_prefill", "yes")])
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"engine.{field}"):
        EngineConfig(**{field: value})


def test_bad_requests_fail_naming_the_field(make_llm):
    llm = make_llm(num_blocks=4)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 999]], GREEDY)
    with pytest.raises(ValueError, match="num_blocks"):
        llm.generate([list(range(3, 100))], GREEDY)


def test_stream_closed_early_returns_its_blocks(make_llm, reference):
    llm = make_llm(enable_cache=False)
    stream = llm.stream(prompts(1)[0], LONG)
    got = [next(stream).token_ids for _ in range(3)]
    assert got[-1] == reference[0][:3]
    stream.close()
    assert llm.store.l1.num_free == 128 and not llm.scheduler.has_work()
    assert [o.token_ids for o in llm.generate(prompts(6), LONG)] == reference


def test_a_request_that_outgrows_l1_ends_with_length(make_llm, reference):
    # 4 blocks hold the K/V of 64 tokens; the 65th is sampled from them and needs no slot.
    llm = make_llm(enable_cache=False, num_blocks=4)
    prompt = prompts(1)[0][:32]
    out = llm.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 32 + 1
    streamed = list(llm.stream(prompt, SamplingParams(max_tokens=100, ignore_eos=True)))
    assert streamed[-1].finish_reason == "length" and streamed[-1].token_ids == out.token_ids
    assert llm.store.l1.num_free == 4


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_device_without_cuda_names_the_field(tiny_dir):
    from tierkv.engine import LLM

    with pytest.raises(ValueError, match="engine.device"):
        LLM(tiny_dir, engine_config=EngineConfig(device="cuda"))
