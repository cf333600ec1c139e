"""Triton kernel writing new K/V rows into their slots of the canonical L1 pool.

Token t goes to ``pool[slot // B, layer, 0|1, slot % B]`` for
``slot = slot_mapping[t]``; a negative slot is padding and is skipped. The
pool is addressed through its strides (docs/design.md §2), k and v through theirs.
Reference: ``reference.write_kv_ref``.

Tuned constants (starting points, not yet measured on a GPU in this repository):
  TOKENS_PER_PROGRAM = 4   tokens per program: amortises the slot loads and
                           keeps ~T/4 programs in flight for prefill batches
  NUM_WARPS          = 4   one [Hkv, D] tile per token (a few KB) needs no more
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tierkv.kernels.checks import check_write_kv

TOKENS_PER_PROGRAM = 4
NUM_WARPS = 4


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, pool_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_pn, stride_pkv, stride_pb, stride_ph,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    tile_ok = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    for i in range(TOKENS):
        t = tl.program_id(0) * TOKENS + i
        if t < num_tokens:
            slot = tl.load(slot_ptr + t)
            if slot >= 0:
                dst = pool_ptr + (slot // BLOCK_SIZE) * stride_pn + (slot % BLOCK_SIZE) * stride_pb
                dst = dst + h[:, None] * stride_ph + d[None, :]
                t64 = t.to(tl.int64)
                k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=tile_ok)
                v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=tile_ok)
                tl.store(dst, k, mask=tile_ok)
                tl.store(dst + stride_pkv, v, mask=tile_ok)


def write_kv(
    pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Launch ``_write_kv_kernel``; same contract as ``tierkv.kernels.write_kv``.

    Checks shapes, strides and dtypes (no device sync); writes in place,
    asynchronously on the current stream. Slots must be distinct.
    """
    check_write_kv(pool, layer, k, v, slot_mapping)
    if slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping: must be contiguous (stride 1), got strides {slot_mapping.stride()}")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_heads, head_dim = pool.shape[4], pool.shape[5]
    kv = pool[:, layer]
    grid = (triton.cdiv(num_tokens, TOKENS_PER_PROGRAM),)
    # Triton launches on the current device: make it the tensors' one.
    with torch.cuda.device(pool.device) if pool.is_cuda else contextlib.nullcontext():
        _write_kv_kernel[grid](
            k, v, kv, slot_mapping, num_tokens,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            BLOCK_SIZE=pool.shape[3], NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
            TOKENS=TOKENS_PER_PROGRAM, num_warps=NUM_WARPS,
        )
