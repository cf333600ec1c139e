"""What publishing KV events costs the store: lookup time and L2 put throughput, events off vs on, one run.

A ``KVEventPublisher`` on a store (``store.add_tier_listener``), followed by a ``KVEventSubscriber`` in
another process over real ZMQ sockets, as a router would.

lookup_off_us / lookup_on_us  ``store.release(store.lookup(tokens))`` of a 1000-token prompt (16-token
                              blocks, all L2 hits, checked on every call) over an index of 200,000
                              entries (bench/lookup.py's store and call), on two stores, events off and
                              on; they alternate call by call; medians over every call
put_ref / put_small           ``store.put_blocks`` of new blocks into a full L2 (each put evicts one block:
                              two tier events per block); ``ref``: 32 Llama-3.1-8B blocks of 16 tokens
                              (2 MiB) a put, ``small``: 256 of the lookup bench's 16 KiB blocks, where
                              bookkeeping is most of a put. A slot is ``--puts-per-slot`` puts (100; 12
                              with ``--quick``) back to back, as an engine saving a steady stream of requests
                              makes them: the events batch as they do in service (not one per put: a batch
                              25 ms after the slot's first record, then at most one per 100 ms: ~5 in a slot
                              of 100 2 MiB puts), and the slot ends with ``store.flush()``, inside the CPU
                              clock. Every block has contents of its own, and after each slot (off the
                              clocks) every block is read back from L2 and compared.
                              Why a steady stream: the cost that can take throughput is the one paid while
                              puts saturate the machine, and that is a steady stream, where the rate cap
                              sets the batches (<= 10 a second). A short burst (``--puts-per-slot 12``, ~50
                              ms) always carries two batches, the window's and the closing flush's (one
                              per 6 puts where the stream makes one per ~25): its extra CPU is spent when
                              the burst is over and the machine idles. ``--puts-per-slot 1`` is the old
                              worst case: a flush after every put, so every put pays a batch of its own
                              (nothing in tierkv flushes after a save).
                              Memory: a slot's sources and an L2 that holds a whole slot, per kind: ~17 GB
                              of RSS at the default (100 puts of 32 2 MiB blocks: 6.4 GB of sources, 6.5 GB
                              of L2); ``--puts-per-slot 48`` needs about half.

How a slot is compared: one store of each kind against itself. Two identical stores differ by several
per cent between them, steadily through a run (where their L2 memory landed), so one store with events
against another without cannot show 2 %. The store's slots run E O N O E O N O ..., one kind after the
other so that slots follow each other closely: in an E slot its publisher is attached, in O and N slots
nothing is (events off). Each E slot is compared with the mean of the O slots on either side (so a drift
over the three cancels): ``t_E / t_O`` per E slot, the median over E slots, with its 95 % interval
(order statistics, distribution free). The N slots get the same ratio: ``t_N / t_O`` is the noise floor
of this very run, with nothing attached, by the same arithmetic. Before every slot the publisher is
attached, the subscriber brought up to date and checked equal to the store's index (off the clocks),
and, unless the slot is E, the publisher detached again: every slot follows the same work, the same
round trip to the subscriber's process. The first round of slots warms up and is not counted. Clocks
per slot:

wall        the slot's ``put_blocks`` calls as the caller waits for them (the throughput)
caller CPU  the calling thread's CPU in them (``time.thread_time``)
process CPU every thread's, from the slot's first put until ``store.flush()``, the publisher's flush and
            2 ms after (the same in every slot), so the events' delivery and ZMQ's I/O thread's send are
            inside it
events µs   in E slots, the store's ``tierkv-events`` thread and ZMQ's I/O thread, per block (schedstat);
            ``attributable`` divides their CPU by the O slots' process CPU: a floor on the CPU cost that
            load moves little (the caller's recording and any interference are not in it)

cost = median(E ratio) - median(N ratio), ± the two intervals' half widths combined (root of squares).
Target (issue 16): lookup_on / lookup_off <= 1.02, and the 2 MiB puts' wall and process CPU cost <= 2 %:
``--check`` fails when either cost exceeds 0.02, or when either noise exceeds ``--max-noise`` (a run too
noisy to judge passes nothing). ``--null`` attaches nothing in E slots either (every cost must come out
within its noise); ``--inject-us X`` spins X µs of the caller's CPU per block inside each E put's clocks
(the cost must show it; the check fails once X is about 2 % of a put). ``--rounds`` is the lookup rounds
(10 lookups per store each), ``--put-rounds`` the put rounds (4 slots per kind each). At the end every
subscriber's inventory must equal its store's index, key by key and tier by tier (a digest of both):
what the events said is true.
"""
from __future__ import annotations

