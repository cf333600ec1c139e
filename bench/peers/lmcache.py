"""tierkv's L2 / L3 against LMCache 0.5.6's LocalCPUBackend / LocalDiskBackend, same run, interleaved, bytes verified.

Runs in .venv-lmcache (`make bench-peers`). Both stores move the same 512 KiB blocks (16 layers x 8 KV heads x
64 x 16 tokens, fp16), in batches of 32, from the same source buffers into the same junk-filled destinations,
on the same file system (--dir). Each round runs every contender of an operation back to back, rotating who
goes first; a ratio is the median over rounds of the per-round ratio, GB/s are each contender's best round.

LMCache is driven the way its cache engine and storage manager drive it:
  L2 put   LocalCPUBackend.batched_allocate (its memory allocator) + a copy of each block into its MemoryObj (the
           connector's from_gpu) + batched_submit_put_task + the storage manager's ref_count_down
  L2 get   get_blocking per key + a copy into the destination (the connector's to_gpu) + ref_count_down
  L3 put   LocalDiskBackend.batched_submit_put_task of MemoryObjs already filled (the copy into them is not
           timed: in LMCache it is the L2 put's), until every on_complete_callback has fired
  L3 get   LocalDiskBackend.batched_get_blocking (its 4 reader threads, staging MemoryObjs from the allocator)
           + a copy into the destination + ref_count_down
  LMCache's disk backend runs with extra_config use_odirect=True, the mode its docs recommend, so both read
  the disk and not the page cache; it writes one file per chunk and syncs nothing, tierkv writes preallocated
  slots, fdatasyncs each batch and commits an LMDB index. LMCache's default (buffered) mode is measured too,
  as information: its gets then come from the page cache.
tierkv: HostTier.put / get, DiskTier.put / get (O_DIRECT, checksummed), the store's own tier objects.
Floors, same run: memcpy (the fastest of torch copy_ / ctypes.memmove / numpy) for L2; O_DIRECT pwritev + one
fdatasync per batch, and preadv in the tier's own runs, for L3.
Targets: tierkv >= 1.0 x LMCache for L2/L3 put/get; tierkv >= 0.9 x the floor for each.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# This file is named like the package it measures: its own folder must not shadow ``import lmcache``.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # its set-up warns about the controller we do not run
import torch  # noqa: E402
from _common import finish, parser, print_table, target, verdict  # noqa: E402
from tiers import BATCH, JUNK, LAYOUT, memcpy_candidates, prefaulted  # noqa: E402

from tierkv.tiers.base import as_bytes  # noqa: E402
from tierkv.tiers.disk import DiskTier, _runs  # noqa: E402
from tierkv.tiers.host import HostTier  # noqa: E402

OPS = ("l2_put", "l2_get", "l3_put", "l3_get")


def _copy_out(objs, dsts) -> list[bool]:
    """Copy each MemoryObj LMCache returned into its destination and release it; None is a miss."""
    out = []
    for obj, dst in zip(objs, dsts):
        if obj is None:
            out.append(False)
            continue
        dst.view(-1).copy_(obj.tensor.view(-1))
        obj.ref_count_down()
        out.append(True)
    return out


class LMCache:
    """LMCache's local CPU and disk backends for one layout, built as its storage manager builds them."""

    def __init__(self, path: str, odirect: bool, n: int, loop: asyncio.AbstractEventLoop) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        gib = 4 * n * LAYOUT.block_bytes / 2**30  # L2 copies, L3 sources, get staging, headroom
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=LAYOUT.block_size, local_cpu=True, max_local_cpu_size=gib, local_disk=path,
            max_local_disk_size=2 * gib, extra_config={"use_odirect": odirect}, lmcache_instance_id="bench")
        meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=LAYOUT.torch_dtype,
                               kv_shape=(LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim))
        self.cpu = LocalCPUBackend(cfg, meta, dst_device="cpu")
        self.disk = LocalDiskBackend(cfg, loop, self.cpu, dst_device="cpu")
        # KV_2LTD, LMCache's format for a chunk: (K/V, layers, tokens, heads x head_dim), the block's bytes.
        self.shape = torch.Size([2, LAYOUT.num_layers, LAYOUT.block_size, LAYOUT.num_kv_heads * LAYOUT.head_dim])
        self.keys = [CacheEngineKey(model_name="bench", world_size=1, worker_id=0, chunk_hash=i,
                                    dtype=LAYOUT.torch_dtype) for i in range(1, n + 1)]
        self.staged: list = []  # filled MemoryObjs the L3 put writes

    def alloc(self, count: int) -> list:
        objs = self.cpu.batched_allocate(self.shape, LAYOUT.torch_dtype, count)
        if objs is None:
            raise SystemExit("LMCache's allocator is out of memory")
        return objs

    def l2_put(self, keys, srcs) -> None:
        objs = self.alloc(len(keys))
        for obj, src in zip(objs, srcs):
            obj.tensor.view(-1).copy_(src.view(-1))
        self.cpu.batched_submit_put_task(keys, objs)
        for obj in objs:
            obj.ref_count_down()

    def l2_get(self, keys, dsts) -> list[bool]:
        return _copy_out((self.cpu.get_blocking(key) for key in keys), dsts)

    def l2_clear(self) -> None:
        for key in self.keys:
            self.cpu.remove(key)

    def stage(self, srcs) -> None:
        """Untimed: fill MemoryObjs with the blocks (in LMCache that copy is the L2 put's)."""
        self.unstage()
        self.staged = self.alloc(len(srcs))
        for obj, src in zip(self.staged, srcs):
            obj.tensor.view(-1).copy_(src.view(-1))

    def unstage(self) -> None:
        for obj in self.staged:
            obj.ref_count_down()
        self.staged = []

    def l3_put(self, keys, objs) -> None:
        done, left = threading.Event(), [len(keys)]
        lock = threading.Lock()

        def landed(_key) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        self.disk.batched_submit_put_task(keys, objs, on_complete_callback=landed)
        if not done.wait(60):
            raise SystemExit(f"LMCache disk put: {left[0]} of {len(keys)} writes never completed")

    def l3_get(self, keys, dsts) -> list[bool]:
        return _copy_out(self.disk.batched_get_blocking(keys), dsts)

    def l3_clear(self) -> None:
        for key in self.keys:
            self.disk.remove(key)

    def close(self) -> None:
        self.unstage()
        self.l2_clear()
        self.disk.close()


