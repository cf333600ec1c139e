"""TierKVConnector: vLLM's KVConnectorBase_V1 over a TierKVStore (docs/design.md §13).

A thin facade: vLLM builds one instance per role, and each forwards to its
half — ``ConnectorScheduler`` (decides, scheduler process) or
``ConnectorWorker`` (moves bytes, worker process). The two may live in one
process or in two; they share no Python object: the scheduler decides from
what it reads durably (its view of the store: the L3 index, a shared L2, L4)
plus the worker's reports in vLLM's connector output (``metadata.py``);
``shared_store`` gives each process one store per config.

A cache must never fail a request: the connector sets vLLM's
``kv_load_failure_policy`` to ``recompute`` (logging it when it was
``fail``), so a block reported by ``get_block_ids_with_load_errors`` is
recomputed rather than failing its request.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from tierkv.config import L4Config, StoreConfig
from tierkv.connectors.vllm.config import load_config
from tierkv.connectors.vllm.identity import vllm_identity
from tierkv.connectors.vllm.layout import layout_from_kv_cache_config
from tierkv.connectors.vllm.metadata import TierKVMetadata
from tierkv.connectors.vllm.scheduler import ConnectorScheduler
from tierkv.catalog import other_layouts
from tierkv.connectors.vllm.shards import Cover, ShardedView, covers, is_primary, rank_config, rank_layouts
from tierkv.connectors.vllm.shared_store import acquire_store, release_store
from tierkv.connectors.vllm.stats import TierKVPromMetrics, TierKVStats
from tierkv.connectors.vllm.worker import ConnectorWorker

log = logging.getLogger("tierkv.connectors.vllm")


# vLLM's multiprocess executor gives a worker VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) to leave,
# then SIGTERMs it and SIGKILLs it 4 s later; a SIGTERM from outside (a stop of the whole
# process group) starts that clock too. The store's close must be done before the kill.
_KILL_AFTER_SIGTERM_S, _MARGIN_S = 4.0, 1.5


def shutdown_deadline(flush_s: float, now: float | None = None) -> float:
    """When the store's close must be done (a ``time.monotonic()`` value): ``io.shutdown_flush_s``
    from now, or sooner, ``_MARGIN_S`` before vLLM would SIGKILL the worker."""
    try:
        grace = float(os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "5"))
    except ValueError:
        grace = 5.0
    now = time.monotonic() if now is None else now
    return now + max(0.0, min(flush_s, grace + _KILL_AFTER_SIGTERM_S - _MARGIN_S))


def local_only(config: StoreConfig, reason: str) -> StoreConfig:
    """``config`` without the tiers another process could read (L3, L4, a shared L2): used when the
    model's identity cannot be known, so no KV is ever found under a key weaker than its weights."""
    log.warning("tierkv: the model's weights cannot be named by content (%s): L3, L4 and a shared "
                "L2 are off for this engine, a private L2 stays. Point vLLM at a local checkpoint, "
                "or set model_id in kv_connector_extra_config to vouch that the name fixes the "
                "weights.", reason)
    return replace(config, l3_enabled=False, l4=L4Config(),
                   l2=replace(config.l2, shared_name="") if config.l2.shared_name else config.l2)


class TierKVConnector(KVConnectorBase_V1):
    """Loads prefixes vLLM does not hold from tierkv's L2/L3/L4 and saves full blocks back."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise ValueError(
                f"parallel_config.pipeline_parallel_size: tierkv's connector supports 1, got "
                f"{par.pipeline_parallel_size} (a stage holds only its layers, and the scheduler cannot "
                f"tell a block held by every stage from one held by some; docs/design.md §13)")
        for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
            if getattr(par, name, 1) != 1:
                raise ValueError(f"parallel_config.{name}: tierkv's connector supports 1 (context "
                                 f"parallelism splits a block's tokens across ranks), got {getattr(par, name)}")
        xfer = vllm_config.kv_transfer_config
        if xfer.kv_load_failure_policy != "recompute":
            log.warning("tierkv: setting kv_load_failure_policy=recompute (was %r): a cache miss or "
                        "corrupt block must be recomputed, never fail the request", xfer.kv_load_failure_policy)
            xfer.kv_load_failure_policy = "recompute"
        model = vllm_config.model_config
        cfg = load_config(xfer.kv_connector_extra_config, model.model, getattr(model, "revision", None))
        layout, layer_names = layout_from_kv_cache_config(kv_cache_config)
        shards = rank_layouts(layout, par.tensor_parallel_size, model.get_total_num_kv_heads())
        self.settings = cfg.vllm
        self.identity = vllm_identity(vllm_config, cfg.store.model_id if cfg.model_id_declared else None)
        store_cfg = cfg.store if self.identity.known else local_only(cfg.store, self.identity.reason)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        ident = self.identity.identity
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._sources: list = []  # views of other TP sizes' shards this half reads (covers)
        stored = _stored_layouts(store_cfg)

        def options(lay):
            out = []
            for pieces in covers(lay, stored):
                views = [acquire_store(rank_config(store_cfg, src), src, "scheduler", ident) for src, *_ in pieces]
                self._sources.extend(views)
                out.append(Cover([(v, a, b, at) for v, (_, a, b, at) in zip(views, pieces)]))
            return out

        if is_scheduler:
            # One view per rank's shard (shards.py); the scheduler decides for all ranks.
            views = [acquire_store(rank_config(store_cfg, lay), lay, "scheduler", ident) for lay in shards]
            opts = [options(lay) for lay in shards]
            self.store = views[0] if len(views) == 1 and not opts[0] else ShardedView(views, opts)
            self._scheduler = ConnectorScheduler(self.store, cfg.vllm, store_cfg)
        else:
            rank = _tp_rank() if len(shards) > 1 else 0
            lay, primary = shards[rank], is_primary(shards, rank)
            # A replica (KV heads replicated across ranks) reads the primary's copy through a view.
            self.store = acquire_store(rank_config(store_cfg, lay), lay, "worker" if primary else "scheduler", ident)
            self._worker = ConnectorWorker(self.store, cfg.vllm, layer_names, rank, options(lay),
                                           replica=not primary)
        if self._sources:
            log.info("tierkv: %d other tensor-parallel layouts under %s are read where they hold more",
                     len(self._sources), store_cfg.l3.path)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- scheduler side -------------------------------------------------------

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> TierKVMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self):
        return self._scheduler.take_events()

    # -- stats (both sides) ---------------------------------------------------

    def get_kv_connector_stats(self):
        """This side's counter deltas since its last call (``stats.py``), or None when nothing changed."""
        half = self._scheduler if self._scheduler is not None else self._worker
        return half.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return TierKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ----------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta()

    def shutdown(self) -> None:
        """Finish this half (the worker lands its queued saves; see ``ConnectorWorker.shutdown``) and
        release the store: the last release closes it, writing L2-only blocks down to L3, all
        within ``shutdown_deadline``. Idempotent: vLLM may call it from more than one place."""
        if self.store is None:
            return
        deadline = shutdown_deadline(self.store.config.io.shutdown_flush_s)
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        store, self.store = self.store, None
        for each in [*getattr(store, "stores", [store]), *self._sources]:
            release_store(each, deadline)
        self._sources = []


def _stored_layouts(config: StoreConfig) -> list:
    """The layouts stored under ``l3.path`` (none without L3); ``catalog.other_layouts`` leaves out
    a damaged directory and one this process holds open already (this engine's own, when both
    halves share a process)."""
    if not config.l3_enabled:
        return []
    return [lay for _, lay, _ in other_layouts(config.l3.path, None)]


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM's TP group exists before it builds the connector)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
