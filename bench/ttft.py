"""Time to first token by tier of the cached prefix, against a copy floor built from the engine, and the cost of a miss.

Model: SmolLM2-135M-Instruct (fp32 unless --dtype; `tierkv.models.pull`), block size 16, one thread unless
--threads. For each prompt length, every contender runs once per round, rounds alternate the order, and every
figure is the median over rounds (cold included). Each timed request's ``hit_tokens`` is checked: a hit row
that was not served from its tier, or a miss that hit, stops the benchmark.

cold_ms       a never-seen prompt, store off (enable_cache=False): prefill of every token
miss_ms       a never-seen prompt on the store as users run it: L2 (four prompts' worth) and L3 on, write-back
l1_ms         the cached prompt, all of it in L1 but the last block (recomputed for its logits)
l2_ms         the cached prompt with its prefix only in L2 (L1 flushed: write-back demoted it)
l3_ms         the cached prompt with its prefix only in L3 (an engine without L2: L1 flushes to disk)
tail_ms       the engine's own prefill of the uncached tail after the prefix is in its KV cache, store off
              (the store-off engine's scheduler is given the prefix as one chunk, the tail is timed)
l2_floor_ms   memmove of the prefix's bytes from the L2 slab into the L1 pool + tail_ms
l3_floor_ms   O_DIRECT preadv of the prefix's bytes from the L3 slot file + tail_ms
miss_cpu_ms, cold_cpu_ms  process CPU time of those requests (other tenants move wall times, not CPU time)
Targets: l2 <= 1.5 x l2_floor and l3 <= 1.5 x l3_floor at every length; miss CPU <= 1.05 x cold CPU;
at 4096 tokens (the full run) cold/l2 >= 30 and cold/l3 >= 10.
"""

from __future__ import annotations

import dataclasses
import json
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
from _common import finish, parser, print_table, target, verdict  # noqa: E402

from tierkv.config import L2Config, L3Config, StoreConfig  # noqa: E402
from tierkv.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from tierkv.engine.checkpoint import write_checkpoint  # noqa: E402
from tierkv.models import resolve_model  # noqa: E402
from tierkv.tiers.base import _memmove  # noqa: E402
from tierkv.tiers.disk import _runs  # noqa: E402

FIRST = SamplingParams(max_tokens=1, ignore_eos=True)


def checkpoint(path: str, preset: str = "small") -> str:
    """A seeded random ``preset`` checkpoint at ``path``, written if missing (bench/throughput.py uses it)."""
    if not (Path(path) / "config.json").is_file():
        write_checkpoint(path, preset, seed=0)
    return path


def block_bytes(model: Path, block_size: int, dtype: str) -> int:
    """Bytes of one KV block of the checkpoint at ``model`` (K and V, every layer)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * block_size * (4 if dtype == "float32" else 2)


class Timed:
    """One request's wall TTFT and process CPU time, with the tokens each tier served."""

    def __init__(self, llm: LLM, prompt: list[int]) -> None:
        c0 = time.process_time()
        out = llm.generate([prompt], FIRST)[0]
        self.cpu_ms = (time.process_time() - c0) * 1e3
        self.ms = out.ttft_s * 1e3
        self.hits = dict(out.hit_tokens)


def served(t: Timed, tier: str | None, tokens: int, what: str) -> float:
    """``t.ms`` after checking the request was served as ``what`` says (``tier`` None: a miss)."""
    hit = sum(t.hits.values())
    if tier is None and hit:
        raise SystemExit(f"{what}: expected a miss, {t.hits} tokens hit")
    if tier is not None and (t.hits.get(tier, 0) != tokens or hit != tokens):
        raise SystemExit(f"{what}: expected {tokens} tokens from {tier}, got {t.hits}")
    return t.ms


def flush_l1(llm: LLM) -> None:
    """Demote every cached L1 block one tier down (allocating all of L1 evicts them)."""
    llm.store.free(llm.store.allocate(llm.store.l1.capacity))


def tail_ms(llm: LLM, prompt: list[int], prefix: int) -> float:
    """The store-off engine's time for the tail of ``prompt`` once its first ``prefix`` tokens are computed.

    The scheduler's token budget is set to ``prefix`` for this request: the first step computes the
    prefix (untimed), the second the tail and the first token (timed): the engine's own code, no store.
    """
    sched = llm.scheduler
    saved = sched.config
    sched.config = dataclasses.replace(saved, max_num_batched_tokens=prefix)
    try:
        seq = llm._sequence(prompt, FIRST, None)
        sched.add(seq)
        while seq.num_computed < prefix:
            llm.step()
        if seq.num_computed != prefix or seq.output_ids:
            raise SystemExit(f"tail floor: the first chunk computed {seq.num_computed} tokens, expected {prefix}")
        t0 = time.perf_counter()
        while not seq.output_ids:
            llm.step()
        seconds = time.perf_counter() - t0
        while not seq.is_finished:
            llm.step()
    finally:
        sched.config = saved
    return seconds * 1e3