async def _cancel_tasks() -> None:
    """Cancel the idle workers LMCache's disk backend leaves on the loop (they would be reported as destroyed)."""
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.cancel()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.path.expanduser(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")),
                   help="a directory on the file system both L3s use (default: ~/.cache/tierkv)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 21, 7 with --quick)")
    args = p.parse_args()
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    n = 128
    rounds = args.rounds or (7 if args.quick else 21)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tierkv-peers-", dir=args.dir)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        f = run(n, rounds, work, loop)
    finally:
        asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        shutil.rmtree(work, ignore_errors=True)
    targets = []
    for op in OPS:
        targets.append(target(f"{op}_vs_lmcache", f[f"{op}_vs_lmcache"], ">=", 1.0, "LMCache, same run"))
    for op in OPS:
        targets.append(target(f"{op}_vs_floor", f[f"{op}_vs_floor"], ">=", 0.9, "floor, same run"))
    t = {x["metric"]: x for x in targets}
    g = f["gbps"]
    rows = []
    for op in OPS:
        rows.append((f"{op} tierkv", f"{g['tierkv'][op]:.2f}",
                     f"vs LMCache {verdict(t[f'{op}_vs_lmcache'])}; vs floor {verdict(t[f'{op}_vs_floor'])}"))
        rows.append((f"{op} lmcache", f"{g['lmcache'][op]:.2f}",
                     "LocalCPUBackend" if op.startswith("l2") else "LocalDiskBackend, use_odirect"))
        if op.startswith("l3"):
            rows.append((f"{op} lmcache_buffered", f"{g['lmcache_buffered'][op]:.2f}",
                         f"default mode (page cache): tierkv / it = {f[f'{op}_vs_lmcache_buffered']:.2f} (information)"))
        rows.append((f"{op} floor", f"{g['floor'][op]:.2f}", f["floor_what"][op]))
    print_table(f"tierkv vs LMCache 0.5.6: {n} blocks of {LAYOUT.block_bytes >> 10} KiB, batches of {BATCH}, "
                f"{rounds} interleaved rounds; GB/s: best round; ratios: median of per-round ratios", rows)
    finish(args, "peers_lmcache", f, targets)


