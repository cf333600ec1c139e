"""paged_attention: the torch reference against dense causal attention, the Triton
kernel (under TRITON_INTERPRET=1, on CPU tensors) against the reference, the
argument checks of both launchers, and the dispatch rules."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from _interpret import interpreted
import tierkv.kernels as kernels
from tierkv.kernels.reference import paged_attention_ref



@dataclass
class Case:
    """A paged batch plus the dense per-sequence K/V it was built from."""

    q: torch.Tensor
    pool: torch.Tensor
    layer: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    dense_k: list[torch.Tensor]
    dense_v: list[torch.Tensor]

    def args(self):
        return (self.q, self.pool, self.layer, self.block_tables, self.context_lens, self.query_start_loc, self.scale)


def make_case(seqs, *, hq=8, hkv=2, d=16, block=16, layers=2, layer=1, dtype=torch.float32, seed=0) -> Case:
    """seqs: (context_len, q_len) per sequence. Blocks are shuffled over a random pool."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(ctx / block) for ctx, _ in seqs]
    num_blocks = sum(need) + 3
    pool = torch.randn(num_blocks, layers, 2, block, hkv, d, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(need) + 1, dtype=torch.int32)
    dense_k, dense_v, qs, starts = [], [], [], [0]
    for s, (ctx, q_len) in enumerate(seqs):
        ids = [order.pop() for _ in range(need[s])]
        tables[s, : need[s]] = torch.tensor(ids, dtype=torch.int32)
        kv = pool[ids, layer].permute(1, 0, 2, 3, 4).reshape(2, -1, hkv, d)[:, :ctx]
        dense_k.append(kv[0])
        dense_v.append(kv[1])
        qs.append(torch.randn(q_len, hq, d, generator=gen).to(dtype))
        starts.append(starts[-1] + q_len)
    return Case(
        q=torch.cat(qs),
        pool=pool,
        layer=layer,
        block_tables=tables,
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=1.0 / math.sqrt(d),
        dense_k=dense_k,
        dense_v=dense_v,
    )


