"""What publishing KV events costs the store: lookup time and L2 put throughput, events off vs on, one run.

Two identical default-config stores side by side; on one a ``KVEventPublisher`` is attached
(``store.add_tier_listener``) and a ``KVEventSubscriber`` in another process follows it over real
ZMQ sockets, as a router would.

lookup_off_us / lookup_on_us  ``store.release(store.lookup(tokens))`` of a 1000-token prompt (16-token
                              blocks, all L2 hits, checked on every call) over an index of 200,000
                              entries (bench/lookup.py's store and call); the two stores alternate call by
                              call, so a burst of machine noise lands on both; medians over every call
put_{ref,small}_off/on_bps   ``store.put_blocks`` of new blocks into a full L2 (each put evicts one block:
                              two tier events per block), blocks per second by wall clock; ``ref``: 32
                              Llama-3.1-8B blocks of 16 tokens (2 MiB) a round, ``small``: 256 of the
                              lookup bench's 16 KiB blocks, where bookkeeping is most of a put. Every
                              block of a round has its own contents, and after the round (off the
                              clocks) every block is read back from L2 and compared byte for byte
put_*_caller_cpu_off/on_us    the calling thread's CPU per put block (``time.thread_time``): what a save
                              pays on its own thread; the events' delivery runs on others
put_*_cpu_off_us / _on_us     process CPU (every thread) per put block, the clock running until
                              ``store.flush()`` returns (on both stores) and, events on, until every event
                              of the round has been sent: the events' whole cost in this process, which
                              the caller does not wait for
put_*_events_thread_us        of that, the events-on store's ``tierkv-events`` thread (Linux schedstat)
Rounds alternate which store goes first; figures are medians over rounds (101; 11 with --quick);
``put_*_off_over_on_paired`` is the median of each round's own off/on ratio. At the end the subscriber's
inventory must equal the store's index, key by key and tier by tier (a digest of both): what the
events said is true. The load average before and after is reported: on a shared machine the wall-clock
rows are only as good as it was quiet.
Targets (issue 16): lookup_on / lookup_off <= 1.02; put_ref_off / put_ref_on <= 1.02 (small: reported).
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
from _common import finish, parser, print_table, target, verdict  # noqa: E402
from lookup import LAYOUT, make_store  # noqa: E402

from tierkv.config import L2Config, StoreConfig  # noqa: E402
from tierkv.index import Tier  # noqa: E402
from tierkv.layout import KVLayout  # noqa: E402
from tierkv.kvevents import KVEventPublisher, PublisherConfig  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402

PROMPT, ENTRIES = 1000, 200_000
# The put rounds: Llama-3.1-8B's block (32 layers x 8 KV heads x 128 x 16 tokens, bf16: 2 MiB), and the
# lookup bench's 16 KiB block, where the store's bookkeeping, not the copy, is most of a put.
REF_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
PUTS = {"ref": (REF_LAYOUT, 32, 128), "small": (LAYOUT, 256, 2048)}  # layout, blocks per round, L2 blocks


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


class Follower:
    """A publisher on ``store`` and a subscriber process following it."""

    def __init__(self, store: TierKVStore) -> None:
        self.store = store
        self.pub = KVEventPublisher(PublisherConfig(block_size=store.block_size))
        self.pub.attach(store)
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


def thread_cpu(thread) -> float:
    """CPU seconds ``thread`` has run (Linux schedstat, ns), 0 without one."""
    if thread is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except OSError:
        return 0.0


def verify_round(store: TierKVStore, keys: list[bytes], sources: list[torch.Tensor],
                 landing: list[torch.Tensor], name: str) -> None:
    """Read every block of the round back from L2 and compare it with what was put, byte for byte."""
    m = store.lookup_keys(keys)
    try:
        if m.num_blocks != len(keys) or any(t != Tier.L2 for t in m.tiers):
            raise SystemExit(f"events-{name} store: the round's blocks are not all in L2 ({m.counts})")
        result = store.load(m, landing[:len(keys)]).wait(30)
        if result.num_ok != len(keys):
            raise SystemExit(f"events-{name} store: {len(keys) - result.num_ok} blocks did not read back")
        for i, (got, put) in enumerate(zip(landing, sources)):
            if not torch.equal(got.view(torch.uint8), put.view(torch.uint8)):
                raise SystemExit(f"events-{name} store: block {i} of the round read back different bytes")
    finally:
        store.release(m)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--null", action="store_true",
                   help="attach nothing to the 'on' stores: both sides events off, the ratios show the noise floor")
    args = p.parse_args()
    rounds = 11 if args.quick else 101
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    rng = random.Random(1)
    tokens = [rng.randrange(128_000) for _ in range(PROMPT)]
    work = tempfile.mkdtemp(prefix="tierkv-events-")
    look = {"off": make_store("xxh3_128", os.path.join(work, "off"), tokens, ENTRIES),
            "on": make_store("xxh3_128", os.path.join(work, "on"), tokens, ENTRIES)}
    puts = {(kind, name): put_store(layout, l2) for kind, (layout, _, l2) in PUTS.items() for name in ("off", "on")}
    # One source tensor per block of a round, refilled each round with contents of its own (small
    # integers: exact in any dtype), and as many landing tensors to read the round back into.
    sources = {kind: [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in range(n)]
               for kind, (layout, n, _) in PUTS.items()}
    landing = {kind: [torch.empty(layout.block_shape, dtype=layout.torch_dtype) for _ in range(n)]
               for kind, (layout, n, _) in PUTS.items()}
    followers = {} if args.null else {"lookup": Follower(look["on"]), **{kind: Follower(puts[kind, "on"]) for kind in PUTS}}
    counter = iter(range(10**9))

    def put_round(kind: str, name: str, check: bool) -> tuple[float, float, float]:
        """(blocks/s as the caller sees it, the caller's CPU µs per block, process CPU µs per block
        including sending its events); with ``check``, the round read back and compared."""
        store, n = puts[kind, name], PUTS[kind][1]
        keys = [next(counter).to_bytes(16, "little") for _ in range(n)]
        for i, src in enumerate(sources[kind]):
            src.fill_(int.from_bytes(keys[i][:2], "little") % 251)
        events_thread = store.events._thread
        e0 = thread_cpu(events_thread)
        c0, t0, u0 = time.process_time(), time.perf_counter(), time.thread_time()
        ok = store.put_blocks(keys, sources[kind])
        seconds, caller = time.perf_counter() - t0, time.thread_time() - u0
        store.flush()  # outside the wall clock, inside the CPU clock; on both stores, so only the events differ
        if name == "on" and followers:
            followers[kind].pub.flush()
        cpu = time.process_time() - c0
        if name == "on" and followers:
            res[f"put_{kind}_events_thread"].append((thread_cpu(events_thread) - e0) / n * 1e6)
        if not all(ok):
            raise SystemExit(f"put_blocks refused blocks on the events-{name} store")
        if check:
            verify_round(store, keys, sources[kind], landing[kind], name)
        return n / seconds, caller / n * 1e6, cpu / n * 1e6

    res: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for kind, (_, n, l2) in PUTS.items():
            for name in ("off", "on"):
                for _ in range(l2 // n + 1):  # fill L2: from here on every put evicts
                    put_round(kind, name, check=False)
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            lookup_pair(look, tokens, order, 20, res)
            for kind in PUTS:
                for name in order:
                    bps, caller_us, cpu_us = put_round(kind, name, check=True)
                    res[f"put_{kind}_{name}"].append(bps)
                    res[f"put_{kind}_caller_cpu_{name}"].append(caller_us)
                    res[f"put_{kind}_cpu_{name}"].append(cpu_us)
        verified = {what: f.verify() for what, f in followers.items()}
    finally:
        for f in followers.values():
            f.close()
        for store in (*look.values(), *puts.values()):
            store.close()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    # The same rounds paired: each on round against the off round beside it, so a drift in the
    # machine's load between rounds cancels (reported beside the ratio of medians the target uses).
    paired = {kind: sorted(a / b for a, b in zip(res[f"put_{kind}_off"], res[f"put_{kind}_on"]))[rounds // 2]
              for kind in PUTS}
    targets = [
        target("lookup_on_over_off", med["lookup_on"] / med["lookup_off"], "<=", 1.02, "lookup, events off"),
        target("put_off_over_on", med["put_ref_off"] / med["put_ref_on"], "<=", 1.02,
               "L2 put throughput of Llama-3.1-8B blocks, events off"),
    ]
    t = {x["metric"]: x for x in targets}
    figures = {"rounds": rounds, "null": args.null, "lookup_calls": len(res["lookup_on"]), "prompt_tokens": PROMPT,
               "index_entries": ENTRIES, "loadavg_before": [round(x, 2) for x in load_before],
               "loadavg_after": [round(x, 2) for x in load_after],
               "put": {kind: {"layout_block_bytes": layout.block_bytes, "blocks_per_round": n, "l2_blocks": l2}
                       for kind, (layout, n, l2) in PUTS.items()},
               **{f"{k}_us" if k.startswith("lookup") or "cpu" in k or "thread" in k else f"{k}_bps": round(v, 2)
                  for k, v in med.items()},
               "small_put_off_over_on": round(med["put_small_off"] / med["put_small_on"], 4),
               **{f"put_{kind}_off_over_on_paired": round(v, 4) for kind, v in paired.items()},
               "verified": {w: {"inventory": n, "batches": b, "events": e} for w, (n, b, e) in verified.items()},
               **{x["metric"]: x["value"] for x in targets}}
    rows = [
        ("lookup_off_us", f"{med['lookup_off']:.2f}", f"{PROMPT}-token prompt, all L2 hits, {ENTRIES:,} entries"),
        ("lookup_on_us", f"{med['lookup_on']:.2f}", f"events on; on/off {verdict(t['lookup_on_over_off'])}"),
    ]
    for kind, (layout, _, _) in PUTS.items():
        size = f"{layout.block_bytes / 2**20:g} MiB" if layout.block_bytes >= 2**20 else f"{layout.block_bytes // 1024} KiB"
        ratio = med[f"put_{kind}_off"] / med[f"put_{kind}_on"]
        rows += [
            (f"put_{kind}_off_bps", f"{med[f'put_{kind}_off']:,.0f}", f"put_blocks of {size} blocks into a full L2"),
            (f"put_{kind}_on_bps", f"{med[f'put_{kind}_on']:,.0f}",
             f"events on; off/on {verdict(t['put_off_over_on']) if kind == 'ref' else f'{ratio:.3f} (no target)'}"),
            (f"put_{kind}_off_over_on_paired", f"{paired[kind]:.3f}",
             "median of each round's off/on (the rounds side by side), no target"),
            (f"put_{kind}_caller_cpu_off_us", f"{med[f'put_{kind}_caller_cpu_off']:.1f}",
             "the calling thread's CPU per block"),
            (f"put_{kind}_caller_cpu_on_us", f"{med[f'put_{kind}_caller_cpu_on']:.1f}", "the same, events on "
             f"({med[f'put_{kind}_caller_cpu_on'] / med[f'put_{kind}_caller_cpu_off']:.2f}x): what a save pays"),
            (f"put_{kind}_cpu_off_us", f"{med[f'put_{kind}_cpu_off']:.1f}", "process CPU per block, all threads"),
            (f"put_{kind}_cpu_on_us", f"{med[f'put_{kind}_cpu_on']:.1f}",
             f"events on, until every event is sent ({med[f'put_{kind}_cpu_on'] / med[f'put_{kind}_cpu_off']:.2f}x)"),
        ]
        if not args.null:
            rows.append((f"put_{kind}_events_thread_us", f"{med[f'put_{kind}_events_thread']:.1f}",
                         "of which the store's tierkv-events thread: batching, encoding, sending"))
    if args.null:
        rows.append(("null", "1", "--null: nothing attached to the 'on' stores (events off on both sides)"))
    else:
        n, b, e = verified["small"]
        rows.append(("verified", f"{n:,}", f"subscriber == store index (small-block store; {b:,} batches, {e:,} events)"))
    rows.append(("loadavg", f"{load_before[0]:.2f}", f"1-minute load average before; {load_after[0]:.2f} after "
                 f"({os.cpu_count()} CPUs); every put round read back and compared"))
    print_table(f"KV event publishing overhead, median of {rounds} interleaved rounds", rows)
    finish(args, "events", figures, targets)


if __name__ == "__main__":
    main()
