"""gather_blocks / scatter_blocks: the torch references against a per-block loop,
the Triton kernel (under TRITON_INTERPRET=1 in a subprocess) against the
references, round trips, and the argument checks of both launchers.

Each case builds an engine cache the way vLLM 0.32.0 lays one out (one
allocation for all layers) and views it as [L, num_blocks, 2, B, Hkv, D]."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from _interpret import interpreted
import tierkv.kernels as kernels
from tierkv.kernels.reference import gather_blocks_ref, scatter_blocks_ref

# name: (layers, num_blocks, block_size, Hkv, D, layout, block ids)
#   cpu_planes   vLLM CPU backend: per layer [blocks, H, B, 2D], each (block, head) holds K rows then V rows
#   block_outer  the same pages with the block outermost (BLHNC): layers interleave per block
#   token_split  per layer [blocks, H, B, 2D] with K|V split inside each token's row (GPU backends)
CASES = {
    "cpu_planes": (2, 9, 16, 4, 32, "cpu_planes", [3, 4, 5, 0, 8]),
    "block_outer": (3, 7, 8, 2, 16, "block_outer", [6, 1, 2]),
    "token_split": (2, 6, 16, 4, 32, "token_split", [5, 0]),
    "odd_dims": (1, 5, 5, 3, 24, "cpu_planes", [4, 2, 3]),
}


def engine_cache(layers, num_blocks, block, hkv, d, layout, dtype=torch.float32, seed=0):
    """(the raw allocation, its [L, num_blocks, 2, B, Hkv, D] view)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(layers * num_blocks * hkv * block * 2 * d, generator=gen).to(dtype)
    page = hkv * block * 2 * d
    if layout == "block_outer":
        s_layer, s_block = page, layers * page
    else:
        s_layer, s_block = num_blocks * page, page
    if layout == "token_split":
        strides = (s_layer, s_block, d, 2 * d, block * 2 * d, 1)
    else:
        strides = (s_layer, s_block, block * d, d, block * 2 * d, 1)
    return raw, raw.as_strided((layers, num_blocks, 2, block, hkv, d), strides)


