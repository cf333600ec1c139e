"""Real fleet: `tierkv route` over real `tierkv serve` nodes, a slice of the shared trace, beside the simulator.

Issue 27 item 2. Per router (round_robin, longest_prefix, cost_model), a fresh fleet: one real
redis-server as the shared L4, ``--nodes`` `tierkv serve` processes on SmolLM2-135M-Instruct (fp32,
one thread each, fresh cache directories, their ``[cost]`` figures set to the calibrated engine model
``tools/engine_model.json`` so the real routers price prefill as the simulated ones do), and
`tierkv route --policy ROUTER` in front. A slice of the Mooncake trace (one ``hash_id`` = one
512-token block, scaled to ``--block-tokens`` model tokens as ``tools/fleet.py`` scales it) is
replayed through the official ``openai`` client, concurrently, streaming, each request sent at its
arrival time × ``--time-scale``. A prompt is token ids: each model block's 16 ids drawn from a seed
of its trace key, so requests that share trace blocks share token prefixes exactly and nothing
else does. Each request asks ``min(output_length, --max-output)`` tokens, greedy, ``ignore_eos``.

Per router: mean / p90 TTFT at the client (send to the first streamed chunk), the hit rate
(``usage.prompt_tokens_details.cached_tokens`` over the prompts' full-block tokens), requests per
node (``x-tierkv-node``), and the same slice through ``tools/fleet.py``'s ``simulate`` with the
calibrated engine model and the same tier sizes. Verified: every stream ends with its usage, the
number of tokens asked and non-empty text; the same prompt gives the same greedy text under every
router (whichever node served it, from cache or not); a warm-up prompt gives the same text on
every node.

Targets (issue 27's acceptance): cost_model has the lowest real mean and p90 TTFT of the three;
the simulator ranks the routers by mean TTFT as the real run does; sim mean within 25 % of real.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import finish, parser, print_table, target, verdict  # noqa: E402

from tierkv.policy import DEFAULT_POLICY  # noqa: E402
from tools.engine_model import EngineParams  # noqa: E402
from tools.fleet import DEFAULT_ENGINE, Request, load_requests, simulate  # noqa: E402

MODEL = "smollm2-135m-instruct"
ROUTERS = ("round_robin", "longest_prefix", "cost_model")
TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl"
BLOCK = 16  # the engine's block size (tokens)
VOCAB = (1000, 40000)  # ordinary SmolLM2 token ids
URL = re.compile(r"(http://[0-9.]+:\d+)")
WARMUP = 64  # tokens of the warm-up prompt sent to each node before the replay


# -- the slice ------------------------------------------------------------------------


def block_ids(key: bytes) -> list[int]:
    """The 16 token ids of one model block, from its key (trace hash_id + index): same key, same ids."""
    rng = random.Random(key)
    return [rng.randrange(*VOCAB) for _ in range(BLOCK)]


def prompt_ids(request: Request, index: int) -> list[int]:
    """The request's prompt: its full blocks' ids, then a tail of its own (not a full block)."""
    ids = [t for key in request.keys for t in block_ids(key)]
    rng = random.Random(f"tail:{index}")
    return ids + [rng.randrange(*VOCAB) for _ in range(request.n_tokens - len(ids))]


def load_slice(trace: Path, start: int, count: int, block_tokens: int, time_scale: float,
               max_output: int) -> list[Request]:
    """Trace lines ``start .. start+count-1``, scaled; arrivals shifted so the first is at 0."""
    rs = load_requests(trace, block_tokens, BLOCK, time_scale, start + count, max_output)[start:]
    t0 = rs[0].arrival_us
    return [Request(r.arrival_us - t0, r.n_tokens, r.keys, r.output_tokens) for r in rs]


def reuse_ceiling(requests: list[Request]) -> float:
    """Full blocks an ideal single cache (infinite, instant) would hit in this slice, of all full blocks."""
    seen, hit = set(), 0
    for r in requests:
        for k in r.keys:
            if k not in seen:
                break
            hit += 1
        seen.update(r.keys)
    return hit / max(sum(len(r.keys) for r in requests), 1)


# -- the fleet --------------------------------------------------------------------------


def _start(cmd: list[str], log: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """A server that prints its URL on its first stdout line (tierkv serve / route with --port 0)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), stdin=subprocess.DEVNULL,
                            text=True, env=env)
    line = proc.stdout.readline()
    m = URL.search(line)
    if not m:
        proc.kill()
        raise SystemExit(f"fleet_real: {cmd[3]} did not start: {line!r}; see {log}")
    return proc, m.group(1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"fleet_real: timed out waiting for {what}")


