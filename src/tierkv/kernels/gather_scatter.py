"""Triton kernels moving blocks between an engine's per-layer KV cache and canonical blocks.

The engine's cache is described by one strided view ``kv`` of logical shape
[L, num_blocks, 2, B, Hkv, D] (vLLM keeps one tensor per layer, all layers in
one allocation, so the layer, block, K/V, token and head strides say
everything about its layout). A canonical block is [L, 2, B, Hkv, D]
contiguous (docs/design.md §2). ``gather_blocks`` copies ``kv[:, block_ids[i]]`` into
``blocks[i]``; ``scatter_blocks`` is the reverse. References:
``reference.gather_blocks_ref`` / ``reference.scatter_blocks_ref``.

Tuned constants (starting points, not yet measured on a GPU in this repository):
  grid = (n, 2 L)   one program per (block, layer, K|V): a [B, Hkv, D] tile of
                    a few KB to a few tens of KB, walked one token at a time
  NUM_WARPS = 4     one [Hkv, D] row per token needs no more
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierkv.kernels.reference import check_block_copy

NUM_WARPS = 4


@triton.jit
def _block_copy_kernel(
    kv_ptr, ids_ptr, blocks_ptr,
    stride_kl, stride_kb, stride_kkv, stride_kt, stride_kh, stride_bn,
    NUM_LAYERS: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SCATTER: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    lkv = tl.program_id(1).to(tl.int64)
    layer = lkv // 2
    which = lkv % 2
    block = tl.load(ids_ptr + i)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    cache = kv_ptr + layer * stride_kl + block * stride_kb + which * stride_kkv
    cache = cache + h[:, None] * stride_kh + d[None, :]
    canon = blocks_ptr + i * stride_bn + lkv * (BLOCK_SIZE * NUM_HEADS * HEAD_DIM)
    canon = canon + h[:, None] * HEAD_DIM + d[None, :]
    for t in range(BLOCK_SIZE):
        if SCATTER:
            x = tl.load(canon + t * (NUM_HEADS * HEAD_DIM), mask=mask)
            tl.store(cache + t * stride_kt, x, mask=mask)
        else:
            x = tl.load(cache + t * stride_kt, mask=mask)
            tl.store(canon + t * (NUM_HEADS * HEAD_DIM), x, mask=mask)


def _launch(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor, scatter: bool) -> None:
    check_block_copy(kv, block_ids, blocks)
    if block_ids.stride(0) != 1 and block_ids.numel() > 1:
        raise ValueError(f"block_ids: must be contiguous (stride 1), got strides {block_ids.stride()}")
    n = blocks.shape[0]
    if n == 0:
        return
    num_layers, _, _, block_size, num_heads, head_dim = kv.shape
    _block_copy_kernel[(n, 2 * num_layers)](
        kv, block_ids, blocks,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4), blocks.stride(0),
        NUM_LAYERS=num_layers, BLOCK_SIZE=block_size, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        SCATTER=scatter, num_warps=NUM_WARPS,
    )


def gather_blocks(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Launch the gather: ``blocks[i] = kv[:, block_ids[i]]``; same contract as the reference.

    Checks shapes, strides and dtypes (no device sync); asynchronous on the current stream.
    """
    _launch(kv, block_ids, blocks, scatter=False)


def scatter_blocks(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Launch the scatter: ``kv[:, block_ids[i]] = blocks[i]``; block ids must be distinct.

    Checks shapes, strides and dtypes (no device sync); asynchronous on the current stream.
    """
    _launch(kv, block_ids, blocks, scatter=True)
