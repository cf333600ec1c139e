"""Value trailer (codec.py), MAC, circuit breaker and deadline: pure, no server."""

from __future__ import annotations

import pytest
import torch
import xxhash
from _kv import LAYOUT, ODD_LAYOUT, block_for, key_of, same_bytes

from tierkv.config import L4Config
from tierkv.tiers.remote import open_remote
from tierkv.tiers.base import as_bytes
from tierkv.tiers.remote.base import CircuitBreaker, Deadline, RemoteUnavailable
from tierkv.tiers.remote.codec import (
    CORRUPT, FOREIGN, LAYOUT as LAYOUT_VERDICT, OK, TRAILER_BYTES, TRUNCATED, UNAUTHENTICATED, ValueCodec)


def encode(codec: ValueCodec, key: bytes, layout=LAYOUT) -> bytearray:
    buf = bytearray(codec.value_bytes)
    codec.encode_into(key, block_for(key, layout), memoryview(buf))
    return buf


def test_round_trip_is_byte_identical():
    codec, key = ValueCodec(LAYOUT), key_of("a")
    value = encode(codec, key)
    P = LAYOUT.block_bytes
    assert len(value) == P + TRAILER_BYTES and value[P:P + 4] == b"TKV4"
    assert same_bytes(torch.frombuffer(bytearray(value[:P]), dtype=LAYOUT.torch_dtype).view(LAYOUT.block_shape),
                      block_for(key, LAYOUT))  # the payload is the block's bytes, from offset 0
    assert codec.check(key, memoryview(value)) == OK
    # Split as a backend delivers it: the payload landed in the block itself, the trailer apart.
    out = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    payload = as_bytes(out)
    payload[:] = value[:P]
    tail = bytes(value[P:])
    assert codec.verify(key, len(value), tail, payload) == OK
    assert same_bytes(out, block_for(key, LAYOUT))
    payload[5] ^= 1
    assert codec.verify(key, len(value), tail, payload) == CORRUPT
    # The payload is not even read when the trailer already says no.
    assert codec.verify(key, len(value) - 1, tail, memoryview(b"")) == TRUNCATED
    assert codec.verify(key, len(value) + 1, b"", memoryview(b"")) == LAYOUT_VERDICT  # too big to hold
    assert codec.verify(key, 10, bytes(value[:10]), memoryview(b"")) == TRUNCATED
    assert codec.verify(key, len(value), b"\x00" * TRAILER_BYTES, memoryview(b"")) == FOREIGN


def test_every_bad_value_has_its_reason():
    codec, key = ValueCodec(LAYOUT), key_of("b")
    value = encode(codec, key)
    assert codec.check(key_of("other"), memoryview(value)) == FOREIGN
    assert codec.check(key, memoryview(value[:-1])) == TRUNCATED
    assert codec.check(key, memoryview(value[:10])) == TRUNCATED
    assert codec.check(key, memoryview(b"")) == TRUNCATED
    assert codec.check(key, memoryview(b"\x00" * len(value))) == FOREIGN
    flipped = bytearray(value)
    flipped[7] ^= 1
    assert codec.check(key, memoryview(flipped)) == CORRUPT
    odd = ValueCodec(ODD_LAYOUT)
    assert codec.check(key, memoryview(encode(odd, key, ODD_LAYOUT))) == LAYOUT_VERDICT


def test_mac_rejects_values_written_without_or_with_another_key():
    signed, key = ValueCodec(LAYOUT, "k1"), key_of("c")
    assert signed.check(key, memoryview(encode(signed, key))) == OK
    assert signed.check(key, memoryview(encode(ValueCodec(LAYOUT), key))) == UNAUTHENTICATED
    assert signed.check(key, memoryview(encode(ValueCodec(LAYOUT, "k2"), key))) == UNAUTHENTICATED
    tampered = encode(signed, key)
    tampered[-1] ^= 1
    assert signed.check(key, memoryview(tampered)) == UNAUTHENTICATED
    # A reader without the key still checks the checksum of a signed value.
    assert ValueCodec(LAYOUT).check(key, memoryview(encode(signed, key))) == OK


def test_breaker_opens_probes_and_closes():
    now = [0.0]
    b = CircuitBreaker(failures=2, reset_s=1.0, clock=lambda: now[0])
    assert b.allow() and b.state == "closed"
    b.failure()
    assert b.allow() and b.state == "closed"
    b.failure()
    assert b.state == "open" and not b.allow() and b.opens == 1
    now[0] = 1.5
    assert b.state == "half_open"
    assert b.allow() and not b.allow()  # exactly one probe
    b.failure()
    assert b.state == "open" and b.opens == 2 and not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_deadline_gives_up_and_keeps_the_gate_until_the_late_call_ends():
    import threading

    release = threading.Event()
    d = Deadline(0.05, "test")
    with pytest.raises(RemoteUnavailable, match="timeout"):
        d.run(release.wait)
    with pytest.raises(RemoteUnavailable, match="busy"):
        d.run(lambda: 1)
    release.set()
    assert d.run(lambda: 2, after=lambda r: r + 1) == 3
    d.close()