def node_env(params: EngineParams, redis_url: str, l2: str, l3: str) -> dict:
    """The nodes' store settings: the shared L4, small L2/L3, and the engine model's cost figures (what
    the simulated routers are given), instead of the store's built-in 100 µs/token recompute."""
    cost = params.cost_model()
    env = {**os.environ, "TIERKV_L4_URL": redis_url, "TIERKV_L2_CAPACITY": l2, "TIERKV_L3_CAPACITY": l3,
           "TIERKV_COST_RECOMPUTE_US_PER_TOKEN": f"{cost.recompute_us:.6g}",
           "TIERKV_COST_RECOMPUTE_GROWTH": f"{cost.growth:.6g}"}
    for tier, us in zip(("L2", "L3", "L4"), cost.load_us[1:]):
        env[f"TIERKV_COST_{tier}_US_PER_TOKEN"] = f"{us:.6g}"
    return env


@dataclass
class Fleet:
    """redis-server + ``nodes`` `tierkv serve` + `tierkv route --policy router`, in ``work``; stopped by pid."""

    work: Path
    router: str
    nodes: int
    num_blocks: int
    env: dict
    procs: list[subprocess.Popen] = field(default_factory=list)
    node_urls: list[str] = field(default_factory=list)
    url: str = ""
    redis_port: int = 0

    def start(self, model: Path) -> None:
        self.redis_port = _free_port()
        self.procs.append(subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.work)], stdout=open(self.work / "redis.log", "w"),
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        _wait("redis-server", lambda: self._redis("PING") is True, 30)
        env = dict(self.env, TIERKV_L4_URL=f"redis://127.0.0.1:{self.redis_port}/0")
        starting = [subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "serve", "--model", str(model), "--port", "0", "--threads", "1",
             "--num-blocks", str(self.num_blocks), "--served-model-name", "m", "--cache-dir",
             str(self.work / f"node{i}"), "--kv-events", "tcp://127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=open(self.work / f"node{i}.log", "w"), stdin=subprocess.DEVNULL,
            text=True, env=env) for i in range(self.nodes)]
        self.procs += starting
        for i, proc in enumerate(starting):  # all load the model at once
            m = URL.search(proc.stdout.readline())
            if not m:
                raise SystemExit(f"fleet_real: node{i} did not start; see {self.work / f'node{i}.log'}")
            self.node_urls.append(m.group(1))
        for u in self.node_urls:
            _wait(f"{u}/health", lambda u=u: httpx.get(f"{u}/health", timeout=5).status_code == 200)
        cmd = [sys.executable, "-m", "tierkv.cli", "route", "--port", "0", "--policy", self.router,
               "--timeout", "5", "--poll", "0.3"]
        for u in self.node_urls:
            cmd += ["--node", u]
        proc, self.url = _start(cmd, self.work / "router.log", env)
        self.procs.append(proc)
        _wait("every node up and synced at the router", lambda: all(
            n["up"] and n["events"] and n["events"]["synced"]
            for n in httpx.get(f"{self.url}/v1/route/status", timeout=5).json()["nodes"]))

    def _redis(self, command: str):
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.redis_port, socket_timeout=5)
        try:
            return client.execute_command(command)
        except redis.RedisError:
            return None
        finally:
            client.close()

    def l4_keys(self) -> int:
        return int(self._redis("DBSIZE") or 0)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


# -- the replay --------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    node: str = ""
    ttft_ms: float = float("nan")
    late_ms: float = 0.0  # sent this long after its scheduled arrival (a busy client)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_tokens: dict = field(default_factory=dict)
    server_ttft_ms: float = float("nan")  # the node's own arrival-to-first-token, from its usage chunk
    completion_tokens: int = 0
    text: str = ""
    error: str = ""


