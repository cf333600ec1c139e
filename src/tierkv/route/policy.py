"""Routing policies: pick the node a prompt goes to (issue 16). Pure Python; moves nothing.

A router sees one ``Candidate`` per live node — what that node holds of the
prompt, per tier, its queue, and its cost figures — and answers an index into
the candidates. The same objects decide in ``tierkv route`` (candidates from
the global prefix index fed by node events) and in ``tools/fleet.py``
(candidates from each simulated node's own index), so the simulation measures
the code that routes.

Policies:

- ``round_robin``: the next node in turn; ignores the cache.
- ``hash``: consistent hashing (a ring of virtual nodes) of the prompt's first
  block key, so a shared system prompt always lands on the same node.
- ``longest_prefix``: the most matched tokens, in any tier; ties to the
  shorter queue.
- ``tier_weighted``: ``Σ_i w_i·m_i / N − k·queue_depth`` with weights
  L1 1.0, L2 0.8, L4 0.6, L3 0.3.
- ``cost_model``: the lowest estimated TTFT (``route.ttft.estimate_ttft_us``).

Remaining ties go to the candidate after the last one picked (a rotation), so
prompts nobody holds spread evenly. Routers are not thread-safe: the proxy
calls ``pick`` under its lock.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from tierkv.cost import CostModel
from tierkv.route.ttft import estimate_ttft_us

# Tier-weighted score weights, L1..L4 (index order of tierkv.index.Tier).
DEFAULT_TIER_WEIGHTS = (1.0, 0.8, 0.3, 0.6)
DEFAULT_QUEUE_WEIGHT = 0.1
_VIRTUAL_NODES = 64


@dataclass(frozen=True)
class Candidate:
    """One live node as a router sees it for one prompt.

    ``matched[i]``: leading prompt tokens the node holds in tier i (L1..L4);
    ``queue_depth``: requests waiting or running there; ``queue_us``: the
    delay before it would start this one; ``cost``: its per-token costs.
    """

    name: str
    matched: tuple[int, int, int, int]
    queue_depth: int
    queue_us: float
    cost: CostModel


@dataclass(frozen=True)
class Prompt:
    """What a router knows of a prompt: its length and the keys of its full blocks."""

    n_tokens: int
    keys: Sequence[bytes]


class Router(ABC):
    """Chooses one of the candidates. Not thread-safe; keeps only rotation state."""

    name = "base"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, prompt: Prompt, candidates: Sequence[Candidate]) -> int:
        """Index of the chosen candidate. Raises ValueError when there is none."""
        if not candidates:
            raise ValueError("route: no live node to send the request to")
        scores = [self.score(prompt, c) for c in candidates]
        best = min(scores)
        n = len(candidates)
        start = self._turn % n
        for step in range(n):
            i = (start + step) % n
            if scores[i] == best:
                self._turn = i + 1
                return i
        raise AssertionError("unreachable")

    @abstractmethod
    def score(self, prompt: Prompt, candidate: Candidate) -> tuple | float:
        """Lower is better; equal scores are broken by rotation."""


class RoundRobin(Router):
    name = "round_robin"

    def score(self, prompt: Prompt, candidate: Candidate) -> float:
        return 0.0


class LongestPrefix(Router):
    name = "longest_prefix"

    def score(self, prompt: Prompt, candidate: Candidate) -> tuple:
        return (-sum(candidate.matched), candidate.queue_depth)


class TierWeighted(Router):
    name = "tier_weighted"

    def __init__(self, weights: Sequence[float] = DEFAULT_TIER_WEIGHTS,
                 queue_weight: float = DEFAULT_QUEUE_WEIGHT) -> None:
        super().__init__()
        if len(weights) != 4 or any(w < 0 for w in weights):
            raise ValueError(f"route.tier_weights: expected 4 numbers >= 0 (L1..L4), got {list(weights)!r}")
        if queue_weight < 0:
            raise ValueError(f"route.queue_weight: expected >= 0, got {queue_weight!r}")
        self.weights = tuple(float(w) for w in weights)
        self.queue_weight = float(queue_weight)

    def score(self, prompt: Prompt, candidate: Candidate) -> tuple:
        held = sum(w * m for w, m in zip(self.weights, candidate.matched)) / max(prompt.n_tokens, 1)
        return (self.queue_weight * candidate.queue_depth - held, candidate.queue_depth)


class CostModelRouter(Router):
    name = "cost_model"

    def score(self, prompt: Prompt, candidate: Candidate) -> tuple:
        ttft = estimate_ttft_us(candidate.cost, candidate.matched, prompt.n_tokens, candidate.queue_us)
        return (ttft, candidate.queue_depth)


class ConsistentHash(Router):
    """A ring of ``_VIRTUAL_NODES`` points per node name; a prompt goes to the first point after its key."""

    name = "hash"

    def __init__(self) -> None:
        super().__init__()
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def _ring(self, names: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(names)
        if ring is None:
            points = sorted((xxhash.xxh64_intdigest(f"{name}#{v}".encode()), name)
                            for name in names for v in range(_VIRTUAL_NODES))
            ring = self._rings[names] = ([p for p, _ in points], [n for _, n in points])
            if len(self._rings) > 64:  # membership churn: keep the cache bounded
                self._rings = {names: ring}
        return ring

    def pick(self, prompt: Prompt, candidates: Sequence[Candidate]) -> int:
        if not candidates:
            raise ValueError("route: no live node to send the request to")
        if not prompt.keys:
            return super().pick(prompt, candidates)
        names = tuple(sorted(c.name for c in candidates))
        points, owners = self._ring(names)
        at = bisect.bisect(points, xxhash.xxh64_intdigest(prompt.keys[0])) % len(points)
        owner = owners[at]
        return next(i for i, c in enumerate(candidates) if c.name == owner)

    def score(self, prompt: Prompt, candidate: Candidate) -> float:
        return 0.0


ROUTERS: dict[str, type[Router]] = {
    r.name: r for r in (RoundRobin, ConsistentHash, LongestPrefix, TierWeighted, CostModelRouter)
}


def make_router(name: str, **options) -> Router:
    """A router by name; unknown names fail naming the allowed ones."""
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(f"route.policy: expected one of {sorted(ROUTERS)}, got {name!r}") from None
    return cls(**options)
