"""vLLM connector loads: into its landing slots against a fresh tensor, from L3 and from a Mooncake L4.

The connector loads each prefix into CPU blocks, then scatters them into vLLM's
cache. ``LandingPool`` (``connectors/vllm/landing.py``) gives it page-aligned
slots registered with the L4 client, with trailer room on Mooncake; before it,
every load went into a fresh ``torch.empty`` batch (64-byte aligned,
unregistered), as the peer here still does. Both load the same 16 blocks of
512 KiB through the same store, in turns (order shuffled per round, seeded),
lower quartile of the rounds.

l3_fresh/landing_gbps        L3 hits (O_DIRECT): unaligned memory goes through the disk tier's bounce buffer
mooncake_fresh/landing_gbps  L4 hits over Mooncake TCP: unregistered memory goes through its staging buffer
*_landing_vs_fresh           the ratio (above 1: the landing slots are faster)
Target: landing >= 1.0 x fresh for both sources.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import finish, parser, print_table, target  # noqa: E402
from remote import start_mooncake, stop  # noqa: E402

from tierkv.config import L2Config, L3Config, L4Config, StoreConfig  # noqa: E402
from tierkv.connectors.vllm.landing import LandingPool  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402
from tierkv.tiers.remote.codec import TRAILER_BYTES  # noqa: E402

LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="float16")  # 512 KiB
BLOCKS = 16


def measure(store: TierKVStore, keys: list[bytes], rounds: int) -> dict[str, float]:
    """GB/s of ``store.load`` of ``keys`` into landing slots and into a fresh tensor, in turns."""
    landing = LandingPool(store, 4 * BLOCKS)
    times: dict[str, list[float]] = {"fresh": [], "landing": []}
    order = list(times)
    shuffle = random.Random(0).shuffle
    try:
        for _ in range(rounds):
            shuffle(order)
            for kind in order:
                m = store.lookup_keys(keys)
                t0 = time.perf_counter()
                dst = (landing.take(len(keys)) if kind == "landing"
                       else torch.empty((len(keys), *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype))
                ok = store.load(m, list(dst.unbind(0))).wait(60).ok
                times[kind].append(time.perf_counter() - t0)
                store.release(m)
                landing.give_back(dst)
                assert ok == [True] * len(keys), f"{kind}: load failed {ok}"
        assert landing.fallbacks == 0
    finally:
        landing.close()
    nbytes = len(keys) * LAYOUT.block_bytes
    return {kind: nbytes / sorted(t)[len(t) // 4] / 1e9 for kind, t in times.items()}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    os.sync()  # as bench/remote.py: writeback from an earlier run slows transfers unevenly
    rounds = 31 if args.quick else 101
    blocks = torch.empty((BLOCKS, *LAYOUT.block_shape), dtype=LAYOUT.torch_dtype)
    blocks.view(torch.int16).random_(-30000, 30000)
    work = Path(tempfile.mkdtemp(prefix="tierkv-bench-landing-"))
    procs: list[subprocess.Popen] = []
    figures: dict[str, float] = {}
    started = time.perf_counter()
    try:
        l3 = StoreConfig(l2=L2Config(capacity=0), l3=L3Config(path=str(work / "l3"), capacity=64 * LAYOUT.block_bytes))
        store = TierKVStore(l3, LAYOUT, l1_blocks=0)
        try:
            keys = store.hash(list(range(BLOCKS * LAYOUT.block_size)))
            assert store.put_blocks(keys, list(blocks)) == [True] * BLOCKS  # into L3, the highest host tier
            for kind, v in measure(store, keys, rounds).items():
                figures[f"l3_{kind}_gbps"] = v
        finally:
            store.close()
        url = start_mooncake(work, procs, 64 * (LAYOUT.block_bytes + TRAILER_BYTES) + (64 << 20))
        cfg = StoreConfig(l2=L2Config(capacity=0), l3_enabled=False, l4=L4Config(url=url, timeout_ms=30_000))
        store = TierKVStore(cfg, LAYOUT, l1_blocks=0)
        try:
            keys = store.hash(list(range(BLOCKS * LAYOUT.block_size)))
            assert store.l4.put(keys, list(blocks)) == [True] * BLOCKS
            for kind, v in measure(store, keys, rounds).items():
                figures[f"mooncake_{kind}_gbps"] = v
        finally:
            store.close()
    finally:
        stop(procs)
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for src in ("l3", "mooncake"):
        fresh, landed = figures[f"{src}_fresh_gbps"], figures[f"{src}_landing_gbps"]
        figures[f"{src}_landing_vs_fresh"] = landed / fresh
        rows.append((f"{src}_fresh_gbps", f"{fresh:.3f}", "a fresh torch.empty batch (the connector before)"))
        rows.append((f"{src}_landing_gbps", f"{landed:.3f}", f"{landed / fresh:.2f} x fresh: landing slots"))
    figures["seconds"] = time.perf_counter() - started
    print_table(f"connector loads of {BLOCKS} blocks of {LAYOUT.block_bytes >> 10} KiB, lower quartile of "
                f"{rounds} rounds", rows)
    finish(args, "landing", figures, [
        target(f"{src}_landing_vs_fresh", figures[f"{src}_landing_vs_fresh"], ">=", 1.0, "a fresh torch.empty batch")
        for src in ("l3", "mooncake")])


if __name__ == "__main__":
    main()
