"""Pure-torch references for the tierkv kernels; also the CPU serving path.

Each Triton kernel in this package is tested against the function here with the
same name minus ``_ref``. The engine serves through these on CPU, so they are
vectorised: one gather and one attention call per prefill sequence, and one
gather and one attention call per group of DECODE_GROUP decode sequences of
similar context length.
Inputs in fp16/bf16 are upcast so that scores, softmax and the weighted sum
accumulate in fp32 (except bf16 decode on CPU, handed to SDPA in bf16: its CPU
kernel accumulates in fp32 itself); the output comes back in ``q``'s dtype.

Arguments are validated by ``tierkv.kernels.checks`` (metadata only, no device
sync). Values are trusted: block ids, slot ids and lengths must be in range.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from tierkv.kernels.checks import check_paged_attention, check_write_kv


# Decode sequences per attention call, sorted by context length. For 32 sequences of
# 144-767 tokens one padded call took 5.1 ms (fp32) / 6.2 ms (bf16) of CPU time per
# layer, groups of 4 took 3.0 / 1.8 ms, groups of 2 3.2 / 2.4 ms: a group wastes its
# padding, a call costs ~50 us of overhead.
DECODE_GROUP = 4


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class _Workspace(threading.local):
    """Per-thread gather buffers for CPU, reused across calls.

    A fresh multi-megabyte tensor per layer costs more in page faults than the
    gather itself (measured ~10 ms vs ~1.5 ms for 25 MB), so gathers land in
    buffers that only grow. Thread-local, so concurrent callers never share one.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get((slot, dtype))
        if buf is None or buf.numel() < numel:
            # A normal tensor even when first asked for under inference_mode: an
            # inference tensor could not be written later outside it.
            with torch.inference_mode(False):
                buf = torch.empty(numel + numel // 4, dtype=dtype)
            self.buffers[(slot, dtype)] = buf
        return buf[:numel].view(shape)


_WORKSPACE = _Workspace()


def _gather_heads_first(cache: torch.Tensor, blocks: torch.Tensor, slot: str) -> torch.Tensor:
    """cache [N, B, Hkv, D], blocks int64 [..., M] -> [..., Hkv, M*B, D] (one copy, a view of it)."""
    flat = blocks.reshape(-1)
    _, b, hkv, d = cache.shape
    # index_select on dim 0 copies whole [B, Hkv, D] rows; advanced indexing is ~5x slower on CPU.
    if cache.device.type == "cpu":
        out = _WORKSPACE.get(slot, (flat.numel(), b, hkv, d), cache.dtype)
        torch.index_select(cache, 0, flat, out=out)
    else:
        out = cache.index_select(0, flat)
    return out.view(*blocks.shape[:-1], blocks.shape[-1] * b, hkv, d).transpose(-3, -2)


def _prefill_one(q_s, k_cache, v_cache, blocks, ctx, scale, cdt):
    """Attention of one sequence's q_len new rows over its first ``ctx`` cached tokens."""
    q_len, hq, d = q_s.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    # Query head h reads KV head h // group. K/V are expanded (stride 0) over the group:
    # measured 3x faster than repeat_interleave or enable_gqa on CPU, and no copy.
    k = _gather_heads_first(k_cache, blocks, "k")[:, :ctx].to(cdt)  # [Hkv, ctx, D]
    v = _gather_heads_first(v_cache, blocks, "v")[:, :ctx].to(cdt)
    k = k[:, None].expand(hkv, group, ctx, d)
    v = v[:, None].expand(hkv, group, ctx, d)
    qh = q_s.to(cdt).view(q_len, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, q_len, D]
    if q_len == 1:
        out = F.scaled_dot_product_attention(qh, k, v, scale=scale)
    elif q_len == ctx:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
    else:
        # Row i sits at absolute position ctx - q_len + i and sees keys 0..that position
        # (is_causal would align the mask top-left, i.e. ignore the cached prefix).
        rows = torch.arange(q_len, device=q_s.device) + (ctx - q_len)
        mask = torch.arange(ctx, device=q_s.device)[None, :] <= rows[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(q_len, hq, d)


def _decode_batch(q_d, k_cache, v_cache, tables, mask, scale, cdt):
    """One query row per sequence; sequences padded to the longest context, ``mask`` [n, M*B] the real keys."""
    if q_d.device.type == "cpu" and q_d.dtype == torch.bfloat16:
        # CPU SDPA already accumulates bf16 in fp32; upcasting the gathered K/V first
        # made batched decode 3-5x slower (engine measurement, n=32, 256-768 tokens).
        cdt = torch.bfloat16
    n, hq, d = q_d.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    k = _gather_heads_first(k_cache, tables, "k").to(cdt)  # [n, Hkv, M*B, D]
    v = _gather_heads_first(v_cache, tables, "v").to(cdt)
    qh = q_d.to(cdt).view(n, hkv, group, d)
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(n, hq, d)


def paged_attention_ref(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over the paged KV in ``pool[:, layer]``.

    q [T, Hq, D] holds the new tokens of all sequences concatenated; the rows
    q[qsl[s]:qsl[s+1]] are the last q_len tokens of sequence s, whose K/V are
    already in the pool. Reads the pool, never writes it; returns a new tensor
    [T, Hq, D] in q's dtype. Synchronous (reads the length tensors on the host).
    """
    check_paged_attention(q, pool, layer, block_tables, context_lens, query_start_loc)
    block_size = pool.shape[3]
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    cdt = _compute_dtype(q.dtype)
    out = torch.empty_like(q)
    ctx_list = context_lens.tolist()
    starts = query_start_loc.tolist()
    for s in range(len(ctx_list)):
        q_len, ctx = starts[s + 1] - starts[s], ctx_list[s]
        if q_len <= 1:
            continue
        n_blocks = -(-ctx // block_size)
        blocks = block_tables[s, :n_blocks].long()
        q_s = q[starts[s] : starts[s + 1]]
        out[starts[s] : starts[s + 1]] = _prefill_one(q_s, k_cache, v_cache, blocks, ctx, scale, cdt)
    decode = sorted((s for s in range(len(ctx_list)) if starts[s + 1] - starts[s] == 1), key=ctx_list.__getitem__)
    if decode:
        _decode_grouped(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, decode, ctx_list,
                        scale, cdt, out)
    return out


def _decode_grouped(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, decode, ctx_list,
                    scale, cdt, out):
    """Decode rows ``decode`` (sorted by context length) in groups of DECODE_GROUP: little padding, few calls.

    Index tensors and the key mask are built once for all groups; per group only views are sliced.
    """
    block_size = k_cache.shape[1]
    idx = torch.tensor(decode, device=q.device)
    rows = query_start_loc[idx].long()
    tables = block_tables[idx].long()
    keys = -(-ctx_list[decode[-1]] // block_size) * block_size
    mask = torch.arange(keys, device=q.device)[None, :] < context_lens[idx][:, None]
    q_sorted = q[rows]
    res = torch.empty_like(q_sorted)
    for i in range(0, len(decode), DECODE_GROUP):
        j = min(i + DECODE_GROUP, len(decode))
        n_blocks = -(-ctx_list[decode[j - 1]] // block_size)
        res[i:j] = _decode_batch(q_sorted[i:j], k_cache, v_cache, tables[i:j, :n_blocks],
                                 mask[i:j, : n_blocks * block_size], scale, cdt)
    out[rows] = res


def write_kv_ref(
    pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k[t], v[t] [T, Hkv, D] into slot ``slot_mapping[t]`` of ``pool[:, layer]`` in place.

    slot = block_id * block_size + offset; a negative slot is padding and is
    skipped. Slots must be distinct. Synchronous on CPU; stream-ordered on CUDA.
    """
    check_write_kv(pool, layer, k, v, slot_mapping)
    block_size = pool.shape[3]
    slots = slot_mapping
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    blocks, offsets = slots // block_size, slots % block_size
    pool[:, layer, 0].index_put_((blocks, offsets), k.to(pool.dtype))
    pool[:, layer, 1].index_put_((blocks, offsets), v.to(pool.dtype))


def check_block_copy(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Validate ``gather_blocks`` / ``scatter_blocks`` arguments; raise naming the argument.

    ``kv`` is an engine's KV cache seen as [L, num_blocks, 2, B, Hkv, D] through
    any strides (head_dim contiguous); ``blocks`` is [n, L, 2, B, Hkv, D] with
    each block contiguous; ``block_ids`` is int64 [n] on ``kv``'s device.
    """
    if kv.dim() != 6 or kv.shape[2] != 2:
        raise ValueError(f"kv: expected [L, num_blocks, 2, B, Hkv, D], got shape {tuple(kv.shape)}")
    if kv.stride(-1) != 1:
        raise ValueError(f"kv: head_dim must be contiguous (stride 1), got strides {kv.stride()}")
    want = (kv.shape[0], *kv.shape[2:])
    if blocks.dim() != 6 or tuple(blocks.shape[1:]) != want:
        raise ValueError(f"blocks: expected [n, {', '.join(map(str, want))}], got shape {tuple(blocks.shape)}")
    if blocks.dtype != kv.dtype or blocks.device != kv.device:
        raise ValueError(f"blocks: expected {kv.dtype} on {kv.device} like kv, got {blocks.dtype} on {blocks.device}")
    dense = [1]
    for size in reversed(blocks.shape[2:]):
        dense.insert(0, dense[0] * size)
    if list(blocks.stride()[1:]) != dense:
        raise ValueError(f"blocks: each block must be contiguous, got strides {blocks.stride()}")
    if block_ids.dim() != 1 or block_ids.dtype != torch.int64 or block_ids.shape[0] != blocks.shape[0]:
        raise ValueError(
            f"block_ids: expected int64 [{blocks.shape[0]}], got {block_ids.dtype} {tuple(block_ids.shape)}"
        )
    if block_ids.device != kv.device:
        raise ValueError(f"block_ids: must be on {kv.device} like kv, got {block_ids.device}")


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first position, first block id, length) of each run of consecutive block ids."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            out.append((start, ids[start], i - start))
            start = i
    return out


def gather_blocks_ref(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """``blocks[i] = kv[:, block_ids[i]]``: an engine's per-layer cache into canonical blocks.

    One strided copy per run of consecutive block ids (all layers at once), so
    the work is a handful of large copies rather than one per block and layer.
    Synchronous on CPU; stream-ordered on CUDA (``block_ids`` is read on the host).
    """
    check_block_copy(kv, block_ids, blocks)
    for i, b, n in _runs(block_ids.tolist()):
        blocks[i : i + n].copy_(kv[:, b : b + n].transpose(0, 1))


def scatter_blocks_ref(kv: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """``kv[:, block_ids[i]] = blocks[i]``: canonical blocks into an engine's per-layer cache.

    Block ids must be distinct. Same cost shape and completion as ``gather_blocks_ref``.
    """
    check_block_copy(kv, block_ids, blocks)
    for i, b, n in _runs(block_ids.tolist()):
        kv[:, b : b + n].transpose(0, 1).copy_(blocks[i : i + n])