def dense_attention(case: Case) -> torch.Tensor:
    """Naive float64 causal attention per sequence and per head, over the dense K/V."""
    hq, hkv = case.q.shape[1], case.dense_k[0].shape[1]
    out = torch.empty(case.q.shape, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    for s, ctx in enumerate(case.context_lens.tolist()):
        q = case.q[starts[s] : starts[s + 1]].double()
        q_len = q.shape[0]
        for h in range(hq):
            k = case.dense_k[s][:, h // (hq // hkv)].double()
            v = case.dense_v[s][:, h // (hq // hkv)].double()
            scores = q[:, h] @ k.T * case.scale
            pos = torch.arange(ctx - q_len, ctx)[:, None]
            scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, -math.inf)
            out[starts[s] : starts[s + 1], h] = scores.softmax(-1) @ v
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# (context_len, q_len) per sequence; GQA ratio 4 and block size 16 unless stated.
CASES = {
    "mixed": dict(seqs=[(37, 10), (21, 21), (50, 1), (16, 1), (5, 5)]),
    "decode": dict(seqs=[(1, 1), (17, 1), (64, 1), (130, 1)]),
    "long_prefill": dict(seqs=[(100, 70), (33, 33)], hq=4, hkv=1, d=32),
    "odd_group_dim": dict(seqs=[(30, 12), (9, 1), (25, 1)], hq=6, hkv=2, d=24, block=8),
    "empty_seq": dict(seqs=[(20, 0), (19, 3)], layers=1, layer=0),
    "split_decode": dict(seqs=[(300, 1), (5, 1), (129, 1)], hq=4, hkv=1, d=32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_dense_causal_attention(name):
    case = make_case(**CASES[name])
    assert rel_err(paged_attention_ref(*case.args()), dense_attention(case)) <= 1e-6


def test_reference_runs_outside_inference_mode_after_inside():
    """The engine calls the reference under inference_mode; later plain calls must still work."""
    case = make_case(**CASES["long_prefill"])
    with torch.inference_mode():
        inside = paged_attention_ref(*case.args())
    outside = paged_attention_ref(*case.args())
    assert torch.equal(inside, outside)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_reference_half_precision_returns_q_dtype(dtype, tol):
    case = make_case(**CASES["mixed"], dtype=dtype)
    out = paged_attention_ref(*case.args())
    assert out.dtype == dtype
    assert rel_err(out, dense_attention(case)) <= tol


def test_reference_single_decode_equals_batched_decode():
    case = make_case(seqs=[(40, 1), (23, 1), (7, 1)])
    batched = paged_attention_ref(*case.args())
    for s in range(3):
        one = paged_attention_ref(
            case.q[s : s + 1], case.pool, case.layer, case.block_tables[s : s + 1],
            case.context_lens[s : s + 1], torch.tensor([0, 1], dtype=torch.int32), case.scale,
        )
        torch.testing.assert_close(one, batched[s : s + 1], rtol=1e-6, atol=1e-6)


def test_reference_decode_groups_sorted_by_length_match_dense():
    # 11 decodes in shuffled length order: groups of DECODE_GROUP, a partial last group,
    # and a prefill between them.
    from tierkv.kernels.reference import DECODE_GROUP

    seqs = [(90, 1), (3, 1), (47, 1), (47, 1), (120, 1), (16, 1), (33, 9), (61, 1), (1, 1), (17, 1), (99, 1), (64, 1)]
    assert sum(q == 1 for _, q in seqs) > 2 * DECODE_GROUP
    case = make_case(seqs=seqs)
    assert rel_err(paged_attention_ref(*case.args()), dense_attention(case)) <= 1e-6


def test_reference_leaves_pool_untouched():
    case = make_case(**CASES["mixed"])
    before = case.pool.clone()
    paged_attention_ref(*case.args())
    assert torch.equal(case.pool, before)


def interpreted_results() -> dict:
    """Run in a subprocess with TRITON_INTERPRET=1: the Triton kernel on every case.

    Triton reads TRITON_INTERPRET when its own @jit helpers (tl.sum, tl.max)
    are decorated at ``import triton``, so the interpreter needs a process
    where the variable is set before triton is first imported.
    """
    from tierkv.kernels import triton_paged_attention as tpa

    results = {}
    for name, spec in CASES.items():
        case = make_case(**spec)
        out = tpa.paged_attention(*case.args())
        ok = out.shape == case.q.shape and out.dtype == case.q.dtype
        results[f"fp32/{name}"] = [ok, rel_err(out, paged_attention_ref(*case.args()))]
    for name in ("mixed", "split_decode"):
        case = make_case(**CASES[name], dtype=torch.float16)
        out = tpa.paged_attention(*case.args())
        results[f"fp16/{name}"] = [out.dtype == torch.float16, rel_err(out, paged_attention_ref(*case.args()))]
    results["splits/decode"] = tpa._num_splits(4, 4, 2)
    tpa.SPLIT_TARGET_PROGRAMS = 1  # the same decode batches without split-KV
    for name in ("decode", "split_decode"):
        case = make_case(**CASES[name])
        out = tpa.paged_attention(*case.args())
        results[f"fp32/{name}/no_split"] = [True, rel_err(out, paged_attention_ref(*case.args()))]
    case = make_case(**CASES["decode"])
    os.environ[kernels.ENV_VAR] = "triton"
    via_dispatch = kernels.paged_attention(*case.args())
    results["dispatch/triton"] = [torch.equal(via_dispatch, tpa.paged_attention(*case.args())), 0.0]
    return results


@pytest.fixture(scope="module")
def triton_results() -> dict:
    return interpreted(__file__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_matches_reference_fp32(triton_results, name):
    shape_and_dtype_ok, err = triton_results[f"fp32/{name}"]
    assert shape_and_dtype_ok
    assert err <= 1e-5


@pytest.mark.parametrize("name", ["mixed", "split_decode"])
def test_triton_matches_reference_fp16(triton_results, name):
    dtype_ok, err = triton_results[f"fp16/{name}"]
    assert dtype_ok
    assert err <= 2e-3


@pytest.mark.parametrize("name", ["decode", "split_decode"])
def test_triton_decode_without_split_kv_matches_reference(triton_results, name):
    assert triton_results["splits/decode"] == 16  # the split runs above really split
    assert triton_results[f"fp32/{name}/no_split"][1] <= 1e-5


def test_split_kv_only_for_decode_batches_that_underfill_the_device():
    triton = pytest.importorskip("triton")  # noqa: F841
    from tierkv.kernels.triton_paged_attention import MAX_SPLITS, _num_splits

    assert _num_splits(num_tokens=70, num_seqs=2, num_kv_heads=1) == 1  # prefill
    assert _num_splits(num_tokens=64, num_seqs=64, num_kv_heads=8) == 1  # 512 programs already
    assert _num_splits(num_tokens=16, num_seqs=16, num_kv_heads=8) == 4  # 128 programs -> 512
    assert _num_splits(num_tokens=1, num_seqs=1, num_kv_heads=8) == MAX_SPLITS


def test_dispatch_forced_triton_runs_the_triton_kernel(triton_results):
    assert triton_results["dispatch/triton"][0]


def _bad(case: Case, **changes):
    args = dict(zip(("q", "pool", "layer", "block_tables", "context_lens", "query_start_loc", "scale"), case.args()))
    args.update(changes)
    return tuple(args.values())


BAD_ARGS = {
    "pool dims": (lambda c: dict(pool=c.pool[:, 0]), "pool: expected the canonical L1 pool"),
    "layer range": (lambda c: dict(layer=2), "layer: expected 0 <= layer < 2"),
    "q dtype": (lambda c: dict(q=c.q.double()), "q: dtype must equal the pool's"),
    "q heads": (lambda c: dict(q=c.q[:, :7]), "must be a multiple of the pool's num_kv_heads"),
    "q head_dim": (lambda c: dict(q=c.q[..., :8]), "q: head_dim must equal the pool's (16)"),
    "q stride": (lambda c: dict(q=c.q.transpose(0, 2).contiguous().transpose(0, 2)), "q: head_dim must be contiguous"),
    "table dtype": (lambda c: dict(block_tables=c.block_tables.long()), "block_tables: dtype must be torch.int32"),
    "lens shape": (lambda c: dict(context_lens=c.context_lens[:-1]), "context_lens: expected [S] with S=5"),
    "qsl shape": (lambda c: dict(query_start_loc=c.query_start_loc[:-1]), "query_start_loc: expected [S+1]"),
}


@pytest.mark.parametrize("launcher", ["reference", "triton"])
@pytest.mark.parametrize("bad", sorted(BAD_ARGS))
def test_launchers_reject_bad_arguments(launcher, bad):
    if launcher == "triton":
        pytest.importorskip("triton")
        from tierkv.kernels.triton_paged_attention import paged_attention as fn
    else:
        fn = paged_attention_ref
    case = make_case(**CASES["mixed"])
    change, message = BAD_ARGS[bad]
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(*_bad(case, **change(case)))


def test_triton_launcher_rejects_strided_index_tensors():
    pytest.importorskip("triton")
    from tierkv.kernels.triton_paged_attention import paged_attention

    case = make_case(**CASES["mixed"])
    strided = case.block_tables.t().contiguous().t()  # same values, column-major
    with pytest.raises(ValueError, match=re.escape("block_tables: last dim must be contiguous")):
        paged_attention(*_bad(case, block_tables=strided))


def test_dispatch_rules(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend_for(torch.device("cpu")) == "reference"
    assert kernels.backend_for(torch.device("cuda", 0)) == "triton"
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels.backend_for(torch.device("cuda", 0)) == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=r"TIERKV_KERNELS: expected one of \('triton', 'reference'\)"):
        kernels.backend_for(torch.device("cpu"))


def test_importing_kernels_does_not_import_triton():
    code = "import sys, tierkv.kernels; sys.exit(1 if 'triton' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


if __name__ == "__main__":
    print(json.dumps(interpreted_results()))
