"""A stripped-down single-tier simulator of the replay's prefix rule, for trying eviction orders fast.

Not the store's code: ``tools/replay.py`` grades the real ``PrefixIndex`` and
policies. This one keeps only the rule, so an idea costs a few lines: per
request, block i hits only if blocks 0..i are cached; the request's blocks are
then cached and used, and the cache is trimmed back to capacity, leaves only,
the request's own blocks exempt (pinned); a leaf is ranked when it becomes
evictable, by a priority fixed until its next use (lowest evicted first).
On the shared trace its LRU and its ``reuse`` bound give exactly the hit
rates of ``replay.py --policy lru`` and ``--policy reuse_oracle``
(``tests/test_evict_sim.py`` checks that on a generated trace).

Policies (``--policy``, comma-separated; the figures of docs/replay.md's
"fourth attempt" section):

- ``lru``; ``reuse`` (offline: LRU told whether each block is used again) and
  ``reuse_seen`` (told only for blocks used twice or more; others go first);
- ``thresh:K`` (blocks used fewer than K times first, LRU within; use counts over
  the whole history), ``lfu:C`` (use count capped at C, 0: uncapped, LRU ties),
  ``lfu_halve:P`` (uncapped, counts halved every P × capacity accesses),
  ``lfuda`` (greedy-dual LFU with dynamic aging);
- ``hot:ORDER`` (blocks used once first, LRU; among the others ``hash`` (a fixed
  subset), ``mru``, ``nextgap`` (latest predicted next use first: last use +
  smoothed gap) or ``overdue:M`` (past M × their smoothed gap first); a third
  field weighs the latest gap in the smoothing, 0.3 by default: ``hot:nextgap::1``);
- ``sticky:SEL:THETA:F[:nhf]``: a share THETA of requests (SEL ``root``: by
  their first block, ``new``: by their first uncached block) or of blocks
  (``block``) kept in a protected LRU segment of F × capacity; ``nhf``: the
  rest evicts blocks used once first;
- ``learned:FEATS:Q``: P(used again) learned online per bucket of a new block's
  save (FEATS from ``t`` new-tail length, ``p`` place in it, ``m`` continued a
  known prefix), reused blocks by use count; LRU within P quantized to Q levels;
- ``bigtail:K[:mru]``: new tails longer than capacity / K evicted first.

    python tools/evict_sim.py TRACE --capacity 1000,3000,10000 --policy lru,thresh:3,lfu:4
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path


def load_ids(path: str | Path) -> list[list[int]]:
    """The trace's requests as chains of int block keys, chained as ``replay.load_trace`` does."""
    chained: dict[tuple[int, int], int] = {}
    out = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                keys, parent = [], -1
                for block_id in json.loads(line)["hash_ids"]:
                    parent = chained.setdefault((parent, int(block_id)), len(chained))
                    keys.append(parent)
                out.append(keys)
    return out


