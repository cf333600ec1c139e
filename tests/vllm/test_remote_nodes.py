"""Two vLLM nodes share one L4 pool: what node A computed, node B's scheduler finds and loads.

Each node has its own vLLM scheduler, KV cache, L2 and L3 directory; they share
only a real pool (redis-server, or mooncake_master with one pool node). Node B
never computed the prompt: its hit can only come from what node A wrote to the
pool, and the bytes in B's vLLM blocks must be what the model would have
written there.
"""

from __future__ import annotations

import pytest
from harness import Engine, blocks_hold, no_pins, prompt
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from tierkv.index import Tier


@pytest.fixture(params=["redis", "mooncake"])
def pool(request):
    return request.getfixturevalue("redis_server" if request.param == "redis" else "mooncake_pool")


def sent_to_l4(e: Engine) -> None:
    """Wait until every L4 put node ``e`` queued so far has been sent (the IO thread runs them in order)."""
    e.store.transfer.io(lambda: None).result(timeout=60)


def test_node_b_loads_from_l4_what_node_a_computed(engine, pool):
    l4 = {"url": pool.url, "timeout_ms": 2000}
    a = engine(node="a", l4=l4, write="write_through", save_async=False)
    b = engine(node="b", l4=l4, save_async=False)
    p = prompt(11, 100)
    first = a.add("a1", p)
    a.run()
    assert first.is_finished()
    sent_to_l4(a)
    keys = a.store.hash(p)[:3]
    assert a.store.l4.contains(keys) == [True] * 3  # written through as the blocks filled
    assert b.store.lookup_keys(keys, pin=False).tiers == [Tier.L4] * 3  # B holds none of them locally

    b.add("o", prompt(12, 20), max_tokens=60)
    req = b.add("b1", p)
    step = b.step()
    assert b.calls[-1] == ("matched", "b1", 0, (96, True))  # an L4 hit loads while others run
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and "b1" not in step.output.num_scheduled_tokens
    assert b.connector.get_external_cache_hit_sources(req, 96) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 96}
    b.step_until(lambda: any("b1" in (s.connector_output.finished_recving or ()) for s in b.steps))
    assert not b.steps[-1].connector_output.invalid_block_ids
    step = b.step()
    assert step.output.num_scheduled_tokens["b1"] == 4  # only the tail is prefilled on B
    assert blocks_hold(b, "b1", p, 3) == [True, True, True]
    b.run()
    assert req.is_finished() and len(req.output_token_ids) == 3 and no_pins(b)
    s = b.store.stats()["l4"]
    assert s["hits"] == 3 and s["bad_values"] == 0
    if s["backend"] == "mooncake":  # landed whole in B's registered landing slots: no staging copy
        assert s["in_place_calls"] >= 1 and s["staged_calls"] == 0


def test_a_pool_that_is_down_is_a_miss_and_node_b_computes(engine, pool):
    l4 = {"url": pool.url, "timeout_ms": 300, "breaker_failures": 1}
    a = engine(node="a", l4=l4, write="write_through", save_async=False)
    p = prompt(12, 100)
    a.add("a1", p)
    a.run()
    sent_to_l4(a)
    pool.kill()
    b = engine(node="b", l4=l4, save_async=False)
    req = b.add("b1", p)
    step = b.step()
    assert b.calls[-1] == ("matched", "b1", 0, (0, False))  # no exception: a counted miss
    assert step.output.num_scheduled_tokens == {"b1": 100}
    assert blocks_hold(b, "b1", p, 3) == [True, True, True]  # computed by B itself
    b.run()
    assert req.is_finished() and no_pins(b)
    assert b.store.stats()["l4"]["failed_calls"] >= 1
