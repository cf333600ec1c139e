"""Counters for one store, exported to Prometheus as ``tierkv_*``.

Counters are plain Python numbers guarded by a lock (cheap on the hot path);
a custom collector exposes them to a per-store ``CollectorRegistry``, so two
stores in one process never collide.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger("tierkv")
TIER_NAMES = ("l1", "l2", "l3", "l4")
_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Thread-safe counters: hits/misses/bytes/evictions/failures by tier, load latency."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = defaultdict(int)        # tier -> blocks
        self.misses = 0                     # blocks looked up and not found anywhere
        self.lookups = 0
        self.bytes = defaultdict(int)       # (tier, "read"|"write") -> bytes
        self.evictions = defaultdict(int)   # tier -> blocks
        self.failures = defaultdict(int)    # (tier, reason) -> blocks
        self.failure_events = defaultdict(int)  # (tier, reason) -> failures, each of 0 or more blocks
        self.corrupt = defaultdict(int)     # tier -> blocks
        self.load_buckets = [0] * (len(_BUCKETS) + 1)
        self.load_sum = 0.0
        self.load_count = 0
        self.usage: dict[str, tuple[int, int]] = {}  # tier -> (used, capacity) in blocks
        self._warned: set[str] = set()

    def add(self, counter: str, key, n: int = 1) -> None:
        with self._lock:
            getattr(self, counter)[key] += n

    def count_lookup(self, tiers_hit: list[int], missed: int) -> None:
        with self._lock:
            self.lookups += 1
            for tier in tiers_hit:
                self.hits[TIER_NAMES[tier]] += 1
            self.misses += missed

    def failure(self, tier: str, reason: str, n: int = 1, detail: str = "", say: bool = True) -> None:
        """Count one failure that lost ``n`` blocks (0 where unknown); log the first of each kind only
        (none with ``say`` False: the caller says it its own way)."""
        with self._lock:
            self.failures[(tier, reason)] += n
            self.failure_events[(tier, reason)] += 1
            if reason == "corrupt":
                self.corrupt[tier] += n
            first = say and (tier, reason) not in self._warned
            self._warned.add((tier, reason))
        if first:
            log.warning("tierkv %s %s: %s (counted as a miss; further ones are only counted)", tier, reason, detail)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            self.load_sum += seconds
            self.load_count += 1
            for i, bound in enumerate(_BUCKETS):
                if seconds <= bound:
                    self.load_buckets[i] += 1
                    return
            self.load_buckets[-1] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "lookups": self.lookups,
                "hits": dict(self.hits),
                "misses": self.misses,
                "bytes": {f"{t}_{d}": v for (t, d), v in self.bytes.items()},
                "evictions": dict(self.evictions),
                "failures": {f"{t}_{r}": v for (t, r), v in self.failures.items()},
                "failure_events": {f"{t}_{r}": v for (t, r), v in self.failure_events.items()},
                "corrupt": dict(self.corrupt),
                "load_count": self.load_count,
                "load_seconds_sum": self.load_sum,
                "usage": dict(self.usage),
            }

    def registry(self) -> CollectorRegistry:
        """A registry exposing these counters (for /metrics or a push gateway)."""
        reg = CollectorRegistry(auto_describe=True)
        reg.register(_Collector(self))
        return reg

    def exposition(self) -> bytes:
        return generate_latest(self.registry())


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self):
        s = self.m.snapshot()
        hits = CounterMetricFamily("tierkv_hits", "Blocks found, by tier", labels=["tier"])
        for tier in TIER_NAMES:
            hits.add_metric([tier], s["hits"].get(tier, 0))
        yield hits
        yield CounterMetricFamily("tierkv_misses", "Blocks looked up and found in no tier", value=s["misses"])
        yield CounterMetricFamily("tierkv_lookups", "Lookups", value=s["lookups"])
        byt = CounterMetricFamily("tierkv_bytes", "Bytes moved, by tier and direction", labels=["tier", "direction"])
        with self.m._lock:
            items = list(self.m.bytes.items())
            fails = list(self.m.failures.items())
            events = list(self.m.failure_events.items())
        for (tier, direction), v in items:
            byt.add_metric([tier, direction], v)
        yield byt
        ev = CounterMetricFamily("tierkv_evictions", "Blocks evicted, by tier", labels=["tier"])
        for tier in TIER_NAMES:
            ev.add_metric([tier], s["evictions"].get(tier, 0))
        yield ev
        cor = CounterMetricFamily("tierkv_corrupt_blocks", "Blocks that failed their checksum", labels=["tier"])
        for tier in TIER_NAMES:
            cor.add_metric([tier], s["corrupt"].get(tier, 0))
        yield cor
        fail = CounterMetricFamily("tierkv_failures", "Blocks lost to tier failures", labels=["tier", "reason"])
        for (tier, reason), v in fails:
            fail.add_metric([tier, reason], v)
        yield fail
        # A damaged L3 moved aside may have lost an unknown number of blocks (counted as 0 above):
        # this counter still goes up by one, so an alert on it sees every failure.
        ev_fail = CounterMetricFamily("tierkv_failure_events", "Tier failures, each losing 0 or more blocks",
                                      labels=["tier", "reason"])
        for (tier, reason), v in events:
            ev_fail.add_metric([tier, reason], v)
        yield ev_fail
        use = GaugeMetricFamily("tierkv_blocks", "Blocks held, by tier", labels=["tier"])
        cap = GaugeMetricFamily("tierkv_capacity_blocks", "Capacity in blocks, by tier", labels=["tier"])
        for tier, (used, capacity) in s["usage"].items():
            use.add_metric([tier], used)
            cap.add_metric([tier], capacity)
        yield use
        yield cap
        with self.m._lock:
            buckets = list(self.m.load_buckets)
        cum, acc = [], 0
        for bound, n in zip([*map(str, _BUCKETS), "+Inf"], buckets):
            acc += n
            cum.append((bound, acc))
        yield HistogramMetricFamily("tierkv_load_seconds", "Time to load a batch of blocks",
                                    buckets=cum, sum_value=s["load_seconds_sum"])