import collections
import inspect
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402
import xxhash  # noqa: E402
from _common import finish, median_ci, parser, print_table, target, verdict  # noqa: E402
from lookup import LAYOUT, make_store  # noqa: E402

from tierkv.config import L2Config, StoreConfig  # noqa: E402
from tierkv.index import Tier  # noqa: E402
from tierkv.kvevents import KVEventPublisher, PublisherConfig  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402

PROMPT, ENTRIES = 1000, 200_000
# The puts: Llama-3.1-8B's block (32 layers x 8 KV heads x 128 x 16 tokens, bf16: 2 MiB), and the
# lookup bench's 16 KiB block, where the store's bookkeeping, not the copy, is most of a put.
REF_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
PUTS = {"ref": (REF_LAYOUT, 32, 128), "small": (LAYOUT, 256, 2048)}  # layout, blocks per put, L2 blocks
CYCLE = "EONO"  # a store's slots; the second store of a kind runs one slot behind
PER_SLOT = 100  # puts a slot streams back to back (~0.4-1 s of 2 MiB puts: several 100 ms batching intervals)
QUICK_PER_SLOT = 12  # --quick: a burst of ~50 ms (two batches: the window's and the flush's)
SETTLE_S = 0.002  # inside every put's CPU clock, after the flushes: ZMQ's I/O thread sends meanwhile


def put_store(layout: KVLayout, l2_blocks: int) -> TierKVStore:
    """L2 only (no L3): every put lands in L2 and, once it is full, evicts one block."""
    cfg = StoreConfig(l2=L2Config(capacity=l2_blocks * layout.block_bytes, pin=False), l3_enabled=False)
    return TierKVStore(cfg, layout, l1_blocks=16)


# The subscriber runs in its own process, as a router would: it follows the stream and, asked
# "SEQ" on stdin, waits until it has applied batch SEQ and prints its inventory's size and digest.
SUBSCRIBER = """
import sys
from tierkv.kvevents import KVEventSubscriber
sub = KVEventSubscriber(sys.argv[1], sys.argv[2]).start()
for line in sys.stdin:
    ok = sub.wait_for(int(line), timeout=60)
    held = sub.inventory.holds()
    print(int(ok), len(held), digest(held), sub.gaps, flush=True)
"""


def digest(held: dict[bytes, int]) -> str:
    return xxhash.xxh3_64_hexdigest(b"".join(k + bytes([m]) for k, m in sorted(held.items())))


def index_by_tier(store: TierKVStore) -> list[set[bytes]]:
    with store._lock:
        entries = [(e.key, e.mask) for e in store.index.entries() if e.mask]
    return [{k for k, m in entries if m >> t & 1} for t in range(4)]


