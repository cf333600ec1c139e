"""Generate prefix-cache traces in Mooncake's JSONL format, from a seed.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with one id per 512-token block of the prompt, ids chained
(equal ids mean equal prefixes; a partial last block gets its own id, as it
matches nothing). Prompts are built from *segments* (a system prompt, a
document, a user turn, a model answer, a tool result), so two prompts share a
block exactly when their token streams agree up to the end of that block.

Workloads (``--workload``; each is a Poisson stream of sessions):

- ``chat``: multi-turn conversations over a few shared system prompts (Zipf);
  each turn re-sends the whole history plus the last answer and a new user
  message after a heavy-tailed think time; conversations end (geometric turns)
  or stop at the context limit; a few users paste a long document.
- ``rag``: one-shot questions over a shared corpus (Zipf popularity): a system
  prompt, the top retrieved documents in relevance order, a unique question.
- ``agent``: agent loops: a long tool/system prompt per agent type, then steps
  seconds apart, each appending a tool result and the model's next action.
- ``scan``: one-off long prompts (summarise this file) that nothing reuses.
- ``mixed``: all four at once.

Every workload but ``scan`` mixes in a stream of scan prompts (``--scan-share``
of requests, default 10 %), as production traffic does.

    python tools/tracegen.py --workload chat --seed 1 --requests 5000 --out chat.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
CONTEXT_LIMIT = 128 * 1024
WORKLOADS = ("chat", "rag", "agent", "scan", "mixed")


@dataclass(frozen=True)
class Request:
    """One generated request: arrival (s), prompt segments as (segment id, tokens), output tokens."""

    time: float
    segments: tuple[tuple[object, int], ...]
    output: int


def _lognormal(rng: random.Random, median: float, sigma: float, low: int = 1, high: int = 1 << 30) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), low), high))


class _Zipf:
    """Draws 0..n-1 with P(k) ∝ 1 / (k + 1) ** s."""

    def __init__(self, n: int, s: float) -> None:
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        total, acc = sum(weights), 0.0
        self.cdf = []
        for w in weights:
            acc += w / total
            self.cdf.append(acc)

    def draw(self, rng: random.Random) -> int:
        import bisect

        return min(bisect.bisect_left(self.cdf, rng.random()), len(self.cdf) - 1)


# -- workloads: each yields one session's requests, in time order ---------------------


class Chat:
    """Multi-turn chat: shared system prompts, think times, conversations that end."""

    rate = 2.0  # sessions per second

    def __init__(self, rng: random.Random) -> None:
        self.systems = [_lognormal(rng, 1200, 0.6, 200, 6000) for _ in range(60)]
        self.pick = _Zipf(len(self.systems), 1.0)
        self.count = 0

    def session(self, rng: random.Random, start: float) -> Iterator[Request]:
        self.count += 1
        me = ("chat", self.count)
        sys_id = self.pick.draw(rng)
        history: list[tuple[object, int]] = [(("sys", sys_id), self.systems[sys_id])]
        turns = 1 + min(int(rng.expovariate(1 / 5.0)), 60)  # mean ~6 turns, some long
        t = start
        for turn in range(turns):
            if turn == 0 and rng.random() < 0.1:   # a pasted document
                user = _lognormal(rng, 8000, 0.7, 1000, 60000)
            else:
                user = _lognormal(rng, 150, 1.0, 5, 4000)
            history.append(((me, turn, "user"), user))
            if sum(n for _, n in history) > CONTEXT_LIMIT:
                return
            output = _lognormal(rng, 350, 0.8, 5, 4000)
            yield Request(t, tuple(history), output)
            history.append(((me, turn, "answer"), output))
            # Answer streaming (~40 tok/s) plus a heavy-tailed think time (median 40 s).
            t += output / 40.0 + _lognormal(rng, 40.0, 1.4, 1, 3600)


class Rag:
    """One-shot questions over a shared Zipf-popular corpus."""

    rate = 4.0

    def __init__(self, rng: random.Random) -> None:
        self.docs = [_lognormal(rng, 3000, 0.6, 300, 20000) for _ in range(2000)]
        self.pick = _Zipf(len(self.docs), 1.0)
        self.systems = [_lognormal(rng, 600, 0.4, 100, 3000) for _ in range(4)]
        self.count = 0

    def session(self, rng: random.Random, start: float) -> Iterator[Request]:
        self.count += 1
        sys_id = rng.randrange(len(self.systems))
        segments: list[tuple[object, int]] = [(("rag-sys", sys_id), self.systems[sys_id])]
        chosen: list[int] = []
        while len(chosen) < rng.choice((1, 2, 3, 4)):
            doc = self.pick.draw(rng)
            if doc not in chosen:
                chosen.append(doc)
        segments += [(("doc", d), self.docs[d]) for d in chosen]
        segments.append((("question", self.count), _lognormal(rng, 60, 0.6, 5, 500)))
        yield Request(start, tuple(segments), _lognormal(rng, 200, 0.6, 10, 2000))


class Agent:
    """Agent loops: a long tool prompt per agent type, then quick steps that append results."""

    rate = 0.8

    def __init__(self, rng: random.Random) -> None:
        self.tools = [_lognormal(rng, 10000, 0.4, 4000, 40000) for _ in range(16)]
        self.pick = _Zipf(len(self.tools), 0.8)
        self.count = 0

    def session(self, rng: random.Random, start: float) -> Iterator[Request]:
        self.count += 1
        me = ("agent", self.count)
        kind = self.pick.draw(rng)
        history: list[tuple[object, int]] = [(("tools", kind), self.tools[kind]),
                                             ((me, "task"), _lognormal(rng, 200, 0.8, 10, 4000))]
        steps = 1 + min(int(rng.expovariate(1 / 12.0)), 80)
        t = start
        for step in range(steps):
            if sum(n for _, n in history) > CONTEXT_LIMIT:
                return
            action = _lognormal(rng, 120, 0.7, 5, 2000)
            yield Request(t, tuple(history), action)
            history.append(((me, step, "action"), action))
            history.append(((me, step, "result"), _lognormal(rng, 800, 1.1, 10, 16000)))
            t += action / 40.0 + _lognormal(rng, 4.0, 1.0, 0, 600)


class Scan:
    """One-off long prompts: nothing in them is ever used again."""

    rate = 0.3

    def __init__(self, rng: random.Random) -> None:
        self.count = 0

    def session(self, rng: random.Random, start: float) -> Iterator[Request]:
        self.count += 1
        yield Request(start, ((("scan", self.count), _lognormal(rng, 20000, 0.5, 4000, 100000)),),
                      _lognormal(rng, 300, 0.5, 10, 2000))


_KINDS = {"chat": Chat, "rag": Rag, "agent": Agent, "scan": Scan}


def _components(workload: str, scan_share: float) -> list[str]:
    if workload == "mixed":
        return ["chat", "rag", "agent", "scan"]
    if workload == "scan" or scan_share == 0:
        return [workload]
    return [workload, "scan"]


def generate(workload: str, seed: int, requests: int, scan_share: float = 0.1) -> list[Request]:
    """The first ``requests`` requests (by arrival) of ``workload`` drawn from ``seed``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload: expected one of {list(WORKLOADS)}, got {workload!r}")
    if requests < 1:
        raise ValueError(f"requests: expected >= 1, got {requests}")
    if not 0 <= scan_share < 1:
        raise ValueError(f"scan_share: expected in [0, 1), got {scan_share}")
    rng = random.Random(seed)
    names = _components(workload, scan_share)
    gens = {n: _KINDS[n](rng) for n in names}
    rates = {n: gens[n].rate for n in names}
    if "scan" in names and workload not in ("scan", "mixed"):
        # Scale scan sessions so they are ~scan_share of the requests (a chat or
        # agent session yields several requests; the mean comes from a dry draw).
        probe = random.Random(seed + 1)
        per = sum(1 for _ in range(200) for _ in gens[workload].session(probe, 0.0)) / 200
        gens[workload].count = 0
        rates["scan"] = rates[workload] * per * scan_share / (1 - scan_share)
    total_rate = sum(rates.values())
    out: list[Request] = []
    latest: list[float] = []  # max-heap (negated) of the `requests` earliest arrival times
    t = 0.0
    while True:
        t += rng.expovariate(total_rate)
        if len(latest) >= requests and t > -latest[0]:
            break  # every later session starts after the last request we keep
        name = rng.choices(names, weights=[rates[n] for n in names])[0]
        for req in gens[name].session(rng, t):
            out.append(req)
            if len(latest) < requests:
                heapq.heappush(latest, -req.time)
            elif req.time < -latest[0]:
                heapq.heapreplace(latest, -req.time)
    out.sort(key=lambda r: r.time)
    return out[:requests]