def test_unreachable_pool_is_misses_not_exceptions():
    # Nothing listens on port 1: every call fails fast, is counted, and the breaker opens.
    failures = []
    tier = open_remote(L4Config(url="redis://127.0.0.1:1/0", timeout_ms=100, breaker_failures=2),
                       LAYOUT, lambda *a: failures.append(a))
    key = key_of("d")
    dst = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)]
    assert tier.contains([key]) == [False]
    assert tier.put([key], [block_for(key, LAYOUT)]) == [False]
    assert tier.get([key], dst) == [False]
    s = tier.stats()
    assert s["failed_calls"] == 2 and s["skipped_calls"] == 1 and s["breaker"] == "open"
    assert [f[1] for f in failures] == ["unavailable", "unavailable", "breaker_open"]
    tier.close()


def test_bad_urls_name_the_field():
    with pytest.raises(ValueError, match="l4.url"):
        open_remote(L4Config(url="mooncake://nohost"), LAYOUT)
    with pytest.raises(ValueError, match="unknown mooncake option 'segmnt'"):
        open_remote(L4Config(url="mooncake://127.0.0.1:1?segmnt=1GB"), LAYOUT)
    with pytest.raises(ValueError, match="protocol"):
        open_remote(L4Config(url="mooncake://127.0.0.1:1?protocol=ib"), LAYOUT)


def test_rdma_detection_never_raises_and_says_why():
    from tierkv.tiers.remote import rdma

    report = rdma.detect()
    assert report.usable or report.reason  # devices with an active port, or the reason there are none
    assert report.summary().startswith("rdma: ")
    if not report.usable:
        assert "TCP" in report.summary()
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine cannot be imported here")
    from tierkv.tiers.remote import open_backend

    backend = open_backend("mooncake://127.0.0.1:1", 100, 4096)  # connecting is lazy: nothing listens there
    try:
        assert backend.protocol == ("rdma" if report.usable else "tcp")
        assert backend.info()["rdma_reason"] == ("" if report.usable else report.reason)
    finally:
        backend.close()


def test_a_cluster_that_is_down_at_start_is_misses_not_a_start_up_error():
    failures = []
    tier = open_remote(L4Config(url="redis+cluster://127.0.0.1:1", timeout_ms=100), LAYOUT,
                       lambda *a: failures.append(a))
    assert tier.contains([key_of("e")]) == [False]
    assert [f[1] for f in failures] == ["unavailable"]
    assert tier.stats()["url"] == "redis+cluster://127.0.0.1:1"
    tier.close()


def test_urls_in_stats_never_show_a_password():
    from tierkv.tiers.remote.redis import display_url

    assert display_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert display_url("rediss://h:1/0?password=secret&ssl_cert_reqs=none") == "rediss://h:1/0"


def test_checksum_by_address_matches_the_python_api(monkeypatch):
    # Tensors are hashed through xxhash's exported XXH3_64bits by address when it is there;
    # both routes must give the same trailer and the same verdicts, for every dtype.
    from tierkv.tiers.remote import codec as base

    codec, key = ValueCodec(LAYOUT, "k"), key_of("addr")
    block = block_for(key, LAYOUT)
    bf16 = torch.randn(4, 33).to(torch.bfloat16)
    fast = (codec.trailer(key, block), base._xxh3(bf16))
    monkeypatch.setattr(base, "_XXH3_AT", None)
    slow = (codec.trailer(key, block), base._xxh3(bf16))
    assert fast == slow and slow[1] == xxhash.xxh3_64_intdigest(bf16.view(torch.uint8).numpy().tobytes())
    value = encode(codec, key)
    out = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    as_bytes(out)[:] = value[:LAYOUT.block_bytes]
    assert codec.verify(key, len(value), bytes(value[LAYOUT.block_bytes:]), out) == OK


def test_regions_know_which_slots_have_room_for_a_trailer():
    from tierkv.tiers.remote.regions import Regions

    block, slot = 4096, 8192
    r = Regions()
    r.add(1 << 20, 4 * slot, slot_bytes=slot)  # four slots with room
    r.add(1 << 24, 4 * block)                  # blocks back to back
    starts = [(1 << 20) + i * slot for i in range(4)]
    assert r.with_room(starts, block) and r.covers(starts, block)
    assert not r.with_room([starts[0] + 64], block)            # not a slot start
    assert not r.with_room([(1 << 24) + block], block)          # registered, but no room
    assert r.covers([(1 << 24) + block], block)
    assert not r.with_room(starts, slot)                        # a block as large as the slot: no room left
    assert not r.with_room([(1 << 20) + 4 * slot], block) and not r.covers([1 << 19], block)  # outside
    r.remove(1 << 20)
    assert not r.with_room(starts[:1], block) and not r.covers(starts[:1], block)


def test_registering_room_that_the_slots_do_not_have_is_refused():
    tier = open_remote(L4Config(url="redis://127.0.0.1:1/0", timeout_ms=100), LAYOUT)
    try:
        dense = torch.empty((4, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
        with pytest.raises(ValueError, match="room=64"):
            tier.register(dense, room=64)
        tier.register(dense)  # no room claimed: fine
    finally:
        tier.close()
