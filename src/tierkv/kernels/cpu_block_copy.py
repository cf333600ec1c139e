"""A native CPU loop for ``gather_blocks`` / ``scatter_blocks``, built with the system C compiler.

Why: moving blocks between vLLM's head-major pages and canonical token-major
blocks is a transpose at the granularity of one head_dim row (128-256 bytes).
torch's strided copy (and numpy's) spends ~20 ns per row in loop overhead and
ran at 0.15-0.25x memcpy in bench/connector.py; a C loop with fixed-size row
copies runs several times faster. Both directions walk the canonical block in
memory order (the vLLM page side is strided), which measured fastest for both.

The loop is ``tierkv/_native/block_copy.c``, built on first use by
``tierkv.native``. Without a compiler, or with ``TIERKV_NATIVE=0``, callers get
None from ``library()`` and use the torch reference, which computes the same
bytes (the tests compare them).
"""

from __future__ import annotations

import ctypes

import torch

from tierkv import native
from tierkv.kernels.reference import check_block_copy


def library() -> ctypes.CDLL | None:
    """The compiled loop, built once per process; None when it cannot be built or is disabled."""
    lib = native.load("block_copy")
    if lib is not None and lib.tierkv_block_copy.argtypes is None:
        fn = lib.tierkv_block_copy
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 11 + [ctypes.c_int]
        fn = lib.tierkv_block_copy_list
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 10 + [ctypes.c_int]
    return lib


def _run(lib: ctypes.CDLL, kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor, scatter: bool) -> None:
    check_block_copy(kv, block_ids, blocks)
    if kv.device.type != "cpu":
        raise ValueError(f"kv: the native block copy runs on CPU tensors, got {kv.device}")
    if blocks.shape[0] == 0:
        return
    ids = block_ids.contiguous()
    num_blocks = kv.shape[1]
    if bool(((ids < 0) | (ids >= num_blocks)).any()):
        raise ValueError(f"block_ids: expected ids in [0, {num_blocks}), got {ids.tolist()}")
    item = kv.element_size()
    num_layers, _, _, block_size, num_heads, head_dim = kv.shape
    s = [x * item for x in kv.stride()[:5]]
    lib.tierkv_block_copy(kv.data_ptr(), blocks.data_ptr(), ids.data_ptr(), blocks.shape[0], num_layers,
                          block_size, num_heads, head_dim * item, *s, blocks.stride(0) * item, int(scatter))


def gather_blocks(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """``blocks[i] = kv[:, block_ids[i]]`` on CPU tensors; the torch reference when no library builds."""
    lib = library()
    if lib is None:
        from tierkv.kernels.reference import gather_blocks_ref

        gather_blocks_ref(kv, block_ids, blocks)
    else:
        _run(lib, kv, block_ids, blocks, scatter=False)


def scatter_blocks(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """``kv[:, block_ids[i]] = blocks[i]`` on CPU tensors (distinct ids); falls back like ``gather_blocks``."""
    lib = library()
    if lib is None:
        from tierkv.kernels.reference import scatter_blocks_ref

        scatter_blocks_ref(kv, block_ids, blocks)
    else:
        _run(lib, kv, block_ids, blocks, scatter=True)


def scatter_block_list(kv: torch.Tensor, block_ids: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    """``kv[:, block_ids[i]] = blocks[i]`` for canonical blocks that lie anywhere (each contiguous,
    ``kv``'s layers), in one native call; the reference per block when no library builds. For
    blocks read in place (an L2 slab's slots), a layer range at a time: one call, not one per block."""
    lib = library()
    if lib is None or not blocks:
        from tierkv.kernels.reference import scatter_blocks_ref

        for i, block in enumerate(blocks):
            scatter_blocks_ref(kv, block_ids[i:i + 1], block.unsqueeze(0))
        return
    first = blocks[0]
    check_block_copy(kv, block_ids, first.unsqueeze(0).expand(len(blocks), *first.shape))
    if kv.device.type != "cpu":
        raise ValueError(f"kv: the native block copy runs on CPU tensors, got {kv.device}")
    for i, block in enumerate(blocks):
        if block.shape != first.shape or block.dtype != kv.dtype or block.device != kv.device or not block.is_contiguous():
            raise ValueError(f"blocks[{i}]: expected a contiguous {kv.dtype} block of shape {tuple(first.shape)} "
                             f"on {kv.device}, got {block.dtype} {tuple(block.shape)} on {block.device}")
    ids = block_ids.contiguous()
    num_blocks = kv.shape[1]
    if bool(((ids < 0) | (ids >= num_blocks)).any()):
        raise ValueError(f"block_ids: expected ids in [0, {num_blocks}), got {ids.tolist()}")
    ptrs = (ctypes.c_void_p * len(blocks))(*[b.data_ptr() for b in blocks])
    item = kv.element_size()
    num_layers, _, _, block_size, num_heads, head_dim = kv.shape
    s = [x * item for x in kv.stride()[:5]]
    lib.tierkv_block_copy_list(kv.data_ptr(), ptrs, ids.data_ptr(), len(blocks), num_layers, block_size,
                               num_heads, head_dim * item, *s, 1)