class BlockIds:
    """Chained ids: a block's id names its whole token stream so far (Mooncake's convention)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def render(self, segments: Sequence[tuple[object, int]]) -> tuple[list[int], int]:
        """(hash_ids, input_length) of a prompt made of ``segments``."""
        ids: list[int] = []
        parent = -1
        pieces: list[tuple[object, int, int]] = []
        room = BLOCK_TOKENS
        for seg, n in segments:
            offset = 0
            while offset < n:
                take = min(room, n - offset)
                pieces.append((seg, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    ids.append(parent)
                    pieces, room = [], BLOCK_TOKENS
        if pieces:
            ids.append(self._id(parent, pieces))
        return ids, sum(n for _, n in segments)

    def _id(self, parent: int, pieces: list) -> int:
        key = (parent, tuple(pieces))
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def write(requests: Sequence[Request], path: str | Path) -> int:
    """Write ``requests`` as Mooncake JSONL; returns the number of block accesses."""
    ids = BlockIds()
    blocks = 0
    with open(path, "w") as fh:
        for req in requests:
            hash_ids, length = ids.render(req.segments)
            blocks += len(hash_ids)
            fh.write(json.dumps({"timestamp": int(req.time * 1000), "input_length": length,
                                 "output_length": req.output, "hash_ids": hash_ids}) + "\n")
    return blocks


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate a Mooncake-format prefix-cache trace from a seed.")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=5000, help="requests to write (the earliest arrivals)")
    p.add_argument("--scan-share", type=float, default=0.1,
                   help="share of one-off long scan prompts mixed into chat/rag/agent (default 0.1)")
    p.add_argument("--out", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    try:
        reqs = generate(args.workload, args.seed, args.requests, args.scan_share)
    except ValueError as exc:
        p.error(str(exc))
    blocks = write(reqs, args.out)
    span = reqs[-1].time - reqs[0].time if reqs else 0.0
    print(f"{args.out}: {len(reqs)} requests, {blocks} block accesses, {span:.0f} s of arrivals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