def run(n: int, rounds: int, work: str, loop) -> dict:
    import lmcache

    bb = LAYOUT.block_bytes
    nbytes = n * bb
    src, dst, spare = prefaulted(n), prefaulted(n), prefaulted(n)
    src.view(torch.int16).random_(-30000, 30000)
    srcs, dsts = list(src), list(dst)
    keys = [i.to_bytes(16, "little") for i in range(1, n + 1)]
    batches = [range(i, min(i + BATCH, n)) for i in range(0, n, BATCH)]
    host = HostTier(LAYOUT, n, pin=False)
    disk = DiskTier(os.path.join(work, "tierkv-l3"), LAYOUT, n)
    lmc = LMCache(os.path.join(work, "lmcache-odirect"), True, n, loop)
    lmc_buf = LMCache(os.path.join(work, "lmcache-buffered"), False, n, loop)
    fd = os.open(os.path.join(work, "floor.bin"), os.O_RDWR | os.O_CREAT | (os.O_DIRECT if disk.direct else 0))
    os.ftruncate(fd, n * disk.stride)
    os.posix_fallocate(fd, 0, n * disk.stride)
    views_src, views_dst = [as_bytes(b) for b in srcs], [as_bytes(b) for b in dsts]

    def junk() -> None:
        dst.view(torch.int16).fill_(JUNK)

    def verify(what: str, flags) -> None:
        if flags is not None and not all(flags):
            raise SystemExit(f"{what}: {list(flags).count(False)} of {len(flags)} blocks missing")
        if not torch.equal(dst.view(torch.int16), src.view(torch.int16)):
            raise SystemExit(f"{what}: the destination holds different bytes than were stored")

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    def per_batch(fn, ks, items):
        out = []
        for b in batches:
            r = fn([ks[i] for i in b], [items[i] for i in b])
            out += r if r is not None else []
        return out

    # -- contenders: each returns its timed seconds, with untimed set-up and checks around it ---------
    # Every copy method runs in every round; the floor is the one with the fastest median round.
    cands_put, cands_get = memcpy_candidates(spare, src), memcpy_candidates(dst, spare)
    contig = list(range(n))  # the tier's slots after a remove-all: consecutive from 0

    def floor_l2_put() -> dict[str, float]:
        return {how: timed(fn)[0] for how, fn in cands_put.items()}

    def floor_l2_get() -> dict[str, float]:
        spare.copy_(src)
        out = {}
        for how, fn in cands_get.items():
            junk()
            out[how] = timed(fn)[0]
            verify(f"memcpy {how}", None)
        return out

    def floor_l3_put():
        def go():
            for b in batches:
                os.pwritev(fd, [views_src[i] for i in b], b[0] * disk.stride)
                os.fdatasync(fd)
        return timed(go)[0]

    def floor_l3_get():
        runs = [run for b in batches for run in _runs([(contig[i], i) for i in b])]
        junk()
        s, got = timed(lambda: sum(os.preadv(fd, [views_dst[i] for _, i in r], r[0][0] * disk.stride) for r in runs))
        if got != n * disk.stride:
            raise SystemExit(f"O_DIRECT floor read {got} of {n * disk.stride} bytes")
        verify("O_DIRECT floor read", None)
        return s

    def tierkv_l2_put():
        host.remove(keys)
        s, flags = timed(lambda: per_batch(host.put, keys, srcs))
        if not all(flags):
            raise SystemExit("tierkv l2 put refused blocks")
        return s

    def tierkv_l2_get():
        junk()
        s, flags = timed(lambda: per_batch(host.get, keys, dsts))
        verify("tierkv l2 get", flags)
        return s

    def tierkv_l3_put():
        disk.remove(keys)
        s, flags = timed(lambda: per_batch(disk.put, keys, srcs))
        if not all(flags):
            raise SystemExit("tierkv l3 put refused blocks")
        slots = {r.key: r.slot for r in disk.records()}
        if [slots[k] for k in keys] != contig:
            raise SystemExit("tierkv l3 slots are not the consecutive ones the floor reads")
        return s

    def tierkv_l3_get():
        junk()
        s, flags = timed(lambda: per_batch(disk.get, keys, dsts))
        verify("tierkv l3 get", flags)
        return s

    def lmcache_of(peer: LMCache, name: str):
        def l2_put():
            peer.l2_clear()
            s, _ = timed(lambda: per_batch(peer.l2_put, peer.keys, srcs))
            if not all(peer.cpu.contains(k) for k in peer.keys):
                raise SystemExit(f"{name} l2 put: blocks missing afterwards")
            return s

        def l2_get():
            junk()
            s, flags = timed(lambda: per_batch(peer.l2_get, peer.keys, dsts))
            verify(f"{name} l2 get", flags)
            return s

        def l3_put():
            peer.l3_clear()
            peer.stage(srcs)
            s, _ = timed(lambda: per_batch(peer.l3_put, peer.keys, peer.staged))
            peer.unstage()
            if not all(peer.disk.contains(k) for k in peer.keys):
                raise SystemExit(f"{name} l3 put: blocks missing afterwards")
            return s

        def l3_get():
            junk()
            s, flags = timed(lambda: per_batch(peer.l3_get, peer.keys, dsts))
            verify(f"{name} l3 get", flags)
            return s
        return {"l2_put": l2_put, "l2_get": l2_get, "l3_put": l3_put, "l3_get": l3_get}

    contenders = {
        "tierkv": {"l2_put": tierkv_l2_put, "l2_get": tierkv_l2_get, "l3_put": tierkv_l3_put, "l3_get": tierkv_l3_get},
        "lmcache": lmcache_of(lmc, "lmcache"),
        "lmcache_buffered": lmcache_of(lmc_buf, "lmcache buffered"),
        "floor": {"l2_put": floor_l2_put, "l2_get": floor_l2_get, "l3_put": floor_l3_put, "l3_get": floor_l3_get},
    }
    names = list(contenders)
    for name in names:  # warm-up round, not counted; leaves every store holding the blocks
        for op in OPS:
            contenders[name][op]()
    times = {name: {op: [] for op in OPS} for name in names}
    for r in range(rounds):
        for op in OPS:
            order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
            for name in order:
                times[name][op].append(contenders[name][op]())
    lmc.close()
    lmc_buf.close()
    disk.close()
    os.close(fd)
    best = {}
    for op in ("l2_put", "l2_get"):
        per_how = {how: [r[how] for r in times["floor"][op]] for how in times["floor"][op][0]}
        best[op] = min(per_how, key=lambda how: statistics.median(per_how[how]))
        times["floor"][op] = per_how[best[op]]

    def ratio(a: str, b: str, op: str) -> float:
        return round(statistics.median(tb / ta for ta, tb in zip(times[a][op], times[b][op])), 3)

    out = {
        "blocks": n, "block_bytes": bb, "batch": BATCH, "rounds": rounds, "lmcache_version": lmcache.__version__
        if hasattr(lmcache, "__version__") else "0.5.6", "direct_io": disk.direct,
        "gbps": {name: {op: round(gbps(nbytes, min(v)), 3) for op, v in ops.items()} for name, ops in times.items()},
        "floor_what": {"l2_put": f"memcpy ({best['l2_put']})", "l2_get": f"memcpy ({best['l2_get']})",
                       "l3_put": "O_DIRECT pwritev + fdatasync per batch", "l3_get": "O_DIRECT preadv, the tier's runs"},
    }
    for op in OPS:
        out[f"{op}_vs_lmcache"] = ratio("tierkv", "lmcache", op)
        out[f"{op}_vs_floor"] = ratio("tierkv", "floor", op)
        out[f"{op}_vs_lmcache_buffered"] = ratio("tierkv", "lmcache_buffered", op)
    return out


if __name__ == "__main__":
    main()
