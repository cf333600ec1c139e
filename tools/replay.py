"""Replay a Mooncake-format trace through tierkv's own index and eviction policies.

Each JSONL line has ``timestamp``, ``input_length``, ``output_length`` and
``hash_ids`` (one id per 512-token block, ids chained so equal ids mean equal
prefixes). Requests run in file order. Tiers are accounting-only: the real
``PrefixIndex`` and policy objects decide, capacities are tracked in blocks,
no bytes move. Per request:

1. block i is a hit only if blocks 0..i are all cached at lookup time (the
   index's longest-prefix match; in multi-tier mode cut by the cost model);
2. all its blocks are inserted into (or promoted to) the top tier and touched,
   and pinned while the request runs;
3. each tier is trimmed back to capacity; a victim demotes one tier down
   unless that tier already holds it (the store's write-back rule); then the
   request's pins are released;
4. the request finishes: the index hears how many tokens it generated
   (``PrefixIndex.finished(entries, output_length)``, what the store hears from
   the engine or the vLLM connector when a request ends; ``hit_density`` learns
   from it, the other policies ignore it; ``--no-output-hint`` leaves it out).

Metrics: ``hit_rate`` = hit blocks / all blocks; ``saved_flops_frac`` = {reference
model: Σ prefill FLOPs of hit blocks / Σ prefill FLOPs of all blocks}, priced by
``tierkv.flops`` from each model's architecture (the grade; no policy parameter
enters it); ``headroom`` = the share of the LRU → oracle hit-rate gap a policy
takes at its capacity (``--policy belady`` is the offline oracle: furthest next
use, leaves only; ``--policy reuse_oracle`` a bound: LRU told whether each block
is used again, within ``--oracle-window`` requests if given); ``saved_cost`` =
the same fraction in the policies' own abstract units, a block at depth d costing
``1 + depth_weight·d`` (the store's
default recompute growth unless ``--depth-weight``). In multi-tier mode
(``--tiers l1=1000,l2=10000,l3=100000``) it also reports hits per tier and the
cost model's estimated prefill time saved. ``accesses_per_cpu_s`` counts block
accesses per second of process CPU time over the replay loops, all policies
together (``accesses_per_cpu_s_by_policy``: each policy's own; the index runs its
per-block loops in C when it can build them, ``--no-native`` for its Python ones:
the same results; the oracle's reading ahead, like loading the trace, is not
timed; the command
line first moves the objects that outlive every replay, the trace and the
imported modules, out of the garbage collector's scans: ``gc.freeze``). Traces of other
shapes come from ``tools/tracegen.py``.

    python tools/replay.py TRACE --capacity 1000,3000,10000,30000 \\
        --policy lru,cost_aware,belady,hit_density --json OUT.json --plot OUT.png
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Sequence
from itertools import repeat
from operator import neg
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tierkv.config import CostConfig  # noqa: E402
from tierkv.cost import CostModel  # noqa: E402
from tierkv.flops import REFERENCE_MODELS  # noqa: E402
from tierkv.index import LOCAL_TIERS, PrefixIndex  # noqa: E402
from tierkv.policy import DEFAULT_POLICY, POLICIES, make_policy  # noqa: E402
from tierkv.policy.base import HeapPolicy  # noqa: E402

BLOCK_TOKENS = 512
TIER_NAMES = ("l1", "l2", "l3")
GRADE = "llama-3.1-8b"  # the reference model the table's ratios use
# The policies' own cost model by default: the store's, when nothing is configured
# or calibrated (its recompute growth per token of context, per 512-token block).
STORE_DEPTH_WEIGHT = CostModel.from_config(CostConfig(), BLOCK_TOKENS, BLOCK_TOKENS).growth * BLOCK_TOKENS
ORACLE = "belady"
# A bound, not an oracle to grade against: LRU told at each use whether the block is used
# again (within --oracle-window requests). It shows how much knowing *whether* buys, apart
# from knowing *when* (which Belady knows too).
REUSE_ORACLE = "reuse_oracle"
OFFLINE = (ORACLE, REUSE_ORACLE)
NEVER = float("inf")
# Reference model for the multi-tier time estimate: a Llama-3-8B-like fp16
# layout (32 layers x 8 KV heads x 128 dims x K,V x 2 bytes = 128 KiB per token).
REF_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


@dataclass
class ReplayResult:
    policy: str
    capacity: int
    hit_rate: float
    saved_flops_frac: dict[str, float]
    saved_cost: float
    accesses: int
    seconds: float
    cpu_seconds: float
    headroom: float | None = None
    tiers: dict[str, int] = field(default_factory=dict)
    hits_per_tier: dict[str, int] = field(default_factory=dict)
    est_saved_prefill_s: float | None = None
    est_total_prefill_s: float | None = None
    evictions: dict[str, int] = field(default_factory=dict)


def load_outputs(path: str | Path) -> list[int]:
    """Each request's ``output_length`` (generated tokens), in file order; 0 where a line has none."""
    with open(path) as fh:
        return [max(0, int(json.loads(line).get("output_length") or 0)) for line in fh if line.strip()]


