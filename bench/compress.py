"""Compressed lower tiers on real KV: byte planes + zstd against raw L3 and L4, and what ``auto`` picks.

The KV is SmolLM2-135M-Instruct's, from a prefill of real text (this repository's README and
design notes) through the bundled engine, in bf16 and fp32. For each dtype:

ratio_raw / ratio_shuffled   block bytes / zstd bytes, without and with the byte-plane shuffle
compress_gbps / decode_gbps  BlockCodec.encode / decode_into on one core (block bytes per second)
                             (the tiers run with compress_threads 2: a batch is coded on two threads)
l3_get_gbps (raw, zstd)      DiskTier.get with O_DIRECT of the same blocks, compress off and zstd
l4_<link>_get_gbps           RemoteTier.get on a redis-server on loopback, and with the backend call
                             held until its bytes would have crossed a 1 or 10 Gbit/s link (simulated)
ttft_l3_hit                  the bundled engine's TTFT of the same real-text prompt served from L3,
                             raw against zstd (two engines side by side, every hit's tier and token checked)
Every get lands in junk-filled destinations and every block's bytes are compared afterwards.
Rounds interleave raw and zstd (alternating which goes first); a gain is the median over rounds of
the per-round zstd/raw ratio. A third tier of each kind runs ``auto`` on the same traffic during the
calibration rounds (its AutoChooser times its own raw reads and codes sample blocks); its choice is
then checked against the measured rounds that follow.
Targets (--check): wherever auto chose zstd, zstd's get beats raw by >= 1.2x in the same run;
wherever it did not, the auto tier stored every block raw.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import finish, parser, print_table, target  # noqa: E402
from remote import start_redis, stop  # noqa: E402

from tierkv.compress import WIN, BlockCodec  # noqa: E402
from tierkv.config import L2Config, L4Config, StoreConfig  # noqa: E402
from tierkv.tiers.base import as_bytes  # noqa: E402
from tierkv.tiers.disk import DiskTier  # noqa: E402
from tierkv.tiers.remote import open_remote  # noqa: E402

MODEL = "smollm2-135m-instruct"
LINKS = {"loopback": None, "10gbit": 10e9 / 8, "1gbit": 1e9 / 8}  # bytes per second
BATCH = 16  # blocks per tier call


def real_text_ids(n_tokens: int) -> tuple[Path, list[int]]:
    """(SmolLM2's directory, the first ``n_tokens`` token ids of README + design notes)."""
    from tokenizers import Tokenizer

    from tierkv.models import pull

    model = Path(pull(MODEL))
    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text() + (root / "docs" / "design.md").read_text()
    return model, Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids[:n_tokens]


def real_kv(dtype: str, n_tokens: int):
    """KV blocks of a prefill of real text (README + design notes) through the bundled engine."""
    from tierkv.engine import LLM, EngineConfig, SamplingParams

    model, ids = real_text_ids(n_tokens)
    engine = EngineConfig(num_blocks=n_tokens // 16 + 16, max_num_batched_tokens=512, dtype=dtype, num_threads=2)
    llm = LLM(model, StoreConfig(l2=L2Config(capacity=0), l3_enabled=False), engine)
    try:
        llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        slots = sorted(e.l1_slot for e in llm.store.index.entries() if e.l1_slot is not None)
        return llm.layout, [llm.store.l1.pool[s].clone() for s in slots]
    finally:
        llm.close()


def aligned_blocks(like: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` page-aligned blocks shaped like ``like`` (as L1 slots are), junk-filled."""
    mm = mmap.mmap(-1, n * like.nbytes)
    pool = torch.frombuffer(mm, dtype=torch.uint8).view(n, -1)
    pool.fill_(0x5A)
    return [pool[i].view(like.dtype).view(like.shape) for i in range(n)]


def codec_figures(blocks: list[torch.Tensor], level: int, rounds: int) -> dict:
    item = blocks[0].element_size()
    views = [as_bytes(b) for b in blocks]
    total = sum(len(v) for v in views)
    out = {}
    for name, shuffled in (("raw", False), ("shuffled", True)):
        codec = BlockCodec(item, len(views[0]), level=level, shuffled=shuffled)
        stored = [codec.encode(v, limit=len(v) * 2) for v in views]
        out[f"ratio_{name}"] = total / sum(len(s) for s in stored)
        if shuffled:
            dst = bytearray(len(views[0]))
            enc, dec = [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for v in views:
                    codec.encode(v)
                enc.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for s in stored:
                    assert codec.decode_into(s, codec.flags, dst)
                dec.append(time.perf_counter() - t0)
            out["compress_gbps"] = total / statistics.median(enc) / 1e9
            out["decode_gbps"] = total / statistics.median(dec) / 1e9
        codec.close()
    return out


class Link:
    """A backend whose values arrive no faster than a link of ``rate`` B/s would bring them: value i
    is handed on (``landed``) only once the bytes of values 0..i could have crossed it since the
    call began (the loopback time counts towards it). A simulated slower network, the same server."""

    def __init__(self, backend, rate: float) -> None:
        self._backend, self.rate = backend, rate

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def read_into(self, names, blocks, landed=None):
        t0, sent = time.perf_counter(), [0]

        def wait_for(length: int) -> None:
            sent[0] += max(length, 0)
            left = t0 + sent[0] / self.rate - time.perf_counter()
            if left > 0:
                time.sleep(left)

        def paced(i, length, tail):
            wait_for(length)
            if landed is not None:
                landed(i, length, tail)

        reported: set[int] = set()
        found = self._backend.read_into(names, blocks, lambda i, n, t: (reported.add(i), paced(i, n, t)))
        for i, (length, _) in enumerate(found):
            if i not in reported:
                wait_for(length)
        return found


def timed_get(tier, keys, dst, want) -> float:
    for d in dst:
        d.view(torch.uint8).fill_(0x5A)
    t0 = time.perf_counter()
    flags = []
    for i in range(0, len(keys), BATCH):
        flags += tier.get(keys[i:i + BATCH], dst[i:i + BATCH])
    seconds = time.perf_counter() - t0
    assert all(flags), f"{tier.name}: {flags.count(False)} misses"
    for d, w in zip(dst, want):
        assert torch.equal(d.view(torch.uint8), w.view(torch.uint8)), f"{tier.name}: wrong bytes"
    return seconds


def put_all(tier, keys, blocks) -> None:
    for i in range(0, len(keys), BATCH // 2):  # small batches: auto codes one sample per batch
        assert all(tier.put(keys[i:i + BATCH // 2], blocks[i:i + BATCH // 2]))


def compare(tiers: dict, keys, blocks, calibrate: int, rounds: int) -> dict:
    """Calibration rounds (auto measures), then interleaved raw/zstd rounds: GB/s and the gain."""
    dst = aligned_blocks(blocks[0], len(blocks))
    for tier in tiers.values():
        put_all(tier, keys, blocks)
    for _ in range(calibrate):
        for name in ("raw", "auto"):
            timed_get(tiers[name], keys, dst, blocks)
        put_all(tiers["auto"], keys, blocks)  # auto codes its samples on puts
    times = {"raw": [], "zstd": []}
    for r in range(rounds):
        for name in (("raw", "zstd") if r % 2 else ("zstd", "raw")):
            times[name].append(timed_get(tiers[name], keys, dst, blocks))
    total = sum(b.nbytes for b in blocks)
    choice = tiers["auto"].compression()["auto"]
    return {"raw_gbps": total / min(times["raw"]) / 1e9, "zstd_gbps": total / min(times["zstd"]) / 1e9,
            "gain": statistics.median(r / z for r, z in zip(times["raw"], times["zstd"])),
            "auto": choice["on"], "auto_gain": choice["gain"], "auto_why": choice["why"]}


def l3_case(work: Path, layout, blocks, keys, level, threads, calibrate, rounds) -> dict:
    tiers = {name: DiskTier(work / f"l3-{name}", layout, len(blocks) + 8, compress="off" if name == "raw" else name,
                            compress_level=level, compress_threads=threads) for name in ("raw", "zstd", "auto")}
    try:
        out = compare(tiers, keys, blocks, calibrate, rounds)
        stored = [r.stored for r in tiers["zstd"].records()]
        out["pages_read_ratio"] = len(stored) * tiers["zstd"].stride / sum(-(-s // 4096) * 4096 for s in stored)
        out["auto_stored_raw"] = all(r.flags == 0 for r in tiers["auto"].records())
        out["direct_io"] = tiers["raw"].direct
        return out
    finally:
        for t in tiers.values():
            t.close()


def l4_case(url: str, layout, blocks, keys, level, threads, rate, tag, calibrate, rounds) -> dict:
    tiers = {}
    for name in ("raw", "zstd", "auto"):
        cfg = L4Config(url=url, timeout_ms=30_000, key_prefix=f"bench-{tag}-{name}",
                       compress="off" if name == "raw" else name, compress_level=level,
                       compress_threads=threads)
        tiers[name] = open_remote(cfg, layout)
        if rate is not None:
            tiers[name].backend = Link(tiers[name].backend, rate)
    try:
        out = compare(tiers, keys, blocks, calibrate, rounds)
        stats = tiers["auto"].stats()
        out["auto_stored_raw"] = stats["stored_bytes_written"] == stats["bytes_written"]
        zstats = tiers["zstd"].stats()
        out["capacity_ratio"] = zstats["bytes_written"] / zstats["stored_bytes_written"]
        return out
    finally:
        for t in tiers.values():
            t.close()


def ttft_case(work: Path, dtype: str, n_tokens: int, level: int, threads: int, rounds: int) -> dict:
    """TTFT of an L3 hit of a real-text prompt through the bundled engine, L3 raw against L3 zstd.

    One engine per mode (L2 off, write-through into its own L3), alive side by side; each round
    demotes every L1 block (``ttft.flush_l1``) and times the prompt again, alternating which mode
    goes first. Every timed request must be served from L3 for its whole cached prefix and must
    give the first token the fill gave."""
    from ttft import FIRST, flush_l1

    from tierkv.config import L3Config, PolicyConfig
    from tierkv.engine import LLM, EngineConfig

    model, ids = real_text_ids(n_tokens)
    engines, first = {}, {}
    try:
        for mode in ("raw", "zstd"):
            cfg = StoreConfig(l2=L2Config(capacity=0), policy=PolicyConfig(write="write_through"),
                              l3=L3Config(path=str(work / f"ttft-{dtype}-{mode}"), capacity="256MiB",
                                          compress="off" if mode == "raw" else "zstd", compress_level=level,
                                          compress_threads=threads))
            engine = EngineConfig(num_blocks=n_tokens // 16 + 16, max_num_batched_tokens=n_tokens, dtype=dtype,
                                  num_threads=1)
            llm = engines[mode] = LLM(model, cfg, engine)
            first[mode] = llm.generate([ids], FIRST)[0].token_ids
            llm.store.flush()
        if first["raw"] != first["zstd"]:
            raise SystemExit(f"ttft {dtype}: the fills disagree: {first}")
        cached = (len(ids) - 1) // 16 * 16
        ms: dict[str, list[float]] = {"raw": [], "zstd": []}
        for r in range(rounds):
            for mode in (("raw", "zstd") if r % 2 == 0 else ("zstd", "raw")):
                llm = engines[mode]
                flush_l1(llm)
                out = llm.generate([ids], FIRST)[0]
                hits = {t: n for t, n in out.hit_tokens.items() if n}
                if out.token_ids != first[mode] or hits != {"l3": cached}:
                    raise SystemExit(f"ttft {dtype} {mode}: expected {cached} tokens from l3 and {first[mode]}, "
                                     f"got {dict(out.hit_tokens)} and {out.token_ids}")
                ms[mode].append(out.ttft_s * 1e3)
        coded = sum(r.flags != 0 for r in engines["zstd"].store.l3.records())
        return {"raw_ms": statistics.median(ms["raw"]), "zstd_ms": statistics.median(ms["zstd"]),
                "gain": statistics.median(a / b for a, b in zip(ms["raw"], ms["zstd"])), "tokens": len(ids),
                "cached_tokens": cached, "zstd_blocks_coded": coded, "ms": ms}
    finally:
        for llm in engines.values():
            llm.close()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.path.expanduser(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")),
                   help="a directory on the L3 filesystem (default: ~/.cache/tierkv)")
    p.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    p.add_argument("--threads", type=int, default=2, help="compress_threads of the zstd and auto tiers (default 2)")
    args = p.parse_args()
    torch.set_num_threads(1)
    n_tokens, calibrate, rounds = (512, 2, 5) if args.quick else (2048, 3, 11)
    os.makedirs(args.dir, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierkv-bench-compress-", dir=args.dir))
    procs: list = []
    figures, targets, rows = {"level": args.level, "threads": args.threads, "tokens": n_tokens}, [], []
    try:
        url = start_redis(work, procs)
        for dtype in ("bfloat16", "float32"):
            layout, blocks = real_kv(dtype, n_tokens)
            keys = [dtype.encode().ljust(8, b".") + i.to_bytes(8, "little") for i in range(len(blocks))]
            f = figures[dtype] = codec_figures(blocks, args.level, rounds)
            f["blocks"], f["block_bytes"] = len(blocks), blocks[0].nbytes
            rows += [(f"{dtype} ratio raw / shuffled", f"{f['ratio_raw']:.3f} / {f['ratio_shuffled']:.3f}",
                      f"{len(blocks)} blocks of {blocks[0].nbytes // 1024} KiB, zstd level {args.level}"),
                     (f"{dtype} compress / decode GB/s", f"{f['compress_gbps']:.2f} / {f['decode_gbps']:.2f}",
                      "one core, block bytes per second")]
            cases = {"l3": l3_case(work / dtype, layout, blocks, keys, args.level, args.threads, calibrate, rounds)}
            for tag, rate in LINKS.items():
                cases[f"l4_{tag}"] = l4_case(url, layout, blocks, keys, args.level, args.threads, rate, f"{dtype}-{tag}", calibrate, rounds)
            f["tiers"] = cases
            for case, c in cases.items():
                rows.append((f"{dtype} {case} get GB/s raw / zstd", f"{c['raw_gbps']:.2f} / {c['zstd_gbps']:.2f}",
                             f"zstd {c['gain']:.2f}x raw; auto: {c['auto_why']}"))
                metric = f"{dtype}_{case}"
                if c["auto"]:
                    targets.append(target(f"{metric}_auto_zstd_gain", c["gain"], ">=", WIN, "raw get, same run"))
                else:
                    targets.append(target(f"{metric}_auto_stays_off", float(c["auto_stored_raw"]), ">=", 1.0,
                                          "1: the auto tier stored every block raw"))
            t = f["ttft_l3_hit"] = ttft_case(work, dtype, n_tokens, args.level, args.threads, rounds)
            rows.append((f"{dtype} TTFT of an L3 hit ms raw / zstd", f"{t['raw_ms']:.0f} / {t['zstd_ms']:.0f}",
                         f"{t['cached_tokens']} of {t['tokens']} tokens from L3 ({t['zstd_blocks_coded']} blocks "
                         f"coded); zstd {t['gain']:.2f}x raw, median of {rounds} rounds"))
    finally:
        stop(procs)
        shutil.rmtree(work, ignore_errors=True)
    print_table("compress: byte planes + zstd on real SmolLM2 KV against the raw tiers; GB/s: best round, "
                "gains: median of per-round ratios", rows)
    finish(args, "compress", figures, targets)


if __name__ == "__main__":
    main()
