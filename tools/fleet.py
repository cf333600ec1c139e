"""Replay a Mooncake-format trace over N simulated tierkv nodes behind each router (issues 16, 27).

Each node (tools/fleet_node.py) runs tierkv's real ``PrefixIndex`` and eviction
policy over L1/L2/L3 capacities counted in blocks, the store's rules for a
request, and an engine model (tools/engine_model.py): continuous batching with
a chunked-prefill token budget per step, decode steps interleaved, loads of
L2/L3 hits at the tiers' GB/s, each step's time from a fit of the bundled
engine's measured steps. The model's figures come from a JSON file
(``--engine``, default tools/engine_model.json, written by
tools/calibrate_engine.py). A request's TTFT is the time from its arrival to
the end of the step that computes its last prompt token, as that engine model
schedules it; the routers' own cost formula plays no part in it.

The routers are ``tierkv.route``'s own, fed as ``tierkv route`` feeds them:
each node's KV event batches (``--event-delay-ms`` after the step that made
them) kept in an ``Inventory``, the requests this router sent there and that
have not finished (queue depth), and the node's reported per-token cost
figures; the candidates come from ``tierkv.route.nodes.Node.candidate``, so
``cost_model`` sees ``queue_us = depth × recompute estimate``, never when a
node will be free.

Trace scaling: one trace block (a ``hash_id``, 512 tokens) stands for
``--block-tokens`` tokens of the model (default 16: the trace's ~15k-token
prompts become ~480 tokens, inside SmolLM2's context), arrivals are stretched
by ``--time-scale``, output lengths capped by ``--max-output``.

    python tools/fleet.py TRACE --nodes 4 --time-scale 8 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.policy import DEFAULT_POLICY, POLICIES  # noqa: E402
from tierkv.route import ROUTERS, Prompt, Router, make_router  # noqa: E402
from tierkv.route.ttft import recompute_us  # noqa: E402
from tools.engine_model import EngineParams, Seq  # noqa: E402
from tools.fleet_node import Job, RouteView, SimNode  # noqa: E402
from tools.replay import load_trace  # noqa: E402

TRACE_BLOCK_TOKENS = 512  # tokens per hash_id in a Mooncake trace
TIER_NAMES = ("l1", "l2", "l3")
DEFAULT_ENGINE = Path(__file__).with_name("engine_model.json")
# Per node, in 16-token SmolLM2 fp32 blocks (720 KiB): the engine's default pool (1024 slots), and
# the store's default L2 (1 GiB) and L3 (8 GiB).
DEFAULT_TIERS = (1024, 1456, 11650)
DEFAULT_BLOCK_TOKENS = 16
DEFAULT_EVENT_DELAY_MS = 25.0  # the store's TierEvents window (tierkv.events.WINDOW_S)


@dataclass(frozen=True)
class Request:
    arrival_us: float
    n_tokens: int
    keys: list[bytes]  # the model's full blocks of the prompt
    output_tokens: int = 1  # tokens it generates (the first one included)
    tell_output: bool = True  # the node's index hears ``output_tokens`` as it ends


def scale_keys(trace_keys: Sequence[bytes], per_block: int, n_blocks: int) -> list[bytes]:
    """Model block keys for a prompt: each trace key split into ``per_block`` keys (the trace's key
    names the whole prefix, so the pair names it too), the first ``n_blocks`` of them."""
    out = []
    for key in trace_keys:
        for j in range(per_block):
            if len(out) == n_blocks:
                return out
            out.append(key + j.to_bytes(4, "little"))
    return out


def load_requests(path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS, block_size: int = 16,
                  time_scale: float = 1.0, limit: int | None = None,
                  max_output: int | None = None) -> list[Request]:
    """The trace's requests scaled to the model: ``input_length × block_tokens / 512`` tokens (at
    least 1), arrivals (``timestamp``, ms) × ``time_scale``, output ``output_length`` (at least 1,
    at most ``max_output``; 1 where a line has none). ``limit``: only the first that many lines."""
    if block_tokens < block_size or block_tokens % block_size:
        raise ValueError(f"--block-tokens: expected a multiple of the engine's block size {block_size}, "
                         f"got {block_tokens}")
    chains = load_trace(path)
    with open(path) as fh:
        lines = [line for line in fh if line.strip()]
    out = []
    for n, (line, chain) in enumerate(zip(lines[:limit], chains), 1):
        row = json.loads(line)
        try:
            arrival, length = float(row["timestamp"]) * 1e3, int(row["input_length"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: expected 'timestamp' and 'input_length' ({exc})") from None
        n_tokens = max(math.ceil(length * block_tokens / TRACE_BLOCK_TOKENS), 1)
        output = max(int(row.get("output_length") or 1), 1)
        if max_output is not None:
            output = min(output, max_output)
        keys = scale_keys(chain, block_tokens // block_size, n_tokens // block_size)
        out.append(Request(arrival * time_scale, n_tokens, keys, output))
    return out


@dataclass
class FleetResult:
    router: str
    hit_rate: float  # blocks served from cache / full blocks of every prompt
    mean_ttft_ms: float
    p90_ttft_ms: float
    p99_ttft_ms: float
    mean_wait_ms: float  # arrival to admission into a step, as the engine model ran it
    mean_queue_est_ms: float  # the chosen node's queue_us as the router estimated it
    requests: int
    blocks: int
    per_node: list[int]
    seconds: float  # wall time of the simulation


def simulate(requests: Sequence[Request], router: str | Router, nodes: int, capacities: Sequence[int],
             policy: str, params: EngineParams, half_life: float = 2000.0,
             event_delay_ms: float = DEFAULT_EVENT_DELAY_MS, **router_options) -> FleetResult:
    """Route every request in arrival order over fresh nodes; TTFT (engine model) and hits per router.

    ``router``: a name from ``ROUTERS`` or a ``Router`` (tests pass one that records its inputs).
    """
    fleet = [SimNode(f"node{i}", capacities, policy, params, half_life) for i in range(nodes)]
    views = [RouteView(node, event_delay_ms * 1e3) for node in fleet]
    if isinstance(router, str):
        router = make_router(router, **router_options)
    queues, per_node = [], [0] * nodes
    start = time.perf_counter()
    for request in sorted(requests, key=lambda r: r.arrival_us):
        now = request.arrival_us
        for node, view in zip(fleet, views):
            node.run_until(now)
            view.catch_up(now)
        candidates = [view.candidate(request.keys, request.n_tokens) for view in views]
        chosen = router.pick(Prompt(request.n_tokens, request.keys), candidates)
        queues.append(candidates[chosen].queue_us)
        views[chosen].sent()
        per_node[chosen] += 1
        job = Job(request.keys, request.tell_output)
        fleet[chosen].submit(Seq(now, request.n_tokens, request.output_tokens, job))
    for node in fleet:
        node.run_until(math.inf)
    seconds = time.perf_counter() - start
    done = [seq for node in fleet for seq in node.done]
    ttfts = sorted(seq.ttft_us for seq in done)
    hits = sum(seq.payload.hit_blocks for seq in done)
    blocks = sum(len(seq.payload.keys) for seq in done)

    def pct(p: float) -> float:
        return ttfts[min(int(p * len(ttfts)), len(ttfts) - 1)] / 1e3

    name = getattr(router, "name", type(router).__name__)
    return FleetResult(name, hits / max(blocks, 1), sum(ttfts) / len(ttfts) / 1e3, pct(0.9), pct(0.99),
                       sum(s.admitted_us - s.arrival_us for s in done) / len(done) / 1e3,
                       sum(queues) / len(queues) / 1e3, len(done), blocks, per_node, seconds)


# -- command line ---------------------------------------------------------------


def _tiers(text: str) -> list[int]:
    caps = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in TIER_NAMES or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected per-node tiers like l1=1024,l2=1456,l3=11650, got {text!r}")
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Replay a Mooncake trace over N simulated tierkv nodes per router; "
                                            "TTFT from a calibrated engine model.")
    p.add_argument("trace", help="JSONL trace (timestamp in ms, input_length, output_length, hash_ids)")
    p.add_argument("--nodes", type=int, default=4, help="nodes in the fleet (default 4)")
    p.add_argument("--routers", type=_names(list(ROUTERS), "routers"), default=list(ROUTERS),
                   help="comma-separated routers (default: all)")
    p.add_argument("--engine", default=str(DEFAULT_ENGINE),
                   help="engine model JSON (default tools/engine_model.json: SmolLM2 on the bundled engine)")
    p.add_argument("--tiers", type=_tiers, default=list(DEFAULT_TIERS),
                   help="per-node capacities in the engine's blocks (default l1=1024,l2=1456,l3=11650)")
    p.add_argument("--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY, help="eviction policy")
    p.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
                   help="model tokens one 512-token trace block stands for (a multiple of the engine's block "
                        "size; default 16)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's arrival times (default 1)")
    p.add_argument("--limit", type=int, default=None, help="replay only the trace's first N requests")
    p.add_argument("--max-output", type=int, default=None, help="cap each request's output tokens")
    p.add_argument("--event-delay-ms", type=float, default=DEFAULT_EVENT_DELAY_MS,
                   help="how long a node's KV event batch takes to reach the router (default 25)")
    p.add_argument("--queue-weight", type=float, default=None, help="tier_weighted: k per queued request")
    p.add_argument("--no-output-hint", dest="output_hint", action="store_false",
                   help="do not tell a node's index each request's output length as it ends")
    p.add_argument("--json", dest="json_out", default=None, help="write results here")
    args = p.parse_args(argv)
    for name in ("nodes", "block_tokens", "limit", "max_output"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {value}")
    if not args.time_scale > 0 or not args.event_delay_ms >= 0:
        p.error(f"--time-scale must be > 0 and --event-delay-ms >= 0, got {args.time_scale}, {args.event_delay_ms}")
    return args


def _header(args: argparse.Namespace, params: EngineParams, requests: Sequence[Request]) -> str:
    cost = params.cost_model()
    mean_tokens = sum(r.n_tokens for r in requests) / max(len(requests), 1)
    span_s = (max(r.arrival_us for r in requests) - min(r.arrival_us for r in requests)) / 1e6 if requests else 0.0
    return (f"{len(requests)} requests over {span_s:.0f} s (time x{args.time_scale:g}), {mean_tokens:.0f} prompt "
            f"tokens mean ({args.block_tokens} per trace block), {args.nodes} nodes, tiers/node "
            + ",".join(f"{n}={c}" for n, c in zip(TIER_NAMES, args.tiers))
            + f"\nengine model {Path(args.engine).name}: {params.name}; step_us = {params.step_base_us:.0f} + "
            f"{params.token_us:.1f}·tokens + {params.attention_us:.3g}·Σctx + {params.seq_us:.0f}·seqs, budget "
            f"{params.max_num_batched_tokens} tokens/step; load GB/s L2 {params.load_gbps[0]:g} L3 "
            f"{params.load_gbps[1]:g}\nrouters see events ({args.event_delay_ms:g} ms late), queue depth and the "
            f"nodes' figures: µs/token load L2 {cost.load_us[1]:.1f} L3 {cost.load_us[2]:.1f}, recompute "
            f"{cost.recompute_us:.0f} (+{cost.growth:.2e}/token of context): a mean prompt's prefill "
            f"{recompute_us(cost, 0, round(mean_tokens)) / 1e3:.0f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    params = EngineParams.from_json(args.engine)
    requests = load_requests(args.trace, args.block_tokens, params.block_size, args.time_scale, args.limit,
                             args.max_output)
    if not args.output_hint:
        requests = [Request(r.arrival_us, r.n_tokens, r.keys, r.output_tokens, False) for r in requests]
    results = []
    for name in args.routers:
        weighted = name == "tier_weighted" and args.queue_weight is not None
        options = {"queue_weight": args.queue_weight} if weighted else {}
        results.append(simulate(requests, name, args.nodes, args.tiers, args.policy, params,
                                event_delay_ms=args.event_delay_ms, **options))
    rr = next((r.hit_rate for r in results if r.router == "round_robin"), None)
    print(_header(args, params, requests))
    print(f"{'router':<16}{'hit rate':>9}{'vs rr':>7}{'mean TTFT':>11}{'p90 TTFT':>10}{'p99 TTFT':>10}"
          f"{'mean wait':>11}{'est. queue':>12}  requests per node")
    for r in results:
        ratio = f"{r.hit_rate / rr:.2f}x" if rr else "-"
        print(f"{r.router:<16}{r.hit_rate:>9.1%}{ratio:>7}{r.mean_ttft_ms:>9.0f}ms{r.p90_ttft_ms:>8.0f}ms"
              f"{r.p99_ttft_ms:>8.0f}ms{r.mean_wait_ms:>9.0f}ms{r.mean_queue_est_ms:>10.0f}ms  {r.per_node}")
    if args.json_out:
        raw = json.loads(Path(args.engine).read_text())
        out = {"trace": str(args.trace), "nodes": args.nodes, "engine": str(args.engine),
               "engine_model": params.to_json(), "calibration": raw.get("calibration", {}).get("command"),
               "calibrated_utc": raw.get("calibration", {}).get("date_utc"),
               "tiers": dict(zip(TIER_NAMES, args.tiers)), "policy": args.policy,
               "block_tokens": args.block_tokens, "time_scale": args.time_scale, "limit": args.limit,
               "max_output": args.max_output, "event_delay_ms": args.event_delay_ms,
               "output_hint": args.output_hint, "results": [asdict(r) for r in results]}
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
