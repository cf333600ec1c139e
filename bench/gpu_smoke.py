"""GPU smoke test: kernel correctness on CUDA, decode attention bandwidth, L2 -> L1 promotion.

correctness           every Triton kernel on CUDA against its torch reference
                      (paged_attention vs the CPU reference computed in fp32 on
                      the same values: fp32 rel err <= 1e-5,
                      fp16 <= 2e-3, bf16 <= 1.6e-2; write_kv and gather/scatter
                      bit-exact against the reference on CUDA, scatter also from
                      the connector's landing slots with trailer room, via .to())
device_copy_gbps      a device-to-device copy: (bytes read + bytes written) / s
decode_read_gbps      decode paged attention: K/V bytes read / kernel time
decode_fraction       decode_read_gbps / device_copy_gbps
decode_small          the same for 4 sequences of a long context (split-KV decode)
promotion_gbps        TierKVStore.load of blocks held in L2 (pinned host) into
                      L1 (device) slots: bytes / wall time from load() to wait()
pinned_copy_gbps      one plain copy of the same bytes from a pinned host buffer
pinned_per_block_gbps the same bytes as one copy per block on one stream
Needs CUDA and triton; exits 2 with a message when there is no CUDA device.
Exit 1 when a correctness check fails. ``--quick`` shrinks the sizes.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import parser, print_table, write_json  # noqa: E402

DEVICE = "cuda"  # the one place naming the device, so the script can be dry-run on CPU
SIZES = {
    "quick": dict(copy_mib=256, decode_seqs=32, decode_ctx=2048, small_ctx=8192, promo_blocks=64, promo_reps=3),
    "full": dict(copy_mib=1024, decode_seqs=64, decode_ctx=4096, small_ctx=16384, promo_blocks=256, promo_reps=5),
}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# name: (seqs as (context_len, q_len), Hq, Hkv, head_dim, block_size)
ATTENTION_CASES = {
    "mixed_gqa4": ([(700, 300), (513, 513), (1500, 1), (16, 1), (40, 7)], 32, 8, 128, 16),
    "decode_gqa4": ([(c, 1) for c in (1, 17, 255, 1024, 2049, 333, 4000, 64)], 32, 8, 128, 16),  # split-KV
    "decode_many": ([(1 + (37 * i) % 600, 1) for i in range(64)], 32, 8, 128, 16),  # 512 programs: no split
    "odd_gqa3_d80": ([(301, 45), (95, 1), (129, 129)], 12, 4, 80, 32),
    "mha_d64": ([(1030, 1030), (77, 1)], 8, 8, 64, 16),
}


def need_cuda() -> None:
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (torch.cuda.is_available() is False); nothing was measured.",
              file=sys.stderr)
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu_smoke: triton is not installed; pip install 'tierkv[gpu]'", file=sys.stderr)
        sys.exit(2)


def cuda_seconds(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def make_attention_case(seqs, hq, hkv, d, block, dtype, layers=2, layer=1, seed=0):
    """A paged batch on the CPU: pool with shuffled blocks, block tables, q. Returns kwargs."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(ctx / block) for ctx, _ in seqs]
    num_blocks = sum(need) + 1
    pool = torch.randn(num_blocks, layers, 2, block, hkv, d, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    q_lens = [q for _, q in seqs]
    return dict(
        q=torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype),
        pool=pool,
        layer=layer,
        block_tables=tables,
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
        scale=1.0 / math.sqrt(d),
    )


