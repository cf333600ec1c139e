"""Replay a Mooncake-format trace over N simulated tierkv nodes behind each router (issue 16).

Each node has the real ``PrefixIndex`` and eviction policy over L1/L2/L3
capacities counted in blocks (accounting only: no bytes move), the store's
rules for a request (longest-prefix match cut by the cost model, then every
block saved to L1 and pinned while it runs, victims demoted one tier down)
and one prefill queue: a request starts when the node has finished the ones
before it. Costs are physics: per-tier load from the reference model's KV
bytes per token over each tier's bandwidth to HBM, recompute from the
model's prefill FLOPs at a given throughput. A request's TTFT is its wait in
the queue plus its prefill (load the matched blocks, recompute the rest). As
a request ends its node's index hears how many tokens it generated (the
trace's ``output_length``; ``PrefixIndex.finished``, what a node's store hears
from its engine), unless ``--no-output-hint``.

The routers are ``tierkv.route``'s own: each request, every node offers a
``Candidate`` (its match per tier, queue depth and delay, cost model) and the
router picks, exactly as ``tierkv route`` does with the global index.

    python tools/fleet.py TRACE --nodes 4 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.cost import CostModel  # noqa: E402
from tierkv.flops import REFERENCE_MODELS, reference_model  # noqa: E402
from tierkv.index import LOCAL_TIERS, PrefixIndex  # noqa: E402
from tierkv.policy import DEFAULT_POLICY, POLICIES, make_policy  # noqa: E402
from tierkv.route import ROUTERS, Candidate, Prompt, make_router  # noqa: E402
from tools.replay import load_trace  # noqa: E402

BLOCK_TOKENS = 512
TIER_NAMES = ("l1", "l2", "l3")
# Per-node capacities in 512-token blocks of Llama-3.1-8B KV (64 MiB each):
# ~30 GiB of HBM left for KV, 128 GiB of pinned DRAM, 512 GiB of NVMe.
DEFAULT_TIERS = (480, 2048, 8192)
# Bandwidth into HBM, GB/s: L2 pinned DRAM over PCIe 5 x16, L3 one NVMe drive, L4 a 100 Gb/s RDMA pool.
DEFAULT_GBPS = (25.0, 6.0, 12.0)
KV_DTYPE_BYTES = 2  # bf16
DEFAULT_TFLOPS = 400.0  # sustained bf16 prefill of an H100-class GPU (~40 % of dense peak)


def reference_cost(model: str, tflops: float, gbps: Sequence[float]) -> CostModel:
    """µs per token: loads are KV bytes over bandwidth, recompute is prefill FLOPs over throughput."""
    arch = reference_model(model)
    per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * KV_DTYPE_BYTES  # K and V, every layer
    load = (0.0, *(per_token / (g * 1e3) for g in gbps))
    depth0 = arch.token_flops(0)
    recompute = depth0 / (tflops * 1e6)
    growth = arch.attention_flops_per_position / depth0
    return CostModel(load, recompute, growth, BLOCK_TOKENS, per_token * BLOCK_TOKENS)


@dataclass(frozen=True)
class Request:
    arrival_us: float
    n_tokens: int
    keys: list[bytes]
    output_tokens: int | None = None  # generated tokens, told to the node's index as it ends (None: not told)


def load_requests(path: str | Path) -> list[Request]:
    """The trace's requests: arrival (its ``timestamp``, ms), prompt length, chained block keys and
    output length (``output_length``; None where a line has none)."""
    chains = load_trace(path)
    out = []
    with open(path) as fh:
        lines = [line for line in fh if line.strip()]
    for n, (line, keys) in enumerate(zip(lines, chains), 1):
        row = json.loads(line)
        try:
            arrival, n_tokens = float(row["timestamp"]) * 1e3, int(row["input_length"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: expected 'timestamp' and 'input_length' ({exc})") from None
        output = row.get("output_length")
        out.append(Request(arrival, max(n_tokens, 1), keys, None if output is None else max(int(output), 0)))
    return out


class SimNode:
    """One node: the real index and policies over accounting-only tiers, and a FIFO prefill queue."""

    def __init__(self, name: str, capacities: Sequence[int], policy: str, cost: CostModel,
                 half_life: float) -> None:
        self.name = name
        self.capacities = list(capacities)
        present = [t for t in LOCAL_TIERS if self.capacities[t] > 0]
        self.lower = {t: next((u for u in present if u > t), None) for t in present}
        policies = [make_policy(policy, t, cost=cost, lower=self.lower[t], half_life=half_life)
                    if t in self.lower else None for t in LOCAL_TIERS]
        self.index = PrefixIndex(policies, half_life)
        self.cost = cost
        self.finishes: deque[float] = deque()
        self.free_at = 0.0

    def candidate(self, request: Request) -> Candidate:
        """What this node offers the router for ``request`` at its arrival time. Changes nothing cached."""
        tiers = self.index.match(request.keys)
        matched = [0, 0, 0, 0]
        for t in tiers:
            matched[t] += BLOCK_TOKENS
        over = len(tiers) * BLOCK_TOKENS - request.n_tokens
        if over > 0:  # the last block is partial
            matched[tiers[-1]] -= over
        finishes, now = self.finishes, request.arrival_us
        while finishes and finishes[0] <= now:
            finishes.popleft()
        return Candidate(self.name, tuple(matched), len(finishes), max(self.free_at - now, 0.0), self.cost)

    def serve(self, request: Request) -> tuple[float, int]:
        """Run ``request`` here: (its TTFT in µs, blocks it loaded from cache). Updates index and queue."""
        keys, index, cost = request.keys, self.index, self.cost
        tiers = index.match(keys)
        loaded = tiers[: cost.cut(tiers)]
        load_us, rest_us = cost.estimate_us(loaded, len(keys))
        start = max(self.free_at, request.arrival_us)
        self.free_at = start + load_us + rest_us
        self.finishes.append(self.free_at)
        self._cache(keys, len(loaded))
        if request.output_tokens is not None:
            index.finished([e for e in map(index.get, keys) if e is not None], request.output_tokens)
        return self.free_at - request.arrival_us, len(loaded)

    def _cache(self, keys: list[bytes], hit: int) -> None:
        """As the store does: pin and touch the hits, save every block to L1 pinned, trim, unpin."""
        index, get = self.index, self.index.get
        entries = [get(k) for k in keys[:hit]]
        index.pin(entries)
        index.touch(entries)
        parent = None
        for depth, key in enumerate(keys):
            entry = get(key)
            if entry is None or not entry.mask & 1:
                unpinned = entry is None or entry.ref_count == 0
                entry = index.add(key, parent, depth, 0, pin=unpinned)
                if unpinned:
                    entries.append(entry)
            parent = key
        self._make_room(0)
        index.unpin(entries)
        self._make_room(0)

    def _make_room(self, tier: int, extra: int = 0) -> None:
        counts, cap = self.index.counts, self.capacities[tier]
        while counts[tier] + extra > cap and self._evict(tier):
            pass

    def _evict(self, tier: int) -> bool:
        entry = self.index.victim(tier)
        if entry is None:
            return False
        lower = self.lower[tier]
        if lower is not None and not entry.mask >> lower & 1:
            self._make_room(lower, extra=1)
            self.index.add(entry.key, entry.parent, entry.depth, lower)
        self.index.drop(entry.key, tier)
        return True


@dataclass
class FleetResult:
    router: str
    hit_rate: float
    mean_ttft_ms: float
    p90_ttft_ms: float
    p99_ttft_ms: float
    mean_queue_ms: float
    requests: int
    blocks: int
    per_node: list[int]
    seconds: float


def simulate(requests: Sequence[Request], router_name: str, nodes: int, capacities: Sequence[int],
             policy: str, cost: CostModel, half_life: float = 2000.0, **router_options) -> FleetResult:
    """Route every request in arrival order over fresh nodes; TTFT and hit figures per router."""
    fleet = [SimNode(f"node{i}", capacities, policy, cost, half_life) for i in range(nodes)]
    router = make_router(router_name, **router_options)
    ttfts, queues, per_node = [], [], [0] * nodes
    hits = blocks = 0
    start = time.perf_counter()
    for request in sorted(requests, key=lambda r: r.arrival_us):
        candidates = [node.candidate(request) for node in fleet]
        chosen = router.pick(Prompt(request.n_tokens, request.keys), candidates)
        queues.append(candidates[chosen].queue_us)
        ttft, hit = fleet[chosen].serve(request)
        ttfts.append(ttft)
        hits += hit
        blocks += len(request.keys)
        per_node[chosen] += 1
    seconds = time.perf_counter() - start
    ttfts.sort()

    def pct(p: float) -> float:
        return ttfts[min(int(p * len(ttfts)), len(ttfts) - 1)] / 1e3

    return FleetResult(router_name, hits / max(blocks, 1), sum(ttfts) / len(ttfts) / 1e3, pct(0.9), pct(0.99),
                       sum(queues) / len(queues) / 1e3, len(ttfts), blocks, per_node, seconds)


# -- command line ---------------------------------------------------------------


def _tiers(text: str) -> list[int]:
    caps = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in TIER_NAMES or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected per-node tiers like l1=480,l2=2048,l3=8192, got {text!r}")
        caps[name.strip()] = int(value)
    if not caps.get("l1"):
        raise argparse.ArgumentTypeError(f"--tiers needs l1 >= 1, got {text!r}")
    return [caps.get(n, 0) for n in TIER_NAMES]


def _names(allowed: Sequence[str], what: str):
    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in names if p not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected {what} from {sorted(allowed)}, got {text!r}")
        return names
    return parse


def _gbps(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected three bandwidths > 0 in GB/s (L2,L3,L4), got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Replay a Mooncake trace over N simulated tierkv nodes per router.")
    p.add_argument("trace", help="JSONL trace (timestamp in ms, input_length, output_length, hash_ids)")
    p.add_argument("--nodes", type=int, default=4, help="nodes in the fleet (default 4)")
    p.add_argument("--routers", type=_names(list(ROUTERS), "routers"), default=list(ROUTERS),
                   help="comma-separated routers (default: all)")
    p.add_argument("--tiers", type=_tiers, default=list(DEFAULT_TIERS),
                   help="per-node capacities in blocks (default l1=480,l2=2048,l3=8192)")
    p.add_argument("--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY, help="eviction policy")
    p.add_argument("--model", choices=sorted(REFERENCE_MODELS), default="llama-3.1-8b", help="reference model")
    p.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, help="sustained prefill TFLOP/s per node")
    p.add_argument("--gbps", type=_gbps, default=DEFAULT_GBPS, help="L2,L3,L4 bandwidth into HBM, GB/s")
    p.add_argument("--queue-weight", type=float, default=None, help="tier_weighted: k per queued request")
    p.add_argument("--no-output-hint", dest="output_hint", action="store_false",
                   help="do not tell a node's index each request's output length as it ends")
    p.add_argument("--json", dest="json_out", default=None, help="write results here")
    args = p.parse_args(argv)
    if args.nodes < 1:
        p.error(f"--nodes: expected >= 1, got {args.nodes}")
    if args.tflops <= 0:
        p.error(f"--tflops: expected > 0, got {args.tflops}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    requests = load_requests(args.trace)
    if not args.output_hint:
        requests = [replace(r, output_tokens=None) for r in requests]
    cost = reference_cost(args.model, args.tflops, args.gbps)
    results = []
    for name in args.routers:
        options = {"queue_weight": args.queue_weight} if name == "tier_weighted" and args.queue_weight is not None else {}
        results.append(simulate(requests, name, args.nodes, args.tiers, args.policy, cost, **options))
    rr = next((r.hit_rate for r in results if r.router == "round_robin"), None)
    print(f"{len(requests)} requests, {args.nodes} nodes, tiers/node "
          + ",".join(f"{n}={c}" for n, c in zip(TIER_NAMES, args.tiers))
          + f", {args.model} at {args.tflops:g} TFLOP/s; µs/token: load L2 {cost.load_us[1]:.1f} "
          f"L3 {cost.load_us[2]:.1f}, recompute {cost.recompute_us:.1f} (+{cost.growth:.2e}/token of context)")
    print(f"{'router':<16}{'hit rate':>9}{'vs rr':>7}{'mean TTFT':>11}{'p90 TTFT':>10}{'p99 TTFT':>10}"
          f"{'mean queue':>12}  requests per node")
    for r in results:
        ratio = f"{r.hit_rate / rr:.2f}x" if rr else "-"
        print(f"{r.router:<16}{r.hit_rate:>9.1%}{ratio:>7}{r.mean_ttft_ms:>9.0f}ms{r.p90_ttft_ms:>8.0f}ms"
              f"{r.p99_ttft_ms:>8.0f}ms{r.mean_queue_ms:>10.0f}ms  {r.per_node}")
    if args.json_out:
        out = {"trace": str(args.trace), "nodes": args.nodes, "model": args.model, "tflops": args.tflops,
               "gbps": list(args.gbps), "tiers": dict(zip(TIER_NAMES, args.tiers)), "policy": args.policy,
               "output_hint": args.output_hint,
               "cost_us_per_token": {"load": list(cost.load_us), "recompute": cost.recompute_us,
                                     "growth": cost.growth},
               "results": [asdict(r) for r in results]}
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
