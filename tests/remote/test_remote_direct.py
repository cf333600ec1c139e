"""The zero-staging paths against real servers: payloads straight into and out of the caller's blocks.

Mooncake moves blocks in registered memory in one piece where each block has
room for its trailer after it (the store's L1 pool), else with two-piece
transfers (block in place + trailer page); Redis GET replies are parsed by tierkv and received
straight into the block. Both must give the same bytes and the same verdicts
as the staged paths, never write a caller's block after returning, and keep
their connections usable after odd replies.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _kv import LAYOUT, block_for, key_of, same_bytes

from tierkv.config import L4Config
from tierkv.tiers.device import DeviceTier
from tierkv.tiers.remote import open_remote
from tierkv.tiers.remote.codec import TRAILER_BYTES, ValueCodec

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["redis", "mooncake"])
def pool(request):
    return request.getfixturevalue("redis_server" if request.param == "redis" else "mooncake_pool")


def tier_for(url: str, **fields):
    fields.setdefault("timeout_ms", 1000)
    return open_remote(L4Config(url=url, **fields), LAYOUT)


def pool_tensor(n: int) -> torch.Tensor:
    """A block pool like the store's L1 (blocks back to back), filled with garbage."""
    t = torch.empty((n, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    t.view(torch.int16).fill_(-1)
    return t


def room_pool(n: int) -> DeviceTier:
    """The store's L1 pool with a Mooncake L4: each slot keeps room for a trailer after its block."""
    l1 = DeviceTier(LAYOUT, n, "cpu", slot_room=TRAILER_BYTES)
    l1.pool.view(torch.int16).fill_(-1)
    return l1


@pytest.mark.parametrize("memory", ["dense", "room"])
def test_registered_blocks_move_directly_and_read_back_either_way(pool, memory):
    keys = [key_of("direct", i) for i in range(40)]  # more than one 32-value chunk
    if memory == "dense":
        src, dst, room = pool_tensor(40), pool_tensor(40), 0
    else:
        src_l1, dst_l1 = room_pool(40), room_pool(40)
        src, dst, room = src_l1.pool, dst_l1.pool, src_l1.slot_room
    for i, k in enumerate(keys):
        src[i].copy_(block_for(k, LAYOUT))
    writer, reader = tier_for(pool.url), tier_for(pool.url)
    try:
        writer.register(src, room=room)
        reader.register(dst, room=room)
        assert writer.put(keys, list(src)) == [True] * 40
        assert reader.get(keys, list(dst)) == [True] * 40
        assert all(same_bytes(dst[i], src[i]) for i in range(40))
        # Unregistered memory (staged on Mooncake) reads the same values, byte for byte.
        loose = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in keys]
        assert reader.get(keys, loose) == [True] * 40
        assert all(same_bytes(loose[i], src[i]) for i in range(40))
        # And a staged put reads back through the direct path.
        more = [key_of("staged", i) for i in range(3)]
        assert writer.put(more, [block_for(k, LAYOUT) for k in more]) == [True] * 3
        assert reader.get(more, list(dst[:3])) == [True] * 3
        assert all(same_bytes(dst[i], block_for(k, LAYOUT)) for i, k in enumerate(more))
        s = reader.stats()
        if s["backend"] == "mooncake":
            moved = s["in_place_calls"] if room else s["direct_calls"]
            assert moved >= 3 and s["staged_calls"] >= 1
            assert s["in_place_calls" if not room else "direct_calls"] == 0
            assert s["registered_bytes"] == 40 * (LAYOUT.block_bytes + room)
            assert writer.stats()["in_place_calls" if room else "direct_calls"] == 2  # 32 + 8 values
        assert s["hits"] == 83 and s["bad_values"] == 0
    finally:
        writer.close()
        reader.close()


def put_odd_values(tier, pool, tag: str, longer_by: int) -> tuple[list[bytes], list[torch.Tensor]]:
    """Six keys: two good values put through ``tier``, then planted straight in the pool a truncated
    one, one ``longer_by`` bytes too long, one shorter than a trailer; the sixth is missing."""
    keys = [key_of(tag, i) for i in range(6)]
    good = [block_for(k, LAYOUT) for k in keys]
    assert tier.put(keys[:2], good[:2]) == [True, True]
    codec = ValueCodec(LAYOUT)
    whole = bytearray(codec.value_bytes)
    codec.encode_into(keys[2], good[2], memoryview(whole))
    pool.plant(tier.key_name(keys[2]), bytes(whole[:-7]))
    pool.plant(tier.key_name(keys[3]), bytes(whole) + b"m" * longer_by)
    pool.plant(tier.key_name(keys[4]), b"x" * 5)
    return keys, good


def test_odd_values_in_a_direct_batch_get_their_own_verdicts(pool):
    tier = tier_for(pool.url)
    dst = pool_tensor(6)
    tier.register(dst)
    try:
        keys, good = put_odd_values(tier, pool, "odd", longer_by=4)
        assert tier.get(keys, list(dst)) == [True, True, False, False, False, False]
        assert same_bytes(dst[0], good[0]) and same_bytes(dst[1], good[1])
        s = tier.stats()
        assert s["bad_values"] == 3 and s["misses"] == 4
        # The connection and client are still good for the next batch.
        assert tier.get(keys[:2], list(dst[:2])) == [True, True]
    finally:
        tier.close()


def test_a_value_landing_in_place_never_writes_past_its_slot_room(mooncake_pool):
    # Every other slot is a destination; the slots between them hold live blocks that nothing may
    # touch, whatever arrives: good values, a longer one, a truncated one, a tiny one, a missing one.
    tier = tier_for(mooncake_pool.url)
    l1 = room_pool(12)
    tier.register(l1.pool, room=l1.slot_room)
    try:
        keys, good = put_odd_values(tier, mooncake_pool, "room", longer_by=5000)  # longer than slot + room
        live = {2 * i + 1: block_for(key_of("live", i), LAYOUT) for i in range(6)}
        for slot, block in live.items():
            l1.block(slot).copy_(block)
        dst = [l1.block(2 * i) for i in range(6)]
        assert tier.get(keys, dst) == [True, True, False, False, False, False]
        assert same_bytes(dst[0], good[0]) and same_bytes(dst[1], good[1])
        assert all(same_bytes(l1.block(slot), block) for slot, block in live.items()), "a neighbour was written"
        s = tier.stats()
        assert s["bad_values"] == 3 and s["misses"] == 4 and s["in_place_calls"] >= 1
        # The room past the block held the trailer: the stored value is block || trailer.
        room = torch.frombuffer(l1._mm, dtype=torch.uint8)[LAYOUT.block_bytes:LAYOUT.block_bytes + 4]
        assert bytes(room.tolist()) == b"TKV4"
        assert tier.get(keys[:2], dst[:2]) == [True, True]
    finally:
        tier.close()


def test_redis_reader_survives_error_replies_and_reuses_its_connection(redis_server):
    tier = tier_for(redis_server.url)
    try:
        keys = [key_of("wrongtype", i) for i in range(3)]
        assert tier.put([keys[0], keys[2]], [block_for(k, LAYOUT) for k in (keys[0], keys[2])]) == [True, True]
        c = redis_server.client()
        c.rpush(tier.key_name(keys[1]), b"a list, not a string")  # GET answers -WRONGTYPE
        c.close()
        dst = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in keys]
        for _ in range(3):  # the same pooled connection serves every round
            assert tier.get(keys, dst) == [True, False, True]
            assert same_bytes(dst[0], block_for(keys[0], LAYOUT)) and same_bytes(dst[2], block_for(keys[2], LAYOUT))
        assert tier.stats()["failed_calls"] == 0
        # A strided destination (a slice of a bigger pool) is served through a bounce block.
        layers, *rest = LAYOUT.block_shape
        wide = torch.zeros((layers, 2, *rest), dtype=LAYOUT.torch_dtype)
        assert tier.get([keys[0]], [wide[:, 1]]) == [True]
        assert same_bytes(wide[:, 1].contiguous(), block_for(keys[0], LAYOUT)) and not wide[:, 0].any()
    finally:
        tier.close()


