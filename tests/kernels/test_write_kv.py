"""write_kv: the torch reference against a per-token loop, the Triton kernel
(under TRITON_INTERPRET=1 in a subprocess) against the reference, and the
argument checks of both launchers."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from _interpret import interpreted
import tierkv.kernels as kernels
from tierkv.kernels.reference import write_kv_ref

# name: (num_blocks, layers, layer, block_size, Hkv, D, tokens, padding slots)
CASES = {
    "prefill": (6, 2, 1, 16, 2, 16, 37, 0),
    "decode": (9, 3, 2, 16, 4, 32, 5, 0),
    "padded_odd": (5, 1, 0, 8, 3, 24, 11, 3),
}


def make_case(num_blocks, layers, layer, block, hkv, d, tokens, padding, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, layers, 2, block, hkv, d, generator=gen).to(dtype)
    k = torch.randn(tokens, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tokens, hkv, d, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:padding]] = -1
    return pool, layer, k, v, slots


def looped_write(pool, layer, k, v, slots):
    out = pool.clone()
    block = pool.shape[3]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[slot // block, layer, 0, slot % block] = k[t]
            out[slot // block, layer, 1, slot % block] = v[t]
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_per_token_loop(name):
    pool, layer, k, v, slots = make_case(*CASES[name])
    expected = looped_write(pool, layer, k, v, slots)
    write_kv_ref(pool, layer, k, v, slots)
    assert torch.equal(pool, expected)


def test_reference_writes_strided_k_v():
    pool, layer, k, v, slots = make_case(*CASES["decode"])
    kv = torch.stack([k, v], dim=1)  # [T, 2, Hkv, D]: k and v are strided views of one tensor
    expected = looped_write(pool, layer, kv[:, 0], kv[:, 1], slots)
    write_kv_ref(pool, layer, kv[:, 0], kv[:, 1], slots)
    assert torch.equal(pool, expected)


def interpreted_results() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1 (see test_paged_attention.interpreted_results)."""
    from tierkv.kernels import triton_write_kv as twk

    results = {}
    for name, spec in CASES.items():
        for dtype in (torch.float32, torch.float16):
            pool, layer, k, v, slots = make_case(*spec, dtype=dtype)
            expected = pool.clone()
            write_kv_ref(expected, layer, k, v, slots)
            twk.write_kv(pool, layer, k, v, slots)
            results[f"{dtype}/{name}"] = torch.equal(pool, expected)
    pool, layer, k, v, slots = make_case(*CASES["decode"])
    kv = torch.stack([k, v], dim=1)
    expected = pool.clone()
    write_kv_ref(expected, layer, k, v, slots)
    os.environ[kernels.ENV_VAR] = "triton"
    kernels.write_kv(pool, layer, kv[:, 0], kv[:, 1], slots)
    results["dispatch/strided"] = torch.equal(pool, expected)
    return results


@pytest.fixture(scope="module")
def triton_results() -> dict:
    return interpreted(__file__)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_matches_reference_exactly(triton_results, name, dtype):
    assert triton_results[f"{dtype}/{name}"]


def test_dispatch_forced_triton_with_strided_k_v(triton_results):
    assert triton_results["dispatch/strided"]


BAD_ARGS = {
    "pool dims": (lambda p, k, v, s: (p[0], 1, k, v, s), "pool: expected the canonical L1 pool"),
    "layer": (lambda p, k, v, s: (p, 3, k, v, s), "layer: expected 0 <= layer < 3"),
    "k heads": (lambda p, k, v, s: (p, 2, k[:, :2], v, s), "k: expected [T, 4, 32]"),
    "v dtype": (lambda p, k, v, s: (p, 2, k, v.half(), s), "v: dtype must equal the pool's (torch.float32)"),
    "v tokens": (lambda p, k, v, s: (p, 2, k, v[:3], s), "v: expected 5 tokens like k, got 3"),
    "slot dtype": (lambda p, k, v, s: (p, 2, k, v, s.int()), "slot_mapping: dtype must be torch.int64"),
    "slot count": (lambda p, k, v, s: (p, 2, k, v, s[:4]), "slot_mapping: expected [T] with T=5"),
    "k stride": (
        lambda p, k, v, s: (p, 2, k.transpose(0, 2).contiguous().transpose(0, 2), v, s),
        "k: head_dim must be contiguous",
    ),
}


@pytest.mark.parametrize("launcher", ["reference", "triton"])
@pytest.mark.parametrize("bad", sorted(BAD_ARGS))
def test_launchers_reject_bad_arguments(launcher, bad):
    if launcher == "triton":
        pytest.importorskip("triton")
        from tierkv.kernels.triton_write_kv import write_kv as fn
    else:
        fn = write_kv_ref
    pool, layer, k, v, slots = make_case(*CASES["decode"])
    change, message = BAD_ARGS[bad]
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(*change(pool, k, v, slots))


if __name__ == "__main__":
    print(json.dumps(interpreted_results()))