def load_trace(path: str | Path) -> list[list[bytes]]:
    """The trace's requests as chains of block keys, one 8-byte key per block.

    Keys are chained like tierkv's own hashes: a block's key names its whole
    prefix (its id and its parent's key), so equal keys mean equal prefixes even
    in a trace whose ids name block contents only. For Mooncake traces, whose ids
    are already chained, this changes nothing.
    """
    requests = []
    chained: dict[tuple[int, int], bytes] = {}
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ids = [int(i) for i in json.loads(line)["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected a JSON object with 'hash_ids' ({exc})") from None
            keys, parent = [], -1
            for block_id in ids:
                key = chained.get((parent, block_id))
                if key is None:
                    key = chained[(parent, block_id)] = len(chained).to_bytes(8, "little")
                keys.append(key)
                parent = int.from_bytes(key, "little")
            requests.append(keys)
    return requests


class BeladyPolicy(HeapPolicy):
    """Offline oracle: evicts the evictable leaf whose next use lies furthest in the future.

    Replay-only (it reads the future): ``ranks`` maps a block key to minus the
    index of the next request that uses it (its priority), and the replay updates
    it as each request runs, before any of that request's blocks is listed again.
    Leaf-only like every policy here (a block's next use is never later than its
    children's, so the cache stays prefix-closed at no loss to the rule).
    """

    name = ORACLE

    def __init__(self, tier: int, ranks: dict[bytes, float], **_context) -> None:
        super().__init__(tier)
        self.ranks = ranks
        self.priority_by_key = (ranks, -NEVER)  # what priority() computes, for the index's C loops

    def priority(self, entry):
        return self.ranks.get(entry.key, -NEVER)


def next_uses(requests: list[list[bytes]]) -> list[list[float]]:
    """For each request and block: the index of the next request using that block (inf: none)."""
    seen: dict[bytes, float] = {}
    out: list[list[float]] = [[] for _ in requests]
    get = seen.get
    for i in range(len(requests) - 1, -1, -1):  # per block in C: map and update over the request's keys
        keys = requests[i]
        out[i] = list(map(get, keys, repeat(NEVER)))
        seen.update(zip(keys, repeat(i)))
    return out


def reuse_ranks(requests: list[list[bytes]], window: float | None = None) -> list[list[float]]:
    """The reuse oracle's priorities per request and block: the request's index, plus the
    request count if the block is used again (within ``window`` requests; None: at all).

    Lower is evicted first: blocks not used again go first, LRU among each kind.
    """
    n, limit = float(len(requests)), NEVER if window is None else window
    return [[i + n if later != NEVER and later - i <= limit else float(i) for later in nexts]
            for i, nexts in enumerate(next_uses(requests))]


class Replayer:
    """The store's eviction decisions over accounting-only tiers (capacities in blocks)."""

    def __init__(self, policy: str, capacities: Sequence[int], cost: CostModel, half_life: float,
                 native: bool | None = None, **options) -> None:
        self.capacities = list(capacities) + [0] * (len(LOCAL_TIERS) - len(capacities))
        present = [t for t in LOCAL_TIERS if self.capacities[t] > 0]
        self.lower = {t: next((u for u in present if u > t), None) for t in present}
        self.future: dict[bytes, float] | None = None
        self.ahead: list[list[float]] | None = None  # the oracle's priorities per request and block
        self.policy = policy
        self.oracle_window: float | None = options.pop("oracle_window", None)
        if policy in OFFLINE:
            self.future = {}
            policies = [BeladyPolicy(t, self.future) if t in self.lower else None for t in LOCAL_TIERS]
        else:
            policies = [make_policy(policy, t, cost=cost, lower=self.lower[t], half_life=half_life, **options)
                        if t in self.lower else None for t in LOCAL_TIERS]
        self.index = PrefixIndex(policies, half_life, native=native)
        self.cost = cost
        self.evictions = [0, 0, 0]

    def _evict(self, tier: int) -> bool:
        index = self.index
        entry = index.policies[tier].pop()  # index.victim(tier), without the extra call
        if entry is None:
            return False
        lower = self.lower[tier]
        if lower is not None and not entry.mask >> lower & 1:
            self._make_room(lower)
            index.add(entry.key, entry.parent, entry.depth, lower)
        index.drop(entry.key, tier)
        self.evictions[tier] += 1
        return True

    def _make_room(self, tier: int) -> None:
        counts, cap = self.index.counts, self.capacities[tier]
        while counts[tier] >= cap and self._evict(tier):
            pass

    def run(self, requests: list[list[bytes]], multi: bool,
            outputs: Sequence[int] | None = None) -> tuple[list[int], list[int], float]:
        """Replay; returns (hit blocks per tier, hit prefix length per request, cost model's saved µs).

        ``outputs``: each request's generated tokens, told to the index when it
        finishes (None: never told). Only this loop is timed. The saved µs are
        added up in multi-tier mode only.
        """
        if self.future is not None:
            return self._run_oracle(requests, multi)
        index, cost = self.index, self.cost
        finished = index.finished if outputs is not None else None
        match, use, save_chain, unpin = index.match_entries, index.use, index.save_chain, index.unpin
        top = LOCAL_TIERS[0]
        cap_top = self.capacities[top]
        counts = index.counts
        evict = index.evict
        hits = [0, 0, 0]
        hit_lengths: list[int] = []
        record = hit_lengths.append
        saved_us = 0.0
        evicted = 0
        for keys, out in zip(requests, outputs if outputs is not None else repeat(0)):
            # As the store does: the lookup pins and touches the blocks it found,
            # then the request's blocks are saved into (or promoted to) the top tier, pinned.
            entries = match(keys)
            if multi:
                tiers = [e.best for e in entries]
                del entries[cost.cut(tiers):]
                tiers = tiers[: len(entries)]
                saved_us += cost.saved_us(tiers)
                for t in tiers:
                    hits[t] += 1
            else:
                hits[top] += len(entries)
            record(len(entries))
            use(entries, True)
            # One tier evicts leaves only, so nothing past the first miss is cached there:
            # start at the miss. Across tiers a matched block may still need promoting.
            entries += save_chain(keys, 0 if multi else len(entries), top)
            if multi:
                while counts[top] > cap_top and self._evict(top):
                    pass
            elif counts[top] > cap_top:  # nothing to demote to
                evicted += len(evict(top, counts[top] - cap_top))
            unpin(entries)
            while counts[top] > cap_top and self._evict(top):  # a request larger than the tier
                pass
            if finished is not None:
                finished(entries, out)
        self.evictions[top] += evicted
        return hits, hit_lengths, saved_us

    def read_ahead(self, requests: list[list[bytes]]) -> list[list[float]]:
        """The oracle's knowledge of the trace, per request and block (``ahead``): minus each
        block's next use (Belady), or ``reuse_ranks`` (the reuse oracle)."""
        if self.policy == REUSE_ORACLE:
            self.ahead = reuse_ranks(requests, self.oracle_window)
        else:
            self.ahead = [list(map(neg, later)) for later in next_uses(requests)]
        return self.ahead

    def _run_oracle(self, requests: list[list[bytes]], multi: bool) -> tuple[list[int], list[int], float]:
        """``run`` with the oracle: the same steps, each block's next use set as its request starts."""
        future, index, cost = self.future, self.index, self.cost
        get, top, cap = index._entries.get, LOCAL_TIERS[0], self.capacities[0]
        match, use, save_chain, unpin, evict = index.match_entries, index.use, index.save_chain, index.unpin, index.evict
        counts = index.counts
        hits = [0, 0, 0]
        hit_lengths: list[int] = []
        saved_us = 0.0
        evicted = 0
        ahead = self.ahead if self.ahead is not None else self.read_ahead(requests)
        for keys, ranks in zip(requests, ahead):
            future.update(zip(keys, ranks))  # each block's priority: minus its next use
            entries = match(keys)
            if multi:
                tiers = [e.best for e in entries]
                del entries[cost.cut(tiers):]
                tiers = tiers[: len(entries)]
                saved_us += cost.saved_us(tiers)
                for t in tiers:
                    hits[t] += 1
            else:
                hits[top] += len(entries)
            hit_lengths.append(len(entries))
            use(entries, True)
            if multi:  # blocks cached past the cut stay listed: re-rank them by their new next use
                for key in keys[len(entries):]:
                    entry = get(key)
                    if entry is not None and entry.ref_count == 0:
                        for t, policy in enumerate(index.policies):
                            if entry.handles[t] is not None:
                                policy.touch(entry)
            entries += save_chain(keys, 0 if multi else len(entries), top)
            if multi:
                while counts[top] > cap and self._evict(top):
                    pass
            elif counts[top] > cap:
                evicted += len(evict(top, counts[top] - cap))
            unpin(entries)
            while counts[top] > cap and self._evict(top):
                pass
        self.evictions[top] += evicted
        return hits, hit_lengths, saved_us


def replay(requests: list[list[bytes]], policy: str, capacities: Sequence[int],
           depth_weight: float | None = None,
           half_life: float = 2000.0, cost: CostModel | None = None, native: bool | None = None,
           outputs: Sequence[int] | None = None, **options) -> ReplayResult:
    """Replay ``requests`` with ``policy`` over tiers of ``capacities`` blocks (L1, L2, L3).

    ``options`` go to the policy (e.g. ``reuse_exponent`` for cost_aware; ``oracle_window``
    for the reuse oracle). ``outputs``: each request's generated tokens, told to the index
    as the request finishes (None: never). ``native``
    goes to the index: False runs its pure-Python loops (the same decisions, slower).
    """
    if depth_weight is None:
        depth_weight = STORE_DEPTH_WEIGHT
    multi = len([c for c in capacities if c > 0]) > 1
    units = CostModel.units(depth_weight, BLOCK_TOKENS)
    model = cost if cost is not None else units
    accesses = sum(len(r) for r in requests)
    sim = Replayer(policy, capacities, model, half_life, native, **options)
    if sim.future is not None:  # the oracle reads the trace ahead before it runs, as the trace itself is loaded
        sim.read_ahead(requests)
    # The previous replay's index is garbage by now (a heap policy's entries form cycles with
    # their heap items): collect it here, not inside this replay's timed loop.
    gc.collect()
    start, cpu_start = time.perf_counter(), time.process_time()
    hits, hit_lengths, saved_us = sim.run(requests, multi, outputs)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    names = TIER_NAMES[: len(capacities)]
    lengths = [len(r) for r in requests]
    result = ReplayResult(
        policy=policy, capacity=int(capacities[0]), hit_rate=sum(hits) / max(accesses, 1),
        saved_flops_frac=saved_flops_frac(lengths, hit_lengths),
        saved_cost=_saved_fraction(lengths, hit_lengths, lambda d: 1.0 + depth_weight * d),
        accesses=accesses, seconds=seconds, cpu_seconds=cpu_seconds,
        tiers={n: int(c) for n, c in zip(names, capacities)},
        evictions={n: sim.evictions[t] for t, n in enumerate(names)},
    )
    if multi:
        result.hits_per_tier = {n: hits[t] for t, n in enumerate(names)}
        result.est_saved_prefill_s = saved_us / 1e6
        result.est_total_prefill_s = sum(model.recompute_block_us(d) for r in requests for d in range(len(r))) / 1e6
    return result


def _saved_fraction(lengths: Sequence[int], hit_lengths: Sequence[int], block_cost) -> float:
    """Σ cost of the hit blocks / Σ cost of all blocks, a block at depth d costing ``block_cost(d)``."""
    prefix = [0.0]
    for d in range(max(lengths, default=0)):
        prefix.append(prefix[-1] + block_cost(d))
    total = sum(prefix[n] for n in lengths)
    return sum(prefix[h] for h in hit_lengths) / total if total > 0 else 0.0


def saved_flops_frac(lengths: Sequence[int], hit_lengths: Sequence[int]) -> dict[str, float]:
    """Per reference model: the fraction of all prefill FLOPs that the hits saved.

    ``lengths[i]`` is request i's block count, ``hit_lengths[i]`` its hit prefix
    (blocks); each block is ``BLOCK_TOKENS`` tokens priced by ``tierkv.flops``.
    """
    return {name: _saved_fraction(lengths, hit_lengths, lambda d, m=m: m.block_flops(d, BLOCK_TOKENS))
            for name, m in REFERENCE_MODELS.items()}


def add_headroom(results: list[ReplayResult]) -> None:
    """Set each single-tier result's ``headroom``: its share of the LRU → oracle gap in hit rate.

    0 is LRU, 1 the oracle; needs both at the same capacity in ``results`` (else None).
    """
    single = [r for r in results if len(r.tiers) == 1]
    lru = {r.capacity: r.hit_rate for r in single if r.policy == "lru"}
    oracle = {r.capacity: r.hit_rate for r in single if r.policy == ORACLE}
    for r in single:
        low, high = lru.get(r.capacity), oracle.get(r.capacity)
        if low is not None and high is not None and high > low:
            r.headroom = (r.hit_rate - low) / (high - low)


def reference_cost(depth_weight: float, recompute_us: float, gbps: Sequence[float]) -> CostModel:
    """µs costs for the multi-tier estimate: the reference layout's bytes over tier bandwidths."""
    load = (0.0, *(REF_BYTES_PER_TOKEN / (g * 1e3) for g in gbps), 0.0)
    return CostModel(load[:4], recompute_us, depth_weight / BLOCK_TOKENS, BLOCK_TOKENS,
                     REF_BYTES_PER_TOKEN * BLOCK_TOKENS)


# -- command line ---------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block counts, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected block counts >= 1, got {text!r}")
    return out


def _tiers(text: str) -> list[int]:
    caps = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in TIER_NAMES or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected tiers like l1=1000,l2=10000,l3=100000, got {text!r}")
        caps[name.strip()] = int(value)
    if "l1" not in caps:
        raise argparse.ArgumentTypeError(f"--tiers needs l1, got {text!r}")
    return [caps.get(n, 0) for n in TIER_NAMES]


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    allowed = sorted([*POLICIES, *OFFLINE])
    bad = [p for p in names if p not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected policies from {allowed}, got {text!r}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Replay a Mooncake JSONL trace through tierkv's index and policies.")
    p.add_argument("trace", help="JSONL trace (timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--capacity", type=_ints, default=None, help="single-tier capacities in blocks, e.g. 1000,3000")
    p.add_argument("--tiers", type=_tiers, default=None, help="multi-tier capacities, e.g. l1=1000,l2=10000,l3=100000")
    p.add_argument("--policy", type=_policies, default=["lru", "cost_aware", ORACLE, DEFAULT_POLICY],
                   help=f"comma-separated policies (default lru,cost_aware,{ORACLE},{DEFAULT_POLICY})")
    p.add_argument("--depth-weight", type=float, default=STORE_DEPTH_WEIGHT,
                   help="the policies' cost model: a block at depth d costs 1 + W*d "
                        f"(default {STORE_DEPTH_WEIGHT:.4g}, the store's default recompute growth)")
    p.add_argument("--half-life", type=float, default=2000.0, help="reuse decay half-life in lookups")
    p.add_argument("--reuse-exponent", type=float, default=None,
                   help="cost_aware: power-law decay of the reuse hazard with age (default: the policy's)")
    p.add_argument("--ghost-factor", type=int, default=None,
                   help="hit_density: ghosts kept per block of a tier (default: the most, 64; the store "
                        "sets it from policy.metadata_share and the block size)")
    p.add_argument("--oracle-window", type=float, default=None,
                   help=f"{REUSE_ORACLE}: count a block as used again only within this many requests (default: ever)")
    p.add_argument("--recompute-us", type=float, default=100.0, help="multi-tier: prefill µs/token at depth 0")
    p.add_argument("--gbps", default="5,1", help="multi-tier: L2,L3 load bandwidth in GB/s (reference layout)")
    p.add_argument("--no-output-hint", dest="output_hint", action="store_false",
                   help="do not tell the index each request's output length as it finishes (the store's "
                        "behaviour when no engine or connector reports it)")
    p.add_argument("--no-native", dest="native", action="store_false",
                   help="run the index's pure-Python loops instead of its C ones (same results; for A/B timing)")
    p.add_argument("--json", dest="json_out", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="draw hit rate and saved FLOPs against capacity (PNG)")
    args = p.parse_args(argv)
    if args.capacity is None and args.tiers is None:
        args.capacity = [1000, 3000, 10000, 30000]
    if args.depth_weight < 0 or args.half_life <= 0:
        p.error("--depth-weight must be >= 0 and --half-life > 0")
    return args


def per_policy_rates(results: list[ReplayResult]) -> dict[str, float]:
    """Block accesses per CPU second of each policy's runs (all its capacities and tier sets together)."""
    out = {}
    for policy in dict.fromkeys(r.policy for r in results):
        rows = [r for r in results if r.policy == policy]
        cpu = sum(r.cpu_seconds for r in rows)
        out[policy] = sum(r.accesses for r in rows) / cpu if cpu > 0 else 0.0
    return out


def index_native_loaded() -> bool:
    """Whether the index's C loops (``tierkv.index_native``) could be built and loaded here."""
    from tierkv import index_native

    return index_native.load() is not None


def _print_table(results: list[ReplayResult], rate: float, cpu_rate: float,
                 by_policy: dict[str, float] | None = None) -> None:
    single = [r for r in results if len([c for c in r.tiers.values() if c]) == 1]
    multi = [r for r in results if r not in single]
    if single:
        print(f"{'policy':<12}{'capacity':>10}{'hit rate':>10}{'headroom':>10}{'FLOPs 8B':>10}{'FLOPs 70B':>10}"
              f"{'vs lru':>8}{'saved cost':>12}")
        lru = {r.capacity: r.saved_flops_frac[GRADE] for r in single if r.policy == "lru"}
        for r in single:
            f8 = r.saved_flops_frac[GRADE]
            ratio = f"{f8 / lru[r.capacity]:.2f}x" if lru.get(r.capacity) else "-"
            room = "-" if r.headroom is None else f"{r.headroom:.1%}"
            print(f"{r.policy:<12}{r.capacity:>10}{r.hit_rate:>10.1%}{room:>10}{f8:>10.1%}"
                  f"{r.saved_flops_frac['llama-3.1-70b']:>10.1%}{ratio:>8}{r.saved_cost:>12.1%}")
    for r in multi:
        tiers = ",".join(f"{k}={v}" for k, v in r.tiers.items())
        per = " ".join(f"{k}={v}" for k, v in r.hits_per_tier.items())
        print(f"{r.policy:<12} [{tiers}] hit {r.hit_rate:.1%} saved cost {r.saved_cost:.1%} hits {per} "
              f"est. prefill saved {r.est_saved_prefill_s:.1f} s of {r.est_total_prefill_s:.1f} s")
    print(f"accesses/s: {rate:,.0f} wall ({cpu_rate:,.0f} per CPU second of the process)")
    if by_policy:
        print("per CPU second, by policy: " + ", ".join(f"{p} {v:,.0f}" for p, v in by_policy.items()))


def plot(results: list[ReplayResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r.policy for r in results):
        rows = sorted((r for r in results if r.policy == policy), key=lambda r: r.capacity)
        caps = [r.capacity for r in rows]
        axes[0].plot(caps, [100 * r.hit_rate for r in rows], marker="o", label=policy)
        axes[1].plot(caps, [100 * r.saved_flops_frac[GRADE] for r in rows], marker="o", label=policy)
    for ax, name in zip(axes, ("hit rate (%)", f"saved prefill FLOPs, {GRADE} (%)")):
        ax.set_xscale("log")
        ax.set_xlabel("capacity (blocks of 512 tokens)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    requests = load_trace(args.trace)
    # What exists now (the interpreter's modules, torch among them via the tierkv package,
    # and the trace) outlives every replay: keep it out of the collector's full scans, which
    # otherwise rescan ~170k objects the replay never changes. The index's own objects are
    # still collected as in a store.
    gc.freeze()
    options = {} if args.reuse_exponent is None else {"reuse_exponent": args.reuse_exponent}
    if args.ghost_factor is not None:
        options["ghost_factor"] = args.ghost_factor
    options["native"] = None if args.native else False
    options["outputs"] = load_outputs(args.trace) if args.output_hint else None
    if args.oracle_window is not None:
        options["oracle_window"] = args.oracle_window
    results: list[ReplayResult] = []
    for policy in args.policy:
        for cap in args.capacity or []:
            results.append(replay(requests, policy, [cap], args.depth_weight, args.half_life, **options))
    if args.tiers is not None:
        gbps = [float(g) for g in args.gbps.split(",")]
        model = reference_cost(args.depth_weight, args.recompute_us, gbps)
        for policy in args.policy:
            results.append(replay(requests, policy, args.tiers, args.depth_weight, args.half_life, model, **options))
    add_headroom(results)
    accesses = sum(r.accesses for r in results)
    seconds = sum(r.seconds for r in results)
    cpu_seconds = sum(r.cpu_seconds for r in results)
    rate = accesses / seconds if seconds > 0 else 0.0
    cpu_rate = accesses / cpu_seconds if cpu_seconds > 0 else 0.0
    by_policy = per_policy_rates(results)
    _print_table(results, rate, cpu_rate, by_policy)
    if args.json_out:
        out = {"trace": str(args.trace), "depth_weight": args.depth_weight, "half_life": args.half_life,
               "native": index_native_loaded() if args.native else False, "output_hint": args.output_hint,
               "accesses_per_s": rate, "accesses_per_cpu_s": cpu_rate,
               "accesses_per_cpu_s_by_policy": by_policy,
               "results": [asdict(r) for r in results]}
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    if args.plot:
        single = [r for r in results if len(r.tiers) == 1]
        plot(single, args.plot, f"{Path(args.trace).name}: block size {BLOCK_TOKENS} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
