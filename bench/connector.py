"""vLLM connector block movement against the memcpy floor, measured in the same run.

The engine cache is laid out as vLLM 0.32.0's CPU backend allocates it: one
buffer for all layers, each layer a [num_blocks, Hkv, B, 2*D] view whose
(block, head) pages hold K rows then V rows. Blocks move through the same
``cache_view`` + ``gather_blocks`` / ``scatter_blocks`` the connector uses (on
CPU the native loop of ``kernels/cpu_block_copy.py``; ``TIERKV_KERNELS=reference``
measures the pure-torch path). Each round times every figure once, in turn.

memcpy_gbps          single-threaded memmove of the same bytes between two contiguous buffers
gather_gbps          vLLM cache -> canonical blocks, distinct block ids in random order (the save path)
scatter_gbps         canonical blocks -> vLLM cache, distinct block ids in random order (the load path)
gather/scatter_run_gbps  the same with one run of consecutive block ids
Target: gather and scatter >= 0.6 x memcpy.
"""

from __future__ import annotations

import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import finish, median_of, parser, print_table, target  # noqa: E402

from tierkv.connectors.vllm.layout import cache_view  # noqa: E402
from tierkv.kernels import gather_blocks, scatter_blocks  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.tiers.base import _memmove  # noqa: E402

LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=32, dtype="float16")  # 1 MiB


def vllm_cpu_caches(num_blocks: int) -> dict[str, torch.Tensor]:
    """Per-layer caches as vLLM 0.32.0 allocates them for the CPU backend (layout LBHNC)."""
    shape = (num_blocks, LAYOUT.num_kv_heads, LAYOUT.block_size, 2 * LAYOUT.head_dim)
    buf = torch.empty(LAYOUT.num_layers, *shape, dtype=LAYOUT.torch_dtype)
    buf.view(torch.int16).random_(-30000, 30000)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYOUT.num_layers)}


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    n, num_blocks, reps = (32, 96, 15) if args.quick else (128, 384, 25)
    caches = vllm_cpu_caches(num_blocks)
    kv = cache_view(caches, list(caches), LAYOUT, "planes")
    nbytes = n * LAYOUT.block_bytes
    blocks = torch.empty(n, *LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    floor_src = torch.empty_like(blocks).view(torch.int16).random_(-30000, 30000)
    floor_dst = torch.empty_like(blocks)
    shuffled = torch.tensor(random.Random(0).sample(range(num_blocks), n), dtype=torch.int64)
    run = torch.arange(7, 7 + n, dtype=torch.int64)

    def memcpy() -> None:
        _memmove(floor_dst.data_ptr(), floor_src.data_ptr(), nbytes)

    ops = {
        "memcpy_gbps": memcpy,
        "gather_gbps": lambda: gather_blocks(kv, shuffled, blocks),
        "scatter_gbps": lambda: scatter_blocks(kv, shuffled, blocks),
        "gather_run_gbps": lambda: gather_blocks(kv, run, blocks),
        "scatter_run_gbps": lambda: scatter_blocks(kv, run, blocks),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps):  # interleaved rounds: a busy neighbour slows every figure alike
        for name, op in ops.items():
            times[name].append(median_of(op, 1))
    f = {name: gbps(nbytes, statistics.median(t)) for name, t in times.items()}
    figures = {k: round(v, 3) for k, v in f.items()}
    figures["gather_vs_memcpy"] = round(f["gather_gbps"] / f["memcpy_gbps"], 3)
    figures["scatter_vs_memcpy"] = round(f["scatter_gbps"] / f["memcpy_gbps"], 3)
    figures.update(blocks=n, block_bytes=LAYOUT.block_bytes, layout=LAYOUT.to_dict(), reps=reps)
    print_table(f"connector: {n} blocks of {LAYOUT.block_bytes // 1024} KiB, vLLM CPU layout, "
                f"median of {reps}, GB/s", [
        ("memcpy_gbps", f"{f['memcpy_gbps']:.2f}", "floor"),
        ("gather_gbps", f"{f['gather_gbps']:.2f}", f"{figures['gather_vs_memcpy']:.2f}x memcpy (target >= 0.6)"),
        ("scatter_gbps", f"{f['scatter_gbps']:.2f}", f"{figures['scatter_vs_memcpy']:.2f}x memcpy (target >= 0.6)"),
        ("gather_run_gbps", f"{f['gather_run_gbps']:.2f}", "consecutive block ids"),
        ("scatter_run_gbps", f"{f['scatter_run_gbps']:.2f}", "consecutive block ids"),
    ])
    finish(args, "connector", figures, [
        target("gather_vs_memcpy", figures["gather_vs_memcpy"], ">=", 0.6, "memcpy floor"),
        target("scatter_vs_memcpy", figures["scatter_vs_memcpy"], ">=", 0.6, "memcpy floor"),
    ])


if __name__ == "__main__":
    main()
