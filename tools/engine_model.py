"""A node as a continuous-batching engine in simulated time: what tools/fleet.py charges a request (issue 27).

Pure Python; no tensors. ``EngineSim`` schedules as ``tierkv.engine``'s
``Scheduler`` does: each step spends a token budget (``max_num_batched_tokens``)
over at most ``max_num_seqs`` sequences, running sequences first in admission
order (a decoding one takes one token, a prefilling one what is left of the
budget: chunked prefill), then waiting ones admitted while the budget lasts.
A sequence whose cached prefix sits in L2/L3 is LOADING (while the others run)
for ``tokens × kv_bytes_per_token / load_gbps[tier]``. A step takes::

    step_us = step_base_us + token_us·T + attention_us·Σctx + seq_us·S

T tokens in the step, Σctx the positions they attend over (a token at position
p attends to p earlier ones), S sequences that sample a token in it. A request's
first token comes at the end of the step that computes its last prompt token;
then it decodes one token a step until its output length.

``EngineParams`` live in a JSON file (tools/engine_model.json, written by
tools/calibrate_engine.py from measured steps of the bundled engine on
SmolLM2). Not modelled: L1 room for admission and preemption, the CPU the
loads take from compute, stalls of the engine thread (docs/routing.md).
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tierkv.cost import CostModel

_FIELDS_FLOAT = ("step_base_us", "token_us", "attention_us", "seq_us")


def positions_sum(start: int, end: int) -> int:
    """Σ p for p in start..end-1: the attention work of computing those positions."""
    return (start + end - 1) * (end - start) // 2 if end > start else 0


@dataclass(frozen=True)
class EngineParams:
    """Step-time coefficients (µs), scheduler budget, KV bytes and per-tier load bandwidth of one node."""

    name: str
    step_base_us: float
    token_us: float
    attention_us: float
    seq_us: float
    max_num_batched_tokens: int
    max_num_seqs: int
    chunked_prefill: bool
    kv_bytes_per_token: int
    load_gbps: tuple[float, float, float]  # L2, L3, L4 into L1
    block_size: int  # tokens per KV block of the node's store

    def __post_init__(self) -> None:
        for name in _FIELDS_FLOAT:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"engine_model.{name}: expected a number >= 0, got {value!r}")
        if self.token_us <= 0:
            raise ValueError(f"engine_model.token_us: expected > 0, got {self.token_us!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "kv_bytes_per_token", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine_model.{name}: expected an integer >= 1, got {value!r}")
        if len(self.load_gbps) != 3 or any(not g > 0 for g in self.load_gbps):
            raise ValueError(f"engine_model.load_gbps: expected three numbers > 0 (L2, L3, L4), got {self.load_gbps!r}")

    @classmethod
    def from_json(cls, path: str | Path) -> EngineParams:
        """The model in ``path``; keys other than the fields (e.g. ``calibration``) are kept out."""
        raw = json.loads(Path(path).read_text())
        names = set(cls.__dataclass_fields__)
        missing = sorted(names - set(raw))
        if missing:
            raise ValueError(f"{path}: engine model lacks {missing}")
        fields = {k: raw[k] for k in names}
        fields["load_gbps"] = tuple(fields["load_gbps"])
        return cls(**fields)

    def to_json(self) -> dict:
        out = asdict(self)
        out["load_gbps"] = list(self.load_gbps)
        return out

    def step_us(self, tokens: int, ctx: int, seqs: int) -> float:
        return self.step_base_us + self.token_us * tokens + self.attention_us * ctx + self.seq_us * seqs

    def load_us(self, tier: int, tokens: int) -> float:
        """Time to bring ``tokens`` of KV from ``tier`` (0 L1 .. 3 L4) into L1."""
        return 0.0 if tier == 0 else tokens * self.kv_bytes_per_token / (self.load_gbps[tier - 1] * 1e3)

    def cost_model(self) -> CostModel:
        """The node's own cost figures, as its store would report them (``/v1/kv/status``): per-token
        loads from the bandwidths, prefill of n tokens ``r·n + r·g·n²/2`` with r = ``token_us`` and
        g = attention/token. A per-token estimate: the step's fixed costs, batching, chunking and the
        queue are not in it (that is what the router is graded against)."""
        per_token, bs = self.kv_bytes_per_token, self.block_size
        load = (0.0, *(per_token / (g * 1e3) for g in self.load_gbps))
        return CostModel(load, self.token_us, self.attention_us / self.token_us, bs, per_token * bs)


@dataclass(eq=False)
class Seq:
    """One request in the engine. Times in µs of simulated time."""

    arrival_us: float
    n_tokens: int
    output_tokens: int = 1
    payload: object = None
    computed: int = 0
    generated: int = 0
    admitted_us: float | None = None
    ready_us: float = 0.0
    first_token_us: float | None = None
    finished_us: float | None = None
    chunks: list[int] = field(default_factory=list)

    @property
    def ttft_us(self) -> float:
        return self.first_token_us - self.arrival_us


# admit(seq, now) -> (cached tokens, (tier, tokens) loads); prefilled(seq, now); finished(seq, now)
Admit = Callable[[Seq, float], tuple[int, list[tuple[int, int]]]]
Hook = Callable[[Seq, float], None]


def _no_cache(seq: Seq, now: float) -> tuple[int, list[tuple[int, int]]]:
    return 0, []


def _nothing(seq: Seq, now: float) -> None:
    return None


class EngineSim:
    """One node's engine over simulated time. Not thread-safe; one driver calls add/run_until.

    The hooks are how the node's store takes part: ``admit`` answers how many
    leading tokens are cached and which must be loaded from which tier,
    ``prefilled`` fires as the first token comes, ``finished`` as the last does.
    """

    def __init__(self, params: EngineParams, admit: Admit = _no_cache, prefilled: Hook = _nothing,
                 finished: Hook = _nothing) -> None:
        self.params = params
        self.admit, self.prefilled, self.finished = admit, prefilled, finished
        self.now = 0.0
        self.waiting: deque[Seq] = deque()
        self.loading: list[Seq] = []
        self.running: list[Seq] = []
        self.steps = 0
        self.busy_us = 0.0

    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def add(self, seq: Seq) -> None:
        """Queue ``seq`` at its arrival; an idle engine's clock moves up to it."""
        if not self.has_work():
            self.now = max(self.now, seq.arrival_us)
        self.waiting.append(seq)

    def run_until(self, t: float) -> None:
        """Run every step that starts before ``t`` (math.inf: until no work is left)."""
        while self.has_work() and self.now < t:
            self.step(t)
        if not self.has_work():
            self.now = max(self.now, t) if t < math.inf else self.now

    def step(self, limit: float = math.inf) -> None:
        """One scheduled batch from ``self.now``; with only loads in flight, wait for the first (or ``limit``)."""
        for seq in [s for s in self.loading if s.ready_us <= self.now]:
            self.loading.remove(seq)
            self.running.append(seq)
        budget = self.params.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        for seq in self.running:
            n = self._chunk(seq, budget, bool(batch))
            if n:
                batch.append((seq, n))
                budget -= n
        self._admit(batch, budget)
        if not batch:
            if self.loading:
                self.now = min(min(s.ready_us for s in self.loading), max(limit, self.now))
            return
        self._run(batch)

    def _admit(self, batch: list[tuple[Seq, int]], budget: int) -> None:
        p = self.params
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < p.max_num_seqs:
            seq = self.waiting.popleft()
            seq.admitted_us = self.now
            cached, loads = self.admit(seq, self.now)
            seq.computed = min(cached, seq.n_tokens - 1)  # the last token is always computed, for its logits
            load_us = sum(p.load_us(tier, tokens) for tier, tokens in loads)
            if load_us > 0:
                seq.ready_us = self.now + load_us
                self.loading.append(seq)
                continue
            self.running.append(seq)
            n = self._chunk(seq, budget, bool(batch))
            if n:
                batch.append((seq, n))
                budget -= n

    def _chunk(self, seq: Seq, budget: int, others: bool) -> int:
        left = seq.n_tokens - seq.computed
        if left == 0:
            return 1 if budget > 0 else 0  # decoding
        if left <= budget or self.params.chunked_prefill:
            return min(left, budget)
        return 0 if others else left

    def _run(self, batch: list[tuple[Seq, int]]) -> None:
        tokens = ctx = seqs = 0
        for seq, n in batch:
            if seq.computed < seq.n_tokens:
                ctx += positions_sum(seq.computed, seq.computed + n)
                seqs += seq.computed + n == seq.n_tokens
            else:
                ctx += seq.n_tokens + seq.generated - 1
                seqs += 1
            tokens += n
        dt = self.params.step_us(tokens, ctx, seqs)
        end = self.now + dt
        for seq, n in batch:
            if seq.computed < seq.n_tokens:
                seq.computed += n
                seq.chunks.append(n)
                if seq.computed < seq.n_tokens:
                    continue
                seq.first_token_us = end
                self.prefilled(seq, end)
            seq.generated += 1
            if seq.generated >= seq.output_tokens:
                seq.finished_us = end
                self.running.remove(seq)
                self.finished(seq, end)
        self.steps += 1
        self.busy_us += dt
        self.now = end
