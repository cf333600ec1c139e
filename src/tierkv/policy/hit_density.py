"""Evicts the leaf with the lowest learned hit density: hits expected per unit of cache space-time (the default).

Nothing here is fitted to a trace: the policy learns, online and per tier,
how reuse depends on a block's recency (its *age*: lookups since its last
use) and frequency (how many lookups hit it), in the spirit of LHD (Beckmann
et al., NSDI '18), with ARC-style ghosts to see past its own evictions:

- Blocks fall into *classes* by two things the store knows. Their hits:
  never hit, split by whether the block was the tip of the save that created
  it (often a partial or private tail that nothing reuses — or, in chat, the
  block the next turn continues: the policy finds out which); hit once; hit
  twice or more. And, once a request that used the block has finished and
  said how many tokens it generated (``finished``, from the engine or the
  connector), the band of that output: under 8 tokens, 8–127, 128 or more
  (bands of 16×; before any such word the band is "unknown", and a store that
  never says it keeps the four hit classes alone). In the shared production
  trace a first prompt answered in under 128 tokens comes back 75–84 % of the
  time, one answered at length 6 % (docs/replay.md); the policy learns, per
  band, whether anything like that holds where it runs.
- Per class it keeps two histograms over age (half-octave bins): hits at each
  age, and lives that ended unreused at each age. Every hit the index sees
  counts, listed or not (``observe``). A victim's life has not ended: its key
  stays as a *ghost* (up to ``GHOST_FACTOR`` × the tier's blocks); a ghost's
  return counts as the hit keeping it would have given (``admit``) and the
  block comes back with its hit count; the oldest ghosts end unreused. Lives
  still running (cached blocks, ghosts) count as exposure so far (censoring).
- The *hit density* of class c at age a is the hits still expected per unit
  of residence, given the block reached age a: Σ hits at ages ≥ a over
  Σ residence at ages ≥ a. A tier keeps what earns the most hits per
  block-lookup of space.
- Within a class the oldest block is the candidate (density falls with age
  in the heavy-tailed reuse of prefix caches), so eviction compares one head
  per class: O(classes + log n).

Histograms decay geometrically (an update per turnover of the tier), so the
weights follow a changing workload; at each age a class with few hits past it
leans on the pooled rate of all classes there (a one-hit Gamma prior), and
before any data every class has the same falling density, which makes the
order plain LRU. Cost-awareness stays where it is real: the density is
multiplied by what a reuse saves by staying in this tier
(``CostModel.keep_benefit_us``: the reload from the tier below if cheaper than
recompute, minus this tier's own load), nearly flat across depths on a real
model. Not thread-safe (the store holds its lock).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from itertools import islice
from operator import attrgetter

from tierkv.cost import CostModel
from tierkv.index import Entry
from tierkv.policy.age_queue import TAG_BITS, AgeQueue
from tierkv.policy.base import EvictionPolicy

BINS = 64                 # half-octave age bins: ages up to 2**32 lookups
_LEVELS = 2               # hit-count levels past 0: once, twice or more
HIT_CLASSES = 2 + _LEVELS  # never hit (0: not a tip, 1: a tip), then hit 1, 2+ times
BANDS = 4                 # output bands: unknown, then < 8, 8-127, >= 128 generated tokens
CLASSES = HIT_CLASSES * BANDS  # class = hit class * BANDS + band
# Entry.tag bits this policy owns: tip, seen (classified), for a block back
# from a ghost the hits the index forgot (bits 2-3), and the output band of
# the last finished request that used it (bits 4-5).
_TIP, _SEEN = 1, 2
_CLASS_MASK = (1 << TAG_BITS) - 1  # a listed block's handle carries its class (its queue's tag)
_EXTRA_SHIFT, _EXTRA_MASK = 2, 3
_BAND_SHIFT, _BAND_MASK = 4, 3
# Recompute the densities after as many observed events (hits, ghost returns
# and ends, evictions) as the tier holds blocks (one turnover of the tier), at
# least this many, and enough that the update's scan reads at most GHOST_FACTOR
# + 1 of the tier's lives and one entry of another tier per event; each time
# multiply the histograms by _DECAY (a memory of ~20 such periods). The period
# follows the tier, not its ghosts: more ghosts lengthen what the densities
# see, not how slowly they learn (with the period set by blocks and ghosts
# together, as before, more ghosts meant rarer updates).
# Scale-free choices in the spirit of LHD's defaults, not fits to a trace.
_MIN_PERIOD = 512
_DECAY = 0.95
# Ghosts kept per block of the tier (keys of victims, with class and last use):
# they let the densities see ages past the tier's own eviction age. A life the
# ghosts forget ends there unreused, so a short list truncates every class's
# curve at its horizon (a return after it never counts) and biases the classes
# whose blocks come back late. So the list is long: a ghost costs one key and
# one int in an OrderedDict (~190 bytes with a 16-byte key, measured), so 64
# per block are ~12 KiB: 0.6 % of a 2 MiB Llama-3.1-8B block, 3 % of a 360 KiB
# SmolLM2-135M one; MAX_GHOSTS bounds the total for tiers of small blocks.
GHOST_FACTOR = 64
MAX_GHOSTS = 1 << 20  # ~200 MB of keys at most per tier, whatever its size
# What the budget below counts per ghost and per listed block: a ghost measured 186 B on
# average (tracemalloc, 200k ghosts) and up to ~230 B just after the dict grows; a listed
# block's place in its class queue is a deque slot when the blocks of a request share a
# bucket, and at worst a bucket of its own (a deque, 837 B measured) when every block has
# its own last use: the budget takes the worst.
GHOST_BYTES, LISTED_BYTES = 240, 840


def ghosts_for(block_bytes: int, share: float) -> int:
    """Ghosts per block that keep the policy's per-block state within ``share`` of the tier's
    bytes (``policy.metadata_share``): at 1 %, 11 for SmolLM2-135M's 360 KiB bf16 block of 16
    tokens, 27 for its fp32 one, 64 (the most) from 1.6 MiB blocks on (docs/design.md §6)."""
    return max(0, min(GHOST_FACTOR, int((share * block_bytes - LISTED_BYTES) // GHOST_BYTES)))
# Lives read per update at most (of each kind: cached blocks, ghosts), beyond that a strided sample.
_ALIVE_SAMPLE = 1 << 17
# Scale of the density given to ages past a class's last observed hit.
_FLOOR = 1e-6
# Strength of each class's prior, in hits: at each age a class's hit rate over
# the ages past it leans on the pooled (all-class) rate there with the weight of
# this many hits at that rate (a Gamma-Poisson prior): a class with many hits
# in its tail keeps its own rate, a sparse one follows the pool.
_PRIOR_HITS = 1.0
# What _alive reads of each entry, in one C-level call.
_LIFE = attrgetter("mask", "hits", "tag", "last_access")


def age_bin(age: int) -> int:
    """Half-octave bin of an age in lookups: 0, 1, 2, 3, 4-5, 6-7, 8-11, 12-15, ..."""
    bl = age.bit_length()
    return bl if bl < 2 else min(2 * bl - 2 + ((age >> (bl - 2)) & 1), BINS - 1)


def _bin_widths() -> list[int]:
    return [1 if b < 2 else 1 << ((b + 2) // 2 - 2) for b in range(BINS)]


_WIDTHS = _bin_widths()


def _tails(hits: list[float], ends: list[float]) -> tuple[list[float], list[float]]:
    """Per age bin b, from one class's (or the pool's) histograms: Σ hits at ages >= b, and the
    residence from bin b on summed over lives (a life ending in bin b counts half its width there):
    the numerator and denominator of the hit density at age b."""
    hits_tail, time_tail = [0.0] * BINS, [0.0] * BINS
    hits_after = alive_after = time_after = 0.0
    for b in range(BINS - 1, -1, -1):
        ending = hits[b] + ends[b]
        time_after += _WIDTHS[b] * (alive_after + 0.5 * ending)
        alive_after += ending
        hits_after += hits[b]
        hits_tail[b], time_tail[b] = hits_after, time_after
    return hits_tail, time_tail


def output_band(output_tokens: int) -> int:
    """The band of a finished request's output: 1 for < 8 tokens, 2 for 8-127, 3 for 128 or more."""
    if output_tokens < 0:
        raise ValueError(f"output_tokens: expected >= 0, got {output_tokens}")
    b = output_tokens.bit_length() >> 2
    return 1 + (b if b < BANDS - 2 else BANDS - 2)


