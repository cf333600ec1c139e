"""What publishing KV events costs the store: lookup time and L2 put throughput, events off vs on, one run.

Two identical default-config stores side by side; on one a ``KVEventPublisher`` is attached
(``store.add_tier_listener``) and a ``KVEventSubscriber`` in another process follows it over real
ZMQ sockets, as a router would.

lookup_off_us / lookup_on_us  ``store.release(store.lookup(tokens))`` of a 1000-token prompt (16-token
                              blocks, all L2 hits) over an index of 200,000 entries (bench/lookup.py's
                              store and call)
put_off_bps / put_on_bps      ``store.put_blocks`` of 256 new 16 KiB blocks into a full L2 (each put evicts
                              one block: two tier events per block), blocks per second by wall clock
put_cpu_off_us / _on_us       process CPU (every thread) per put block; on the events-on store the clock
                              runs until every event of the round has been sent (the events' whole cost,
                              which the caller does not wait for)
Rounds alternate which store goes first; figures are medians over rounds. At the end the subscriber's
inventory must equal the store's index, key by key and tier by tier (a digest of both): what the
events said is true.
Targets (issue 16): lookup_on / lookup_off <= 1.02; put_off / put_on <= 1.02.
"""

from __future__ import annotations

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
from lookup import LAYOUT, make_store, timed  # noqa: E402

from tierkv.config import L2Config, StoreConfig  # noqa: E402
from tierkv.index import Tier  # noqa: E402
from tierkv.kvevents import KVEventPublisher, PublisherConfig  # noqa: E402
from tierkv.store import TierKVStore  # noqa: E402

PROMPT, ENTRIES, PUT_BLOCKS, L2_BLOCKS = 1000, 200_000, 256, 2048


def put_store() -> TierKVStore:
    """L2 only (no L3): every put lands in L2 and, once it is full, evicts one block."""
    cfg = StoreConfig(l2=L2Config(capacity=L2_BLOCKS * LAYOUT.block_bytes, pin=False), l3_enabled=False)
    return TierKVStore(cfg, LAYOUT, l1_blocks=16)


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
        self.pub = KVEventPublisher(PublisherConfig(block_size=LAYOUT.block_size))
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


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rounds = 11 if args.quick else 41
    torch.set_num_threads(1)
    rng = random.Random(1)
    tokens = [rng.randrange(128_000) for _ in range(PROMPT)]
    block = torch.full(LAYOUT.block_shape, 1.0, dtype=LAYOUT.torch_dtype)
    work = tempfile.mkdtemp(prefix="tierkv-events-")
    look = {"off": make_store("xxh3_128", os.path.join(work, "off"), tokens, ENTRIES),
            "on": make_store("xxh3_128", os.path.join(work, "on"), tokens, ENTRIES)}
    puts = {"off": put_store(), "on": put_store()}
    followers = [Follower(look["on"]), Follower(puts["on"])]
    counter = iter(range(10**9))

    def put_round(name: str) -> tuple[float, float]:
        """(blocks/s as the caller sees it, process CPU µs per block including sending its events)."""
        store = puts[name]
        keys = [next(counter).to_bytes(16, "little") for _ in range(PUT_BLOCKS)]
        c0, t0 = time.process_time(), time.perf_counter()
        ok = store.put_blocks(keys, [block] * PUT_BLOCKS)
        seconds = time.perf_counter() - t0
        if name == "on":  # outside the wall clock, inside the CPU clock: the events' whole cost
            store.flush()
            followers[1].pub.flush()
        cpu = time.process_time() - c0
        if not all(ok):
            raise SystemExit(f"put_blocks refused blocks on the events-{name} store")
        return PUT_BLOCKS / seconds, cpu / PUT_BLOCKS * 1e6

    res: dict[str, list[float]] = {k: [] for k in ("lookup_off", "lookup_on", "put_off", "put_on", "put_cpu_off",
                                                    "put_cpu_on")}
    try:
        for name in ("off", "on"):
            for _ in range(L2_BLOCKS // PUT_BLOCKS + 1):  # fill L2: from here on every put evicts
                put_round(name)
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for name in order:
                store = look[name]
                res[f"lookup_{name}"].append(timed(lambda store=store: store.release(store.lookup(tokens)), 3))
            for name in order:
                bps, cpu_us = put_round(name)
                res[f"put_{name}"].append(bps)
                res[f"put_cpu_{name}"].append(cpu_us)
        verified = [f.verify() for f in followers]
        m = look["on"].lookup(tokens)
        if m.num_blocks != PROMPT // LAYOUT.block_size or set(m.tiers) != {Tier.L2}:
            raise SystemExit(f"lookup store: expected every block an L2 hit, got {m.counts}")
        look["on"].release(m)
    finally:
        for f in followers:
            f.close()
        for store in (*look.values(), *puts.values()):
            store.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    targets = [
        target("lookup_on_over_off", med["lookup_on"] / med["lookup_off"], "<=", 1.02, "lookup, events off"),
        target("put_off_over_on", med["put_off"] / med["put_on"], "<=", 1.02, "L2 put throughput, events off"),
    ]
    t = {x["metric"]: x for x in targets}
    figures = {"rounds": rounds, "prompt_tokens": PROMPT, "index_entries": ENTRIES, "put_blocks": PUT_BLOCKS,
               "block_bytes": LAYOUT.block_bytes, "lookup_off_us": round(med["lookup_off"], 2),
               "lookup_on_us": round(med["lookup_on"], 2), "put_off_bps": round(med["put_off"]),
               "put_on_bps": round(med["put_on"]), "put_cpu_off_us_per_block": round(med["put_cpu_off"], 2),
               "put_cpu_on_us_per_block": round(med["put_cpu_on"], 2),
               "verified": [{"inventory": n, "batches": b, "events": e} for n, b, e in verified],
               **{x["metric"]: x["value"] for x in targets}}
    print_table(f"KV event publishing overhead, median of {rounds} interleaved rounds", [
        ("lookup_off_us", f"{med['lookup_off']:.2f}", f"{PROMPT}-token prompt, all L2 hits, {ENTRIES:,} entries"),
        ("lookup_on_us", f"{med['lookup_on']:.2f}", f"events on; on/off {verdict(t['lookup_on_over_off'])}"),
        ("put_off_bps", f"{med['put_off']:,.0f}", f"put_blocks into a full L2, {LAYOUT.block_bytes // 1024} KiB blocks"),
        ("put_on_bps", f"{med['put_on']:,.0f}", f"events on; off/on {verdict(t['put_off_over_on'])}"),
        ("put_cpu_off_us", f"{med['put_cpu_off']:.1f}", "process CPU per put block, all threads"),
        ("put_cpu_on_us", f"{med['put_cpu_on']:.1f}", "the same with events on, until every event is sent "
                                                      f"({med['put_cpu_on'] / med['put_cpu_off']:.2f}x)"),
        ("verified", f"{verified[1][0]:,}", f"subscriber == store index; {verified[1][1]:,} batches, "
                                            f"{verified[1][2]:,} events"),
    ])
    finish(args, "events", figures, targets)


if __name__ == "__main__":
    main()