async def _one(client, index: int, ids: list[int], max_tokens: int, t0: float, at_s: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + at_s - time.perf_counter()))
    res = Result(index)
    sent = time.perf_counter()
    res.late_ms = (sent - t0 - at_s) * 1e3
    try:
        raw = await client.completions.with_raw_response.create(
            model="m", prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        res.node = raw.headers.get("x-tierkv-node", "")
        texts = []
        async for chunk in raw.parse():
            if chunk.choices and res.ttft_ms != res.ttft_ms:
                res.ttft_ms = (time.perf_counter() - sent) * 1e3
            texts += [c.text for c in chunk.choices]
            if chunk.usage is not None:
                res.prompt_tokens, res.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                res.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
                info = (chunk.model_extra or {}).get("tierkv") or {}
                res.hit_tokens, res.server_ttft_ms = info.get("hit_tokens", {}), info.get("ttft_ms") or float("nan")
        res.text = "".join(texts)
    except Exception as exc:  # counted and shown: a failed request fails the check, it does not stop the run
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def replay(url: str, requests: list[Request], prompts: list[list[int]]) -> list[Result]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256),
                                                              timeout=600))
    t0 = time.perf_counter()
    try:
        return list(await asyncio.gather(*(_one(client, i, p, r.output_tokens, t0, r.arrival_us / 1e6)
                                           for i, (r, p) in enumerate(zip(requests, prompts)))))
    finally:
        await client.close()


def warmup(urls: list[str]) -> list[str]:
    """One greedy prompt of unrelated tokens to each node directly (first-request costs out of the timed
    run); returns each node's text, which must be the same."""
    rng = random.Random("warm-up")
    ids = [rng.randrange(*VOCAB) for _ in range(WARMUP)]
    out = []
    for u in urls:
        r = httpx.post(f"{u}/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True}, timeout=600)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


# -- one router -------------------------------------------------------------------------------


@dataclass
class RouterRun:
    router: str
    real_mean_ttft_ms: float
    real_p90_ttft_ms: float
    sim_mean_ttft_ms: float
    sim_p90_ttft_ms: float
    hit_rate: float  # real: cached tokens / full-block prompt tokens
    sim_hit_rate: float
    per_node: list[int]
    sim_per_node: list[int]
    hit_tokens: dict  # real cached tokens by tier, summed
    l4_keys: int  # values in the shared redis-server at the end
    inventory: list  # per node, blocks per tier (L1-L4) in the router's event-fed index at the end
    failed: int
    wall_s: float
    mean_late_ms: float
    warmup_same: bool


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(int(0.9 * len(xs)), len(xs) - 1)]


def run_router(router: str, args, requests: list[Request], prompts: list[list[int]], params: EngineParams,
               model: Path, env: dict, sim_tiers: tuple[int, int, int]) -> tuple[RouterRun, list[Result]]:
    with tempfile.TemporaryDirectory(prefix=f"tierkv-fleet-{router}-") as tmp:
        fleet = Fleet(Path(tmp), router, args.nodes, args.num_blocks, env)
        t0 = time.perf_counter()
        try:
            fleet.start(model)
            warm = warmup(fleet.node_urls)
            results = asyncio.run(replay(fleet.url, requests, prompts))
            l4 = fleet.l4_keys()
            time.sleep(0.5)  # the last saves' events
            view = {n["url"]: n["events"]["per_tier"] if n["events"] else None
                    for n in httpx.get(f"{fleet.url}/v1/route/status", timeout=10).json()["nodes"]}
        finally:
            fleet.stop()
        wall = time.perf_counter() - t0
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft_ms for r in ok]
    full = sum(BLOCK * len(requests[r.index].keys) for r in ok)
    tiers: dict[str, int] = {}
    for r in ok:
        for t, n in r.hit_tokens.items():
            tiers[t] = tiers.get(t, 0) + n
    sim = simulate(requests, router, args.nodes, sim_tiers, DEFAULT_POLICY, params)
    index = {u: i for i, u in enumerate(fleet.node_urls)}
    per_node = [0] * args.nodes
    for r in ok:
        per_node[index[r.node]] += 1
    nan = float("nan")
    run = RouterRun(router, statistics.fmean(ttfts) if ttfts else nan, p90(ttfts) if ttfts else nan,
                    sim.mean_ttft_ms, sim.p90_ttft_ms, sum(r.cached_tokens for r in ok) / max(full, 1),
                    sim.hit_rate, per_node, sim.per_node, tiers, l4, [view.get(u) for u in fleet.node_urls],
                    len(results) - len(ok), wall,
                    statistics.fmean(r.late_ms for r in results), len(set(warm)) == 1 and bool(warm[0]))
    return run, results


