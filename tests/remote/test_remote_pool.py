"""L4 against real servers, for both backends: sharing between nodes, a killed server, planted values.

"Nodes" are two TierKVStores in this process with their own L1-L3 (own L3
directories) and one shared L4 pool.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from _kv import block_for, prompt, same_bytes, save_prompt, store_config

from tierkv.config import L4Config
from tierkv.index import Tier
from tierkv.layout import KVLayout
from tierkv.store import TierKVStore
from tierkv.tiers.remote.codec import TRAILER_BYTES, ValueCodec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(params=["redis", "mooncake"])
def pool(request):
    return request.getfixturevalue("redis_server" if request.param == "redis" else "mooncake_pool")


def make_node(tmp_path, name: str, layout: KVLayout, url: str, l1: int = 8, l2: int = 1, l3: int = 1,
              policy=None, **l4) -> TierKVStore:
    l4.setdefault("timeout_ms", 300)
    extra = {"policy": policy} if policy is not None else {}
    cfg = store_config(layout, l2, l3, tmp_path / name / "l3", l4=L4Config(url=url, **l4), **extra)
    return TierKVStore(cfg, layout, l1_blocks=l1)


def two_nodes(tmp_path, layout: KVLayout, url: str, **l4) -> tuple[TierKVStore, TierKVStore]:
    """Nodes A and B: own L1-L3 (own L3 directories), one shared pool at ``url``."""
    return make_node(tmp_path, "a", layout, url, **l4), make_node(tmp_path, "b", layout, url, **l4)


def saved_in_l4(store: TierKVStore, seed: int, num_blocks: int, layout: KVLayout) -> tuple[list[int], list[bytes]]:
    """A prompt of ``num_blocks`` blocks saved on ``store`` and evicted down into L4: (tokens, keys)."""
    tokens = prompt(seed, num_blocks, layout)
    keys = save_prompt(store, tokens)
    push_to_l4(store, keys, layout)
    return tokens, keys


def drain(store: TierKVStore) -> None:
    """Wait until every L4 put queued so far has been sent (they run on the IO thread, in order)."""
    store.transfer.io(lambda: None).result(timeout=60)


def wait_healthy(store: TierKVStore, timeout: float = 60.0) -> None:
    """Until the pool takes a value again: after a restart, the first calls may fail or time out."""
    deadline = time.monotonic() + timeout
    probe = [torch.zeros(store.layout.block_shape, dtype=store.layout.torch_dtype)]
    while not store.l4.put([bytes(16)], probe)[0]:
        assert time.monotonic() < deadline, f"L4 did not come back: {store.l4.stats()}"
        time.sleep(0.2)
    store.l4.remove([bytes(16)])


def wait_for_a_call(store: TierKVStore, calls: int) -> None:
    """Until the L4 tier has started a call past the first ``calls`` (counted as it begins)."""
    deadline = time.monotonic() + 60
    while store.stats()["l4"]["calls"] <= calls:
        assert time.monotonic() < deadline, "no L4 call started"
        time.sleep(0.01)


def push_to_l4(store: TierKVStore, keys: list[bytes], layout: KVLayout) -> None:
    """Evict through every tier of ``store`` until ``keys`` all sit in L4 (write-back demotion)."""
    for round_ in range(8):
        store.free(store.allocate(store.l1.capacity))
        drain(store)
        if all(store.l4.contains(keys)):
            return
        save_prompt(store, prompt(10_000 + round_, 2, layout), namespace="filler")
    raise AssertionError(f"blocks never reached L4: {store.l4.contains(keys)} {store.stats()}")


def load_into_l1(store: TierKVStore, tokens: list[int]):
    m = store.lookup(tokens)
    slots = store.allocate(len(m.to_load))
    result = store.load(m, slots).wait(30)
    return m, slots, result


def test_node_b_hits_what_node_a_saved(pool, tmp_path, layout):
    a, b = two_nodes(tmp_path, layout, pool.url)
    try:
        tokens, keys = saved_in_l4(a, 1, 6, layout)
        m, slots, result = load_into_l1(b, tokens)
        assert m.tiers == [Tier.L4] * 6
        assert result.ok == [True] * 6 and all(result.adopted)
        for key, slot in zip(keys, slots):
            assert same_bytes(b.l1.block(slot), block_for(key, layout))
        s = b.stats()["l4"]
        assert s["hits"] == 6
        if s["backend"] == "mooncake":  # the store registered its L1 pool with room: whole values landed in place
            assert s["in_place_calls"] >= 1 and s["direct_calls"] == 0 and s["staged_calls"] == 0
            assert b.l1.slot_room >= TRAILER_BYTES
            # A's demotions were copied into its registered outbox and left from there in one piece.
            sa = a.stats()["l4"]
            assert sa["in_place_calls"] >= 1 and sa["direct_calls"] == 0 and sa["staged_calls"] == 0
        b.release(m)
        # A second lookup on B is served locally now.
        assert b.lookup(tokens, pin=False).tiers == [Tier.L1] * 6
    finally:
        a.close()
        b.close()


def test_server_killed_mid_run_is_misses_then_hits_resume(pool, tmp_path, layout):
    a, b = two_nodes(tmp_path, layout, pool.url, breaker_failures=2, breaker_reset_s=1.0)
    try:
        tokens, keys = saved_in_l4(a, 2, 4, layout)
        m = b.lookup(tokens)
        assert m.tiers == [Tier.L4] * 4
        pool.kill()
        # A load started from a match made before the kill: a miss, not an exception.
        result = b.load(m, b.allocate(4)).wait(30)
        assert result.ok == [False] * 4 and result.num_ok == 0
        b.release(m)
        for _ in range(4):
            assert b.lookup(tokens, pin=False).tiers == []
        s = b.stats()
        assert s["l4"]["breaker"] in ("open", "half_open") and s["l4"]["breaker_opens"] >= 1
        assert s["l4"]["skipped_calls"] >= 1
        assert s["failures"].get("l4_unavailable", 0) >= 2 and s["failures"].get("l4_breaker_open", 0) >= 1
        pool.restart()
        # The pool came back empty (no persistence): A saves again, B hits again.
        wait_healthy(a)
        push_to_l4(a, save_prompt(a, prompt(3, 4, layout)), layout)
        deadline = time.monotonic() + 60  # generous: polling, not a timing assertion
        tokens3 = prompt(3, 4, layout)
        while b.lookup(tokens3, pin=False).tiers != [Tier.L4] * 4:
            assert time.monotonic() < deadline, "L4 hits did not resume after the restart"
            time.sleep(0.5)
        assert b.stats()["l4"]["breaker"] == "closed"
        _, slots, result = load_into_l1(b, tokens3)
        assert result.ok == [True] * 4
        keys3 = b.hash(tokens3)
        assert all(same_bytes(b.l1.block(s), block_for(k, layout)) for k, s in zip(keys3, slots))
    finally:
        a.close()
        b.close()


OTHER = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, block_size=8)  # same bytes, other layout


def test_planted_values_are_counted_misses(pool, tmp_path, layout):
    assert OTHER.block_bytes == layout.block_bytes and OTHER.fingerprint != layout.fingerprint
    node = make_node(tmp_path, "n", layout, pool.url, auth_key="s3cret")
    try:
        tokens = prompt(4, 7, layout)
        keys = node.hash(tokens)
        names = [node.l4.key_name(k) for k in keys]
        signed = ValueCodec(layout, "s3cret")
        unsigned = ValueCodec(layout)
        foreign = ValueCodec(OTHER, "s3cret")

        def value(codec: ValueCodec, key: bytes) -> bytes:
            buf = bytearray(codec.value_bytes)
            codec.encode_into(key, block_for(key, layout), memoryview(buf))
            return bytes(buf)

        good = value(signed, keys[0])
        flipped = bytearray(value(signed, keys[6]))
        flipped[-1] ^= 0x40
        plants = [good, value(signed, keys[1])[:-100], os.urandom(len(good)), value(foreign, keys[3]),
                  value(unsigned, keys[4]), value(ValueCodec(layout, "wrong"), keys[5]), bytes(flipped)]
        for name, data in zip(names, plants):
            pool.plant(name, data)
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in keys]
        assert node.l4.contains(keys) == [True] * 7
        assert node.l4.get(keys, dst) == [True] + [False] * 6
        assert same_bytes(dst[0], block_for(keys[0], layout))
        f = node.stats()["failures"]
        assert f.get("l4_truncated") == 1 and f.get("l4_foreign") == 1 and f.get("l4_layout") == 1
        assert f.get("l4_unauthenticated") == 3  # with a MAC, a flipped payload byte fails the MAC first
        assert node.stats()["l4"]["bad_values"] == 6
        # Through the store: the match stops nowhere (the pool holds all 7), the load keeps only block 0.
        m = node.lookup(tokens)
        result = node.load(m, node.allocate(len(m.to_load))).wait(30)
        assert result.ok == [True] + [False] * 6 and result.num_ok == 1
    finally:
        node.close()


@pytest.mark.parametrize("kind", ["redis_cluster", "redis_tls"])
def test_cluster_and_tls_schemes_share_between_nodes(kind, request, tmp_path, layout):
    server = request.getfixturevalue(kind)
    a, b = two_nodes(tmp_path, layout, server.url)
    try:
        tokens, keys = saved_in_l4(a, 5, 3, layout)
        _, slots, result = load_into_l1(b, tokens)
        assert result.ok == [True] * 3
        assert all(same_bytes(b.l1.block(s), block_for(k, layout)) for k, s in zip(keys, slots))
        assert b.stats()["l4"]["backend"] == ("redis-cluster" if kind == "redis_cluster" else "redis")
        b.l4.remove(keys)  # in a cluster, keys in different hash slots: still one call
        assert b.l4.contains(keys) == [False] * 3
    finally:
        a.close()
        b.close()


def test_hung_server_times_out_then_recovers(pool, tmp_path, layout):
    # SIGSTOP keeps the sockets open and answers nothing: only the client-side timeouts end the calls.
    node = make_node(tmp_path, "n", layout, pool.url, timeout_ms=200, breaker_failures=2, breaker_reset_s=1.0)
    try:
        tokens = prompt(6, 3, layout)
        keys = node.hash(tokens)
        blocks = [block_for(k, layout) for k in keys]
        # The 200 ms timeout is for the hang below; on a loaded host a healthy put may exceed it too.
        deadline = time.monotonic() + 60
        while node.l4.put(keys, blocks) != [True] * 3:
            assert time.monotonic() < deadline, f"L4 never took the blocks: {node.stats()['l4']}"
            time.sleep(0.2)
        pool.pause()
        try:
            for _ in range(3):
                assert node.lookup(tokens, pin=False).tiers == []
            dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in keys]
            assert node.l4.get(keys, dst) == [False] * 3
            s = node.stats()["l4"]
            assert s["failed_calls"] >= 2 and s["breaker"] in ("open", "half_open") and s["breaker_opens"] >= 1
        finally:
            pool.resume()
        deadline = time.monotonic() + 60  # generous: polling, not a timing assertion
        while node.lookup(tokens, pin=False).tiers != [Tier.L4] * 3:
            assert time.monotonic() < deadline, f"L4 did not recover: {node.stats()['l4']}"
            time.sleep(0.5)
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in keys]
        assert node.l4.get(keys, dst) == [True] * 3
        assert all(same_bytes(d, b) for d, b in zip(dst, blocks))
    finally:
        node.close()


def test_valkey_scheme_and_key_prefix(redis_server, tmp_path, layout):
    url = redis_server.url.replace("redis://", "valkey://")
    node = make_node(tmp_path, "n", layout, url, key_prefix="fleet-a")
    try:
        key = node.hash(prompt(7, 1, layout))[0]
        assert node.l4.put([key], [block_for(key, layout)]) == [True]
        names = [n.decode() for n in redis_server.client().keys("*")]
        assert names == [f"fleet-a/{layout.fingerprint}/{key.hex()}"]
        assert node.stats()["l4"]["backend"] == "redis"
    finally:
        node.close()


def writer_and_reader(tmp_path, layout, url: str, write: str) -> tuple[TierKVStore, TierKVStore]:
    """Node A with roomy L2/L3 (nothing gets evicted) under ``write``, and a plain node B."""
    from tierkv.config import PolicyConfig

    a = make_node(tmp_path, "a", layout, url, l2=8, l3=8, policy=PolicyConfig(name="lru", write=write))
    return a, make_node(tmp_path, "b", layout, url)


def test_write_through_puts_to_l4_on_fill(pool, tmp_path, layout):
    a, b = writer_and_reader(tmp_path, layout, pool.url, "write_through")
    try:
        tokens = prompt(8, 3, layout)
        keys = save_prompt(a, tokens)  # nothing evicted: only write-through can have sent them
        drain(a)
        assert a.stats()["evictions"] == {} and a.l4.contains(keys) == [True] * 3
        s = a.stats()["l4"]
        if s["backend"] == "mooncake":  # sent from the pinned L1 slots themselves: no copy, one piece
            assert s["in_place_calls"] >= 1 and s["direct_calls"] == 0 and s["staged_calls"] == 0
        _, slots, result = load_into_l1(b, tokens)
        assert result.ok == [True] * 3
        assert all(same_bytes(b.l1.block(s), block_for(k, layout)) for k, s in zip(keys, slots))
    finally:
        a.close()
        b.close()


def test_write_through_selective_puts_to_l4_on_the_second_hit(redis_server, tmp_path, layout):
    a, b = writer_and_reader(tmp_path, layout, redis_server.url, "write_through_selective")
    try:
        tokens = prompt(12, 3, layout)
        keys = save_prompt(a, tokens)
        a.release(a.lookup(tokens))  # first hit: nothing selected
        a.flush()
        assert a.l4.contains(keys) == [False] * 3
        a.release(a.lookup(tokens[: layout.block_size]))  # second hit of block 0 only
        a.flush()
        assert a.l4.contains(keys) == [True, False, False]
        a.release(a.lookup(tokens))  # second hit of blocks 1 and 2, third of block 0 (not sent again)
        a.release(a.lookup(tokens))
        a.flush()
        s = a.stats()
        assert s["evictions"] == {} and a.l4.contains(keys) == [True] * 3
        assert s["bytes"]["l4_write"] == 3 * layout.block_bytes and s["failures"] == {}
        m, slots, result = load_into_l1(b, tokens)
        assert m.tiers == [Tier.L4] * 3 and result.ok == [True] * 3
        assert all(same_bytes(b.l1.block(s), block_for(k, layout)) for k, s in zip(keys, slots))
        b.release(m)
    finally:
        a.close()
        b.close()


def test_l4_put_queue_is_capped_and_drains_after_a_hang(redis_server, tmp_path, layout):
    from tierkv.outbox import OUTBOX_BLOCKS as L4_MAX_QUEUED

    extra = 44
    n = L4_MAX_QUEUED + extra
    # The timeout (the largest allowed) outlasts the pause: the first put waits for the hung
    # server and then succeeds.
    node = make_node(tmp_path, "n", layout, redis_server.url, l1=n, timeout_ms=60_000)
    try:
        keys = save_prompt(node, prompt(13, n, layout))
        drain(node)  # connected (the save's lookup asked L4), nothing queued
        calls = node.stats()["l4"]["calls"]
        redis_server.pause()
        try:
            assert node.persist(keys, Tier.L4) == L4_MAX_QUEUED  # no exception: the excess is dropped
            marker = node.transfer.io(lambda: None)
            wait_for_a_call(node, calls)  # the IO thread is inside the first put, on the hung server
            assert not marker.done()  # stuck there: nothing behind it has run
            s = node.stats()
            assert s["failures"] == {"l4_put_dropped": extra} and s["bytes"].get("l4_write", 0) == 0
        finally:
            redis_server.resume()
        marker.result(timeout=30)
        s = node.stats()
        assert s["failures"] == {"l4_put_dropped": extra}  # the queued ones neither timed out nor failed
        # Batched puts, not one per block: the IO thread takes whatever is queued when it wakes
        # (one block or all of them, as the scheduler decides) and, after the hang, the rest at once.
        assert s["l4"]["calls"] - calls in (1, 2)
        assert s["bytes"]["l4_write"] == L4_MAX_QUEUED * layout.block_bytes
        assert node.l4.contains(keys) == [True] * L4_MAX_QUEUED + [False] * extra
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in range(2)]
        assert node.l4.get([keys[0], keys[L4_MAX_QUEUED - 1]], dst) == [True, True]
        assert same_bytes(dst[0], block_for(keys[0], layout))
        assert same_bytes(dst[1], block_for(keys[L4_MAX_QUEUED - 1], layout))
    finally:
        node.close()


def test_a_hung_pool_never_blocks_other_store_calls(redis_server, tmp_path, layout):
    import threading

    node = make_node(tmp_path, "n", layout, redis_server.url, timeout_ms=60_000)
    try:
        tokens = prompt(9, 2, layout)
        keys = save_prompt(node, prompt(10, 2, layout))
        drain(node)
        calls = node.stats()["l4"]["calls"]
        redis_server.pause()
        try:
            waiting = threading.Thread(target=node.lookup, args=(tokens,), kwargs={"pin": False})
            waiting.start()
            wait_for_a_call(node, calls)  # the lookup now waits on the hung pool (for up to 60 s)
            # The store lock is free meanwhile: other lookups, allocations and stats go on.
            assert node.lookup_keys(keys, pin=False).tiers == [Tier.L1] * 2
            node.free(node.allocate(1))
            node.stats()
            assert waiting.is_alive()
        finally:
            redis_server.resume()
        waiting.join(120)
        assert not waiting.is_alive()
    finally:
        node.close()


def test_first_call_of_a_fresh_tier_may_be_a_read(pool, tmp_path, layout):
    # Connecting is lazy: whichever call comes first (here a get) connects.
    writer = make_node(tmp_path, "w", layout, pool.url)
    reader = make_node(tmp_path, "r", layout, pool.url)
    try:
        keys = writer.hash(prompt(11, 2, layout))
        assert writer.l4.put(keys, [block_for(k, layout) for k in keys]) == [True, True]
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in keys]
        assert reader.l4.get(keys, dst) == [True, True]
        assert all(same_bytes(d, block_for(k, layout)) for d, k in zip(dst, keys))
    finally:
        writer.close()
        reader.close()


def test_connector_landing_slots_take_l4_values_in_place_until_unregistered(pool, tmp_path, layout):
    # The vLLM connector loads into LandingPool slots: registered with the store's L4 (with
    # trailer room on Mooncake), so a hit lands whole in place; a fresh tensor goes staged.
    from tierkv.connectors.vllm.landing import LandingPool

    a, b = two_nodes(tmp_path, layout, pool.url)
    landing = LandingPool(b, 8)
    try:
        tokens, keys = saved_in_l4(a, 21, 4, layout)
        m = b.lookup(tokens)
        assert m.tiers == [Tier.L4] * 4
        blocks = landing.take(4)
        assert landing.owns(blocks) and landing.num_free == 4 and blocks.data_ptr() % 4096 == 0
        assert b.load(m, list(blocks.unbind(0))).wait(30).ok == [True] * 4
        assert all(same_bytes(blk, block_for(k, layout)) for blk, k in zip(blocks, keys))
        s = b.stats()["l4"]
        if s["backend"] == "mooncake":
            assert landing.slots.slot_room >= TRAILER_BYTES
            assert s["in_place_calls"] >= 1 and s["direct_calls"] == 0 and s["staged_calls"] == 0
        b.release(m)
        landing.give_back(blocks)
        assert landing.num_free == 8

        # Once unregistered, the same slots are ordinary memory for the pool client: staged.
        registered = b.stats()["l4"].get("registered_bytes", 0)
        landing.close()
        m = b.lookup(tokens)
        blocks = landing.slots.pool[:4]
        assert b.load(m, list(blocks.unbind(0))).wait(30).ok == [True] * 4
        assert all(same_bytes(blk, block_for(k, layout)) for blk, k in zip(blocks, keys))
        s = b.stats()["l4"]
        if s["backend"] == "mooncake":
            assert s["staged_calls"] >= 1 and s["registered_bytes"] < registered
        b.release(m)
    finally:
        a.close()
        b.close()
