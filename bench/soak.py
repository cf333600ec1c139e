"""A long-running `tierkv serve`: memory that stays flat and latency that does not drift.

`tierkv serve` on SmolLM2-135M-Instruct (fp32, one thread) runs as a subprocess with a small
L1 (``--num-blocks``), L2 and L3, so blocks churn through every tier, and the official
``openai`` client sends it N requests one after another (1,000; --quick 300):

- a new conversation: one user message of 16-1,500 tokens (log-uniform);
- the next turn of an open conversation (up to 6 are open): the earlier turns, the server's
  answer and a new question of 16-160 tokens; its prefix is somewhere in the cache;
- every 25th request a replay of an earlier one (same messages, greedy): its text must equal
  the first answer, token for token — the check that the cache gave back the right KV;
- one in ten streams, and half of those leave after the first chunk (an abort).

A conversation that would pass 1,500 tokens ends (with the chat template and re-tokenised
text, prompts measured 46-1,520 tokens) and every answer is 8 tokens (``ignore_eos``). The RSS of the server process is sampled after each request.
Requests 100-200 and the last 100 run the same request shapes (lengths, turns, replays,
streams; fresh text), both starting with no conversation open, so their latencies compare
the server at two ages on one workload.

Targets: RSS at the end within 10 % of RSS after request 100; p99 latency of the last 100
within 1.2x of requests 100-200; every replay identical; evictions in L1, L2 and L3 (the
churn happened); nothing left in the engine or pinned at the end.
"""

from __future__ import annotations

import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import finish, parser, print_table, target, verdict  # noqa: E402

MODEL = "smollm2-135m-instruct"
MAX_PROMPT, ANSWER, OPEN, WINDOW = 1500, 8, 6, 100


@dataclass
class Conversation:
    messages: list[dict]
    tokens: int = 0  # prompt tokens of its last request, as the server counted them


@dataclass
class Record:
    messages: list[dict]
    text: str


@dataclass
class Run:
    latencies: dict[int, float] = field(default_factory=dict)  # request -> seconds (completed ones)
    rss: list[int] = field(default_factory=list)               # bytes after each request
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    replays: int = 0
    replays_identical: int = 0
    aborted: int = 0


class Server:
    """`tierkv serve` in a subprocess; its stdout's first line names the URL."""

    def __init__(self, workdir: Path, num_blocks: int, l2: str, l3: str) -> None:
        env = {**os.environ, "TIERKV_L2_CAPACITY": l2, "TIERKV_L3_CAPACITY": l3}
        self.log = open(workdir / "serve.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierkv.cli", "serve", "--model", MODEL, "--port", "0", "--threads", "1",
             "--num-blocks", str(num_blocks), "--max-model-len", "2048", "--served-model-name", "m",
             "--cache-dir", str(workdir / "cache")],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"(http://[0-9.]+:\d+)", line)
        if not m:
            self.proc.kill()
            raise SystemExit(f"soak: tierkv serve did not start: {line!r}; see {workdir / 'serve.log'}")
        import httpx
        import openai
        import psutil

        self.url = m.group(1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.ps = psutil.Process(self.proc.pid)

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def metrics(self) -> dict[tuple[str, tuple], float]:
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def idle(self, timeout: float = 60) -> dict:
        """/metrics once no request is in the engine and no block is pinned (an abort lands at the next step)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m[("tierkv_engine_sequences", ())] == 0 and m[("tierkv_engine_pinned_blocks", ())] == 0:
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self) -> int:
        self.http.close()
        self.proc.terminate()
        code = self.proc.wait(timeout=120)
        self.log.close()
        return code


class Workload:
    """Request shapes from a per-request seed; text from a separate stream (fresh in every window)."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tok = tokenizer
        self.seed = seed
        self.text_rng = random.Random(seed * 7919 + 1)
        self.open: list[Conversation] = []
        self.done: list[Record] = []

    def shape_rng(self, i: int, window_start: int | None) -> random.Random:
        if window_start is not None:  # both timed windows: request k of a window has one shape
            return random.Random(f"{self.seed}:window:{i - window_start}")
        return random.Random(f"{self.seed}:{i}")

    def text(self, n: int) -> str:
        """About ``n`` tokens of text (random ordinary tokens, decoded)."""
        return self.tok.decode([self.text_rng.randrange(1000, 40000) for _ in range(n)])

    def next(self, rng: random.Random, i: int) -> tuple[str, list[dict], Conversation | None, Record | None]:
        """(kind, messages, the conversation it extends or None, the record it replays or None)."""
        if i % 25 == 24 and self.done:
            rec = self.done[-1 - rng.randrange(min(20, len(self.done)))]
            return "replay", rec.messages, None, rec
        if self.open and (len(self.open) >= OPEN or rng.random() < 0.6):
            conv = self.open[rng.randrange(len(self.open))]
            n = int(16 * 10 ** rng.uniform(0, 1))  # 16-160
            if conv.tokens + ANSWER + n + 16 <= MAX_PROMPT:
                return "turn", [*conv.messages, {"role": "user", "content": self.text(n)}], conv, None
            self.open.remove(conv)
        n = int(round(math.exp(rng.uniform(math.log(16), math.log(MAX_PROMPT - 40)))))
        conv = Conversation([])
        self.open.append(conv)
        return "new", [{"role": "user", "content": self.text(n)}], conv, None


def ask(server: Server, messages: list[dict], stream: bool, abort: bool) -> tuple[str, object | None]:
    """Send one chat request; (text, usage). An abort reads one chunk and closes the stream."""
    kw = {"model": "m", "messages": messages, "max_tokens": ANSWER, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    if not stream:
        r = server.client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage
    parts, usage = [], None
    with server.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}) as s:
        for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
            if abort:
                break
    return "".join(parts), usage


