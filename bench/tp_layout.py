"""What one cache for every TP size costs: reading a prefix from L3 in the reader's own layout
against assembling it from another TP size's shards (docs/design.md §13, issue 32).

One model layout (16 layers, 4 KV heads, head_dim 64, 16-token blocks, fp16: 256 KiB a block),
``--blocks`` blocks written three ways into one ``l3.path``: unsharded (what a TP=1 instance
saves) and as the 2 shards of TP=2 (each rank's own directory). Readers, interleaved round by
round, each from a fresh store on the directory (the L3 index read, then every block loaded):

- ``tp1_own``: TP=1 reading its own blocks (1 object, 1 read per block);
- ``tp1_from_tp2``: TP=1 assembling each block from the two TP=2 shards (2 objects, 2 reads of
  half the bytes, 2 lookups) — ``shards.Cover``, what the connector does;
- ``tp2_own``: the two TP=2 ranks each reading their own shard, one after the other;
- ``tp2_from_tp1``: the two TP=2 ranks each slicing its heads from the unsharded blocks (each reads
  every byte for half of them: 2x read amplification).

Per reader: lookup µs per block, load time, useful GB/s (the bytes the reader keeps), bytes read
per useful byte, objects per block. Checked: every assembled or sliced block equals the block it
stands for, byte for byte. ``--check``: an assembled read keeps ≥ 0.5x its own layout's useful
GB/s (a TP size reading another's saves still beats recomputing by far; the default stays the
per-rank layout, which pays nothing for the sharing).

    .venv/bin/python bench/tp_layout.py --quick --json bench/results/tp_layout.json --check
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import finish, parser, print_table, target  # noqa: E402

from tierkv.config import L2Config, L3Config, StoreConfig  # noqa: E402
from tierkv.connectors.vllm.shards import Cover, best, covers  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402

FULL = KVLayout(num_layers=16, num_kv_heads=4, head_dim=64, block_size=16, dtype="float16")
SHARDS = [FULL.shard(0, 2), FULL.shard(2, 2)]


def _store(l3: Path, layout: KVLayout, capacity: int) -> TierKVStore:
    cfg = StoreConfig(model_id="tp-layout-bench", l2=L2Config(capacity=0),
                      l3=L3Config(path=str(l3), capacity=capacity))
    return TierKVStore(cfg, layout, l1_blocks=0)


def _read(store: TierKVStore, keys: list[bytes], cover: Cover | None) -> tuple[float, float, torch.Tensor]:
    """(lookup s, load s, the blocks) of ``keys`` through ``store`` (its own blocks, or ``cover``'s)."""
    t0 = time.perf_counter()
    m, chosen = best(store, keys, [cover] if cover else [], True)
    t1 = time.perf_counter()
    assert m.num_blocks == len(keys), f"found {m.num_blocks} of {len(keys)}"
    dst = torch.empty((len(keys), *store.layout.block_shape), dtype=store.layout.torch_dtype)
    if chosen is not None:
        ok = chosen.load(m, 0, dst).wait().ok
    else:
        ok = store.load(m, list(dst.unbind(0))).wait().ok
        store.release(m)
    t2 = time.perf_counter()
    assert all(ok), "a block failed to load"
    return t1 - t0, t2 - t1, dst


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=0, help="blocks of the prefix (default 64 quick, 256 full)")
    p.add_argument("--reps", type=int, default=0, help="rounds (default 3 quick, 7 full)")
    p.add_argument("--dir", help="directory for the L3 files (default: a temporary one)")
    args = p.parse_args()
    n = args.blocks or (64 if args.quick else 256)
    reps = args.reps or (3 if args.quick else 7)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="tierkv-tp-layout-", dir=args.dir))
    l3 = work / "l3"
    cap = (n + 8) * FULL.block_bytes
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn((n, *FULL.block_shape), generator=gen).to(FULL.torch_dtype)
    tokens = list(range(3, 3 + n * FULL.block_size))
    try:
        writer = _store(l3, FULL, cap)
        keys = writer.hash(tokens)
        assert all(writer.put_blocks(keys, list(blocks.unbind(0))))
        writer.close()
        for lay in SHARDS:
            w = _store(l3, lay, cap)
            assert w.hash(tokens) == keys, "one chain of keys for every TP size"
            a, b = lay.kv_head_start, lay.kv_head_start + lay.num_kv_heads
            assert all(w.put_blocks(keys, list(blocks[:, :, :, :, a:b].contiguous().unbind(0))))
            w.close()

        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in
                                                          ("tp1_own", "tp1_from_tp2", "tp2_own", "tp2_from_tp1")}
        exact = True

        def tp1(assemble: bool) -> None:
            nonlocal exact
            own = _store(l3, FULL, cap)
            if assemble:  # the own blocks are there too: read through the cover, as a TP=1 reader would
                parts = [_store(l3, lay, cap) for lay in SHARDS]
                (pieces,) = covers(FULL, SHARDS)
                cover = Cover([(s, a, b, at) for s, (_, a, b, at) in zip(parts, pieces)])
                t_lookup = time.perf_counter()
                m = cover.lookup(keys, True)
                t_load = time.perf_counter()
                dst = torch.empty((n, *FULL.block_shape), dtype=FULL.torch_dtype)
                assert m.num_blocks == n and all(cover.load(m, 0, dst).wait().ok)
                done = time.perf_counter()
                samples["tp1_from_tp2"].append((t_load - t_lookup, done - t_load))
                for s in parts:
                    s.close()
            else:
                lk, ld, dst = _read(own, keys, None)
                samples["tp1_own"].append((lk, ld))
            exact = exact and torch.equal(dst, blocks)
            own.close()

        def tp2(slice_full: bool) -> None:
            nonlocal exact
            total_lk = total_ld = 0.0
            for lay in SHARDS:
                a, b = lay.kv_head_start, lay.kv_head_start + lay.num_kv_heads
                own = _store(l3, lay, cap)
                if slice_full:
                    full = _store(l3, FULL, cap)
                    (pieces,) = covers(lay, [FULL])
                    cover = Cover([(full, *pieces[0][1:])])
                    t0 = time.perf_counter()
                    m = cover.lookup(keys, True)
                    t1 = time.perf_counter()
                    dst = torch.empty((n, *lay.block_shape), dtype=lay.torch_dtype)
                    assert m.num_blocks == n and all(cover.load(m, 0, dst).wait().ok)
                    total_lk += t1 - t0
                    total_ld += time.perf_counter() - t1
                    full.close()
                else:
                    lk, ld, dst = _read(own, keys, None)
                    total_lk += lk
                    total_ld += ld
                exact = exact and torch.equal(dst, blocks[:, :, :, :, a:b])
                own.close()
            samples["tp2_from_tp1" if slice_full else "tp2_own"].append((total_lk, total_ld))

        steps = [lambda: tp1(False), lambda: tp1(True), lambda: tp2(False), lambda: tp2(True)]
        for r in range(reps):
            for step in steps[r % 4:] + steps[: r % 4]:
                step()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    useful = n * FULL.block_bytes  # every reader keeps one full model block's bytes per block in all
    read_factor = {"tp1_own": 1.0, "tp1_from_tp2": 1.0, "tp2_own": 1.0, "tp2_from_tp1": 2.0}
    objects = {"tp1_own": 1, "tp1_from_tp2": 2, "tp2_own": 2, "tp2_from_tp1": 2}
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in samples.items()}
    gbs = {k: useful / (lk + ld) / 1e9 for k, (lk, ld) in med.items()}
    figures = {"blocks": n, "block_bytes": FULL.block_bytes, "reps": reps, "exact": exact}
    rows = []
    for k, (lk, ld) in med.items():
        figures.update({f"{k}_lookup_us_per_block": round(lk / n * 1e6, 2), f"{k}_load_ms": round(ld * 1e3, 2),
                        f"{k}_useful_gbs": round(gbs[k], 3), f"{k}_bytes_read_per_useful": read_factor[k],
                        f"{k}_objects_per_block": objects[k]})
        rows.append((k, f"{gbs[k]:.2f} GB/s", f"lookup {lk / n * 1e6:.1f} us/block, load {ld * 1e3:.1f} ms, "
                                             f"{objects[k]} objects/block, {read_factor[k]:.0f}x bytes read"))
    rows.append(("exact", str(exact), "every assembled / sliced block equals the block it stands for"))
    print_table(f"TP layouts: {n} blocks of {FULL.block_bytes >> 10} KiB from L3 (O_DIRECT), median of {reps}, "
                f"useful bytes per second", rows)
    targets = [
        target("tp1_from_tp2_useful_gbs", gbs["tp1_from_tp2"] / gbs["tp1_own"], ">=", 0.5, "x tp1_own"),
        target("tp2_from_tp1_useful_gbs", gbs["tp2_from_tp1"] / gbs["tp2_own"], ">=", 0.5, "x tp2_own"),
        target("exact", float(exact), ">=", 1.0, "bytes equal"),
    ]
    finish(args, "tp_layout", figures, targets)


if __name__ == "__main__":
    main()