def mix(x: int) -> float:
    """A fixed hash of ``x`` onto [0, 1) (splitmix64's finalizer)."""
    x = (x * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 29
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 32
    return x / 2**64


class Policy:
    """LRU over evictable leaves; subclasses change ``prio`` (and may see each request first)."""

    def __init__(self) -> None:
        self.heap: list[tuple] = []
        self.live: dict[int, int] = {}  # listed block -> its heap item's sequence number
        self.seq = itertools.count()
        self.sim: Sim | None = None

    def request(self, ids: list[int], matched: int) -> None:
        """Request ``ids`` arrives, its first ``matched`` blocks cached (before any update)."""

    def prio(self, b: int) -> tuple:
        """Lower is evicted first; fixed until the block is next used."""
        return (self.sim.last[b],)

    def list(self, b: int) -> None:
        """``b`` became evictable."""
        s = next(self.seq)
        self.live[b] = s
        heapq.heappush(self.heap, (self.prio(b), s, b))

    def unlist(self, b: int) -> None:
        """``b`` stopped being evictable."""
        self.live.pop(b, None)

    def _head(self, heap: list[tuple]) -> int | None:
        while heap:
            _, s, b = heap[0]
            if self.live.get(b) == s:
                return b
            heapq.heappop(heap)
        return None

    def _take(self, heap: list[tuple]) -> int:
        b = heapq.heappop(heap)[2]
        del self.live[b]
        return b

    def victim(self) -> int | None:
        """Unlist and return the block to evict (None if none is evictable)."""
        return None if self._head(self.heap) is None else self._take(self.heap)

    def evicted(self, b: int) -> None:
        """``b`` left the cache."""


class Sim:
    """One cache of ``capacity`` blocks replaying ``requests`` under ``policy``."""

    def __init__(self, requests: list[list[int]], capacity: int, policy: Policy) -> None:
        self.requests, self.capacity, self.policy = requests, capacity, policy
        self.clock = 0
        self.last: dict[int, int] = {}

    def run(self) -> float:
        """The hit rate: hit blocks / all blocks."""
        p, cap, last = self.policy, self.capacity, self.last
        p.sim = self
        parent: dict[int, int | None] = {}
        children: dict[int, int] = {}
        hits = total = 0
        for clock, ids in enumerate(self.requests):
            self.clock = clock
            total += len(ids)
            n = 0
            for b in ids:
                if b not in children:
                    break
                n += 1
            hits += n
            p.request(ids, n)
            prev = None
            for b in ids:
                if b in children:
                    if children[b] == 0:
                        p.unlist(b)
                else:
                    parent[b], children[b] = prev, 0
                    if prev is not None:
                        if children[prev] == 0:
                            p.unlist(prev)
                        children[prev] += 1
                last[b] = clock
                prev = b
            pinned = set(ids)
            while len(children) > cap:
                v = p.victim()
                if v is None:
                    break
                p.evicted(v)
                up = parent.pop(v)
                del children[v]
                if up is not None:
                    children[up] -= 1
                    if children[up] == 0 and up not in pinned:
                        p.list(up)
            for b in ids:
                if children.get(b) == 0:
                    p.list(b)
        return hits / max(total, 1)


class Counted(Policy):
    """Keeps each block's use count over the whole trace (an unbounded key history)."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[int] = Counter()

    def seen_prefix(self, ids: list[int]) -> int:
        """How many leading blocks of ``ids`` were seen before (by any earlier request)."""
        known = 0
        for b in ids:
            if not self.count[b]:
                break
            known += 1
        return known

    def request(self, ids: list[int], matched: int) -> None:
        for b in ids:
            self.count[b] += 1


class Reuse(Policy):
    """Offline: LRU told, at each use, whether the block is used again (only past ``seen`` uses)."""

    def __init__(self, requests: list[list[int]], seen: int = 1) -> None:
        super().__init__()
        self.seen = seen
        self.again: list[dict[int, bool]] = [{} for _ in requests]
        later: set[int] = set()
        for t in range(len(requests) - 1, -1, -1):
            self.again[t] = {b: b in later for b in requests[t]}
            later.update(requests[t])
        self.count: Counter[int] = Counter()
        self.now: dict[int, bool] = {}

    def request(self, ids: list[int], matched: int) -> None:
        self.now.update(self.again[self.sim.clock])
        for b in ids:
            self.count[b] += 1

    def prio(self, b: int) -> tuple:
        told = self.count[b] >= self.seen and self.now[b]
        return (told, self.sim.last[b])


class Thresh(Counted):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def prio(self, b: int) -> tuple:
        return (self.count[b] >= self.k, self.sim.last[b])


class LFU(Counted):
    def __init__(self, cap: int = 0, halve_every: int = 0) -> None:
        super().__init__()
        self.cap, self.halve_every, self.seen = cap or 1 << 62, halve_every, 0

    def request(self, ids: list[int], matched: int) -> None:
        super().request(ids, matched)
        self.seen += len(ids)
        if self.halve_every and self.seen >= self.halve_every:
            self.seen = 0
            self.count = Counter({b: c // 2 for b, c in self.count.items() if c > 1})

    def prio(self, b: int) -> tuple:
        return (min(self.count[b], self.cap), self.sim.last[b])


class LFUDA(Counted):
    """Priority = L + (uses − 1), L the last victim's priority (greedy-dual aging)."""

    def __init__(self) -> None:
        super().__init__()
        self.level = 0.0
        self.given: dict[int, float] = {}

    def prio(self, b: int) -> tuple:
        self.given[b] = p = self.level + self.count[b] - 1
        return (p, self.sim.last[b])

    def victim(self) -> int | None:
        b = super().victim()
        if b is not None:
            self.level = self.given[b]
        return b


class Hot(Counted):
    """Blocks used once first (LRU); the others in ``order``."""

    def __init__(self, order: str, m: float = 2.0, weight: float = 0.3) -> None:
        super().__init__()
        self.order, self.m, self.weight = order, m, weight
        self.gap: dict[int, float] = {}
        self.prev: dict[int, int] = {}

    def request(self, ids: list[int], matched: int) -> None:
        super().request(ids, matched)
        t = self.sim.clock
        for b in ids:
            if b in self.prev:
                g = t - self.prev[b]
                self.gap[b] = g if b not in self.gap else self.weight * g + (1 - self.weight) * self.gap[b]
            self.prev[b] = t

    def prio(self, b: int) -> tuple:
        last = self.sim.last[b]
        if self.count[b] < 2:
            return (0, 0, last)
        if self.order == "hash":
            return (1, 0, mix(b))
        if self.order == "mru":
            return (1, 0, -last)
        if self.order == "nextgap":
            return (1, 0, -(last + self.gap[b]))
        return (1, self.sim.clock - last < self.m * self.gap[b] + 1, last)  # overdue


class Sticky(Counted):
    """A hash-sampled share of requests (or blocks) kept in a protected LRU segment."""

    def __init__(self, capacity: int, select: str, theta: float, share: float, nhf: bool) -> None:
        super().__init__()
        self.quota, self.select, self.theta, self.nhf = share * capacity, select, theta, nhf
        self.kept_heap: list[tuple] = []
        self.kept: set[int] = set()

    def request(self, ids: list[int], matched: int) -> None:
        known = self.seen_prefix(ids)
        if self.select == "block":  # each uncached block by its own hash
            self.kept.update(b for b in ids[matched:] if mix(b) < self.theta)
        elif known < len(ids) and mix(ids[0] if self.select == "root" else ids[known]) < self.theta:
            self.kept.update(ids[known:])
        super().request(ids, matched)

    def prio(self, b: int) -> tuple:
        last = self.sim.last[b]
        return (self.count[b] >= 2, last) if self.nhf else (last,)

    def list(self, b: int) -> None:
        s = next(self.seq)
        self.live[b] = s
        heapq.heappush(self.kept_heap if b in self.kept else self.heap, (self.prio(b), s, b))

    def victim(self) -> int | None:
        other, kept = self._head(self.heap), self._head(self.kept_heap)
        if kept is not None and (other is None or len(self.kept) > self.quota):
            return self._take(self.kept_heap)
        return None if other is None else self._take(self.heap)

    def evicted(self, b: int) -> None:
        self.kept.discard(b)


class Learned(Counted):
    """P(used again) per bucket, learned online; LRU within P quantized to ``levels``."""

    def __init__(self, feats: str, levels: int) -> None:
        super().__init__()
        self.feats, self.levels = feats, levels
        self.bucket: dict[int, tuple] = {}
        self.made: Counter[tuple] = Counter()
        self.reused: Counter[tuple] = Counter()

    def request(self, ids: list[int], matched: int) -> None:
        known = self.seen_prefix(ids)
        tail = len(ids) - known
        for i, b in enumerate(ids):
            k = self.count[b]
            if k:
                self.reused[self.bucket[b]] += 1
                key: tuple = ("used", min(k, 3))
            else:
                key = ("new",
                       min(tail.bit_length(), 9) if "t" in self.feats else 0,
                       min((i - known).bit_length(), 8) if "p" in self.feats else 0,
                       known > 0 if "m" in self.feats else 0)
            self.bucket[b] = key
            self.made[key] += 1
            self.count[b] = k + 1

    def prio(self, b: int) -> tuple:
        key = self.bucket[b]
        p = (self.reused[key] + 1) / (self.made[key] + 2)
        return (int(p * self.levels), self.sim.last[b])


class BigTail(Counted):
    """New tails longer than capacity / k evicted first (LRU, or most recent first)."""

    def __init__(self, capacity: int, k: int, mru: bool) -> None:
        super().__init__()
        self.limit, self.mru = capacity / k, mru
        self.low: set[int] = set()

    def request(self, ids: list[int], matched: int) -> None:
        known = self.seen_prefix(ids)
        if len(ids) - known > self.limit:
            self.low.update(ids[known:])
        super().request(ids, matched)

    def prio(self, b: int) -> tuple:
        if self.count[b] >= 2:
            self.low.discard(b)
        low, last = b in self.low, self.sim.last[b]
        return (not low, -last if low and self.mru else last)


def make(spec: str, requests: list[list[int]], capacity: int) -> Policy:
    """The policy named by ``spec`` (see the module docstring) for one run."""
    name, *args = spec.split(":")
    if name == "lru":
        return Policy()
    if name in ("reuse", "reuse_seen"):
        return Reuse(requests, 1 if name == "reuse" else 2)
    if name == "thresh":
        return Thresh(int(args[0]))
    if name == "lfu":
        return LFU(int(args[0]) if args else 0)
    if name == "lfu_halve":
        return LFU(0, int(float(args[0]) * capacity))
    if name == "lfuda":
        return LFUDA()
    if name == "hot":
        return Hot(args[0], float(args[1]) if len(args) > 1 and args[1] else 2.0,
                   float(args[2]) if len(args) > 2 else 0.3)
    if name == "sticky":
        return Sticky(capacity, args[0], float(args[1]), float(args[2]), args[3:] == ["nhf"])
    if name == "learned":
        return Learned(args[0] if args[0] != "-" else "", int(args[1]))
    if name == "bigtail":
        return BigTail(capacity, int(args[0]), args[1:] == ["mru"])
    raise ValueError(f"unknown policy {spec!r}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Single-tier prefix-cache simulator for trying eviction orders.")
    p.add_argument("trace", help="Mooncake-format JSONL trace")
    p.add_argument("--capacity", default="1000,3000,10000", help="comma-separated capacities in blocks")
    p.add_argument("--policy", default="lru", help="comma-separated policy specs (module docstring)")
    args = p.parse_args(argv)
    requests = load_ids(args.trace)
    caps = [int(c) for c in args.capacity.split(",")]
    results: defaultdict[str, list[float]] = defaultdict(list)
    for spec in args.policy.split(","):
        for cap in caps:
            results[spec].append(Sim(requests, cap, make(spec, requests, cap)).run())
        print(f"{spec:<24} " + " / ".join(f"{100 * r:.2f}" for r in results[spec]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