class Follower:
    """A publisher on ``store`` and a subscriber process following it; ``pause``/``resume`` detach
    and re-attach the publisher (resume publishes what changed meanwhile and checks the subscriber)."""

    def __init__(self, store: TierKVStore) -> None:
        self.store = store
        self.pub = KVEventPublisher(PublisherConfig(block_size=store.block_size))
        self.pub.attach(store)
        self.attached = True
        code = f"import xxhash\n{inspect.getsource(digest)}\n{SUBSCRIBER}"
        self.proc = subprocess.Popen([sys.executable, "-c", code, self.pub.endpoint, self.pub.replay_endpoint],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def verify(self) -> tuple[int, int, int]:
        """(inventory size, batches, events) once the subscriber's inventory equals the store's index."""
        self.store.flush()
        self.pub.flush()
        self.proc.stdin.write(f"{self.pub.last_seq}\n")
        self.proc.stdin.flush()
        ok, n, got, _ = self.proc.stdout.readline().split()
        with self.store._lock:
            want = {e.key: e.mask for e in self.store.index.entries() if e.mask}
        if ok != "1" or got != digest(want) or int(n) != len(want):
            raise SystemExit(f"the subscriber's inventory ({n} blocks) differs from the store's ({len(want)})")
        return len(want), self.pub.batches, self.pub.events

    def pause(self) -> None:
        self.store.flush()
        self.store.remove_tier_listener(self.pub.on_tier_keys)
        self.attached = False

    def resume(self) -> None:
        """Attach again and publish the change since ``pause`` as one net batch; checked end to end."""
        self.store.add_tier_listener(self.pub.on_tier_keys, by_tier=True)
        self.attached = True
        want, have = index_by_tier(self.store), [set(keys) for keys in self.pub.inventory.by_tier()]
        self.pub.on_tier_keys([list(w - h) for w, h in zip(want, have)], [list(h - w) for w, h in zip(want, have)])
        self.verify()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.pub.close()


def lookup_pair(look: dict[str, TierKVStore], tokens: list[int], order: tuple[str, str], calls: int,
                res: dict[str, list[float]]) -> None:
    """``calls`` lookups on each store, alternating call by call; µs per call into ``res``; every
    match checked (all L2 hits) off the clock."""
    want = PROMPT // LAYOUT.block_size
    for _ in range(calls):
        for name in order:
            store = look[name]
            t0 = time.perf_counter()
            m = store.lookup(tokens)
            store.release(m)
            res[f"lookup_{name}"].append((time.perf_counter() - t0) * 1e6)
            if m.num_blocks != want or any(t != Tier.L2 for t in m.tiers):
                raise SystemExit(f"lookup store {name}: expected {want} L2 hits, got {m.counts}")


def thread_cpu(tid: int | None) -> float:
    """CPU seconds thread ``tid`` of this process has run (Linux schedstat, ns), 0 without one."""
    if tid is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return 0.0


def zmq_io_thread() -> int | None:
    """The tid of libzmq's I/O thread (one per context; every publisher here shares it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/IO"):
                    return int(tid)
        except OSError:
            pass
    return None


def verify_round(store: TierKVStore, keys: list[bytes], sources: list[torch.Tensor],
                 landing: list[torch.Tensor], name: str) -> None:
    """Read every block of the put back from L2 and compare it with what was put, byte for byte."""
    m = store.lookup_keys(keys)
    try:
        if m.num_blocks != len(keys) or any(t != Tier.L2 for t in m.tiers):
            raise SystemExit(f"store {name}: the put's blocks are not all in L2 ({m.counts})")
        result = store.load(m, landing[:len(keys)]).wait(30)
        if result.num_ok != len(keys):
            raise SystemExit(f"store {name}: {len(keys) - result.num_ok} blocks did not read back")
        for i, (got, put) in enumerate(zip(landing, sources)):
            if not torch.equal(got.view(torch.uint8), put.view(torch.uint8)):
                raise SystemExit(f"store {name}: block {i} of the put read back different bytes")
    finally:
        store.release(m)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class PutRunner:
    """The put slots of one kind: its store, its follower, the sources and the per-slot clocks. A slot
    is ``per_slot`` puts back to back, as a saving engine streams them (no flush between them)."""

    def __init__(self, kind: str, null: bool, inject_us: float, counter, per_slot: int = 1) -> None:
        self.kind, self.null, self.inject_us, self.counter = kind, null, inject_us, counter
        self.layout, self.n, l2 = PUTS[kind]
        self.per_slot = per_slot
        # L2 holds a whole slot's blocks (plus one put), so every block of the slot can be read back
        # after it; it is full from the start, so every block put still evicts one.
        l2 = max(l2, (per_slot + 1) * self.n)
        self.stores = [put_store(self.layout, l2)]
        self.followers = [Follower(s) for s in self.stores]
        # One source tensor per block of a slot, refilled before each slot with contents of its own
        # (small integers: exact in any dtype), and a put's worth of landing tensors to read back into.
        shape, dtype = self.layout.block_shape, self.layout.torch_dtype
        self.sources = [torch.empty(shape, dtype=dtype) for _ in range(self.n * per_slot)]
        self.landing = [torch.empty(shape, dtype=dtype) for _ in range(self.n)]
        self.slots: list[list[tuple[str, dict[str, float]]]] = [[] for _ in self.stores]  # per store: (slot, clocks)
        self.zmq_tid = None
        for follower in self.followers:
            follower.pause()
        for store in range(len(self.stores)):
            for _ in range(l2 // (self.n * per_slot) + 1):  # fill L2: from here on every put evicts
                self.put(store, "O", record=False)

    def put(self, i: int, slot: str, record: bool = True) -> None:
        """One slot: ``per_slot`` puts of ``n`` new blocks each, back to back."""
        store, follower, n = self.stores[i], self.followers[i], self.n
        follower.resume()  # before every slot, so every slot follows the same work (a round trip to the subscriber)
        if slot != "E" or self.null:
            follower.pause()
        if self.zmq_tid is None:
            self.zmq_tid = zmq_io_thread()
        puts = [[next(self.counter).to_bytes(16, "little") for _ in range(n)] for _ in range(self.per_slot)]
        for j, src in enumerate(self.sources):
            src.fill_(int.from_bytes(puts[j // n][j % n][:2], "little") % 251)
        sources = [self.sources[k * n:(k + 1) * n] for k in range(self.per_slot)]
        events_tid = store.events._thread.native_id if store.events._thread is not None else None
        e0, z0, b0 = thread_cpu(events_tid), thread_cpu(self.zmq_tid), store.events.batches
        seconds = caller = 0.0
        ok = True
        c0 = time.process_time()
        for keys, src in zip(puts, sources):
            t0, u0 = time.perf_counter(), time.thread_time()
            ok = all(store.put_blocks(keys, src)) and ok
            if slot == "E" and self.inject_us:
                spin(self.inject_us * n / 1e6)
            seconds += time.perf_counter() - t0
            caller += time.thread_time() - u0
        store.flush()  # outside the wall clock, inside the CPU clock; in every slot, so only the events differ
        follower.pub.flush()
        time.sleep(SETTLE_S)
        cpu = time.process_time() - c0
        blocks = n * self.per_slot
        events_us = (thread_cpu(events_tid) - e0 + thread_cpu(self.zmq_tid) - z0) / blocks * 1e6
        batches = store.events.batches - b0
        if not ok:
            raise SystemExit(f"put_blocks refused blocks on store {self.kind}{i}")
        for keys, src in zip(puts, sources):
            verify_round(store, keys, src, self.landing, f"{self.kind}{i}")
        if slot == "E" and follower.attached:
            follower.pause()
        if record:
            self.slots[i].append((slot, {"wall": seconds, "caller": caller, "cpu": cpu, "events_us": events_us,
                                         "batches": batches}))

    def run_round(self, r: int, record: bool = True) -> None:
        for i in range(len(self.stores)):  # (with more stores, each runs one slot behind the one before)
            self.put(i, CYCLE[(r - i) % 4], record)

    def ratios(self, slot: str, clock: str) -> list[float]:
        """Per ``slot`` put: its clock over the mean of the O puts either side of it (same store)."""
        out = []
        for seq in self.slots:
            for j in range(1, len(seq) - 1):
                if seq[j][0] == slot and seq[j - 1][0] == seq[j + 1][0] == "O":
                    out.append(seq[j][1][clock] / ((seq[j - 1][1][clock] + seq[j + 1][1][clock]) / 2))
        return out

    def clock(self, slot: str, clock: str) -> float:
        """The median of ``clock`` over the ``slot`` slots."""
        values = sorted(v[clock] for seq in self.slots for s, v in seq if s == slot)
        return values[len(values) // 2]

    def close(self) -> tuple[int, int, int]:
        try:
            for f in self.followers:
                f.resume()  # the final check: every subscriber equals its store
            return tuple(sum(x) for x in zip(*(f.verify() for f in self.followers)))
        finally:
            for f in self.followers:
                f.close()
            for s in self.stores:
                s.close()


def put_figures(runner: PutRunner) -> dict:
    """Medians, intervals and the cost beyond the null floor for each clock."""
    out: dict = {"slots": {s: sum(1 for seq in runner.slots for x, _ in seq if x == s) for s in "EON"}}
    for clock in ("wall", "caller", "cpu"):
        e, e_lo, e_hi = median_ci(runner.ratios("E", clock))
        z, z_lo, z_hi = median_ci(runner.ratios("N", clock))
        noise = (((e_hi - e_lo) / 2) ** 2 + ((z_hi - z_lo) / 2) ** 2) ** 0.5
        out[clock] = {"on_over_off": round(e, 4), "ci": [round(e_lo, 4), round(e_hi, 4)],
                      "null": round(z, 4), "null_ci": [round(z_lo, 4), round(z_hi, 4)],
                      "cost": round(e - z, 4), "noise": round(noise, 4)}
    out["cpu"]["mean_on_over_off"] = round(_mean_ratio(runner, "E", "cpu"), 4)
    out["cpu"]["mean_null"] = round(_mean_ratio(runner, "N", "cpu"), 4)
    blocks = runner.n * runner.per_slot
    out["per_block_us"] = {f"{clock}_{s}": round(runner.clock(s, clock) / blocks * 1e6, 2)
                           for clock in ("wall", "caller", "cpu") for s in "EO"}
    out["events_thread_and_zmq_us"] = round(runner.clock("E", "events_us"), 2)
    out["batches_per_e_slot"] = runner.clock("E", "batches")
    threads_s = runner.clock("E", "events_us") * blocks / 1e6
    out["attributable_cpu"] = round(threads_s / runner.clock("O", "cpu"), 4)
    out["puts_per_slot"] = runner.per_slot
    out["raw"] = [[(slot, {k: round(v, 7) for k, v in clocks.items()}) for slot, clocks in seq] for seq in runner.slots]
    return out


def _mean_ratio(runner: PutRunner, slot: str, clock: str) -> float:
    """Sum of the slot's clock over the sum of its O neighbours' means: every put counted, outliers too."""
    num = den = 0.0
    for seq in runner.slots:
        for j in range(1, len(seq) - 1):
            if seq[j][0] == slot and seq[j - 1][0] == seq[j + 1][0] == "O":
                num += seq[j][1][clock]
                den += (seq[j - 1][1][clock] + seq[j + 1][1][clock]) / 2
    return num / den if den else float("nan")


def cost_verdict(f: dict) -> str:
    cost, noise = f["cost"], f["noise"]
    if cost + noise <= 0.02:
        return "<= 2 %: shown"
    if cost - noise > 0.02:
        return "> 2 %: MISSED"
    return "not resolved (its interval crosses 2 %)"


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--null", action="store_true", help="attach nothing in E slots either: the cost must be ~0")
    p.add_argument("--inject-us", type=float, default=0.0, metavar="US",
                   help="spin US µs of the caller's CPU per block in each E put (the check's own test)")
    p.add_argument("--max-noise", type=float, default=0.01,
                   help="--check fails when the 2 MiB put's wall noise exceeds this (default 0.01)")
    p.add_argument("--rounds", type=int, default=0,
                   help="lookup rounds, 10 lookups per store each (default 201; 41 with --quick)")
    p.add_argument("--put-rounds", type=int, default=0,
                   help="put rounds, 4 slots per kind each (default 90; 6 with --quick)")
    p.add_argument("--puts-per-slot", type=int, default=0,
                   help=f"puts streamed back to back in a slot (default {PER_SLOT}: a steady stream; "
                        f"{QUICK_PER_SLOT} with --quick: a burst); 1: a flush after every put, "
                        "so every put is a batch of its own (the worst case: no batching at all)")
    args = p.parse_args()
    if args.puts_per_slot < 0:
        p.error("--puts-per-slot: expected an integer >= 1")
    args.puts_per_slot = args.puts_per_slot or (QUICK_PER_SLOT if args.quick else PER_SLOT)
    rounds = args.rounds or (41 if args.quick else 201)
    put_rounds = args.put_rounds or (6 if args.quick else 90)
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    rng = random.Random(1)
    tokens = [rng.randrange(128_000) for _ in range(PROMPT)]
    work = tempfile.mkdtemp(prefix="tierkv-events-")
    look = {"off": make_store("xxh3_128", os.path.join(work, "off"), tokens, ENTRIES),
            "on": make_store("xxh3_128", os.path.join(work, "on"), tokens, ENTRIES)}
    look_follower = None if args.null else Follower(look["on"])
    counter = iter(range(10**12))
    runners: dict[str, PutRunner] = {}
    res: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for r in range(rounds):
            lookup_pair(look, tokens, ("off", "on") if r % 2 == 0 else ("on", "off"), 10, res)
        for kind in PUTS:  # one kind after the other: a store's slots follow each other closely
            runners[kind] = runner = PutRunner(kind, args.null, args.inject_us, counter, args.puts_per_slot)
            for r in range(4):  # a warm-up round, not counted
                runner.run_round(r, record=False)
            for r in range(4 * put_rounds):
                runner.run_round(r)
        verified = {kind: runner.close() for kind, runner in runners.items()}
        if look_follower is not None:
            verified["lookup"] = look_follower.verify()
    finally:
        if look_follower is not None:
            look_follower.close()
        for store in look.values():
            store.close()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    puts = {kind: put_figures(runner) for kind, runner in runners.items()}
    report(args, rounds, put_rounds, med, puts, verified, load_before, load_after)


def report(args, rounds: int, put_rounds: int, med: dict, puts: dict, verified: dict, load_before,
           load_after) -> None:
    targets = [target("lookup_on_over_off", med["lookup_on"] / med["lookup_off"], "<=", 1.02, "lookup, events off")]
    for clock, what in (("wall", "wall"), ("cpu", "process CPU")):
        c = puts["ref"][clock]
        targets.append(target(f"put_ref_{clock}_cost", c["cost"], "<=", 0.02,
                              f"2 MiB L2 puts, {what}: median(E/O) - median(N/O)"))
        targets.append(target(f"put_ref_{clock}_noise", c["noise"], "<=", args.max_noise,
                              f"the run resolves the 2 MiB puts' {what} cost to this"))
    t = {x["metric"]: x for x in targets}
    rows = [
        ("lookup_off_us", f"{med['lookup_off']:.2f}", f"{PROMPT}-token prompt, all L2 hits, {ENTRIES:,} entries"),
        ("lookup_on_us", f"{med['lookup_on']:.2f}", f"events on; on/off {verdict(t['lookup_on_over_off'])}"),
    ]
    for kind, (layout, n, _) in PUTS.items():
        f = puts[kind]
        size = f"{layout.block_bytes / 2**20:g} MiB" if layout.block_bytes >= 2**20 else f"{layout.block_bytes // 1024} KiB"
        us = f["per_block_us"]
        rows.append((f"put_{kind}_off_us", f"{us['wall_O']:.1f}",
                     f"wall per block, put_blocks of {n} {size} blocks into a full L2, {f['puts_per_slot']} "
                     "back to back a slot (events off, median)"))
        for clock, what in (("wall", "wall"), ("caller", "caller CPU"), ("cpu", "process CPU")):
            c = f[clock]
            note = (f"null {c['null']:.3f} [{c['null_ci'][0]:.3f}, {c['null_ci'][1]:.3f}]; "
                    f"cost {c['cost'] * 100:+.2f} % ± {c['noise'] * 100:.2f}")
            if kind == "ref" and clock != "caller":
                note += f": {cost_verdict(c)}"
            if clock == "cpu":
                note += f"; means {c['mean_on_over_off']:.3f} / null {c['mean_null']:.3f}"
            rows.append((f"put_{kind}_{clock}_on_over_off", f"{c['on_over_off']:.3f}",
                         f"{what} E/O [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}], {note}"))
        per_batch = f["events_thread_and_zmq_us"] * n * f["puts_per_slot"] / max(f["batches_per_e_slot"], 1)
        rows.append((f"put_{kind}_events_us", f"{f['events_thread_and_zmq_us']:.2f}",
                     "per block in E slots: the tierkv-events thread + ZMQ's I/O thread (median); "
                     f"{f['batches_per_e_slot']} batches a slot, ~{per_batch:.0f} µs a batch; attributable "
                     f"{f['attributable_cpu'] * 100:.2f} % of an O slot's process CPU"))
    rows.append(("slots", f"{puts['ref']['slots']['E']}", f"E slots per kind ({puts['ref']['slots']['N']} N, "
                 f"{puts['ref']['slots']['O']} O; {put_rounds} put rounds, {args.puts_per_slot} puts a slot)" + ("; --null: nothing attached in E" if args.null else "")
                 + (f"; --inject-us {args.inject_us:g}" if args.inject_us else "")))
    n, b, e = verified["small"] if "small" in verified else (0, 0, 0)
    rows.append(("verified", f"{n:,}", f"subscriber == store index (the small-block store; {b:,} batches, {e:,} events)"))
    rows.append(("loadavg", f"{load_before[0]:.2f}", f"1-minute load average before; {load_after[0]:.2f} after "
                 f"({os.cpu_count()} CPUs); every put read back and compared"))
    print_table(f"KV event publishing overhead, {rounds} lookup / {put_rounds} put rounds, each store against itself",
                rows)
    figures = {"rounds": rounds, "put_rounds": put_rounds, "puts_per_slot": args.puts_per_slot, "null": args.null, "inject_us": args.inject_us, "prompt_tokens": PROMPT,
               "index_entries": ENTRIES, "loadavg_before": [round(x, 2) for x in load_before],
               "loadavg_after": [round(x, 2) for x in load_after],
               "lookup_off_us": round(med["lookup_off"], 2), "lookup_on_us": round(med["lookup_on"], 2),
               "put": {kind: dict(f, layout_block_bytes=PUTS[kind][0].block_bytes, blocks_per_put=PUTS[kind][1],
                                  l2_blocks=max(PUTS[kind][2], (args.puts_per_slot + 1) * PUTS[kind][1]))
                       for kind, f in puts.items()},
               "verified": {w: {"inventory": n, "batches": b, "events": e} for w, (n, b, e) in verified.items()},
               **{x["metric"]: x["value"] for x in targets}}
    finish(args, "events", figures, targets)


if __name__ == "__main__":
    main()
