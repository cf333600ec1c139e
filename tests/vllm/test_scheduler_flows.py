"""TierKVConnector under vLLM 0.32.0's real v1 Scheduler: real Requests, real block hashes.

Every hit is checked twice: by what vLLM scheduled (only the tail beyond the
hit) and by the bytes in vLLM's KV cache (what the model would have written).
"""

from __future__ import annotations

import os

import pytest
from harness import BLOCK, Engine, blocks_hold, no_pins, prompt
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus


def populate(e: Engine, tokens: list[int]) -> None:
    """Compute ``tokens`` once (tierkv saves its blocks), then make vLLM forget them."""
    req = e.add(f"warm{len(e.requests)}", tokens)
    e.run()
    assert req.is_finished()
    e.forget_local_cache()


def test_no_hit_computes_everything_and_saves_full_blocks(engine):
    e = engine(save_async=False)
    p = prompt(1, 100)
    req = e.add("a", p)
    step = e.step()
    assert e.calls == [("matched", "a", 0, (0, False))]
    assert step.output.num_scheduled_tokens == {"a": 100}
    meta = step.output.kv_connector_metadata
    assert meta.loads == [] and [s.start for s in meta.saves] == [0] and len(meta.saves[0].block_ids) == 3
    e.run()
    assert req.is_finished() and len(req.output_token_ids) == 3
    keys = e.store.hash(p)[:3]
    assert e.store.lookup_keys(keys, pin=False).num_blocks == 3
    stored = [ev for ev in e.events if type(ev).__name__ == "BlockStored"]
    assert [ev.block_hashes for ev in stored] == [keys] and stored[0].token_ids == p[:96]
    assert stored[0].medium == "CPU" and no_pins(e)


def test_sync_hit_from_l2_schedules_only_the_tail(engine):
    e = engine(save_async=False)
    p = prompt(2, 100)
    populate(e, p)
    req = e.add("b", p)
    step = e.step()
    assert e.calls[-1] == ("matched", "b", 0, (96, False))
    assert step.output.num_scheduled_tokens == {"b": 4}
    assert req.status == RequestStatus.RUNNING
    (load,) = step.output.kv_connector_metadata.loads
    assert (load.start, len(load.block_ids), load.is_async) == (0, 3, False)
    assert blocks_hold(e, "b", p, 3) == [True, True, True]
    assert e.connector.get_external_cache_hit_sources(req, 96) == {CacheHitSource.HOST: 96}
    e.run()
    assert req.is_finished() and len(req.output_token_ids) == 3 and no_pins(e)


def test_async_hit_from_l3_waits_then_schedules_only_the_tail(engine):
    e = engine(l2="0", save_async=False)
    p = prompt(3, 100)
    populate(e, p)
    other = e.add("o", prompt(30, 20), max_tokens=60)  # another request live: the load overlaps it
    req = e.add("c", p)
    step = e.step()
    assert e.calls[-1] == ("matched", "c", 0, (96, True))
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "c" not in step.output.num_scheduled_tokens
    assert "o" in step.output.num_scheduled_tokens
    assert e.connector.get_external_cache_hit_sources(req, 96) == {CacheHitSource.DISK: 96}
    e.step_until(lambda: any("c" in (s.connector_output.finished_recving or ()) for s in e.steps))
    assert not e.steps[-1].connector_output.invalid_block_ids
    step = e.step()
    assert step.output.num_scheduled_tokens["c"] == 4
    assert blocks_hold(e, "c", p, 3) == [True, True, True]
    assert sum(1 for c in e.calls if c[1] == "c") == 1  # not asked again after the load
    e.run()
    assert req.is_finished() and len(req.output_token_ids) == 3 and no_pins(e)
    assert other.is_finished()


def test_l3_hit_of_a_request_alone_loads_inside_the_step(engine):
    """``auto`` with nothing else live: no step to overlap, so the L3 load runs in the step (an
    async hand-back would cost one more)."""
    e = engine(l2="0", save_async=False)
    p = prompt(3, 100)
    populate(e, p)
    req = e.add("c", p)
    step = e.step()
    assert e.calls[-1] == ("matched", "c", 0, (96, False))
    assert step.output.num_scheduled_tokens == {"c": 4}
    assert not step.connector_output.invalid_block_ids
    assert e.connector.get_external_cache_hit_sources(req, 96) == {CacheHitSource.DISK: 96}
    assert blocks_hold(e, "c", p, 3) == [True, True, True]
    e.run()
    assert req.is_finished() and len(req.output_token_ids) == 3 and no_pins(e)


def test_local_prefix_hit_plus_external_hit_beyond_it(engine):
    e = engine(save_async=False)
    p = prompt(4, 132)
    populate(e, p)
    short = e.add("short", p[:37], max_tokens=1)  # leaves block 0 in vLLM's own prefix cache
    e.run()
    assert short.is_finished() and e.calls[-1] == ("matched", "short", 0, (32, False))
    req = e.add("f", p)
    step = e.step()
    assert e.calls[-1] == ("matched", "f", 32, (96, False))
    assert step.output.num_scheduled_tokens == {"f": 4}
    (load,) = step.output.kv_connector_metadata.loads
    assert (load.start, len(load.block_ids)) == (1, 3)
    assert blocks_hold(e, "f", p, 4) == [True] * 4
    e.run()
    assert req.is_finished() and no_pins(e)


