"""`tierkv bench`: the quick tier benchmark with a table.

Runs ``bench/tiers.py --quick`` from the source checkout when there is one;
otherwise (an installed wheel) measures L2 and L3 put/get inline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.table import Table

from tierkv.cli.common import CacheDir, ConfigFile, Debug, Json, app, console, print_json, repo_root, settings
from tierkv.layout import KVLayout
from tierkv.tiers.base import Lineage
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.host import HostTier


def inline_bench(work_dir: Path, blocks: int, layout: KVLayout) -> list[dict]:
    """Write then read ``blocks`` blocks through L2 (DRAM slab) and L3 (slot file); GB/s and µs per block."""
    torch.manual_seed(0)
    src = [torch.randn(layout.block_shape).to(layout.torch_dtype) for _ in range(blocks)]
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in range(blocks)]
    keys = [i.to_bytes(16, "little") for i in range(1, blocks + 1)]
    lineage = [Lineage(None, 0)] * blocks
    rows = []
    l2 = HostTier(layout, blocks, pin=False)
    rows += _measure("l2 (DRAM slab)", l2, keys, src, dst, lineage, layout)
    l2.close()
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        l3 = DiskTier(tmp, layout, blocks)
        rows += _measure(f"l3 ({'O_DIRECT' if l3.direct else 'buffered'} slot file)", l3, keys, src, dst, lineage, layout)
        l3.close()
    return rows


def _measure(name, tier, keys, src, dst, lineage, layout) -> list[dict]:
    out = []
    for op in ("write", "read"):
        started = time.perf_counter()
        ok = tier.put(keys, src, lineage) if op == "write" else tier.get(keys, dst)
        seconds = time.perf_counter() - started
        if not all(ok):
            raise RuntimeError(f"bench: {name} {op} failed for {ok.count(False)} blocks")
        nbytes = len(keys) * layout.block_bytes
        out.append({"tier": name, "op": op, "blocks": len(keys), "block_bytes": layout.block_bytes,
                    "gb_per_s": round(nbytes / seconds / 1e9, 3), "us_per_block": round(seconds / len(keys) * 1e6, 1)})
    if not all(torch.equal(a, b) for a, b in zip(src, dst)):
        raise RuntimeError(f"bench: {name} read back different bytes")
    return out


@app.command("bench", epilog="Example: `tierkv bench --json`")
def bench_cmd(
    blocks: Annotated[int, typer.Option("--blocks", min=1, max=4096, help="Blocks per measurement (inline bench).")] = 64,
    inline: Annotated[bool, typer.Option("--inline", help="Measure inline even where bench/tiers.py exists.")] = False,
    json_out: Json = False, cache_dir: CacheDir = None, config: ConfigFile = None, debug: Debug = False,
) -> None:
    """Measure how fast each tier moves blocks (the quick tier benchmark) and print a table."""
    s = settings(cache_dir, config, debug)
    root = repo_root()
    script = root / "bench" / "tiers.py" if root else None
    if script is not None and script.exists() and not inline:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "tiers.json"
            proc = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out), "--dir", str(s.cache_dir)],
                                  capture_output=json_out, text=True, cwd=root)
            if proc.returncode != 0:
                raise typer.Exit(1)
            if json_out:
                print_json(json.loads(out.read_text()))
        return
    torch.set_num_threads(1)
    s.cache_dir.mkdir(parents=True, exist_ok=True)
    layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
    rows = inline_bench(s.cache_dir, blocks, layout)
    if json_out:
        print_json({"layout": layout.to_dict(), "rows": rows})
        return
    table = Table(title=f"tier bench: {blocks} blocks of {layout.block_bytes >> 10} KiB ({layout.fingerprint})")
    for col in ("tier", "op", "GB/s", "µs/block"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["tier"], r["op"], f"{r['gb_per_s']:.2f}", f"{r['us_per_block']:.0f}")
    console.print(table)
