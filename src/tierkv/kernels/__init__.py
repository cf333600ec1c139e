"""Attention and KV-write kernels over the canonical L1 pool (docs/design.md §11).

Dispatch: the Triton kernels for CUDA tensors, the torch references in
``reference.py`` for everything else. ``TIERKV_KERNELS=triton|reference``
forces one (``triton`` on CPU tensors works only under ``TRITON_INTERPRET=1``).
Triton is imported on first use of a Triton kernel, so CPU users without
triton installed never import it. The kernel files are ``triton_*.py``: a
submodule named ``paged_attention`` would replace the function of that name
on this package when imported.

- ``paged_attention(q, pool, layer, block_tables, context_lens, query_start_loc, scale) -> out``
- ``write_kv(pool, layer, k, v, slot_mapping) -> None``
- ``gather_blocks(kv, block_ids, blocks)`` / ``scatter_blocks(kv, block_ids, blocks) -> None``
  (an engine's per-layer cache seen as [L, num_blocks, 2, B, Hkv, D] <-> canonical blocks)
- ``scatter_block_list(kv, block_ids, blocks: list)`` (canonical blocks that lie anywhere)
"""

from __future__ import annotations

import os

import torch

from tierkv.kernels.reference import gather_blocks_ref, paged_attention_ref, scatter_blocks_ref, write_kv_ref

ENV_VAR = "TIERKV_KERNELS"
BACKENDS = ("triton", "reference")

__all__ = ["BACKENDS", "ENV_VAR", "backend_for", "gather_blocks", "paged_attention", "scatter_block_list",
           "scatter_blocks", "write_kv"]


def backend_for(device: torch.device) -> str:
    """The backend used for tensors on ``device``: the env override, else triton on CUDA."""
    forced = os.environ.get(ENV_VAR, "")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_VAR}: expected one of {BACKENDS} or unset, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "reference"


def _triton_module(name: str):
    try:
        if name == "paged_attention":
            from tierkv.kernels import triton_paged_attention as module
        elif name == "gather_scatter":
            from tierkv.kernels import gather_scatter as module
        else:
            from tierkv.kernels import triton_write_kv as module
    except ImportError as exc:
        raise ImportError(
            f"tierkv.kernels: the Triton backend needs triton ({exc}); "
            f"pip install 'tierkv[gpu]', or set {ENV_VAR}=reference"
        ) from exc
    return module


def paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal varlen paged attention of q [T, Hq, D] over ``pool[:, layer]``; returns [T, Hq, D].

    block_tables int32 [S, max_blocks] (padding entries 0), context_lens int32
    [S] (tokens of sequence s including its new ones, already written with
    ``write_kv``), query_start_loc int32 [S+1]: q rows of sequence s are the
    last q_len tokens of its context. GQA: query head h reads KV head
    h // (Hq // Hkv). Reads the pool in place; the output is a new tensor in
    q's dtype, accumulated in fp32. On CUDA it is stream-ordered (no sync).
    """
    if backend_for(q.device) == "triton":
        impl = _triton_module("paged_attention").paged_attention
    else:
        impl = paged_attention_ref
    return impl(q, pool, layer, block_tables, context_lens, query_start_loc, scale)


def write_kv(
    pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V [T, Hkv, D] into ``pool[:, layer]`` at int64 slots (block_id * B + offset).

    In place; negative slots are padding and skipped; slots must be distinct.
    On CUDA it is stream-ordered (no sync).
    """
    if backend_for(pool.device) == "triton":
        impl = _triton_module("write_kv").write_kv
    else:
        impl = write_kv_ref
    impl(pool, layer, k, v, slot_mapping)


def gather_blocks(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """``blocks[i] = kv[:, block_ids[i]]``: an engine's cache [L, num_blocks, 2, B, Hkv, D]
    (any strides) into contiguous canonical blocks [n, L, 2, B, Hkv, D]. On CPU it runs
    ``cpu_block_copy``'s native loop (same bytes as the reference, which it falls back to).

    The caller owns both; nothing is pinned. Synchronous on CPU; stream-ordered on CUDA.
    """
    if backend_for(kv.device) == "triton":
        impl = _triton_module("gather_scatter").gather_blocks
    elif kv.device.type == "cpu" and not os.environ.get(ENV_VAR):
        from tierkv.kernels import cpu_block_copy

        impl = cpu_block_copy.gather_blocks
    else:
        impl = gather_blocks_ref
    impl(kv, block_ids, blocks)


def scatter_blocks(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """``kv[:, block_ids[i]] = blocks[i]``: canonical blocks into an engine's cache (distinct ids).

    Same ownership and completion as ``gather_blocks``.
    """
    if backend_for(kv.device) == "triton":
        impl = _triton_module("gather_scatter").scatter_blocks
    elif kv.device.type == "cpu" and not os.environ.get(ENV_VAR):
        from tierkv.kernels import cpu_block_copy

        impl = cpu_block_copy.scatter_blocks
    else:
        impl = scatter_blocks_ref
    impl(kv, block_ids, blocks)


def scatter_block_list(kv: torch.Tensor, block_ids: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    """``kv[:, block_ids[i]] = blocks[i]`` for canonical blocks that are not one tensor (blocks read
    in place from an L2 slab): on CPU one native call for all of them; elsewhere ``scatter_blocks``
    per block (each copied to ``kv``'s device first). Same ownership and completion as
    ``scatter_blocks``."""
    if kv.device.type == "cpu" and not os.environ.get(ENV_VAR):
        from tierkv.kernels import cpu_block_copy

        cpu_block_copy.scatter_block_list(kv, block_ids, blocks)
        return
    for i, block in enumerate(blocks):
        scatter_blocks(kv, block_ids[i:i + 1], block.unsqueeze(0).to(kv.device))