def block_class(entry: Entry) -> int:
    """The class of ``entry``: hit class × BANDS + output band.

    Hit class: 0 never hit, 1 never hit and a tip, 2 hit once, 3 hit more
    (hits include those a block had before it came back from a ghost); band:
    0 unknown, else ``output_band`` of the last finished request that used it.
    """
    tag = entry.tag
    hits = entry.hits + ((tag >> _EXTRA_SHIFT) & _EXTRA_MASK)
    hc = 1 + (hits if hits < _LEVELS else _LEVELS) if hits else tag & _TIP
    return hc * BANDS + ((tag >> _BAND_SHIFT) & _BAND_MASK)


class HitDensityPolicy(EvictionPolicy):
    """Ranks one tier's evictable leaves by learned hit density × keep benefit. Not thread-safe."""

    name = "hit_density"
    # Slots: the C hot path (tierkv.index_native) reads and writes these by offset.
    __slots__ = ("tier", "index", "cost", "lower", "_queues", "_scored", "_scores", "_scored_clock",
                 "_scored_version", "_benefit", "hit_hist", "end_hist", "density", "_events", "_period",
                 "updates", "ghosts", "_counts", "ghost_hits", "ghost_factor")

    def __init__(self, tier: int, cost: CostModel | None = None, lower: int | None = None,
                 ghost_factor: int = GHOST_FACTOR, **_context) -> None:
        """``cost`` prices a reuse kept in this tier (the store's model; a flat one if None);
        ``lower`` is the tier a victim demotes to (None: it is dropped); ``ghost_factor``: ghosts
        kept per block of the tier (the store sets it from ``policy.metadata_share``: ``ghosts_for``)."""
        super().__init__(tier)
        if not isinstance(ghost_factor, int) or isinstance(ghost_factor, bool) or not 0 <= ghost_factor <= GHOST_FACTOR:
            raise ValueError(f"hit_density ghost_factor: expected an integer in 0..{GHOST_FACTOR}, got {ghost_factor!r}")
        self.ghost_factor = ghost_factor
        self.cost = cost if cost is not None else CostModel.units(0.0)
        self.lower = lower
        self._queues = [AgeQueue(tier, c) for c in range(CLASSES)]
        # Per class: the head last scored and its score, valid for one clock and one version
        # of the densities: a trim of many blocks at one clock scores each class's head once,
        # not per victim (within a clock a listed block's last use does not change).
        self._scored: list[Entry | None] = [None] * CLASSES
        self._scores = [0.0] * CLASSES
        self._scored_clock = self._scored_version = -1
        self._benefit: list[float] = []
        self.hit_hist = [[0.0] * BINS for _ in range(CLASSES)]
        self.end_hist = [[0.0] * BINS for _ in range(CLASSES)]
        # Before any data: the same falling density for every class (LRU order).
        self.density = [[1.0 / (b + 1) for b in range(BINS)] for _ in range(CLASSES)]
        self._events = 0
        self._period = _MIN_PERIOD
        self.updates = 0
        # key -> last use << TAG_BITS | class (an int, not a tuple: one object less per eviction).
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()
        self._counts = [0, 0, 0]  # the index's block counts per tier, once bound
        self.ghost_hits = 0

    def __len__(self) -> int:
        return sum(map(len, self._queues))

    def bind(self, index) -> None:
        """Called once by the index that lists into this policy (its clock and block counts)."""
        super().bind(index)
        self._counts = index.counts

    # -- learning ---------------------------------------------------------------

    def observe(self, entries: list[Entry], clock: int) -> None:
        """Count the hits of a lookup (called by the index before it updates use times)."""
        bit, hist = 1 << self.tier, self.hit_hist
        n = 0
        for e in entries:
            if e.mask & bit:
                age = clock - e.last_access
                bl = age.bit_length()
                b = bl if bl < 2 else 2 * bl - 2 + ((age >> (bl - 2)) & 1)
                hist[block_class(e)][b if b < BINS else BINS - 1] += 1.0
                n += 1
        self._events += n
        if self._events >= self._period:
            self._update()

    def admit(self, entry: Entry) -> None:
        """The tier gained ``entry`` (called by the index): a ghost's return is a hit it missed."""
        ghost = self.ghosts.pop(entry.key, None)
        if ghost is None:
            return
        c, last = ghost & _CLASS_MASK, ghost >> TAG_BITS
        age = self.index.clock - last
        bl = age.bit_length()
        b = bl if bl < 2 else 2 * bl - 2 + ((age >> (bl - 2)) & 1)
        self.hit_hist[c][b if b < BINS else BINS - 1] += 1.0
        self.ghost_hits += 1
        if entry.hits == 0:  # a new entry: carry over the hits the index forgot, this one, and its band
            hc, band = divmod(c, BANDS)
            extra = (0 if hc < 2 else hc - 1) + 1
            entry.tag = ((entry.tag & (_TIP | _SEEN)) | ((extra if extra < _LEVELS else _LEVELS) << _EXTRA_SHIFT)
                         | band << _BAND_SHIFT)
        self._events += 1

    def _trim_ghosts(self, now: int) -> None:
        """The oldest ghosts past the limit end their lives unreused; the limit follows the tier's size."""
        ghosts, ends = self.ghosts, self.end_hist
        limit = min(self.ghost_factor * self._counts[self.tier] + 64, MAX_GHOSTS)
        popitem = ghosts.popitem
        while len(ghosts) > limit:
            _, ghost = popitem(last=False)
            age = now - (ghost >> TAG_BITS)
            bl = age.bit_length()
            b = bl if bl < 2 else 2 * bl - 2 + ((age >> (bl - 2)) & 1)  # age_bin, inlined (once per eviction)
            ends[ghost & _CLASS_MASK][b if b < BINS else BINS - 1] += 1.0

    def _alive(self) -> list[list[float]]:
        """Per class and age bin: lives not ended yet (blocks cached in this tier, ghosts).

        They count as censored lives: their time so far is exposure without a
        hit. Reads every one up to ``_ALIVE_SAMPLE`` of each kind, past that an
        evenly strided sample weighted by its stride (bounded work per update);
        ``_update`` runs at most once per as many events as there are lives,
        or index entries and ghosts if those are more (the work of this scan).
        """
        hot = getattr(self.index, "_c", None)  # the index's C loops (tierkv.index_native): the same counts
        if hot is not None:
            return hot.hd_alive(self, _ALIVE_SAMPLE)
        alive = [[0.0] * BINS for _ in range(CLASSES)]
        if self.index is None:
            return alive
        now = self.index.clock
        # Counted per distinct (class, last use) first: a chain evicted or saved at once shares
        # both, so the Python loop runs over far fewer keys than there are lives.
        stride = max(1, len(self.ghosts) // _ALIVE_SAMPLE)
        for ghost, n in Counter(islice(self.ghosts.values(), 0, None, stride)).items():
            alive[ghost & _CLASS_MASK][age_bin(now - (ghost >> TAG_BITS))] += n * stride
        bit = 1 << self.tier
        stride = max(1, len(self.index) // _ALIVE_SAMPLE)
        for (mask, hits, tag, last), n in Counter(map(_LIFE, islice(self.index.entries(), 0, None, stride))).items():
            if mask & bit:
                hits += (tag >> _EXTRA_SHIFT) & _EXTRA_MASK
                hc = 1 + (hits if hits < _LEVELS else _LEVELS) if hits else tag & _TIP  # block_class, inlined
                alive[hc * BANDS + ((tag >> _BAND_SHIFT) & _BAND_MASK)][age_bin(now - last)] += n * stride
        return alive

    def _update(self) -> None:
        """Recompute every class's density from its histograms and the live blocks, then decay them."""
        self._events = 0
        self.updates += 1
        alive = self._alive()
        # One turnover of the tier between updates; the scan then reads up to
        # GHOST_FACTOR + 1 of the tier's own lives (blocks, ghosts) per event, and at
        # most one entry of other tiers (read and skipped): a small tier over a large
        # index (a 64-block L2 above a million-block L3) would otherwise rescan the
        # index every few lookups. In a one-tier replay the period is the tier's size.
        own = self._counts[self.tier]
        foreign = len(self.index) - own if self.index is not None else 0
        self._period = max(_MIN_PERIOD, own, foreign + len(self.ghosts) // (self.ghost_factor + 1))
        ended = [[e + a for e, a in zip(ends, live)] for ends, live in zip(self.end_hist, alive)]
        pooled_hits = [sum(h[b] for h in self.hit_hist) for b in range(BINS)]
        pooled_ends = [sum(e[b] for e in ended) for b in range(BINS)]
        pooled = sum(pooled_hits) + sum(pooled_ends)
        if pooled >= 1.0:
            pooled_rate = [h / t if t > 0 else 0.0 for h, t in zip(*_tails(pooled_hits, pooled_ends))]
            for c in range(CLASSES):
                density = self.density[c]
                hits_tail, time_tail = _tails(self.hit_hist[c], ended[c])
                for b in range(BINS):
                    hits_after, time_after, rate = hits_tail[b], time_tail[b], pooled_rate[b]
                    if rate > 0.0:  # the posterior mean rate: _PRIOR_HITS pseudo-hits at the pooled rate
                        density[b] = (hits_after + _PRIOR_HITS) / (time_after + _PRIOR_HITS / rate)
                    else:
                        density[b] = hits_after / time_after if time_after > 0 else 0.0
                # Past the last hit seen, no age tells blocks apart: order them by what
                # their class earns overall (far below any density seen), oldest first.
                floor = _FLOOR * density[0]
                for b in range(BINS - 1, -1, -1):
                    if density[b] > 0.0:
                        break
                    density[b] = floor
        for hist in (*self.hit_hist, *self.end_hist):
            for b in range(BINS):
                hist[b] *= _DECAY

    def _benefit_at(self, depth: int) -> float:
        table = self._benefit
        base = self.cost.keep_benefit_us(0, self.tier, self.lower)
        while len(table) <= depth:
            table.append(self.cost.keep_benefit_us(len(table), self.tier, self.lower) / base)
        return table[depth]

    # -- the ranking seam -----------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """List ``entry`` (now evictable in this tier) under its class, oldest first."""
        self._queues[self._listing_class(entry)].add(entry)

    def _listing_class(self, entry: Entry) -> int:
        """``block_class(entry)``, marking a block listed for the first time (a tip if fresh from its save)."""
        if not entry.tag & _SEEN:
            entry.tag |= _SEEN | (_TIP if entry.hits == 0 and self.index is not None
                                  and entry.last_access == self.index.clock else 0)
        return block_class(entry)

    def finished(self, entries: list[Entry], output_tokens: int) -> None:
        """A request that used ``entries`` finished after generating ``output_tokens`` tokens.

        Those of them in this tier take that output's band (``output_band``):
        their class changes, not their age; a listed one is listed again under
        its new class. Called by ``PrefixIndex.finished`` under the store's lock.
        """
        band = output_band(output_tokens) << _BAND_SHIFT
        bit, tier = 1 << self.tier, self.tier
        keep = ~(_BAND_MASK << _BAND_SHIFT)
        for e in entries:
            if not e.mask & bit or e.tag & (_BAND_MASK << _BAND_SHIFT) == band:
                continue
            listed = e.handles[tier] is not None
            if listed:  # its queue is its class: unlist under the old one, list under the new
                self.discard(e)
            e.tag = e.tag & keep | band
            if listed:
                self.add(e)

    def discard(self, entry: Entry) -> None:
        """Unlist ``entry`` (pinned, or no longer a leaf)."""
        handle = entry.handles[self.tier]
        if handle is not None:
            self._queues[handle & _CLASS_MASK].discard(entry)

    def touch(self, entry: Entry) -> None:
        """``entry`` was used while listed: re-list it under its new age and class."""
        self.discard(entry)
        self.add(entry)

    def pop(self) -> Entry | None:
        """Unlist and return the listed leaf of lowest density × benefit (None if none)."""
        return self._take(None, -1)

    def pop_after(self, entry: Entry) -> Entry:
        """``add(entry)`` then ``pop()``; ``entry`` is never listed when it is the one taken.

        ``PrefixIndex.evict`` passes the parent each victim exposes, which is
        often the next victim: its class's oldest, and lowest of all heads.
        """
        c = self._listing_class(entry)
        queue = self._queues[c]
        if queue.head() is not None and queue.keys[0] <= entry.last_access:
            queue.add(entry)  # an older block leads its class: the plain order
            return self._take(None, -1)
        return self._take(entry, c)

    def _take(self, extra: Entry | None, extra_c: int) -> Entry | None:
        """``pop``, with ``extra`` (unlisted, or None) standing as class ``extra_c``'s head:
        listed if another block is taken, taken unlisted if it wins."""
        now = self.index.clock if self.index is not None else 0
        best = None
        best_score = best_last = 0.0
        tier = self.tier
        if self._scored_clock != now or self._scored_version != self.updates:  # every memo is stale
            self._scored_clock, self._scored_version = now, self.updates
            self._scored = [None] * CLASSES
        scored, scores = self._scored, self._scores
        for c, queue in enumerate(self._queues):
            if c == extra_c:
                entry = extra
            else:
                # queue.head(), with its common case inlined: the first block of the first bucket is live.
                keys = queue.keys
                if not keys:
                    continue
                bucket = queue.buckets[keys[0]]
                entry = bucket[0] if bucket else None
                if entry is None or entry.handles[tier] != keys[0] << TAG_BITS | c:
                    entry = queue.head()
                    if entry is None:
                        continue
            last = entry.last_access
            if scored[c] is entry:
                score = scores[c]
            else:
                score = scores[c] = self._score(c, now - last, entry.depth)
                scored[c] = entry
            if best is None or score < best_score or (score == best_score and last < best_last):
                best, best_score, best_last, best_c = entry, score, last, c
        if best is None:
            return None
        if best is not extra:
            if extra is not None:
                self._queues[extra_c].add(extra)
            self._queues[best_c].pop()
        # Bury it: a ghost until it returns (admit) or the oldest ghosts pass the limit.
        ghosts = self.ghosts
        ghosts[best.key] = best_last << TAG_BITS | best_c
        if len(ghosts) > self.ghost_factor * self._counts[self.tier] + 64 or len(ghosts) > MAX_GHOSTS:
            self._trim_ghosts(now)
        self._events += 1
        if self._events >= self._period:
            self._update()
        return best

    def _score(self, c: int, age: int, depth: int) -> float:
        """Class ``c``'s density at ``age``, linear between the starts of its bin and the next
        (so age still orders blocks within a bin when classes look alike), times the benefit at ``depth``."""
        bl = age.bit_length()
        if bl < 2:
            b, frac = bl, 0.0
        else:
            shift = bl - 2
            half = (age >> shift) & 1
            b = 2 * bl - 2 + half
            frac = (age - ((2 + half) << shift)) / (1 << shift)
        if b >= BINS - 1:
            b, frac = BINS - 2, 1.0
        curve = self.density[c]
        at = curve[b]
        benefit = self._benefit
        return (at + (curve[b + 1] - at) * frac) * (benefit[depth] if depth < len(benefit) else self._benefit_at(depth))
