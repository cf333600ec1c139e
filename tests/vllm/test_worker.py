"""The connector's worker side on vLLM 0.32.0's CPU cache tensors, and its configuration.

Round trip: canonical blocks in the store -> a load into vLLM's per-layer
caches (checked through vLLM's own CPU-backend K/V split) -> a save gathered
back into the store -> the same bytes.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from harness import BLOCK, LAYERS, no_pins

from tierkv.connectors.vllm import worker as worker_module
from tierkv.connectors.vllm.config import load_config
from tierkv.connectors.vllm.layout import cache_view
from tierkv.connectors.vllm.metadata import LoadSpec, SaveSpec, TierKVMetadata
from tierkv.index import Tier


def run_step(e, meta: TierKVMetadata) -> None:
    w = e.worker
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name in LAYERS:  # as vLLM's attention layers do
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, e.caches[name], None)
    w.wait_for_save()
    w.clear_connector_metadata()


def canonical(e, n: int, seed: int) -> torch.Tensor:
    layout = e.store.layout
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *layout.block_shape, generator=gen).to(layout.torch_dtype)


def vllm_holds(e, block_id: int, block: torch.Tensor) -> bool:
    """Whether vLLM block ``block_id`` of every layer, read as the CPU backend reads it, is ``block``."""
    for layer, name in enumerate(LAYERS):
        key_cache, value_cache = e.layer_kv(name)
        if not torch.equal(key_cache[block_id].transpose(0, 1), block[layer, 0]):
            return False
        if not torch.equal(value_cache[block_id].transpose(0, 1), block[layer, 1]):
            return False
    return True


@pytest.mark.parametrize("save_async", [False, True])
def test_round_trip_canonical_vllm_canonical_is_byte_identical(engine, save_async):
    e = engine(save_async=save_async)
    blocks, keys = stored(e, 4, seed=0)
    run_step(e, TierKVMetadata(loads=[LoadSpec("x", keys, 1, [9, 2, 5], False)]))
    assert e.worker.get_block_ids_with_load_errors() == set()
    assert [vllm_holds(e, b, blocks[1 + j]) for j, b in enumerate([9, 2, 5])] == [True] * 3
    assert not e.caches[LAYERS[0]][[1, 3, 4, 6, 7, 8]].any()  # nothing else written

    keys2 = e.store.hash(list(range(1000, 1000 + 2 * BLOCK)))
    run_step(e, TierKVMetadata(saves=[SaveSpec(0, "y", keys2, 0, [2, 9])]))  # a partial batch
    e.worker._worker._drain()
    assert e.worker.build_connector_worker_meta().saves_done == {0: 2}
    m = e.store.lookup_keys(keys2)
    back = torch.zeros(2, *e.store.layout.block_shape, dtype=blocks.dtype)
    assert e.store.load(m, list(back.unbind(0))).wait().ok == [True, True]
    e.store.release(m)
    assert torch.equal(back[0].view(torch.int16), blocks[2].view(torch.int16))
    assert torch.equal(back[1].view(torch.int16), blocks[1].view(torch.int16))


def test_missing_blocks_are_reported_as_load_errors(engine):
    e = engine(save_async=False)
    blocks = canonical(e, 2, seed=1)
    keys = e.store.hash(list(range(3 * BLOCK)))
    assert e.store.put_blocks(keys[:2], list(blocks)) == [True, True]
    run_step(e, TierKVMetadata(loads=[LoadSpec("z", keys, 0, [4, 6, 8], False)]))
    assert e.worker.get_block_ids_with_load_errors() == {8}
    assert e.worker.get_block_ids_with_load_errors() == set()  # reported once
    assert vllm_holds(e, 4, blocks[0]) and vllm_holds(e, 6, blocks[1])
    assert e.worker.build_connector_worker_meta().loads_done == {"z"}


def stored(e, n: int, seed: int) -> tuple[torch.Tensor, list[bytes]]:
    """``n`` canonical blocks put into the store as the chain of tokens 0 .. n * BLOCK - 1."""
    blocks = canonical(e, n, seed=seed)
    keys = e.store.hash(list(range(n * BLOCK)))
    assert e.store.put_blocks(keys, list(blocks)) == [True] * n
    return blocks, keys


def layer_holds(e, layer: int, block_id: int, block: torch.Tensor) -> bool:
    key_cache, value_cache = e.layer_kv(LAYERS[layer])
    return (torch.equal(key_cache[block_id].transpose(0, 1), block[layer, 0])
            and torch.equal(value_cache[block_id].transpose(0, 1), block[layer, 1]))


@pytest.mark.parametrize("tier", ["l2", "l3", "l3-sliced"])
def test_a_synchronous_load_is_written_layer_by_layer_beside_the_forward(engine, tier, monkeypatch):
    # On a CPU cache start_load_kv hands the load to the feed thread and returns; each layer is in
    # vLLM's cache once wait_for_layer_load(layer) returns, as the attention layer that asks needs.
    # "l3-sliced": the L3 read comes in slices of whole layers (one layer each here), written as
    # they land.
    if tier == "l3-sliced":
        monkeypatch.setattr(worker_module, "_MIN_SLICE", 4096)
    e = engine(l2="0" if tier != "l2" else "16MiB", save_async=False)
    assert e.worker._worker._parts == (len(LAYERS) if tier == "l3-sliced" else 1)
    blocks, keys = stored(e, 3, seed=3)
    e.store.flush()
    m = e.store.lookup_keys(keys)
    assert m.tiers == [Tier.L2 if tier == "l2" else Tier.L3] * 3
    e.store.release(m)
    w = e.worker
    w.bind_connector_metadata(TierKVMetadata(loads=[LoadSpec("f", keys, 0, [7, 3, 5], False)]))
    w.start_load_kv(None)
    for layer, name in enumerate(LAYERS):
        w.wait_for_layer_load(name)
        assert [layer_holds(e, layer, b, blocks[j]) for j, b in enumerate([7, 3, 5])] == [True] * 3
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set()
    assert w.build_connector_worker_meta().loads_done == {"f"}
    assert no_pins(e)
    w.clear_connector_metadata()


def test_a_sliced_l3_load_written_before_it_was_verified_reports_the_bad_block_and_after(engine, monkeypatch):
    # Slices are written into vLLM's cache as they land, before the block is verified; a block that
    # then fails its checksum, and every block after it, is reported, so vLLM recomputes from there.
    monkeypatch.setattr(worker_module, "_MIN_SLICE", 4096)
    e = engine(l2="0", save_async=False)
    blocks, keys = stored(e, 3, seed=6)
    e.store.flush()
    l3 = e.store.tiers[Tier.L3]
    slot = {r.key: r.slot for r in l3.records()}
    with open(l3.path / "slots.bin", "r+b") as fh:
        fh.seek(slot[keys[1]] * l3.stride + e.store.layout.block_bytes - 3)  # the last layer's slice
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    run_step(e, TierKVMetadata(loads=[LoadSpec("s", keys, 0, [4, 5, 6], False)]))
    assert e.worker.get_block_ids_with_load_errors() == {5, 6}
    assert vllm_holds(e, 4, blocks[0])
    assert e.worker.build_connector_worker_meta().loads_short == {"s": 1}
    assert e.store.metrics.snapshot()["failures"].get("l3_corrupt") == 1
    assert no_pins(e)


def test_a_layer_the_forward_did_not_wait_for_makes_the_load_an_error_and_ends_layer_feeding(engine):
    # If vLLM ran an attention layer without wait_for_layer_load, it may have read the cache before
    # the feed wrote it: the load's blocks are reported (vLLM drops the output and recomputes), and
    # later loads are written whole before start_load_kv returns.
    e = engine(save_async=False)
    blocks, keys = stored(e, 2, seed=4)
    w = e.worker
    w.bind_connector_metadata(TierKVMetadata(loads=[LoadSpec("a", keys, 0, [1, 2], False)]))
    w.start_load_kv(None)
    w.wait_for_layer_load(LAYERS[0])  # the second layer is never waited for
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == {1, 2}
    assert w.build_connector_worker_meta().loads_short == {"a": 0}
    w.clear_connector_metadata()
    assert no_pins(e)
    w.bind_connector_metadata(TierKVMetadata(loads=[LoadSpec("b", keys, 0, [4, 6], False)]))
    w.start_load_kv(None)  # written whole: no wait_for_layer_load needed
    assert vllm_holds(e, 4, blocks[0]) and vllm_holds(e, 6, blocks[1])
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set()
    w.clear_connector_metadata()


def test_load_by_layer_never_writes_the_load_before_start_load_kv_returns(engine):
    e = engine(save_async=False, load_by_layer="never")
    blocks, keys = stored(e, 2, seed=5)
    w = e.worker
    w.bind_connector_metadata(TierKVMetadata(loads=[LoadSpec("n", keys, 0, [3, 8], False)]))
    w.start_load_kv(None)
    assert vllm_holds(e, 3, blocks[0]) and vllm_holds(e, 8, blocks[1])
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set()
    w.clear_connector_metadata()


def test_register_refuses_an_unknown_layout(engine):
    e = engine()
    layout = e.store.layout
    legacy = {n: torch.zeros(2, 64, BLOCK, layout.num_kv_heads, layout.head_dim, dtype=torch.float16)
              for n in LAYERS}
    with pytest.raises(ValueError, match=r"unknown layout \(2, 64, 32, 4, 32\).*\[num_blocks, 4, 32, 64\]"):
        e.worker.register_kv_caches(legacy)
    apart = {n: torch.zeros(64, layout.num_kv_heads, BLOCK, 2 * layout.head_dim, dtype=torch.float16)
             for n in LAYERS}
    with pytest.raises(ValueError, match="not in the same allocation"):
        e.worker.register_kv_caches(apart)
    with pytest.raises(ValueError, match="no cache for layers"):
        e.worker.register_kv_caches({LAYERS[0]: e.caches[LAYERS[0]]})


def test_view_over_vllm_caches_is_the_cpu_backend_split(engine):
    e = engine()
    kv = cache_view(e.caches, LAYERS, e.store.layout, "planes")
    e.caches[LAYERS[1]].copy_(torch.arange(e.caches[LAYERS[1]].numel()).view_as(e.caches[LAYERS[1]]) % 2039)
    key_cache, value_cache = e.layer_kv(LAYERS[1])
    assert torch.equal(kv[1, :, 0], key_cache.transpose(1, 2))
    assert torch.equal(kv[1, :, 1], value_cache.transpose(1, 2))
    assert kv.untyped_storage().data_ptr() == e.caches[LAYERS[0]].untyped_storage().data_ptr()


def test_config_layers_extra_config_and_env():
    extra = {"l2": {"capacity": "2GiB"}, "l1": {"num_blocks": 8}, "vllm": {"load_async": "always"}}
    env = {"TIERKV_L2_CAPACITY": "1GiB", "TIERKV_VLLM_SAVE_ASYNC": "false", "TIERKV_VLLM_LANDING_BLOCKS": "64"}
    cfg = load_config(extra, "my/model", "abc", env=env)
    assert cfg.store.model_id == "my/model" and cfg.store.model_revision == "abc"
    assert cfg.store.l2.capacity == 1 << 30 and cfg.store.l1.num_blocks == 0
    assert (cfg.vllm.load_async, cfg.vllm.save_async, cfg.vllm.landing_blocks) == ("always", False, 64)


@pytest.mark.parametrize("extra, env, message", [
    ({"vllm": {"load_async": "sometimes"}}, {}, "vllm.load_async: expected one of ['auto', 'always', 'never']"),
    ({"vllm": {"speed": 1}}, {}, "vllm.speed: unknown setting"),
    ({"l2": {"capacity": "lots"}}, {}, "l2.capacity: expected a size"),
    ({}, {"TIERKV_VLLM_COLOR": "red"}, "TIERKV_VLLM_COLOR: unknown setting vllm.color"),
    ({"vllm": {"landing_blocks": -1}}, {}, "vllm.landing_blocks: expected an integer >= 0, got -1"),
    ({}, {"TIERKV_VLLM_LANDING_BLOCKS": "lots"}, "vllm.landing_blocks: expected an integer >= 0, got 'lots'"),
    ({"vllm": {"load_by_layer": "yes"}}, {}, "vllm.load_by_layer: expected one of ['auto', 'never'], got 'yes'"),
    ({"vllm": {"io_cpus": "1-"}}, {}, "vllm.io_cpus: expected 'auto', 'inherit' or a CPU list"),
    ({}, {"TIERKV_VLLM_IO_CPUS": "3-1"}, "vllm.io_cpus: expected 'auto', 'inherit' or a CPU list"),
])
def test_config_errors_name_the_field(extra, env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(extra, "m", None, env=env)


@pytest.mark.parametrize("landing_blocks, lands", [(64, True), (2, False), (0, False)])
def test_loads_land_in_page_aligned_slots_or_fall_back_to_a_fresh_tensor(engine, landing_blocks, lands):
    # An async L3 load of 3 blocks holds 3 consecutive landing slots until it is scattered, then
    # gives them back; with fewer slots than that (or none) it lands in a fresh tensor instead.
    # Either way vLLM's blocks end up with the same bytes.
    e = engine(l2="0", save_async=False, landing_blocks=landing_blocks)
    w = e.worker._worker
    blocks, keys = stored(e, 3, seed=7)
    run_step(e, TierKVMetadata(loads=[LoadSpec("r", keys, 0, [9, 2, 5], True)]))
    (load,) = w._async.values()
    assert w.landing.owns(load.staging) == lands
    if lands:
        assert load.staging.data_ptr() % 4096 == 0 and w.landing.num_free == landing_blocks - 3
    deadline = time.monotonic() + 30
    while w._async:
        assert time.monotonic() < deadline, "the async load never finished"
        w.get_finished(set())
        time.sleep(0.01)
    assert w.landing.num_free == landing_blocks and w.landing.fallbacks == (0 if lands else 1)
    assert w.get_block_ids_with_load_errors() == set()
    assert [vllm_holds(e, b, blk) for b, blk in zip([9, 2, 5], blocks)] == [True] * 3
