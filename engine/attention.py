"""Per-step attention metadata and the attention call into the paged kernels.

The model runner builds one ``AttentionMetadata`` per step and passes it down
the model explicitly (no module-level state). Every layer writes its new K/V
into the L1 pool with ``write_kv`` and attends over the pool in place with
``paged_attention``; both come from ``tierkv.kernels`` (Triton on CUDA, the
torch reference on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierkv.kernels import paged_attention, write_kv


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where the new tokens of one step go and what they attend to.

    ``slot_mapping`` [T] int64: pool slot (block * block_size + offset) of each
    new token. ``block_tables`` [S, max_blocks] int32, ``context_lens`` [S]
    int32 (tokens of each sequence including its new ones) and
    ``query_start_loc`` [S + 1] int32 follow the kernel contract.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, layer: int,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's K/V of ``layer`` in the pool, then attend; q/k/v [T, H, D]."""
    write_kv(pool, layer, k, v, meta.slot_mapping)
    return paged_attention(q, pool, layer, meta.block_tables, meta.context_lens, meta.query_start_loc, scale)
