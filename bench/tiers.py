"""Tier bandwidth against the physical floors, measured in the same run.

memcpy_gbps         single-threaded memmove of the same blocks between page-aligned buffers
odirect_read_gbps   O_DIRECT preadv of the same blocks from a file on the L3 filesystem
odirect_write_gbps  O_DIRECT pwritev of the same blocks + one fdatasync
l2_put/get_gbps     HostTier.put / get through the store's tier object
l3_put/get_gbps     DiskTier.put / get (checksums, LMDB index, fdatasync) through the store's tier object
Targets: L2 put and get >= 0.85 x memcpy; L3 get >= 0.85 x O_DIRECT read; L3 put >= 0.6 x O_DIRECT write.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import parser, print_table, write_json  # noqa: E402

from tierkv.layout import KVLayout  # noqa: E402
from tierkv.tiers.base import _memmove, as_bytes  # noqa: E402
from tierkv.tiers.disk import DiskTier  # noqa: E402
from tierkv.tiers.host import HostTier  # noqa: E402

LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="float16")  # 512 KiB
BATCH = 32


def aligned_blocks(n: int) -> tuple[mmap.mmap, torch.Tensor]:
    mm = mmap.mmap(-1, n * LAYOUT.block_bytes)
    t = torch.frombuffer(mm, dtype=torch.uint8).view(LAYOUT.torch_dtype).view(LAYOUT.pool_shape(n))
    return mm, t


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.path.expanduser(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")),
                   help="a directory on the L3 filesystem (default: ~/.cache/tierkv)")
    args = p.parse_args()
    torch.set_num_threads(1)
    n = 128 if args.quick else 512
    reps = 5 if args.quick else 9
    nbytes = n * LAYOUT.block_bytes
    _, src = aligned_blocks(n)
    _, dst = aligned_blocks(n)
    src.view(torch.int16).random_(-30000, 30000)
    keys = [i.to_bytes(16, "little") for i in range(1, n + 1)]
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir)
    try:
        figures = run(src, dst, keys, nbytes, reps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    f = figures
    ratio = {
        "l2_put_vs_memcpy": f["l2_put_gbps"] / f["memcpy_gbps"],
        "l2_get_vs_memcpy": f["l2_get_gbps"] / f["memcpy_gbps"],
        "l3_get_vs_odirect_read": f["l3_get_gbps"] / f["odirect_read_gbps"],
        "l3_put_vs_odirect_write": f["l3_put_gbps"] / f["odirect_write_gbps"],
    }
    figures.update({k: round(v, 3) for k, v in ratio.items()})
    print_table(f"tiers: {n} blocks of {LAYOUT.block_bytes // 1024} KiB, median of {reps}, GB/s", [
        ("memcpy_gbps", f"{f['memcpy_gbps']:.2f}", "floor for L2"),
        ("l2_put_gbps", f"{f['l2_put_gbps']:.2f}", f"{ratio['l2_put_vs_memcpy']:.2f}x memcpy (target >= 0.85)"),
        ("l2_get_gbps", f"{f['l2_get_gbps']:.2f}", f"{ratio['l2_get_vs_memcpy']:.2f}x memcpy (target >= 0.85)"),
        ("odirect_read_gbps", f"{f['odirect_read_gbps']:.2f}", "floor for L3 get"),
        ("odirect_write_gbps", f"{f['odirect_write_gbps']:.2f}", "floor for L3 put"),
        ("l3_get_gbps", f"{f['l3_get_gbps']:.2f}",
         f"{ratio['l3_get_vs_odirect_read']:.2f}x O_DIRECT read (target >= 0.85)"),
        ("l3_put_gbps", f"{f['l3_put_gbps']:.2f}",
         f"{ratio['l3_put_vs_odirect_write']:.2f}x O_DIRECT write (target >= 0.6)"),
    ])
    write_json(args.json, figures)


def run(src: torch.Tensor, dst: torch.Tensor, keys: list[bytes], nbytes: int, reps: int, work: str) -> dict:
    n, bb = len(keys), LAYOUT.block_bytes
    host = HostTier(LAYOUT, n, pin=False)
    disk = DiskTier(os.path.join(work, "l3"), LAYOUT, n)
    if not disk.direct:
        print("note: O_DIRECT refused on this filesystem; floors and L3 both use buffered IO")
    fd = os.open(os.path.join(work, "floor.bin"), os.O_RDWR | os.O_CREAT | (os.O_DIRECT if disk.direct else 0))
    os.ftruncate(fd, nbytes)
    srcs, dsts = list(src), list(dst)
    views_src = [as_bytes(b) for b in srcs]
    views_dst = [as_bytes(b) for b in dsts]

    def memcpy():
        for d, s in zip(dsts, srcs):
            _memmove(d.data_ptr(), s.data_ptr(), bb)

    def od_write():
        for i, v in enumerate(views_src):
            os.pwritev(fd, [v], i * bb)
        os.fdatasync(fd)

    def od_read():
        for i, v in enumerate(views_dst):
            os.preadv(fd, [v], i * bb)

    def batches(fn, items_a, items_b):
        for i in range(0, n, BATCH):
            fn(keys[i:i + BATCH], items_a[i:i + BATCH]) if items_b is None else fn(keys[i:i + BATCH], items_a[i:i + BATCH], items_b[i:i + BATCH])

    samples: dict[str, list[float]] = {k: [] for k in ("memcpy", "l2_put", "l2_get", "odw", "odr", "l3_put", "l3_get")}
    for _ in range(reps):
        samples["memcpy"].append(timed(memcpy))
        samples["l2_put"].append(timed(lambda: host.put(keys, srcs)))
        samples["l2_get"].append(timed(lambda: host.get(keys, dsts)))
        host.remove(keys)
        samples["odw"].append(timed(od_write))
        samples["l3_put"].append(timed(lambda: [disk.put(keys[i:i + BATCH], srcs[i:i + BATCH]) for i in range(0, n, BATCH)]))
        samples["odr"].append(timed(od_read))
        samples["l3_get"].append(timed(lambda: [disk.get(keys[i:i + BATCH], dsts[i:i + BATCH]) for i in range(0, n, BATCH)]))
        if not torch.equal(dst.view(torch.int16), src.view(torch.int16)):
            raise SystemExit("l3 get returned different bytes")
        disk.remove(keys)
    os.close(fd)
    disk.close()
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    return {
        "blocks": n, "block_bytes": bb,
        "memcpy_gbps": round(gbps(nbytes, med["memcpy"]), 3),
        "odirect_read_gbps": round(gbps(nbytes, med["odr"]), 3),
        "odirect_write_gbps": round(gbps(nbytes, med["odw"]), 3),
        "l2_put_gbps": round(gbps(nbytes, med["l2_put"]), 3),
        "l2_get_gbps": round(gbps(nbytes, med["l2_get"]), 3),
        "l3_put_gbps": round(gbps(nbytes, med["l3_put"]), 3),
        "l3_get_gbps": round(gbps(nbytes, med["l3_get"]), 3),
    }


if __name__ == "__main__":
    main()
