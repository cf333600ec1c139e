"""The server's Prometheus metrics: HTTP requests, tokens served, engine batching and what requests hold now.

``ServerMetrics`` counts (thread-safe) and ``exposition(gauges)`` renders
them through prometheus-client after the store's own ``tierkv_*`` families.
``tierkv_engine_pinned_blocks`` is 0 whenever no request is in flight: a
client that leaves mid-stream must not leave one behind.
"""

from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """Request and token counters of one server. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter = Counter()   # (endpoint, status) -> requests
        self.tokens: Counter = Counter()     # "prompt" / "completion" / "cached" -> tokens

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def count_tokens(self, prompt: int, completion: int, cached: int) -> None:
        with self._lock:
            self.tokens["prompt"] += prompt
            self.tokens["completion"] += completion
            self.tokens["cached"] += cached

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "prompt_tokens": self.tokens["prompt"],
                    "completion_tokens": self.tokens["completion"], "cached_tokens": self.tokens["cached"]}

    def exposition(self, batch: dict, gauges: dict) -> bytes:
        """This server's families in the Prometheus text format; ``batch`` from EngineLoop.batch_stats,
        ``gauges`` from EngineLoop.gauges."""
        snap = self.snapshot()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(snap, batch, gauges))
        return generate_latest(registry)


class _Collector:
    def __init__(self, snap: dict, batch: dict, gauges: dict) -> None:
        self.snap, self.batch, self.gauges = snap, batch, gauges

    def collect(self):
        req = CounterMetricFamily("tierkv_http_requests", "HTTP requests by endpoint and status",
                                  labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(self.snap["requests"].items()):
            req.add_metric([endpoint, str(status)], n)
        yield req
        for kind, help_ in (("prompt", "Prompt tokens of finished requests"),
                            ("completion", "Tokens generated for finished requests"),
                            ("cached", "Prompt tokens served from a tierkv tier instead of computed")):
            yield CounterMetricFamily(f"tierkv_{kind}_tokens", help_, value=self.snap[f"{kind}_tokens"])
        b = self.batch
        yield CounterMetricFamily("tierkv_engine_steps", "Engine steps that sampled at least one token",
                                  value=b["steps"])
        yield CounterMetricFamily("tierkv_engine_aborted_requests", "Requests aborted because their client left",
                                  value=b["aborted"])
        yield GaugeMetricFamily("tierkv_engine_batch_size_max", "Most sequences that got a token in one step",
                                value=b["max_batch"])
        yield GaugeMetricFamily("tierkv_engine_batch_size_avg", "Sequences that got a token per step, on average",
                                value=b["avg_batch"])
        g = self.gauges
        yield GaugeMetricFamily("tierkv_engine_sequences", "Requests admitted to the engine and not finished",
                                value=g["sequences"])
        yield GaugeMetricFamily("tierkv_engine_pinned_blocks", "Store blocks pinned by requests in flight",
                                value=g["pinned_blocks"])
        yield GaugeMetricFamily("tierkv_engine_free_l1_blocks", "L1 slots neither cached nor held by a request",
                                value=g["free_l1_blocks"])
