"""Argument checks shared by the Triton launchers and the torch references.

Only metadata is checked (shapes, strides, dtypes, devices), so a check never
synchronises with the device. Every error names the argument and what was
expected, and is a ValueError (TypeError for a wrong Python type).
"""

from __future__ import annotations

import torch

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_pool(pool: torch.Tensor, layer: int) -> None:
    _need(
        pool.dim() == 6,
        f"pool: expected the canonical L1 pool [N, L, 2, B, Hkv, D] (6 dims), got shape {tuple(pool.shape)}",
    )
    _need(pool.shape[2] == 2, f"pool: dim 2 must be 2 (K, V), got shape {tuple(pool.shape)}")
    _need(pool.dtype in KV_DTYPES, f"pool: dtype must be one of {KV_DTYPES}, got {pool.dtype}")
    _need(pool.stride(-1) == 1, f"pool: head_dim must be contiguous (stride 1), got strides {pool.stride()}")
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer: expected an int, got {type(layer).__name__}")
    _need(0 <= layer < pool.shape[1], f"layer: expected 0 <= layer < {pool.shape[1]}, got {layer}")


def _check_index(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype, device: torch.device) -> None:
    _need(t.dim() == dim, f"{name}: expected {dim} dims, got shape {tuple(t.shape)}")
    _need(t.dtype == dtype, f"{name}: dtype must be {dtype}, got {t.dtype}")
    _need(t.device == device, f"{name}: must be on {device} like the pool, got {t.device}")


def check_paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Validate ``paged_attention`` arguments; raise with the offending argument's name."""
    _check_pool(pool, layer)
    hkv, d = pool.shape[4], pool.shape[5]
    _need(q.dim() == 3, f"q: expected [T, Hq, D] (3 dims), got shape {tuple(q.shape)}")
    _need(q.dtype == pool.dtype, f"q: dtype must equal the pool's ({pool.dtype}), got {q.dtype}")
    _need(q.device == pool.device, f"q: must be on the pool's device {pool.device}, got {q.device}")
    _need(q.shape[2] == d, f"q: head_dim must equal the pool's ({d}), got {q.shape[2]}")
    _need(
        q.shape[1] % hkv == 0,
        f"q: num query heads ({q.shape[1]}) must be a multiple of the pool's num_kv_heads ({hkv})",
    )
    _need(q.stride(-1) == 1, f"q: head_dim must be contiguous (stride 1), got strides {q.stride()}")
    _check_index("block_tables", block_tables, 2, torch.int32, pool.device)
    _check_index("context_lens", context_lens, 1, torch.int32, pool.device)
    _check_index("query_start_loc", query_start_loc, 1, torch.int32, pool.device)
    num_seqs = block_tables.shape[0]
    _need(
        context_lens.shape[0] == num_seqs,
        f"context_lens: expected [S] with S={num_seqs} (rows of block_tables), got shape {tuple(context_lens.shape)}",
    )
    _need(
        query_start_loc.shape[0] == num_seqs + 1,
        f"query_start_loc: expected [S+1] with S={num_seqs}, got shape {tuple(query_start_loc.shape)}",
    )


def check_write_kv(
    pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Validate ``write_kv`` arguments; raise with the offending argument's name."""
    _check_pool(pool, layer)
    hkv, d = pool.shape[4], pool.shape[5]
    for name, t in (("k", k), ("v", v)):
        _need(
            t.dim() == 3 and tuple(t.shape[1:]) == (hkv, d),
            f"{name}: expected [T, {hkv}, {d}] (the pool's num_kv_heads, head_dim), got shape {tuple(t.shape)}",
        )
        _need(t.dtype == pool.dtype, f"{name}: dtype must equal the pool's ({pool.dtype}), got {t.dtype}")
        _need(t.device == pool.device, f"{name}: must be on the pool's device {pool.device}, got {t.device}")
        _need(t.stride(-1) == 1, f"{name}: head_dim must be contiguous (stride 1), got strides {t.stride()}")
    _need(k.shape[0] == v.shape[0], f"v: expected {k.shape[0]} tokens like k, got {v.shape[0]}")
    _check_index("slot_mapping", slot_mapping, 1, torch.int64, pool.device)
    _need(
        slot_mapping.shape[0] == k.shape[0],
        f"slot_mapping: expected [T] with T={k.shape[0]} (rows of k), got shape {tuple(slot_mapping.shape)}",
    )
