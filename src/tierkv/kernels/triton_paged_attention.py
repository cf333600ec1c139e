"""Triton varlen paged attention over the canonical L1 pool (docs/design.md §2, §11).

One kernel serves prefill (new tokens over cached prefix blocks plus
themselves, causal) and decode (one new token). It reads ``pool[:, layer, 0]``
as K and ``pool[:, layer, 1]`` as V in place through the pool's strides: no
re-layout, no gather copy. Reference: ``reference.paged_attention_ref``.

Work split: one program per (query tile, KV head). A query tile is
``BLOCK_M`` rows = ``BLOCK_M // GROUP_PAD`` consecutive new tokens of one
sequence times the ``GROUP`` query heads that share the KV head (GQA), so each
K/V tile is loaded once for the whole group. Programs find their sequence
from ``query_start_loc`` alone (no host sync): sequence s owns the virtual
tiles ``[qsl[s] // TOKENS + s, qsl[s+1] // TOKENS + s + 1)``, a range at least
as long as the ``ceil(q_len / TOKENS)`` tiles it needs; the spare programs exit.
Softmax is online (flash style) in fp32; fp32 inputs use IEEE dot products
(no TF32), fp16/bf16 use the tensor cores with fp32 accumulation.

Split-KV for decode: a decode batch with fewer than SPLIT_TARGET_PROGRAMS
(sequence, KV head) pairs cannot fill a large GPU, so each pair's context is
cut into NUM_SPLITS BLOCK_N-aligned slices (a power of 2, at most MAX_SPLITS;
the slice length is computed on the device from the context length). Each
slice writes its unnormalised accumulator with its running max and sum to an
fp32 workspace, and ``_merge_splits_kernel`` rescales and sums the slices.

Tuned constants. No GPU was available while writing this, so they were
chosen by compiling offline for sm_90 (triton 3.9, its bundled ptxas) and
reading registers, spills and shared memory per program (``cuobjdump
--dump-resource-usage``); throughput is for ``bench/gpu_smoke.py`` to measure.
Figures at head_dim 128, GQA 4:
  decode (every sequence has q_len 1):
    DECODE_BLOCK_M = 16, DECODE_BLOCK_N = 32, DECODE_WARPS = 4
        138 registers, no spill, 13 KB shared; 64-token K/V tiles needed
        255 registers and spilled (180 with 8 warps)
  prefill or mixed batches:
    PREFILL_BLOCK_M = 64, PREFILL_BLOCK_N = 64, PREFILL_WARPS = 8
        189 registers, no spill, 48 KB shared; 4 warps hit 255 and spilled.
        head_dim > 128 uses 32-token K/V tiles (235 registers at 256 vs a
        spill with 64)
  fp32 (tests, debugging) always uses 32-token K/V tiles: IEEE dot products
        stage more shared memory (74 KB at 64 query rows, within sm_86/89's
        99 KB; 115 KB with 64-token tiles) and spilled badly with 4 warps
  NUM_STAGES = 2 (3 or 4 changed neither registers nor shared memory)
  split decode: SPLIT_TARGET_PROGRAMS = 512 (about 4 programs per SM on a
        132-SM H100/H200), MAX_SPLITS = 16, MERGE_WARPS = 2 (one [splits,
        head_dim] tile per program); the split build uses 184-190 registers,
        no spill. Two details mattered: with the workspace arguments placed
        before ``scale`` the plain decode build took 182 registers instead of
        138, and a K/V loop counted from the slice start instead of 0 took the
        split build to 236
The kernel body is one function of ~85 lines on purpose: moving the
online-softmax step into a @triton.jit helper raised the decode build from
138 to 168 registers.
BLOCK_M rows are raised to GROUP_PAD when the group is larger. K/V tiles may
cross block boundaries: each token looks its block up in the block table, so
any block_size works.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tierkv.kernels.checks import check_paged_attention

DECODE_BLOCK_M = 16
DECODE_BLOCK_N = 32
DECODE_WARPS = 4
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
PREFILL_WARPS = 8
SMALL_BLOCK_N = 32
NUM_STAGES = 2
SPLIT_TARGET_PROGRAMS = 512
MAX_SPLITS = 16
MERGE_WARPS = 2


@triton.jit
def _locate_tile(qsl_ptr, num_seqs, pid, TOKENS: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, its first q row, its q_len, tile index within it) of virtual tile ``pid``."""
    s_idx = tl.arange(0, BLOCK_S)
    starts = tl.load(qsl_ptr + s_idx, mask=s_idx < num_seqs, other=0)
    virtual = starts // TOKENS + s_idx
    seq = tl.sum(((virtual <= pid) & (s_idx < num_seqs)).to(tl.int32), axis=0) - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    return seq, q_start, q_len, pid - (q_start // TOKENS + seq)


@triton.jit
def _paged_attention_kernel(
    q_ptr, pool_ptr, out_ptr, block_tables_ptr, context_lens_ptr, qsl_ptr,
    scale, num_seqs,
    stride_qt, stride_qh,
    stride_pn, stride_pkv, stride_pb, stride_ph,
    stride_ot, stride_oh,
    stride_bt,
    part_acc_ptr, part_ml_ptr, num_q_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // GROUP_PAD
    kv_head = tl.program_id(1)
    seq, q_start, q_len, tile = _locate_tile(qsl_ptr, num_seqs, tl.program_id(0), TOKENS, BLOCK_S)
    if tile * TOKENS >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + rows // GROUP_PAD
    g = rows % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    pos = ctx - q_len + tok  # absolute position of each query row

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * TOKENS)  # causal: nothing past the tile's last row
    if NUM_SPLITS > 1:
        # Split-KV: this program covers one BLOCK_N-aligned slice of the context.
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = tl.program_id(2) * chunk
        kv_end = tl.minimum(kv_end, kv_lo + chunk)
    else:
        kv_lo = 0
    n = tl.arange(0, BLOCK_N)
    kv_base = pool_ptr + kv_head * stride_ph
    # Counting from 0 (not from kv_lo) kept the split build at 182 registers instead of 236.
    for start in range(0, kv_end - kv_lo, BLOCK_N):
        t = kv_lo + start + n
        t_ok = t < kv_end
        blk = tl.load(block_tables_ptr + seq * stride_bt + t // BLOCK_SIZE, mask=t_ok, other=0)
        tok_off = blk.to(tl.int64) * stride_pn + (t % BLOCK_SIZE) * stride_pb
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_base + tok_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_base + stride_pkv + tok_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        visible = (t[None, :] <= pos[:, None]) & t_ok[None, :]
        qk = tl.where(visible, qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS > 1:
        # Unnormalised partials [T, Hq, NUM_SPLITS, (BLOCK_D | m, l)] for _merge_splits_kernel.
        # int32 is enough: splits happen only below SPLIT_TARGET_PROGRAMS sequence x KV-head pairs.
        part = ((q_start + tok) * num_q_heads + head) * NUM_SPLITS + tl.program_id(2)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """out[row, head] = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i over the splits."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (row * num_q_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :])
    w = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Launch ``_paged_attention_kernel``; same contract as ``tierkv.kernels.paged_attention``.

    Checks shapes, strides and dtypes (no device sync); the output is a new
    tensor [T, Hq, D] in q's dtype, written asynchronously on the current stream.
    """
    check_paged_attention(q, pool, layer, block_tables, context_lens, query_start_loc)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = pool.shape[4]
    index_args = {"block_tables": block_tables, "context_lens": context_lens, "query_start_loc": query_start_loc}
    for name, t in index_args.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}")
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if num_tokens == num_seqs:
        block_m, block_n, num_warps = DECODE_BLOCK_M, DECODE_BLOCK_N, DECODE_WARPS
    else:
        block_m, block_n, num_warps = PREFILL_BLOCK_M, PREFILL_BLOCK_N, PREFILL_WARPS
    if q.dtype == torch.float32 or head_dim > 128:
        block_n = SMALL_BLOCK_N
    block_m = max(block_m, group_pad)
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = _num_splits(num_tokens, num_seqs, num_kv_heads)
    part_acc = part_ml = out  # placeholders: read only when splits > 1
    if splits > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_q_heads, splits, 2, dtype=torch.float32, device=q.device)
    grid = (num_tokens // (block_m // group_pad) + num_seqs, num_kv_heads, splits)
    kv = pool[:, layer]
    # Triton launches on the current device: make it the tensors' one.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _paged_attention_kernel[grid](
            q, kv, out, block_tables, context_lens, query_start_loc,
            float(scale), num_seqs,
            q.stride(0), q.stride(1),
            kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            out.stride(0), out.stride(1),
            block_tables.stride(0),
            part_acc, part_ml, num_q_heads,
            BLOCK_SIZE=pool.shape[3], HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=group_pad,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_seqs + 1), NUM_SPLITS=splits, IEEE=q.dtype == torch.float32,
            num_warps=num_warps, num_stages=NUM_STAGES,
        )
        if splits > 1:
            _merge_splits_kernel[(num_tokens, num_q_heads)](
                part_acc, part_ml, out, num_q_heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, num_warps=MERGE_WARPS,
            )
    return out


def _num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int) -> int:
    """Context splits per decode program: enough programs to fill the device, a power of 2."""
    programs = num_seqs * num_kv_heads
    if num_tokens != num_seqs or programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(-(-SPLIT_TARGET_PROGRAMS // programs)))