def soak(server: Server, work: Workload, n: int) -> Run:
    run = Run()
    windows = (WINDOW, n - WINDOW)  # requests 100-200 and the last 100
    for i in range(n):
        start = next((w for w in windows if w <= i < w + WINDOW), None)
        if start == i:
            work.open.clear()  # both windows begin with no conversation open
        rng = work.shape_rng(i, start)
        kind, messages, conv, rec = work.next(rng, i)
        stream = rng.random() < 0.1
        abort = stream and rng.random() < 0.5 and kind != "replay"
        t0 = time.perf_counter()
        text, usage = ask(server, messages, stream, abort)
        dt = time.perf_counter() - t0
        if abort:
            run.aborted += 1
            if conv is not None and not conv.messages:
                work.open.remove(conv)
        else:
            run.latencies[i] = dt
            run.prompt_tokens.append(usage.prompt_tokens)
            run.cached_tokens += usage.prompt_tokens_details.cached_tokens
            if kind == "replay":
                run.replays += 1
                run.replays_identical += text == rec.text
            else:
                work.done.append(Record(messages, text))
                if conv is not None:
                    conv.messages = [*messages, {"role": "assistant", "content": text}]
                    conv.tokens = usage.prompt_tokens
        run.rss.append(server.rss())
        if (i + 1) % 50 == 0:
            print(f"  {i + 1:5d} requests  rss {run.rss[-1] / 2**20:7.0f} MiB  last {dt:5.2f} s", flush=True)
    return run


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=0, help="requests (default 1,000; --quick 300)")
    p.add_argument("--num-blocks", type=int, default=256, help="the server's L1 pool in blocks")
    p.add_argument("--l2", default="64MiB")
    p.add_argument("--l3", default="256MiB")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    n = args.requests or (300 if args.quick else 1000)
    if n < 3 * WINDOW:
        raise SystemExit(f"--requests: expected at least {3 * WINDOW}, got {n}")
    from tierkv.models import pull
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(pull(MODEL)) / "tokenizer.json"))
    with tempfile.TemporaryDirectory(prefix="tierkv-soak-") as tmp:
        server = Server(Path(tmp), args.num_blocks, args.l2, args.l3)
        t0 = time.perf_counter()
        try:
            run = soak(server, Workload(tokenizer, args.seed), n)
            wall = time.perf_counter() - t0
            m = server.idle()
        finally:
            code = server.stop()
    lat = run.latencies
    early = [lat[i] for i in range(WINDOW, 2 * WINDOW) if i in lat]
    late = [lat[i] for i in range(n - WINDOW, n) if i in lat]
    rss100, rss_end = run.rss[WINDOW - 1], run.rss[-1]
    evictions = {t: m.get(("tierkv_evictions_total", (("tier", t),)), 0) for t in ("l1", "l2", "l3")}
    hits = {t: m.get(("tierkv_hits_total", (("tier", t),)), 0) for t in ("l1", "l2", "l3")}
    left = m[("tierkv_engine_sequences", ())] + m[("tierkv_engine_pinned_blocks", ())]
    rows = [
        ("requests", f"{n}", f"{wall:.0f} s; {run.aborted} left mid-stream; {len(run.prompt_tokens)} completed"),
        ("prompt tokens", f"{sum(run.prompt_tokens)}",
         f"{min(run.prompt_tokens)}-{max(run.prompt_tokens)} per request; {run.cached_tokens} served from the cache"),
        ("rss after 100", f"{rss100 / 2**20:.0f} MiB", f"start {run.rss[0] / 2**20:.0f} MiB"),
        ("rss at end", f"{rss_end / 2**20:.0f} MiB", f"peak {max(run.rss) / 2**20:.0f} MiB"),
        ("p99 requests 100-200", f"{p99(early):.2f} s", f"median {statistics.median(early):.2f} s"),
        ("p99 last 100", f"{p99(late):.2f} s", f"median {statistics.median(late):.2f} s"),
        ("replays identical", f"{run.replays_identical}/{run.replays}", "greedy, same messages"),
        ("evictions l1/l2/l3", "/".join(f"{evictions[t]:.0f}" for t in evictions),
         "hits " + "/".join(f"{hits[t]:.0f}" for t in hits)),
        ("left in the engine", f"{left:.0f}", f"sequences + pinned blocks; serve exit code {code}"),
    ]
    targets = [
        target("rss_end_over_after_100", rss_end / rss100, "<=", 1.10, "RSS at the end / after request 100"),
        target("p99_last_over_100_200", p99(late) / p99(early), "<=", 1.2, "p99 of the last 100 / of 100-200"),
        target("replays_identical", run.replays_identical / max(1, run.replays), ">=", 1.0, "of the replays"),
        target("tiers_churned", min(evictions.values()), ">=", 1, "fewest evictions of L1, L2, L3"),
        target("nothing_left", -left - abs(code), ">=", 0, "-(sequences + pinned blocks + |exit code|)"),
    ]
    print_table(f"soak: tierkv serve, {MODEL} fp32, 1 thread, L1 {args.num_blocks} blocks, "
                f"L2 {args.l2}, L3 {args.l3}", rows + [(t["metric"], verdict(t), t["what"]) for t in targets])
    figures = {"requests": n, "wall_s": wall, "rss_mib": [r / 2**20 for r in run.rss],
               "latency_s": [lat.get(i) for i in range(n)], "evictions": evictions, "hits": hits,
               "replays": run.replays, "replays_identical": run.replays_identical, "aborted": run.aborted,
               "prompt_tokens_total": sum(run.prompt_tokens), "cached_tokens": run.cached_tokens}
    finish(args, "soak", figures, targets)


if __name__ == "__main__":
    main()