# -- main --------------------------------------------------------------------------------------


def _mib_blocks(text: str, block_bytes: int) -> int:
    n = float(text.removesuffix("MiB"))
    return int(n * 2**20 // block_bytes)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(TRACE), help="Mooncake-format JSONL (default the shared trace)")
    p.add_argument("--start", type=int, default=-1, help="first trace line of the slice (default 3900, --quick "
                                                         "3940: stretches whose requests share prefixes)")
    p.add_argument("--requests", type=int, default=0, help="requests in the slice (default 80; --quick 30)")
    p.add_argument("--nodes", type=int, default=2, help="tierkv serve nodes (default 2, on a 2-core host)")
    p.add_argument("--time-scale", type=float, default=0, help="multiply arrival times (default 8; --quick 8)")
    p.add_argument("--block-tokens", type=int, default=16, help="model tokens per 512-token trace block")
    p.add_argument("--max-output", type=int, default=0, help="cap on output tokens (default 16; --quick 8)")
    p.add_argument("--num-blocks", type=int, default=512, help="each node's L1 pool in blocks")
    p.add_argument("--l2", default="128MiB", help="each node's L2 (MiB)")
    p.add_argument("--l3", default="256MiB", help="each node's L3 (MiB)")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--engine", default=str(DEFAULT_ENGINE), help="the calibrated engine model JSON")
    args = p.parse_args()
    n = args.requests or (30 if args.quick else 80)
    args.start = args.start if args.start >= 0 else (3940 if args.quick else 3900)
    args.time_scale = args.time_scale or 8.0
    max_output = args.max_output or (8 if args.quick else 16)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if not set(routers) <= set(ROUTERS) or not routers:
        raise SystemExit(f"--routers: expected some of {list(ROUTERS)}, got {args.routers!r}")
    if shutil.which("redis-server") is None:
        raise SystemExit("fleet_real: redis-server is not installed: bash scripts/install-system-deps.sh")
    from tierkv.models import pull

    params = EngineParams.from_json(args.engine)
    block_bytes = params.kv_bytes_per_token * BLOCK
    sim_tiers = (args.num_blocks, _mib_blocks(args.l2, block_bytes), _mib_blocks(args.l3, block_bytes))
    requests = load_slice(Path(args.trace), args.start, n, args.block_tokens, args.time_scale, max_output)
    prompts = [prompt_ids(r, args.start + i) for i, r in enumerate(requests)]
    model = pull(MODEL)
    env = node_env(params, "", args.l2, args.l3)
    load_before = os.getloadavg()[0]
    runs, texts = [], {}
    for router in routers:
        print(f"== {router}: {args.nodes} nodes, {n} requests", flush=True)
        run, results = run_router(router, args, requests, prompts, params, model, env, sim_tiers)
        runs.append(run)
        texts[router] = results
        print(f"   {run.wall_s:.0f} s; real mean {run.real_mean_ttft_ms:.0f} ms, sim {run.sim_mean_ttft_ms:.0f} ms",
              flush=True)
    report(args, max_output, requests, runs, texts, sim_tiers, load_before)


def verify(requests: list[Request], texts: dict[str, list[Result]]) -> list[dict]:
    """The tokens timed: every stream complete (usage, the prompt and output lengths asked, non-empty
    text), each prompt's greedy text the same under every router, the warm-up's on every node."""
    results = [r for rs in texts.values() for r in rs]
    complete = sum(1 for r in results if not r.error and r.text and r.prompt_tokens == requests[r.index].n_tokens
                   and r.completion_tokens == requests[r.index].output_tokens)
    same = sum(1 for i in range(len(requests))
               if len({rs[i].text for rs in texts.values()}) == 1 and not any(rs[i].error for rs in texts.values()))
    errors = sorted({r.error for r in results if r.error})[:3]
    return [target("requests_complete", complete / len(results), ">=", 1.0,
                   "streams with usage, the tokens asked, non-empty text" + (f"; {errors}" if errors else "")),
            target("same_text_every_router", same / len(requests), ">=", 1.0,
                   "prompts whose greedy text is equal under every router")]


def acceptance(runs: list[RouterRun]) -> list[dict]:
    """Issue 27's: cost_model lowest real mean and p90; the simulator's order and mean within 25 %."""
    out = []
    others = [r for r in runs if r.router != "cost_model"]
    cm = next((r for r in runs if r.router == "cost_model"), None)
    if cm is not None and others:
        out.append(target("cost_model_lowest_mean", cm.real_mean_ttft_ms / min(o.real_mean_ttft_ms for o in others),
                          "<=", 1.0, "cost_model's real mean TTFT / the best other router's"))
        out.append(target("cost_model_lowest_p90", cm.real_p90_ttft_ms / min(o.real_p90_ttft_ms for o in others),
                          "<=", 1.0, "cost_model's real p90 TTFT / the best other router's"))
    real_rank = [r.router for r in sorted(runs, key=lambda r: r.real_mean_ttft_ms)]
    sim_rank = [r.router for r in sorted(runs, key=lambda r: r.sim_mean_ttft_ms)]
    out.append(target("sim_ranks_as_real", float(real_rank == sim_rank), ">=", 1.0,
                      f"by mean TTFT: real {real_rank}, sim {sim_rank}"))
    out.append(target("sim_mean_worst_error", max(abs(r.sim_mean_ttft_ms / r.real_mean_ttft_ms - 1) for r in runs),
                      "<=", 0.25, "largest |sim mean / real mean - 1| over the routers"))
    return out


def report(args, max_output: int, requests: list[Request], runs: list[RouterRun], texts: dict,
           sim_tiers, load_before: float) -> None:
    n = len(requests)
    print(f"\nfleet_real: {n} requests (trace lines {args.start}-{args.start + n - 1}, arrivals x{args.time_scale:g}, "
          f"{sum(r.n_tokens for r in requests) / n:.0f} prompt tokens mean, outputs <= {max_output}), {args.nodes} "
          f"nodes, SmolLM2 fp32 1 thread; in-slice reuse ceiling {reuse_ceiling(requests):.1%}")
    print(f"{'router':<16}{'real mean':>10}{'real p90':>10}{'sim mean':>10}{'sim p90':>9}{'sim/real':>9}"
          f"{'hits':>7}{'sim hits':>9}  per node (sim)   cached by tier")
    for r in runs:
        tiers = " ".join(f"{t}:{v}" for t, v in sorted(r.hit_tokens.items()) if v)
        print(f"{r.router:<16}{r.real_mean_ttft_ms:>8.0f}ms{r.real_p90_ttft_ms:>8.0f}ms{r.sim_mean_ttft_ms:>8.0f}ms"
              f"{r.sim_p90_ttft_ms:>7.0f}ms{r.sim_mean_ttft_ms / r.real_mean_ttft_ms:>9.2f}{r.hit_rate:>7.1%}"
              f"{r.sim_hit_rate:>9.1%}  {r.per_node} ({r.sim_per_node})  {tiers or '-'}")
    targets = acceptance(runs) + verify(requests, texts) + [
        target("warmup_same_every_node", float(all(r.warmup_same for r in runs)), ">=", 1.0,
               "one prompt, the same greedy text on every node")]
    print_table("targets (issue 27 acceptance, and the tokens verified)",
                [(t["metric"], verdict(t), t["what"]) for t in targets])
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs); "
          f"L4 values at the end " + ", ".join(f"{r.router} {r.l4_keys}" for r in runs)
          + "; client send lag mean " + ", ".join(f"{r.router} {r.mean_late_ms:.0f} ms" for r in runs))
    figures = {"rows": [{k: getattr(r, k) for k in ("router", "real_mean_ttft_ms", "real_p90_ttft_ms",
                                                     "sim_mean_ttft_ms", "sim_p90_ttft_ms", "hit_rate")}
                        for r in runs],
               "runs": [asdict(r) for r in runs], "trace": args.trace, "start": args.start, "requests": n,
               "time_scale": args.time_scale, "block_tokens": args.block_tokens, "max_output": max_output,
               "nodes": args.nodes, "num_blocks": args.num_blocks, "l2": args.l2, "l3": args.l3,
               "sim_tiers": list(sim_tiers), "engine": args.engine, "reuse_ceiling": reuse_ceiling(requests),
               "loadavg_before": load_before,
               "per_request": {k: [asdict(r) for r in v] for k, v in texts.items()}}
    finish(args, "fleet_real", figures, targets)


if __name__ == "__main__":
    main()