def l2_copy_ms(llm: LLM, nblocks: int) -> float:
    """One memmove of ``nblocks`` blocks from the L2 slab into the L1 pool."""
    nbytes = nblocks * llm.layout.block_bytes
    src, dst = llm.store.l2.slab, llm.store.l1.pool
    t0 = time.perf_counter()
    _memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    return (time.perf_counter() - t0) * 1e3


def l3_read_ms(llm: LLM, keys: list[bytes], buf: mmap.mmap) -> float:
    """O_DIRECT preadv of the blocks of ``keys`` from the L3 slot file, one call per run of consecutive slots."""
    l3 = llm.store.l3
    by_key = {r.key: r.slot for r in l3.records()}
    slots = sorted(by_key[k] for k in keys)
    view = memoryview(buf)
    fd = os.open(l3.path / "slots.bin", os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        t0 = time.perf_counter()
        done = 0
        for run in _runs([(s,) for s in slots]):
            want = len(run) * l3.stride
            got = os.preadv(fd, [view[done:done + want]], run[0][0] * l3.stride)
            if got != want:
                raise SystemExit(f"l3 floor: read {got} of {want} bytes")
            done += want
        return (time.perf_counter() - t0) * 1e3
    finally:
        os.close(fd)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a registered name, a .gguf file or a Hugging Face Llama directory (default: SmolLM2-135M)")
    p.add_argument("--dir", default=os.path.expanduser(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")),
                   help="a directory on the L3 filesystem for the benchmark's L3s (default: ~/.cache/tierkv)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--lengths", default="", help="prompt lengths (default 1024,4096; 1024 with --quick)")
    p.add_argument("--rounds", type=int, default=0, help="rounds per length (default 5, 3 with --quick)")
    args = p.parse_args()
    lengths = [int(x) for x in (args.lengths or ("1024" if args.quick else "1024,4096")).split(",")]
    rounds = args.rounds or (3 if args.quick else 5)
    model = resolve_model(args.model)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierkv-ttft-", dir=args.dir))
    bs = 16
    blocks = max(lengths) // bs * 2 + 64
    engine = EngineConfig(num_blocks=blocks, block_size=bs, max_num_batched_tokens=max(lengths),
                          num_threads=args.threads, dtype=args.dtype)
    rng = __import__("random").Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, 40000) for _ in range(n)]

    rows = []
    try:
        # L2 sized to four prompts (the cached one stays, never-seen ones are evicted first): a
        # populated 1 GiB slab beside three models got this benchmark OOM-killed on the shared host.
        l2_bytes = 4 * (max(lengths) // bs + 1) * block_bytes(model, bs, args.dtype)
        cached = LLM(model, StoreConfig(l2=L2Config(capacity=l2_bytes),
                                        l3=L3Config(path=str(work / "l3-users"), capacity="1GiB")), engine)
        plain = LLM(model, StoreConfig(l3_enabled=False), engine, enable_cache=False)
        on_disk = LLM(model, StoreConfig(l2=L2Config(capacity=0), l3=L3Config(path=str(work / "l3"), capacity="1GiB")),
                      engine)
        for llm in (plain, cached, on_disk):
            Timed(llm, fresh(64))  # warm up allocators and kernels
        for n in lengths:
            Timed(plain, fresh(n))  # the first use of a length grows buffers: keep it out of the figures
            Timed(cached, fresh(n))
            prompt = fresh(n)
            matched = (n - 1) // bs
            prefix = matched * bs
            served(Timed(cached, prompt), None, 0, "first pass (cached)")
            served(Timed(on_disk, prompt), None, 0, "first pass (on_disk)")
            keys = on_disk.store.hash(prompt)[:matched]
            buf = mmap.mmap(-1, matched * on_disk.store.l3.stride)
            s: dict[str, list[float]] = {k: [] for k in (
                "cold", "miss", "l1", "l2", "l3", "tail", "l2_copy", "l3_read", "cold_cpu", "miss_cpu")}

            def cold():
                t = Timed(plain, fresh(n))
                s["cold"].append(served(t, None, 0, "cold"))
                s["cold_cpu"].append(t.cpu_ms)

            def miss():
                t = Timed(cached, fresh(n))
                s["miss"].append(served(t, None, 0, "miss"))
                s["miss_cpu"].append(t.cpu_ms)

            def l2_then_l1():
                flush_l1(cached)
                s["l2"].append(served(Timed(cached, prompt), "l2", prefix, "l2 hit"))
                s["l1"].append(served(Timed(cached, prompt), "l1", prefix, "l1 hit"))

            def l3():
                flush_l1(on_disk)
                s["l3"].append(served(Timed(on_disk, prompt), "l3", prefix, "l3 hit"))

            def floors():
                s["tail"].append(tail_ms(plain, prompt, prefix))
                s["l2_copy"].append(l2_copy_ms(cached, matched))
                s["l3_read"].append(l3_read_ms(on_disk, keys, buf))

            steps = [cold, miss, l2_then_l1, l3, floors]
            for r in range(rounds):
                for step in (steps if r % 2 == 0 else steps[::-1]):
                    step()
            med = {k: statistics.median(v) for k, v in s.items()}
            row = {"prompt_tokens": n, "cached_tokens": prefix}
            row.update({f"{k}_ms": round(v, 2) for k, v in med.items()})
            row["l2_floor_ms"] = round(med["l2_copy"] + med["tail"], 2)
            row["l3_floor_ms"] = round(med["l3_read"] + med["tail"], 2)
            row["min_ms"] = {k: round(min(v), 2) for k, v in s.items()}
            rows.append(row)
        for llm in (cached, plain, on_disk):
            llm.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    targets, table = [], []
    for r in rows:
        n = r["prompt_tokens"]
        here = [
            target(f"{n}_l2_over_floor", r["l2_ms"] / r["l2_floor_ms"], "<=", 1.5, "memmove + tail prefill"),
            target(f"{n}_l3_over_floor", r["l3_ms"] / r["l3_floor_ms"], "<=", 1.5, "O_DIRECT read + tail prefill"),
            target(f"{n}_miss_cpu_over_cold_cpu", r["miss_cpu_ms"] / r["cold_cpu_ms"], "<=", 1.05, "store off"),
        ]
        if n == 4096:
            here += [target("4096_cold_over_l2", r["cold_ms"] / r["l2_ms"], ">=", 30, "cold prefill"),
                     target("4096_cold_over_l3", r["cold_ms"] / r["l3_ms"], ">=", 10, "cold prefill")]
        targets += here
        t = {x["metric"].split("_", 1)[1]: x for x in here}
        table += [
            (f"{n} cold_ms", f"{r['cold_ms']:.1f}", "store off: prefill of every token"),
            (f"{n} miss_ms", f"{r['miss_ms']:.1f}", f"never-seen prompt, L2+L3 on: {r['miss_ms'] / r['cold_ms']:.3f}x cold"),
            (f"{n} l1_ms", f"{r['l1_ms']:.1f}", f"cold/l1 = {r['cold_ms'] / r['l1_ms']:.1f}x"),
            (f"{n} l2_ms", f"{r['l2_ms']:.1f}", f"cold/l2 = {r['cold_ms'] / r['l2_ms']:.1f}x; l2/floor "
                                                f"{verdict(t['l2_over_floor'])}"),
            (f"{n} l3_ms", f"{r['l3_ms']:.1f}", f"cold/l3 = {r['cold_ms'] / r['l3_ms']:.1f}x; l3/floor "
                                                f"{verdict(t['l3_over_floor'])}"),
            (f"{n} tail_ms", f"{r['tail_ms']:.1f}", f"store-off prefill of the last {n - r['cached_tokens']} tokens"),
            (f"{n} l2_floor_ms", f"{r['l2_floor_ms']:.1f}", f"memmove of the prefix {r['l2_copy_ms']:.2f} ms + tail"),
            (f"{n} l3_floor_ms", f"{r['l3_floor_ms']:.1f}", f"O_DIRECT read of the prefix {r['l3_read_ms']:.2f} ms + tail"),
            (f"{n} miss_cpu_ms", f"{r['miss_cpu_ms']:.1f}", f"process CPU: miss/cold {verdict(t['miss_cpu_over_cold_cpu'])}"),
            (f"{n} cold_cpu_ms", f"{r['cold_cpu_ms']:.1f}", "process CPU, store off"),
        ]
        if n == 4096:
            table.append(("4096 targets", "", f"cold/l2 {verdict(t['cold_over_l2'])}; cold/l3 {verdict(t['cold_over_l3'])}"))
    print_table(f"time to first token, {Path(model).name}, {args.dtype}, {args.threads} thread(s), "
                f"median of {rounds} rounds", table)
    finish(args, "ttft", {"rows": rows, "threads": args.threads, "rounds": rounds, "model": Path(model).name,
                          "dtype": args.dtype, "torch_threads": torch.get_num_threads()}, targets)


if __name__ == "__main__":
    main()