def make_case(layers, num_blocks, block, hkv, d, layout, ids, dtype=torch.float32, seed=0):
    raw, kv = engine_cache(layers, num_blocks, block, hkv, d, layout, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    blocks = torch.randn(len(ids), layers, 2, block, hkv, d, generator=gen).to(dtype)
    return raw, kv, torch.tensor(ids, dtype=torch.int64), blocks


@pytest.mark.parametrize("name", sorted(CASES))
def test_gather_reference_matches_per_block_loop(name):
    _, kv, ids, blocks = make_case(*CASES[name])
    gather_blocks_ref(kv, ids, blocks)
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(blocks[i], kv[:, b])


@pytest.mark.parametrize("name", sorted(CASES))
def test_scatter_reference_writes_only_its_blocks(name):
    raw, kv, ids, blocks = make_case(*CASES[name])
    before = kv.clone()
    scatter_blocks_ref(kv, ids, blocks)
    for b in range(kv.shape[1]):
        if b in ids.tolist():
            assert torch.equal(kv[:, b], blocks[ids.tolist().index(b)])
        else:
            assert torch.equal(kv[:, b], before[:, b])


def test_cpu_planes_view_matches_vllm_cpu_split():
    """The view reads K and V where vLLM's CPU backend puts them: [B, 2D] seen as [2B, D], K first."""
    layers, num_blocks, block, hkv, d = 2, 4, 16, 4, 32
    raw, kv = engine_cache(layers, num_blocks, block, hkv, d, "cpu_planes")
    per_layer = raw.view(layers, num_blocks, hkv, block, 2 * d)
    for layer in range(layers):
        key_cache, value_cache = per_layer[layer].view(num_blocks, hkv, 2 * block, d).chunk(2, dim=2)
        assert torch.equal(kv[layer, :, 0], key_cache.transpose(1, 2))
        assert torch.equal(kv[layer, :, 1], value_cache.transpose(1, 2))


def test_round_trip_is_byte_identical_fp16_partial_batch():
    _, kv, _, _ = make_case(*CASES["cpu_planes"], dtype=torch.float16)
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randn(4, *kv.shape[0:1], *kv.shape[2:], generator=gen).to(torch.float16)
    ids = torch.tensor([7, 2, 3, 0])
    scatter_blocks_ref(kv, ids[:3], blocks[:3])
    back = torch.zeros_like(blocks)
    gather_blocks_ref(kv, ids[:3], back[:3])
    assert torch.equal(back[:3].view(torch.int16), blocks[:3].view(torch.int16))
    assert not back[3].any()


@pytest.fixture
def native():
    from tierkv.kernels import cpu_block_copy

    if cpu_block_copy.library() is None:
        pytest.skip("no C compiler: the native CPU loop is not built (the reference serves instead)")
    return cpu_block_copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_native_cpu_loop_matches_reference_bytes(native, name, dtype):
    raw, kv, ids, blocks = make_case(*CASES[name], dtype=dtype)
    expected, got = torch.empty_like(blocks), torch.empty_like(blocks)
    gather_blocks_ref(kv, ids, expected)
    native.gather_blocks(kv, ids, got)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    raw2, kv2, _, _ = make_case(*CASES[name], dtype=dtype)
    scatter_blocks_ref(kv, ids, blocks)
    native.scatter_blocks(kv2, ids, blocks)
    assert torch.equal(raw2.view(torch.uint8), raw.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_scatter_of_blocks_that_lie_anywhere_matches_the_reference(native, name, dtype):
    # Blocks as an L2 slab lends them (separate slots, here in reverse order in one buffer), and a
    # layer range of them: the same bytes as the reference scatter of the same blocks.
    raw, kv, ids, blocks = make_case(*CASES[name], dtype=dtype)
    raw2, kv2, _, _ = make_case(*CASES[name], dtype=dtype)
    slab = torch.flip(blocks, [0]).contiguous()
    lent = [slab[len(ids) - 1 - i] for i in range(len(ids))]
    scatter_blocks_ref(kv, ids, blocks)
    native.scatter_block_list(kv2, ids, lent)
    assert torch.equal(raw2.view(torch.uint8), raw.view(torch.uint8))
    layers = kv.shape[0]
    if layers > 1:
        raw3, kv3, _, _ = make_case(*CASES[name], dtype=dtype, seed=5)
        raw4, kv4, _, _ = make_case(*CASES[name], dtype=dtype, seed=5)
        scatter_blocks_ref(kv3[1:], ids, blocks[:, 1:])
        kernels.scatter_block_list(kv4[1:], ids, [b[1:] for b in lent])
        assert torch.equal(raw4.view(torch.uint8), raw3.view(torch.uint8))
    with pytest.raises(ValueError, match=re.escape("blocks[1]: expected a contiguous")):
        native.scatter_block_list(kv2, ids[:2], [lent[0], lent[1][..., :-1]])


def test_cpu_dispatch_uses_the_native_loop_unless_forced(native, monkeypatch):
    calls = []
    monkeypatch.setattr(native, "_run", lambda *a, **k: calls.append(k["scatter"]))
    _, kv, ids, blocks = make_case(*CASES["cpu_planes"])
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.gather_blocks(kv, ids, blocks)
    kernels.scatter_blocks(kv, ids, blocks)
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    kernels.gather_blocks(kv, ids, blocks)
    assert calls == [False, True]


def test_native_loop_rejects_out_of_range_ids(native):
    _, kv, ids, blocks = make_case(*CASES["cpu_planes"])
    with pytest.raises(ValueError, match=re.escape("block_ids: expected ids in [0, 9)")):
        native.gather_blocks(kv, torch.tensor([0, 1, 2, 3, 9]), blocks)


def interpreted_results() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1 (see test_paged_attention.interpreted_results)."""
    from tierkv.kernels import gather_scatter as tgs

    results = {}
    for name, spec in CASES.items():
        for dtype in (torch.float32, torch.float16):
            raw, kv, ids, blocks = make_case(*spec, dtype=dtype)
            expected, got = torch.empty_like(blocks), torch.empty_like(blocks)
            gather_blocks_ref(kv, ids, expected)
            tgs.gather_blocks(kv, ids, got)
            results[f"gather/{dtype}/{name}"] = torch.equal(got, expected)
            raw2, kv2, _, _ = make_case(*spec, dtype=dtype)
            scatter_blocks_ref(kv, ids, blocks)
            tgs.scatter_blocks(kv2, ids, blocks)
            results[f"scatter/{dtype}/{name}"] = torch.equal(raw2, raw)
    raw, kv, ids, blocks = make_case(*CASES["cpu_planes"])
    expected = torch.empty_like(blocks)
    gather_blocks_ref(kv, ids, expected)
    os.environ[kernels.ENV_VAR] = "triton"
    got = torch.empty_like(blocks)
    kernels.gather_blocks(kv, ids, got)
    results["dispatch/gather"] = torch.equal(got, expected)
    return results


@pytest.fixture(scope="module")
def triton_results() -> dict:
    return interpreted(__file__)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_triton_matches_reference_exactly(triton_results, op, name, dtype):
    assert triton_results[f"{op}/{dtype}/{name}"]


def test_dispatch_forced_triton(triton_results):
    assert triton_results["dispatch/gather"]


BAD_ARGS = {
    "kv dims": (lambda kv, i, b: (kv[0], i, b), "kv: expected [L, num_blocks, 2, B, Hkv, D]"),
    "kv head_dim": (lambda kv, i, b: (kv.transpose(4, 5), i, b), "kv: head_dim must be contiguous"),
    "blocks shape": (lambda kv, i, b: (kv, i, b[:, :1]), "blocks: expected [n, 2, 2, 16, 4, 32]"),
    "blocks dtype": (lambda kv, i, b: (kv, i, b.half()), "blocks: expected torch.float32"),
    "blocks strided": (lambda kv, i, b: (kv, i, b.transpose(4, 5).contiguous().transpose(4, 5)),
                       "blocks: each block must be contiguous"),
    "ids dtype": (lambda kv, i, b: (kv, i.int(), b), "block_ids: expected int64 [5]"),
    "ids count": (lambda kv, i, b: (kv, i[:2], b), "block_ids: expected int64 [5]"),
}


@pytest.mark.parametrize("launcher", ["reference", "triton"])
@pytest.mark.parametrize("bad", sorted(BAD_ARGS))
def test_launchers_reject_bad_arguments(launcher, bad):
    if launcher == "triton":
        pytest.importorskip("triton")
        from tierkv.kernels.gather_scatter import gather_blocks as fn
    else:
        fn = gather_blocks_ref
    _, kv, ids, blocks = make_case(*CASES["cpu_planes"])
    change, message = BAD_ARGS[bad]
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(*change(kv, ids, blocks))


if __name__ == "__main__":
    print(json.dumps(interpreted_results()))