def test_redis_reports_each_value_as_it_lands_and_the_tier_checks_it_then(redis_server):
    # The tier checks a value while it is still in cache: the backend must report value i once
    # it is whole in its block and before value i + 1 is read, with what the result will hold.
    tier = tier_for(redis_server.url)
    try:
        keys = [key_of("landed", i) for i in range(4)]
        assert tier.put(keys, [block_for(k, LAYOUT) for k in keys]) == [True] * 4
        tier.backend.delete([tier.key_name(keys[2])])  # a miss in the middle
        dst = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in keys]
        names = [tier.key_name(k) for k in keys]
        seen = []

        def landed(i, length, tail):
            seen.append(i)
            if length > 0:
                assert same_bytes(dst[i], block_for(keys[i], LAYOUT))
            later = [j for j in range(i + 1, len(keys)) if j != 2]
            assert not any(dst[j].any() for j in later), "a later value arrived before this one was reported"

        found = tier.backend.read_into(names, dst, landed)
        assert seen == [0, 1, 2, 3]
        assert [length for length, _ in found] == [LAYOUT.block_bytes + TRAILER_BYTES] * 2 + [-1] + [
            LAYOUT.block_bytes + TRAILER_BYTES]
        # Through the tier the reported verdicts are the ones used: a value corrupted on the
        # server is a counted miss, its neighbours hits.
        c = redis_server.client()
        c.setrange(names[1], 100, b"\x00\x01\x02")
        c.close()
        out = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in keys]
        assert tier.get(keys, out) == [True, False, False, True]
        assert same_bytes(out[3], block_for(keys[3], LAYOUT))
        assert tier.stats()["bad_values"] == 1
    finally:
        tier.close()