def test_full_prompt_hit_still_computes_the_last_block(engine):
    e = engine(save_async=False)
    p = prompt(5, 4 * BLOCK)
    populate(e, p)
    req = e.add("g", p)
    step = e.step()
    assert e.calls[-1] == ("matched", "g", 0, (96, False))
    assert step.output.num_scheduled_tokens == {"g": 32}
    assert blocks_hold(e, "g", p, 3) == [True] * 3
    e.run()
    again = e.add("h", p)  # now vLLM itself holds the prefix: tierkv adds nothing
    e.step()
    assert e.calls[-1] == ("matched", "h", 96, (0, False))
    e.run()
    assert req.is_finished() and again.is_finished() and no_pins(e)


def test_preempted_request_with_loaded_blocks_completes(engine):
    e = engine(num_blocks=8, save_async=False)
    p = prompt(6, 100)
    populate(e, p)
    first = e.add("r1", prompt(7, 60), max_tokens=60)
    e.step()
    req = e.add("r2", p, max_tokens=40)
    step = e.step()
    assert e.calls[-1] == ("matched", "r2", 0, (96, False))
    assert [ld.req_id for ld in step.output.kv_connector_metadata.loads] == ["r2"]
    e.step_until(lambda: req.num_preemptions >= 1)
    assert req.status in (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    e.step_until(lambda: req.status == RequestStatus.RUNNING and req.num_computed_tokens >= 100)
    assert blocks_hold(e, "r2", p, 3) == [True] * 3
    e.run()
    assert first.is_finished() and len(first.output_token_ids) == 60
    assert req.is_finished() and len(req.output_token_ids) == 40 and no_pins(e)


@pytest.mark.parametrize("load_async", ["auto", "never"])
def test_corrupt_l3_block_is_reported_and_recomputed(engine, load_async):
    e = engine(l2="0", save_async=False, load_async=load_async)
    p = prompt(8, 100)
    populate(e, p)
    keys = e.store.hash(p)[:3]
    l3 = e.store.l3
    rec = next(r for r in l3.records() if r.key == keys[1])
    with open(l3.path / "slots.bin", "r+b") as fh:
        fh.seek(rec.slot * l3.stride)
        fh.write(b"\xa5" * 512)
        fh.flush()
        os.fsync(fh.fileno())
    if load_async == "auto":
        e.add("o", prompt(31, 20), max_tokens=60)  # another request live: the load goes async
    req = e.add("k", p)
    e.step()
    assert e.calls[-1] == ("matched", "k", 0, (96, load_async == "auto"))
    e.step_until(lambda: any(s.connector_output.invalid_block_ids for s in e.steps))
    ids = e.scheduler.kv_cache_manager.get_block_ids("k")[0]
    assert e.steps[-1].connector_output.invalid_block_ids == set(ids[1:3])
    assert l3.contains([keys[1]]) == [False]
    if load_async == "auto":
        assert "k" in e.steps[-1].connector_output.finished_recving
    step = e.step() if load_async == "auto" else e.steps[-1]
    recompute = e.step() if load_async == "never" else step
    assert recompute.output.num_scheduled_tokens["k"] == 100 - BLOCK
    assert blocks_hold(e, "k", p, 3) == [True] * 3
    e.run()
    assert req.is_finished() and len(req.output_token_ids) == 3
    assert e.store.lookup_keys(keys, pin=False).num_blocks == 3  # the recomputed blocks were saved again
    removed = [ev for ev in e.events if type(ev).__name__ == "BlockRemoved"]
    assert [ev.block_hashes for ev in removed] == [[keys[1]]] and no_pins(e)


def test_async_save_delays_free_until_the_save_is_done(engine):
    e = engine(save_async=True)
    p = prompt(9, 95)
    req = e.add("s", p, max_tokens=2)  # the second decode step fills block 3, then the request ends
    e.run()
    assert req.is_finished()
    assert any("s" in (s.connector_output.finished_sending or ()) for s in e.steps)
    assert e.store.lookup_keys(e.store.hash(p + list(req.output_token_ids))[:3], pin=False).num_blocks == 3
    assert no_pins(e)


def test_a_finished_request_tells_the_workers_store_its_output_length(engine):
    """request_finished -> the next step's metadata -> the worker's store.finished: the eviction hint."""
    from tierkv.policy.hit_density import BANDS, block_class, output_band

    e = engine(save_async=False)  # the default policy (hit_density)
    p = prompt(10, 100)
    req = e.add("f", p, max_tokens=9)
    e.run()
    assert req.is_finished() and len(req.output_token_ids) == 9
    keys = e.store.hash(p)[:3]
    assert {block_class(e.store.index.get(k)) % BANDS for k in keys} == {0}  # not told yet
    e.add("g", prompt(11, 40))
    step = e.step()
    finished = step.output.kv_connector_metadata.finished
    assert [(f_keys[:3], n) for f_keys, n in finished] == [(keys, 9)]
    assert {block_class(e.store.index.get(k)) % BANDS for k in keys} == {output_band(9)}
    e.run()
    assert no_pins(e)
