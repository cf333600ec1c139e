"""tierkv's KV events decode with vLLM's own msgspec classes, and vLLM's encode with tierkv's (in .venv-vllm)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

vllm_events = pytest.importorskip("vllm.distributed.kv_events", reason="runs in .venv-vllm (make test-vllm)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _kv import LAYOUT, prompt, save_prompt, store_config  # noqa: E402

from tierkv.kvevents import KVEventPublisher, PublisherConfig, wire  # noqa: E402
from tierkv.kvevents.wire import seq_bytes, seq_of  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402

K1, K2, K3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


def test_every_field_of_tierkv_events_decodes_with_vllm_classes():
    batch = wire.KVEventBatch(123.5, [
        wire.BlockStored([K1, K2], K3, [1, 2, 3], 16, None, "L2", None, group_idx=1, locality="LOCAL",
                         session_id="s"),
        wire.BlockRemoved([K1], "L1", ownership="o"),
        wire.AllBlocksCleared(),
    ], data_parallel_rank=0)
    got = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert got.ts == 123.5 and got.data_parallel_rank == 0
    stored, removed, cleared = got.events
    assert isinstance(stored, vllm_events.BlockStored) and isinstance(removed, vllm_events.BlockRemoved)
    assert isinstance(cleared, vllm_events.AllBlocksCleared)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == ([K1, K2], K3,
                                                                                                     [1, 2, 3], 16)
    assert (stored.medium, stored.group_idx, stored.locality, stored.session_id) == ("L2", 1, "LOCAL", "s")
    assert (removed.block_hashes, removed.medium, removed.ownership) == ([K1], "L1", "o")


def test_vllm_encoded_events_decode_with_tierkv_classes():
    batch = vllm_events.KVEventBatch(ts=1.0, events=[
        vllm_events.BlockStored(block_hashes=[K1], parent_block_hash=None, token_ids=[5] * 16, block_size=16,
                                lora_id=None, medium=vllm_events.MEDIUM_GPU, lora_name=None),
        vllm_events.BlockRemoved(block_hashes=[K1], medium=vllm_events.MEDIUM_CPU),
    ])
    got = msgspec.msgpack.Decoder(wire.KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockRemoved"]
    assert got.events[0].token_ids == [5] * 16 and got.events[1].medium == "CPU"
    assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(batch)


def test_a_stores_live_stream_and_replay_decode_with_vllm_classes(tmp_path):
    store = TierKVStore(store_config(LAYOUT, 4, 16, tmp_path / "l3"), LAYOUT, l1_blocks=4)
    pub = KVEventPublisher(PublisherConfig(block_size=LAYOUT.block_size))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"tierkv@")
    sub.connect(pub.endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: the SUB's subscription reaches the PUB
    decode = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode
    try:
        pub.attach(store)
        for i in range(3):  # 12 blocks through a 4-block L1 and L2: demotions to L3
            save_prompt(store, prompt(i, 4, LAYOUT))
        store.flush()
        assert pub.flush()
        live = []
        while sub.poll(300):
            topic, seq, payload = sub.recv_multipart()
            live.append((seq_of(seq), decode(payload)))
        assert [s for s, _ in live] == list(range(len(live))) and live
        media = {e.medium for _, b in live for e in b.events}
        assert media == {"L1", "L2", "L3"}
        # Replay as vLLM's protocol asks for it: (b"", start) on a DEALER; batches, then END_SEQ.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", seq_bytes(0)))
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == vllm_events.ZmqEventPublisher.END_SEQ:
                break
            replayed.append((seq_of(seq), decode(payload)))
        assert [s for s, _ in replayed] == [s for s, _ in live]
        assert [b.events for _, b in replayed] == [b.events for _, b in live]
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.close()
        store.close()
