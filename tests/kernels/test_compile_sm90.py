"""Every Triton kernel (attention, write_kv, gather/scatter) compiles for sm_90 on a machine without a GPU.

The interpreter tests check the arithmetic but run Python, not the compiler:
a construct the compiler rejects (an early return inside a loop, a dtype
mismatch in ``tl.dot``) would only show on the first CUDA launch. Here each
launcher runs on CPU tensors with its kernel replaced by a recorder; the
recorded arguments become a signature and the real kernel goes through the
whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas that ships
in the triton wheel). No device or driver is needed.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from tierkv.kernels import gather_scatter as tgs  # noqa: E402
from tierkv.kernels import triton_paged_attention as tpa  # noqa: E402
from tierkv.kernels import triton_write_kv as twk  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
TARGET = GPUTarget("cuda", 90, 32)
OPTIONS = ("num_warps", "num_stages")
TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.int32: "i32", torch.int64: "i64"}


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.calls.append((args, kwargs))

        return record


def _signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    signature, constexprs = {}, {}
    positional = dict(zip(kernel.arg_names, args))
    for arg in kernel.arg_names:
        if arg in positional:
            value = positional[arg]
            if isinstance(value, torch.Tensor):
                signature[arg] = "*" + TRITON_TYPES[value.dtype]
            elif isinstance(value, float):
                signature[arg] = "fp32"
            else:
                signature[arg] = "i64" if abs(value) >= 2**31 else "i32"
        else:
            signature[arg] = "constexpr"
            constexprs[arg] = kwargs[arg]
    return signature, constexprs


def _compile_recorded(monkeypatch, module, names: list[str], launch) -> dict:
    """Run ``launch`` with the kernels ``names`` of ``module`` recorded; compile each launched one for TARGET."""
    kernels, recorders = {}, {}
    for name in names:
        kernels[name] = getattr(module, name)
        if not isinstance(kernels[name], triton.runtime.JITFunction):
            pytest.skip("triton was imported with TRITON_INTERPRET set: kernels are interpreted, not compiled")
        recorders[name] = _Recorder()
        monkeypatch.setattr(module, name, recorders[name])
    launch()
    compiled = {}
    for name, recorder in recorders.items():
        for args, kwargs in recorder.calls:
            signature, constexprs = _signature(kernels[name], args, kwargs)
            options = {k: v for k, v in kwargs.items() if k in OPTIONS}
            src = ASTSource(fn=kernels[name], signature=signature, constexprs=constexprs)
            compiled[name] = triton_compile(src, target=TARGET, options=options)
    return compiled


def _attention_args(seqs, hq, hkv, d, dtype):
    block, need = 16, [math.ceil(c / 16) for c, _ in seqs]
    return dict(
        q=torch.zeros(sum(q for _, q in seqs), hq, d, dtype=dtype),
        pool=torch.zeros(sum(need), 2, 2, block, hkv, d, dtype=dtype),
        layer=1,
        block_tables=torch.arange(sum(need), dtype=torch.int32).repeat(len(seqs), 1),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor([0] + [sum(q for _, q in seqs[: i + 1]) for i in range(len(seqs))],
                                     dtype=torch.int32),
        scale=0.125,
    )


@pytest.mark.parametrize(
    "dtype,seqs,kernels",
    [
        (torch.float16, [(40, 20), (17, 1)], 1),  # prefill tile (64 rows)
        (torch.bfloat16, [(40, 1), (17, 1)], 2),  # decode tile (16 rows), split-KV + merge
        (torch.float16, [(40, 1)] * 64, 1),  # decode tile, enough programs: no split
        (torch.float32, [(40, 20), (17, 1)], 1),  # IEEE dots, 32-token K/V tiles
    ],
    ids=["fp16-prefill", "bf16-split-decode", "fp16-decode", "fp32-prefill"],
)
def test_paged_attention_compiles_for_sm90(monkeypatch, dtype, seqs, kernels):
    args = _attention_args(seqs, hq=32, hkv=8, d=128, dtype=dtype)
    compiled = _compile_recorded(monkeypatch, tpa, ["_paged_attention_kernel", "_merge_splits_kernel"],
                                 lambda: tpa.paged_attention(**args))
    assert len(compiled) == kernels
    for kernel in compiled.values():
        assert kernel.asm["cubin"]
        # The H100/H200 limit is 227 KB per block; sm_86/89 have 99 KB.
        assert kernel.metadata.shared <= 99 * 1024


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_write_kv_compiles_for_sm90(monkeypatch, dtype):
    pool = torch.zeros(4, 2, 2, 16, 8, 128, dtype=dtype)
    kv = torch.zeros(5, 2, 8, 128, dtype=dtype)
    slots = torch.arange(5, dtype=torch.int64)
    compiled = _compile_recorded(
        monkeypatch, twk, ["_write_kv_kernel"], lambda: twk.write_kv(pool, 1, kv[:, 0], kv[:, 1], slots)
    )
    assert compiled["_write_kv_kernel"].asm["cubin"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_and_scatter_compile_for_sm90(monkeypatch, dtype):
    # A vLLM CUDA-style cache: each token's row is [K | V] per head, seen as [L, nb, 2, B, Hkv, D].
    raw = torch.zeros(2, 6, 16, 8, 2, 128, dtype=dtype)
    kv = raw.permute(0, 1, 4, 2, 3, 5)
    blocks = torch.zeros(3, 2, 2, 16, 8, 128, dtype=dtype)
    ids = torch.tensor([4, 1, 5], dtype=torch.int64)
    ptx = {}
    for name, launch in (("gather", tgs.gather_blocks), ("scatter", tgs.scatter_blocks)):
        with monkeypatch.context() as m:
            compiled = _compile_recorded(m, tgs, ["_block_copy_kernel"], lambda: launch(kv, ids, blocks))
        kernel = compiled["_block_copy_kernel"]
        assert kernel.asm["cubin"], name
        ptx[name] = kernel.asm["ptx"]
    # The SCATTER constexpr selects the direction, so the two kernels are different code.
    assert ptx["gather"] != ptx["scatter"]
