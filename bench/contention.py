"""Does write-back to disk slow anyone else down? L1-hit TTFT and L2 put throughput under L3 write pressure.

Two measurements, each against the same work with the disk idle, interleaved round by round:

busy_ttft_ms / idle_ttft_ms
    Time to first token of requests whose prompt is all in L1 (the bundled engine running
    SmolLM2-135M-Instruct, fp32, block size 16, one thread), while another thread shares the engine's store and pushes blocks into a
    full L2 (so every put demotes an L2 victim to L3) and persists chains to L3, flat out. The
    engine's step is the store's foreground work, so the store paces that background IO to
    ``io.background_share`` (default 0.15) of wall time while a step runs (``tierkv.pacing``).
    Median of all timed requests. Target: busy <= 1.15 x idle.
unpaced_busy_ttft_ms
    The same with pacing off (``background_share = 1.0``, as before pacing existed), in the same
    rounds: what the write-back costs when nothing yields. Reported beside busy, no target.
pusher_gbps / unpaced_pusher_gbps
    What the pusher moved (bytes put into L2 per second, each also demoted and persisted) in the
    busy and unpaced phases: the price of pacing, paid by the background tenant.
raw_io_busy_ttft_ms
    The same requests while a bare thread (``RawPusher``, no store, no pacing) copies, checksums
    and O_DIRECT-writes chains of the same blocks at the rate the store's pusher sustained in that
    round's busy phase: what that IO alone, spread evenly, costs an L1-hit request on this host
    (CPU, memory bandwidth, the GIL). Reported beside busy, no target.
l2_put_busy_gbps / l2_put_idle_gbps
    ``put_blocks`` into L2 (room for every block, 256 KiB blocks) by one thread, while another
    thread persists chains to a full L3 on the same store (each persist evicts the other chain's
    copies and writes its own, durably). A put is foreground work; the persists are paced.
    Median of rounds. Target: busy >= 0.9 x idle.
l2_put_unpaced_gbps
    The same puts with pacing off, in the same rounds. Reported, no target.
l2_put_raw_io_gbps
    The same puts while a bare ``RawPusher`` copies, checksums and O_DIRECT-writes (one
    fdatasync per chain) chains of the same size at the rate the persist stream sustained in that
    round: what that IO alone costs the put on this host. Reported beside busy, no target.

Checked: every timed request was served from L1 for its whole prefix and produced the same first
token as its cold run; the pushed, persisted and put blocks read back byte-identical.
The L3 directory goes under --dir (default ~/.cache/tierkv: a real disk, not tmpfs).
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
from _common import finish, parser, print_table, target  # noqa: E402

from tierkv.config import L2Config, L3Config, PolicyConfig, StoreConfig  # noqa: E402
from tierkv.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from tierkv.index import Tier  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.models import resolve_model  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402
from tierkv.tiers.base import checksum  # noqa: E402

FIRST = SamplingParams(max_tokens=1, ignore_eos=True)
TTFT_TARGET, PUT_TARGET = 1.15, 0.9


def random_blocks(layout: KVLayout, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, layout.block_bytes), dtype=torch.uint8, generator=g)
    return [raw[i].view(layout.torch_dtype).view(layout.block_shape) for i in range(n)]


def fresh_keys(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


class RawPusher(threading.Thread):
    """The floor of the busy rounds: the bytes a ``Pusher`` moves, moved without the store.

    Per chain, as fast as it can: copy the chain's blocks into a slab (the L2 put), then twice
    (the demoted victims, the persisted chain) checksum them and write them to an O_DIRECT file
    with one ``pwritev`` and one ``fdatasync``. With ``l2_copy=False, writes=1`` (the floor of a
    persist stream): copy the chain into the write buffer, checksum, one ``pwritev``, one ``fdatasync``. What an L1-hit request loses to this thread is what
    any tenant doing that IO on this host's other core costs it: CPU, memory bandwidth, the GIL.
    """

    def __init__(self, path: Path, blocks: list[torch.Tensor], chain: int, l2_copy: bool = True,
                 writes: int = 2, chains_per_s: float | None = None) -> None:
        super().__init__(daemon=True)
        self.blocks, self.chain, self.l2_copy, self.writes = blocks, chain, l2_copy, writes
        self.chains_per_s = chains_per_s  # None: flat out; else paced to the store's measured rate
        self.stop = threading.Event()
        self.started_writing = threading.Event()
        nbytes = blocks[0].numel() * blocks[0].element_size()
        self.slab = torch.empty((chain, nbytes), dtype=torch.uint8)
        self.buf = mmap.mmap(-1, chain * nbytes)  # page-aligned, as O_DIRECT needs
        self.out = torch.frombuffer(self.buf, dtype=torch.uint8).view(chain, nbytes)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        os.ftruncate(self.fd, writes * chain * nbytes)
        self.rounds = 0

    def run(self) -> None:
        n, i, size = len(self.blocks), 0, len(self.buf)
        t0 = time.perf_counter()
        try:
            while not self.stop.is_set():
                if self.chains_per_s and self.rounds:
                    ahead = self.rounds / self.chains_per_s - (time.perf_counter() - t0)
                    if ahead > 0:
                        self.stop.wait(ahead)
                        continue
                for j in range(self.chain):
                    block = self.blocks[(i + j) % n].view(-1).view(torch.uint8)
                    (self.slab if self.l2_copy else self.out)[j].copy_(block)
                for w in range(self.writes):
                    if self.l2_copy:
                        self.out.copy_(self.slab)
                    offset = w * size
                    for j in range(self.chain):
                        checksum(b"k", self.out[j].numpy())
                    os.pwritev(self.fd, [self.buf], offset)
                    os.fdatasync(self.fd)
                self.rounds += 1
                self.started_writing.set()
                i += self.chain
        finally:
            os.close(self.fd)


class Pusher(threading.Thread):
    """Another tenant of the store: puts fresh chains into a full L2 (each demotes a victim to L3) and
    persists some of them to L3, until stopped. Keeps what it wrote for the byte check."""

    def __init__(self, store: TierKVStore, blocks: list[torch.Tensor], chain: int, persist: bool) -> None:
        super().__init__(daemon=True)
        self.store, self.blocks, self.chain, self.persist = store, blocks, chain, persist
        self.stop = threading.Event()
        self.started_writing = threading.Event()
        self.rng = random.Random(1)
        self.written: list[tuple[bytes, int]] = []  # (key, index into blocks)
        self.l3_before = 0

    def run(self) -> None:
        n, i = len(self.blocks), 0
        self.chains, t0 = 0, time.perf_counter()
        while not self.stop.is_set():
            keys = fresh_keys(self.rng, self.chain)
            idx = [(i + j) % n for j in range(self.chain)]
            ok = self.store.put_blocks(keys, [self.blocks[j] for j in idx])
            self.written += [(k, j) for k, j, f in zip(keys, idx, ok) if f]
            if self.persist:
                self.store.persist(keys, Tier.L3)
            self.started_writing.set()
            i += self.chain
            self.chains += 1
            self.chains_per_s = self.chains / (time.perf_counter() - t0)

    def mark(self) -> None:
        """Call at the start and the end of the timed requests: ``timed_chains_per_s`` is the rate between."""
        now = (time.perf_counter(), self.chains)
        if getattr(self, "_mark", None) is not None:
            (t0, c0) = self._mark
            self.timed_chains_per_s = (now[1] - c0) / (now[0] - t0)
        self._mark = now

    def check(self, sample: int = 64) -> None:
        """A sample of what it wrote is byte-identical wherever the store still has it."""
        s = self.store
        layout = s.layout
        picked = self.written[-sample:]  # the newest: older ones may have been evicted since
        dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in picked]
        s.flush()
        found = 0
        for tier in (s.l2, s.l3):
            if tier is None:
                continue
            flags = tier.get([k for k, _ in picked], dst)
            for (_, j), d, f in zip(picked, dst, flags):
                if f:
                    found += 1
                    assert torch.equal(d.view(torch.uint8), self.blocks[j].view(torch.uint8)), "wrong bytes"
        assert found > 0, "nothing the pusher wrote was found again"


def ttft_rounds(args, work: Path) -> dict:
    model = resolve_model(args.model)
    n_tokens = 512 if args.quick else 1024
    engine = EngineConfig(num_blocks=n_tokens // 16 * 2 + 64, max_num_batched_tokens=n_tokens, dtype="float32")
    cfg = StoreConfig(l2=L2Config(capacity="24MiB", pin=False),
                      l3=L3Config(path=str(work / "ttft-l3"), capacity="256MiB"),
                      policy=PolicyConfig(name="lru", write="write_back"))
    llm = LLM(model, cfg, engine)
    try:
        rng = random.Random(0)
        prompt = [rng.randrange(3, 40000) for _ in range(n_tokens)]
        cold = llm.generate([prompt], FIRST)[0]
        hit = (n_tokens - 1) // 16 * 16
        blocks = random_blocks(llm.layout, 64, seed=3)
        # Fill L2 first, so every put of the timed phase demotes a victim to disk.
        fill_rng = random.Random(9)
        while llm.store.stats()["usage"]["l2"][0] < llm.store.l2.capacity:
            llm.store.put_blocks(fresh_keys(fill_rng, 16), blocks[:16])
        idle, busy, unpaced, floor = [], [], [], []
        rounds, reps = (3, 8) if args.quick else (6, 12)
        pushers, unpaced_pushers = [], []
        pacer = llm.store.pacer
        share = pacer.share
        for _ in range(rounds):
            idle += [timed(llm, prompt, cold, hit) for _ in range(reps)]
            for paced in (True, False):
                pacer.share = share if paced else 1.0  # 1.0: pacing off, as before it existed
                pusher = Pusher(llm.store, blocks, 16, persist=True)
                pusher.start()
                pusher.started_writing.wait(30)
                pusher.mark()
                (busy if paced else unpaced).extend(timed(llm, prompt, cold, hit) for _ in range(reps))
                pusher.mark()
                pusher.stop.set()
                pusher.join(60)
                pusher.check()  # before the next phase's pushes evict what it wrote
                (pushers if paced else unpaced_pushers).append(pusher)
            pacer.share = share
            # The same IO at the rate the store's paced pusher sustained this round, without the store.
            raw = RawPusher(work / "raw-floor.bin", blocks, 16, chains_per_s=pushers[-1].timed_chains_per_s)
            raw.start()
            raw.started_writing.wait(30)
            floor += [timed(llm, prompt, cold, hit) for _ in range(reps)]
            raw.stop.set()
            raw.join(60)
        s = llm.store.stats()
        chain_bytes = 16 * llm.layout.block_bytes
        return {"prompt_tokens": n_tokens, "requests": len(idle) + len(busy) + len(unpaced) + len(floor),
                "background_share": share,
                "idle_ttft_ms": statistics.median(idle), "busy_ttft_ms": statistics.median(busy),
                "unpaced_busy_ttft_ms": statistics.median(unpaced),
                "raw_io_busy_ttft_ms": statistics.median(floor),
                "pusher_gbps": statistics.median(p.timed_chains_per_s for p in pushers) * chain_bytes / 1e9,
                "unpaced_pusher_gbps": statistics.median(p.timed_chains_per_s for p in unpaced_pushers) * chain_bytes / 1e9,
                "pushed_blocks": sum(len(p.written) for p in pushers + unpaced_pushers),
                "l3_write_bytes": s["bytes"].get("l3_write", 0), "evictions": s["evictions"]}
    finally:
        llm.close()


def timed(llm: LLM, prompt: list[int], cold, hit: int) -> float:
    out = llm.generate([prompt], FIRST)[0]
    assert out.hit_tokens.get("l1", 0) == hit and sum(out.hit_tokens.values()) == hit, out.hit_tokens
    assert out.token_ids == cold.token_ids, "an L1 hit produced another first token than the cold run"
    return out.ttft_s * 1e3


def put_rounds(args, work: Path) -> dict:
    layout = KVLayout(num_layers=16, num_kv_heads=4, head_dim=64, block_size=16, dtype="float16")  # 256 KiB
    n, chain = (128, 32) if args.quick else (256, 64)
    rounds, reps = (4, 6) if args.quick else (8, 6)  # reps: timed puts per phase
    phases = 4  # idle, busy (paced), unpaced, raw IO
    cfg = StoreConfig(l2=L2Config(capacity=(phases * rounds * reps * n + 2 * chain) * layout.block_bytes, pin=False),
                      l3=L3Config(path=str(work / "put-l3"), capacity=chain * layout.block_bytes),
                      policy=PolicyConfig(name="lru", write="write_back"))
    store = TierKVStore(cfg, layout)
    try:
        rng = random.Random(5)
        blocks = random_blocks(layout, n, seed=6)
        chains = [fresh_keys(rng, chain) for _ in range(2)]
        for keys in chains:
            assert store.put_blocks(keys, blocks[:chain]) == [True] * chain
        stop = threading.Event()
        persisted = [0]
        rate = [0.0]  # chains persisted per second by the last stream, over its life

        def stream() -> None:
            i, t0 = 0, time.perf_counter()
            while not stop.is_set():
                persisted[0] += store.persist(chains[i % 2], Tier.L3)
                i += 1
            rate[0] = i / (time.perf_counter() - t0)

        def timed_puts() -> list[float]:
            return [put_gbps(store, layout, rng, blocks, puts) for _ in range(reps)]

        pacer, share = store.pacer, store.pacer.share
        idle, busy, unpaced, floor, puts, rates = [], [], [], [], [], []
        for _ in range(rounds):
            idle += timed_puts()
            for paced in (True, False):
                pacer.share = share if paced else 1.0  # 1.0: pacing off, as before it existed
                stop.clear()
                before = persisted[0]
                t = threading.Thread(target=stream, daemon=True)
                t.start()
                while persisted[0] == before:
                    time.sleep(0.001)
                (busy if paced else unpaced).extend(timed_puts())
                stop.set()
                t.join(60)
                if paced:
                    rates.append(rate[0])
            pacer.share = share
            raw = RawPusher(work / "raw-put-floor.bin", blocks, chain, l2_copy=False, writes=1,
                            chains_per_s=max(rates[-1], 1.0))
            raw.start()
            raw.started_writing.wait(30)
            floor += timed_puts()
            raw.stop.set()
            raw.join(60)
        check_puts(store, layout, blocks, puts)
        return {"block_bytes": layout.block_bytes, "blocks_per_put": n, "rounds": rounds, "puts_per_phase": reps,
                "l2_put_idle_gbps": statistics.median(idle), "l2_put_busy_gbps": statistics.median(busy),
                "l2_put_unpaced_gbps": statistics.median(unpaced),
                "l2_put_raw_io_gbps": statistics.median(floor), "l3_persisted_blocks": persisted[0],
                "persist_chains_per_s": statistics.median(rates)}
    finally:
        store.close()


def put_gbps(store, layout, rng, blocks, puts) -> float:
    keys = fresh_keys(rng, len(blocks))
    t0 = time.perf_counter()
    ok = store.put_blocks(keys, blocks)
    dt = time.perf_counter() - t0
    assert ok == [True] * len(blocks), "L2 had room for every put"
    puts.append(keys)
    return len(blocks) * layout.block_bytes / dt / 1e9


def check_puts(store, layout, blocks, puts) -> None:
    dst = [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in blocks]
    for keys in (puts[0], puts[-1]):
        assert store.l2.get(keys, dst) == [True] * len(keys)
        assert all(torch.equal(d.view(torch.uint8), b.view(torch.uint8)) for d, b in zip(dst, blocks))


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a registered name or a .gguf file")
    p.add_argument("--dir", default=os.path.expanduser(os.environ.get("TIERKV_CACHE_DIR", "~/.cache/tierkv")),
                   help="a directory on the L3 filesystem (default: ~/.cache/tierkv)")
    args = p.parse_args()
    torch.set_num_threads(1)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierkv-contention-", dir=args.dir))
    try:
        ttft = ttft_rounds(args, work)
        put = put_rounds(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    idle_ttft, idle_put = ttft["idle_ttft_ms"], put["l2_put_idle_gbps"]
    ttft_ratio = ttft["busy_ttft_ms"] / idle_ttft
    put_ratio = put["l2_put_busy_gbps"] / idle_put
    unpaced_ratio = ttft["unpaced_busy_ttft_ms"] / idle_ttft
    raw_ratio = ttft["raw_io_busy_ttft_ms"] / idle_ttft
    unpaced_put_ratio = put["l2_put_unpaced_gbps"] / idle_put
    raw_put_ratio = put["l2_put_raw_io_gbps"] / idle_put
    share = ttft["background_share"]
    print_table(f"write-back contention (medians; phases interleaved round by round; io.background_share={share})", [
        ("idle_ttft_ms", f"{idle_ttft:.2f}", f"L1-hit TTFT, {ttft['prompt_tokens']} tokens, disk idle"),
        ("busy_ttft_ms", f"{ttft['busy_ttft_ms']:.2f}",
         f"same, while another thread demotes to L3 and persists (paced): {ttft_ratio:.3f}x idle (target <= {TTFT_TARGET})"),
        ("unpaced_busy_ttft_ms", f"{ttft['unpaced_busy_ttft_ms']:.2f}", f"same, pacing off: {unpaced_ratio:.3f}x idle"),
        ("raw_io_busy_ttft_ms", f"{ttft['raw_io_busy_ttft_ms']:.2f}",
         f"same, while a bare thread copies, checksums and O_DIRECT-writes the same blocks at the paced pusher's rate: "
         f"{raw_ratio:.3f}x idle"),
        ("pusher_gbps", f"{ttft['pusher_gbps']:.3f}",
         f"what the pusher put (and demoted, and persisted) per second while requests ran, paced; "
         f"unpaced {ttft['unpaced_pusher_gbps']:.3f} ({ttft['pusher_gbps'] / ttft['unpaced_pusher_gbps']:.2f}x)"),
        ("l2_put_idle_gbps", f"{idle_put:.2f}", f"put_blocks into L2, {put['block_bytes'] >> 10} KiB blocks"),
        ("l2_put_busy_gbps", f"{put['l2_put_busy_gbps']:.2f}",
         f"same, with a concurrent L3 persist stream (paced): {put_ratio:.3f}x idle (target >= {PUT_TARGET})"),
        ("l2_put_unpaced_gbps", f"{put['l2_put_unpaced_gbps']:.2f}", f"same, pacing off: {unpaced_put_ratio:.3f}x idle"),
        ("l2_put_raw_io_gbps", f"{put['l2_put_raw_io_gbps']:.2f}",
         f"same, while a bare thread copies, checksums and O_DIRECT-writes the persisted chains at the paced rate: "
         f"{raw_put_ratio:.3f}x idle"),
    ])
    figures = {**ttft, **put, "busy_over_idle_ttft": ttft_ratio, "busy_over_idle_put": put_ratio,
               "unpaced_busy_over_idle_ttft": unpaced_ratio, "unpaced_over_idle_put": unpaced_put_ratio,
               "raw_io_busy_over_idle_ttft": raw_ratio, "raw_io_over_idle_put": raw_put_ratio,
               "paced_over_unpaced_pusher": ttft["pusher_gbps"] / ttft["unpaced_pusher_gbps"]}
    finish(args, "contention", figures, [
        target("busy_over_idle_ttft", ttft_ratio, "<=", TTFT_TARGET, "L1-hit TTFT, disk busy / idle"),
        target("busy_over_idle_put", put_ratio, ">=", PUT_TARGET, "L2 put GB/s, L3 persist stream / none"),
    ])


if __name__ == "__main__":
    main()
