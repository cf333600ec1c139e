"""CPU cost of the torch reference kernels (the CPU engine's attention path) against dense SDPA.

Shapes are the ``small`` engine preset's (8 query heads, 2 KV heads, head_dim
64, block size 16, fp32, 8 layers in the pool) on one thread. The floor for
each case is ``scaled_dot_product_attention`` on K/V already contiguous per
sequence (what the same attention costs with no paging), measured in the same
run. Blocks are shuffled over the pool, as after a while of serving. Times are
medians of this thread's CPU time per call (the machine may be shared).

decode      32 sequences of 144-767 tokens (fixed seed), one new token each
decode_bf16 the same in bfloat16
prefill     one sequence of 512 new tokens, no cached prefix
prefix      256 new tokens over a 512-token context (256 cached)
write_kv    512 tokens into shuffled slots
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import finish, parser, print_table  # noqa: E402

from tierkv.kernels.reference import paged_attention_ref, write_kv_ref  # noqa: E402

HQ, HKV, D, B, LAYERS = 8, 2, 64, 16, 8


def cpu_ms(fn, reps: int) -> float:
    """Median CPU time of this thread per call of ``fn``, in ms."""
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def paged_batch(ctxs: list[int], q_lens: list[int], seed: int = 0, dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / B) for c in ctxs]
    n = sum(need) + 1
    pool = torch.randn(n, LAYERS, 2, B, HKV, D, generator=gen).to(dtype)
    order = torch.randperm(n, generator=gen)
    tables = torch.zeros(len(ctxs), max(need), dtype=torch.int32)
    used = 0
    for s, k in enumerate(need):
        tables[s, :k] = order[used : used + k].to(torch.int32)
        used += k
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(q=torch.randn(starts[-1], HQ, D, generator=gen).to(dtype), pool=pool, layer=3, block_tables=tables,
                context_lens=torch.tensor(ctxs, dtype=torch.int32),
                query_start_loc=torch.tensor(starts, dtype=torch.int32), scale=D**-0.5)


def dense_floor(ctxs: list[int], q_lens: list[int], dtype=torch.float32):
    """SDPA per sequence over contiguous K/V (decode: one batch padded to the longest context)."""
    g = HQ // HKV
    if all(q == 1 for q in q_lens):
        L = max(ctxs)
        q = torch.randn(len(ctxs), HKV, g, D).to(dtype)
        k, v = torch.randn(len(ctxs), HKV, L, D).to(dtype), torch.randn(len(ctxs), HKV, L, D).to(dtype)
        mask = torch.arange(L)[None, :] < torch.tensor(ctxs)[:, None]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    items = []
    for c, ql in zip(ctxs, q_lens):
        q = torch.randn(HKV, g, ql, D)
        k, v = torch.randn(HKV, 1, c, D).expand(HKV, g, c, D), torch.randn(HKV, 1, c, D).expand(HKV, g, c, D)
        mask = torch.arange(c)[None, :] <= torch.arange(c - ql, c)[:, None]
        items.append((q, k, v, mask))
    return lambda: [F.scaled_dot_product_attention(q, k, v, attn_mask=m) for q, k, v, m in items]


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    reps = 5 if args.quick else 20
    gen = torch.Generator().manual_seed(0)
    decode_ctx = torch.randint(144, 768, (32,), generator=gen).tolist()
    cases = {
        "decode": (decode_ctx, [1] * 32, torch.float32),
        "decode_bf16": (decode_ctx, [1] * 32, torch.bfloat16),
        "prefill": ([512], [512], torch.float32),
        "prefix": ([512], [256], torch.float32),
    }
    rows, figures = [], {}
    for name, (ctxs, q_lens, dtype) in cases.items():
        batch = paged_batch(ctxs, q_lens, dtype=dtype)
        paged_attention_ref(**batch)
        ms = cpu_ms(lambda: paged_attention_ref(**batch), reps)
        floor = dense_floor(ctxs, q_lens, dtype)
        floor()
        floor_ms = cpu_ms(floor, reps)
        figures[name] = dict(ref_ms=ms, dense_sdpa_ms=floor_ms, ratio=ms / floor_ms)
        rows.append((f"{name}_ref_ms", f"{ms:.2f}", f"dense SDPA {floor_ms:.2f} ms -> x{ms / floor_ms:.2f}"))
    batch = paged_batch([4096], [1])
    slots = torch.randperm(batch["pool"].shape[0] * B, generator=gen)[:512]
    k, v = torch.randn(512, HKV, D), torch.randn(512, HKV, D)
    ms = cpu_ms(lambda: write_kv_ref(batch["pool"], 3, k, v, slots), reps)
    figures["write_kv"] = dict(ref_ms=ms, tokens=512)
    rows.append(("write_kv_ref_ms", f"{ms:.3f}", "512 tokens, shuffled slots"))
    print_table("torch reference kernels on CPU (small preset shapes, 1 thread, CPU ms per call)", rows)
    # No target: these are the reference kernels' costs, for information (--check has nothing to miss).
    finish(args, "kernels_cpu", dict(shape=dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=B,
                                                threads=1, timing="median thread CPU time"), **figures), [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