def to_cuda(args: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def check_attention() -> list[dict]:
    import tierkv.kernels as kernels
    from tierkv.kernels.reference import paged_attention_ref
    from tierkv.kernels.triton_paged_attention import paged_attention

    rows = []
    for name, (seqs, hq, hkv, d, block) in ATTENTION_CASES.items():
        for dtype in TOL:
            cpu = make_attention_case(seqs, hq, hkv, d, block, dtype)
            # The reference in fp32 on the same (rounded) values: the exact answer for these inputs.
            ref = paged_attention_ref(**{k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                         else v for k, v in cpu.items()})
            gpu = to_cuda(cpu)
            out = paged_attention(**gpu)
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            rows.append(dict(kernel="paged_attention", case=name, dtype=str(dtype), rel_err=err,
                             tol=TOL[dtype], ok=err <= TOL[dtype] and out.dtype == dtype))
    cpu = make_attention_case(*ATTENTION_CASES["mixed_gqa4"], torch.float16)
    gpu = to_cuda(cpu)
    os.environ.pop(kernels.ENV_VAR, None)
    same = torch.equal(kernels.paged_attention(**gpu), paged_attention(**gpu))
    rows.append(dict(kernel="paged_attention", case="dispatch_cuda_is_triton", dtype="torch.float16",
                     rel_err=0.0, tol=0.0, ok=same))
    err = rel_err(paged_attention_ref(**gpu), paged_attention_ref(**cpu))
    rows.append(dict(kernel="paged_attention_ref", case="reference_on_cuda", dtype="torch.float16",
                     rel_err=err, tol=TOL[torch.float16], ok=err <= TOL[torch.float16]))
    return rows


def check_write_kv() -> list[dict]:
    from tierkv.kernels.reference import write_kv_ref
    from tierkv.kernels.triton_write_kv import write_kv

    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for dtype in TOL:
        n, layers, block, hkv, d, tokens = 64, 4, 16, 8, 128, 700
        pool = torch.randn(n, layers, 2, block, hkv, d, device=DEVICE, generator=gen).to(dtype)
        kv = torch.randn(tokens, 2, hkv, d, device=DEVICE, generator=gen).to(dtype)  # strided k, v
        slots = torch.randperm(n * block, device=DEVICE, generator=gen)[:tokens]
        slots[::50] = -1
        expected = pool.clone()
        write_kv_ref(expected, 2, kv[:, 0], kv[:, 1], slots)
        write_kv(pool, 2, kv[:, 0], kv[:, 1], slots)
        rows.append(dict(kernel="write_kv", case="strided_kv_padded", dtype=str(dtype), rel_err=0.0,
                         tol=0.0, ok=bool(torch.equal(pool, expected))))
    return rows


def check_gather_scatter() -> list[dict]:
    from tierkv.kernels import gather_scatter
    from tierkv.kernels.reference import gather_blocks_ref, scatter_blocks_ref

    layers, n, block, hkv, d = 8, 96, 16, 8, 128
    # One allocation for all layers, seen as [L, N, 2, B, Hkv, D] (a vLLM-style cache).
    kv = torch.randn(layers, n, 2, block, hkv, d, device=DEVICE, dtype=torch.float16)
    ids = torch.tensor([5, 6, 7, 40, 2, 90, 91], device=DEVICE, dtype=torch.int64)
    got = torch.empty(len(ids), layers, 2, block, hkv, d, device=DEVICE, dtype=torch.float16)
    want = torch.empty_like(got)
    gather_scatter.gather_blocks(kv, ids, got)
    gather_blocks_ref(kv, ids, want)
    rows = [dict(kernel="gather_blocks", case="runs_and_singles", dtype="torch.float16", rel_err=0.0,
                 tol=0.0, ok=bool(torch.equal(got, want)))]
    src = torch.randn_like(got)
    a, b = kv.clone(), kv.clone()
    gather_scatter.scatter_blocks(a, ids, src)
    scatter_blocks_ref(b, ids, src)
    rows.append(dict(kernel="scatter_blocks", case="runs_and_singles", dtype="torch.float16", rel_err=0.0,
                     tol=0.0, ok=bool(torch.equal(a, b))))
    return rows


def check_landing_scatter() -> list[dict]:
    """The vLLM connector's CUDA load path with a Mooncake L4: a run of landing slots with trailer
    room (strided on the host) goes to the device with ``.to()`` and is scattered; bit-exact
    against the reference fed the same blocks made contiguous."""
    from tierkv.kernels import gather_scatter
    from tierkv.kernels.reference import scatter_blocks_ref
    from tierkv.layout import KVLayout
    from tierkv.tiers.device import DeviceTier

    layers, n, block, hkv, d = 8, 96, 16, 8, 128
    layout = KVLayout(num_layers=layers, num_kv_heads=hkv, head_dim=d, block_size=block, dtype="float16")
    slots = DeviceTier(layout, 8, "cpu", slot_room=64)  # as LandingPool builds them for mooncake://
    run = slots.pool[2:5]
    run.copy_(torch.randn(3, *layout.block_shape).to(torch.float16))
    ids = torch.tensor([7, 3, 50], device=DEVICE, dtype=torch.int64)
    got = torch.zeros(layers, n, 2, block, hkv, d, device=DEVICE, dtype=torch.float16)
    want = torch.zeros_like(got)
    gather_scatter.scatter_blocks(got, ids, run.to(DEVICE, non_blocking=True))
    scatter_blocks_ref(want, ids, run.contiguous().to(DEVICE))
    return [dict(kernel="scatter_blocks", case="landing_slots_with_room", dtype="torch.float16", rel_err=0.0,
                 tol=0.0, ok=bool(torch.equal(got, want)) and bool(got.any()))]


def device_copy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 256)
    dst = torch.empty_like(src)
    seconds = cuda_seconds(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / seconds / 1e9


def decode_bandwidth(num_seqs: int, ctx: int, copy_gbps: float) -> dict:
    from tierkv.kernels.triton_paged_attention import _num_splits, paged_attention

    hq, hkv, d, block, dtype = 32, 8, 128, 16, torch.float16
    blocks_per_seq = ctx // block
    num_blocks = num_seqs * blocks_per_seq + 1
    pool = torch.randn(num_blocks, 2, 2, block, hkv, d, device=DEVICE, dtype=dtype)
    tables = (torch.randperm(num_blocks - 1, device=DEVICE)[: num_seqs * blocks_per_seq] + 1)
    tables = tables.view(num_seqs, blocks_per_seq).to(torch.int32)
    args = dict(
        q=torch.randn(num_seqs, hq, d, device=DEVICE, dtype=dtype), pool=pool, layer=1,
        block_tables=tables.contiguous(),
        context_lens=torch.full((num_seqs,), ctx, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE),
        scale=1.0 / math.sqrt(d),
    )
    seconds = cuda_seconds(lambda: paged_attention(**args), iters=50)
    read = num_seqs * ctx * hkv * d * 2 * pool.element_size()
    gbps = read / seconds / 1e9
    return dict(num_seqs=num_seqs, context_len=ctx, splits=_num_splits(num_seqs, num_seqs, hkv), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                block_size=block, dtype=str(dtype), kernel_us=seconds * 1e6, kv_bytes_read=read,
                decode_read_gbps=gbps, device_copy_gbps=copy_gbps, decode_fraction=gbps / copy_gbps)


def promotion(num_blocks: int, reps: int) -> dict:
    from tierkv.config import CostConfig, L1Config, L2Config, StoreConfig
    from tierkv.layout import KVLayout
    from tierkv.store import TierKVStore

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
    bb = layout.block_bytes
    # L2 holds every repetition's blocks: a full L2 may evict a chain's first blocks while its
    # last ones are being put, and the lookup would then match nothing.
    cfg = StoreConfig(
        model_id="gpu-smoke", l1=L1Config(device=DEVICE), l2=L2Config(capacity=(reps + 1) * num_blocks * bb + bb),
        l3_enabled=False, cost=CostConfig(recompute_us_per_token=1e6),  # always load, never cut the match
    )
    src = torch.randn(num_blocks, *layout.block_shape, device=DEVICE, dtype=torch.float16).cpu()
    times, verified = [], None
    with TierKVStore(cfg, layout, l1_blocks=num_blocks + 1) as store:
        for rep in range(reps + 1):  # rep 0 warms threads, streams and the allocator
            tokens = list(range(rep * 1_000_000, rep * 1_000_000 + num_blocks * layout.block_size))
            keys = store.hash(tokens)
            if not all(store.put_blocks(keys, list(src))):
                raise RuntimeError("gpu_smoke: L2 refused blocks; promotion not measured")
            match = store.lookup(tokens)
            if match.counts["l2"] != num_blocks:
                raise RuntimeError(f"gpu_smoke: expected {num_blocks} L2 hits, got {match.counts}")
            slots = store.allocate(num_blocks)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = store.load(match, slots).wait()
            elapsed = time.perf_counter() - t0
            if result.num_ok != num_blocks:
                raise RuntimeError(f"gpu_smoke: promotion loaded {result.num_ok} of {num_blocks} blocks")
            if rep == 1:
                index = torch.tensor(slots, device=DEVICE)
                verified = bool(torch.equal(store.l1.pool.index_select(0, index).cpu(), src))
            if rep:
                times.append(elapsed)
            store.release(match)
        l2_pinned = bool(store.l2.pinned)
    nbytes = num_blocks * bb
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    pinned.copy_(src.view(torch.uint8).reshape(-1))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    bulk = cuda_seconds(lambda: dst.copy_(pinned, non_blocking=True), iters=reps)
    pinned_blocks, dst_blocks = pinned.view(num_blocks, bb), dst.view(num_blocks, bb)

    def per_block():
        for i in range(num_blocks):
            dst_blocks[i].copy_(pinned_blocks[i], non_blocking=True)

    per = cuda_seconds(per_block, iters=reps)
    promo = nbytes / statistics.median(times) / 1e9
    return dict(num_blocks=num_blocks, block_bytes=bb, bytes=nbytes, l2_pinned=l2_pinned, bytes_verified=verified,
                promotion_gbps=promo, pinned_copy_gbps=nbytes / bulk / 1e9,
                pinned_per_block_gbps=nbytes / per / 1e9, promotion_vs_pinned=promo / (nbytes / bulk / 1e9))


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    need_cuda()
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    checks = check_attention() + check_write_kv() + check_gather_scatter() + check_landing_scatter()
    size = SIZES["quick" if args.quick else "full"]
    copy_gbps = device_copy_gbps(size["copy_mib"] << 20)
    decode = decode_bandwidth(size["decode_seqs"], size["decode_ctx"], copy_gbps)
    decode_small = decode_bandwidth(4, size["small_ctx"], copy_gbps)
    promo = promotion(size["promo_blocks"], size["promo_reps"])
    all_ok = all(c["ok"] for c in checks)
    rows = [(f"{c['kernel']}/{c['case']}/{c['dtype'].removeprefix('torch.')}",
             "ok" if c["ok"] else "FAIL", f"rel err {c['rel_err']:.2e} (tol {c['tol']:.0e})" if c["tol"] else "exact")
            for c in checks]
    rows += [
        ("device_copy_gbps", f"{copy_gbps:.0f}", "read + write per second, device to device"),
        ("decode_read_gbps", f"{decode['decode_read_gbps']:.0f}",
         f"{decode['num_seqs']} seqs x {decode['context_len']} ctx, fp16, {decode['kernel_us']:.0f} us"),
        ("decode_fraction", f"{decode['decode_fraction']:.2f}", "of device_copy_gbps"),
        ("decode_small_read_gbps", f"{decode_small['decode_read_gbps']:.0f}",
         f"4 seqs x {decode_small['context_len']} ctx, {decode_small['splits']} KV splits, "
         f"{decode_small['kernel_us']:.0f} us, {decode_small['decode_fraction']:.2f} of copy"),
        ("promotion_gbps", f"{promo['promotion_gbps']:.1f}",
         f"store.load L2 -> L1, {promo['num_blocks']} x {promo['block_bytes'] >> 20} MiB blocks, "
         f"l2 pinned={promo['l2_pinned']}, bytes verified={promo['bytes_verified']}"),
        ("pinned_copy_gbps", f"{promo['pinned_copy_gbps']:.1f}", "one copy of the same bytes"),
        ("pinned_per_block_gbps", f"{promo['pinned_per_block_gbps']:.1f}", "one copy per block, one stream"),
        ("promotion_vs_pinned", f"{promo['promotion_vs_pinned']:.2f}", "promotion_gbps / pinned_copy_gbps"),
    ]
    print_table(f"gpu smoke on {torch.cuda.get_device_name()} ({time.perf_counter() - started:.0f} s)", rows)
    write_json(args.json, dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        quick=args.quick, all_correct=all_ok, correctness=checks, device_copy_gbps=copy_gbps,
        decode=decode, decode_small=decode_small, promotion=promo,
    ))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