def test_a_hung_mooncake_node_ends_a_direct_get_while_it_is_still_hung(mooncake_pool):
    # SIGSTOP the process holding the pool's memory: the transfer stalls mid-call. The direct get
    # must return (Mooncake's own progress timeout, set from l4.timeout_ms) with False while the
    # node is still stopped, and nothing may land in the block after it returned, even once the
    # node runs again and serves the same values.
    tier = tier_for(mooncake_pool.url, timeout_ms=500, breaker_failures=100)
    dst, probe = pool_tensor(4), pool_tensor(4)
    tier.register(dst)
    tier.register(probe)
    try:
        keys = [key_of("hang", i) for i in range(4)]
        assert tier.put(keys, [block_for(k, LAYOUT) for k in keys]) == [True] * 4
        mooncake_pool.pool.pause()
        got: list = []
        call = threading.Thread(target=lambda: got.append(tier.get(keys, list(dst))), daemon=True)
        try:
            call.start()
            call.join(120)  # generous; the point is that it returns while the node is stopped
            assert not call.is_alive(), "the get waited for the hung node"
            assert got == [[False] * 4]
            dst.view(torch.int16).fill_(7)
            after = dst.clone()
        finally:
            mooncake_pool.pool.resume()
        # The node runs again: wait until it serves these values (a late transfer of the old
        # call would have landed by then), then check the old destination was left alone.
        deadline = time.monotonic() + 120
        while tier.get(keys, list(probe)) != [True] * 4:
            assert time.monotonic() < deadline, f"the node never served again: {tier.stats()}"
            time.sleep(0.1)
        assert all(same_bytes(probe[i], block_for(k, LAYOUT)) for i, k in enumerate(keys))
        assert torch.equal(dst.view(torch.int16), after.view(torch.int16)), "a late transfer wrote into the block"
    finally:
        tier.close()


def test_direct_calls_from_many_threads(pool):
    tier = tier_for(pool.url)
    n, threads = 16, 4
    src, dst = pool_tensor(n * threads), pool_tensor(n * threads)
    tier.register(src)
    tier.register(dst)
    keys = [key_of("threads", i) for i in range(n * threads)]
    for i, k in enumerate(keys):
        src[i].copy_(block_for(k, LAYOUT))
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            part = slice(t * n, (t + 1) * n)
            for _ in range(3):
                assert tier.put(keys[part], list(src[part])) == [True] * n
                assert tier.get(keys[part], list(dst[part])) == [True] * n
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    try:
        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not errors, errors
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
    finally:
        tier.close()


def test_trailer_is_last_and_payload_first_on_the_wire(redis_server):
    # The stored value's first bytes are the block itself: a reader can land them anywhere as is.
    tier = tier_for(redis_server.url)
    try:
        key = key_of("wire")
        block = block_for(key, LAYOUT)
        assert tier.put([key], [block]) == [True]
        c = redis_server.client()
        raw = c.get(tier.key_name(key))
        c.close()
        assert len(raw) == LAYOUT.block_bytes + TRAILER_BYTES
        assert raw[:LAYOUT.block_bytes] == block.view(torch.uint8).reshape(-1).numpy().tobytes()
        assert raw[LAYOUT.block_bytes:LAYOUT.block_bytes + 4] == b"TKV4"
    finally:
        tier.close()


def test_bfloat16_blocks_round_trip(pool):
    # numpy has no bfloat16: checksums and socket reads must treat blocks as bytes, whatever the dtype.
    from tierkv.layout import KVLayout

    bf16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8, dtype="bfloat16")
    tier = open_remote(L4Config(url=pool.url, timeout_ms=1000, key_prefix="bf16"), bf16)
    try:
        keys = [key_of("bf16", i) for i in range(3)]
        src = torch.randn((3, *bf16.block_shape)).to(torch.bfloat16)
        dst = torch.zeros_like(src)
        tier.register(src)
        tier.register(dst)
        assert tier.put(keys, list(src)) == [True] * 3
        assert tier.get(keys, list(dst)) == [True] * 3
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
        loose = [torch.zeros(bf16.block_shape, dtype=torch.bfloat16) for _ in keys]
        assert tier.get(keys, loose) == [True] * 3
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(loose, src))
    finally:
        tier.close()


def test_a_put_that_fails_mid_batch_leaves_no_half_sent_commands_on_the_connection(redis_server):
    # Trailers are built as the blocks go out: if building one raises after others were sent,
    # the pooled connection must not carry their replies into the next call.
    tier = tier_for(redis_server.url)
    try:
        keys = [key_of("half", i) for i in range(3)]
        blocks = [block_for(k, LAYOUT) for k in keys]

        def failing(i):
            if i == 2:
                raise RuntimeError("trailer failed")
            return tier.codec.trailer(keys[i], blocks[i])

        with pytest.raises(RuntimeError, match="trailer failed"):
            tier.backend.write([tier.key_name(k) for k in keys], failing, blocks)
        for _ in range(2):  # the pool's next connection answers its own commands
            assert tier.put(keys, blocks) == [True] * 3
            dst = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype) for _ in keys]
            assert tier.get(keys, dst) == [True] * 3
            assert all(same_bytes(d, b) for d, b in zip(dst, blocks))
        assert tier.stats()["failed_calls"] == 0
    finally:
        tier.close()
