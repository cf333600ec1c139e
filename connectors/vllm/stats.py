"""What the connector really did, as vLLM connector stats and Prometheus counters.

Both halves count what they see, as deltas since their last report: the
worker the blocks it loaded into vLLM's cache (by the tier they came from),
the blocks it saved, and its store's byte, corruption and failure counters;
the scheduler the blocks it looked up beyond vLLM's own hit and found in no
tier. vLLM carries the worker's deltas to the scheduler in
``KVConnectorOutput.kv_connector_stats``, adds the scheduler's, and hands the
sum to its stat loggers: ``TierKVPromMetrics`` adds them to ``tierkv_*``
counters in vLLM's own registry (``/metrics`` of ``vllm serve``,
``LLM.get_metrics()`` offline), so ``tierkv info --url`` reads them.
Only with vLLM's stats on (``disable_log_stats`` false).

Plain dicts of numbers: they cross process boundaries as vLLM pickles them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from tierkv.metrics import TIER_NAMES

# data keys: "<counter>" or "<counter>:<tier>" (or "failures:<tier>:<reason>", "bytes:<tier>:<direction>")
_TIERED = {
    "hits": ("tierkv_hits", "Blocks loaded into vLLM's KV cache from tierkv, by tier"),
    "corrupt": ("tierkv_corrupt_blocks", "Blocks that failed their checksum, by tier"),
}
_PLAIN = {
    "misses": ("tierkv_misses", "Blocks beyond vLLM's own prefix hit found in no tier"),
    "load_errors": ("tierkv_load_errors", "Promised blocks that did not load (vLLM recomputed them)"),
    "saved": ("tierkv_saved_blocks", "Full blocks the worker stored"),
}


class TierKVStats(KVConnectorStats):
    """Counter deltas since the last report; ``aggregate`` sums, ``reduce`` returns the sums."""

    def reset(self) -> None:
        self.data = {}

    def add(self, key: str, n: int = 1) -> None:
        if n:
            self.data[key] = self.data.get(key, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, n in (other.data if other is not None else {}).items():
            self.add(key, n)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def store_deltas(snapshot: Mapping[str, Any], last: dict[str, int], stats: TierKVStats) -> None:
    """Add the growth of a store's byte/corrupt/failure counters since ``last`` to ``stats``; update ``last``."""
    flat = {f"corrupt:{t}": n for t, n in snapshot.get("corrupt", {}).items()}
    flat.update({f"failures:{k.replace('_', ':', 1)}": n for k, n in snapshot.get("failures", {}).items()})
    flat.update({f"bytes:{k.replace('_', ':', 1)}": n for k, n in snapshot.get("bytes", {}).items()})
    for key, n in flat.items():
        grew = n - last.get(key, 0)
        if grew > 0:
            stats.add(key, grew)
        last[key] = n


class TierKVPromMetrics(KVConnectorPromMetrics):
    """``tierkv_*`` counters in vLLM's Prometheus registry, one child per engine (and tier)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._tiered = {}
        for key, (name, doc) in _TIERED.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "tier"])
            self._tiered[key] = {e: {t: metric.labels(*values, t) for t in TIER_NAMES}
                                 for e, values in per_engine_labelvalues.items()}
        self._plain = {key: create_metric_per_engine(
            self._counter_cls(name=name, documentation=doc, labelnames=labelnames), per_engine_labelvalues)
            for key, (name, doc) in _PLAIN.items()}
        self._bytes_metric = self._counter_cls(name="tierkv_bytes", documentation="Bytes moved, by tier and direction",
                                               labelnames=[*labelnames, "tier", "direction"])
        self._fail_metric = self._counter_cls(name="tierkv_failures", documentation="Blocks lost to tier failures",
                                              labelnames=[*labelnames, "tier", "reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues.get(engine_idx, [])
        for key, n in transfer_stats_data.items():
            if n <= 0:
                continue
            name, _, rest = key.partition(":")
            if name in self._tiered and rest in TIER_NAMES:
                self._tiered[name][engine_idx][rest].inc(n)
            elif name in self._plain and not rest:
                self._plain[name][engine_idx].inc(n)
            elif name == "bytes":
                self._bytes_metric.labels(*values, *rest.split(":", 1)).inc(n)
            elif name == "failures":
                self._fail_metric.labels(*values, *rest.split(":", 1)).inc(n)
