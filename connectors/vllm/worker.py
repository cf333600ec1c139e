"""Worker side of the vLLM connector: moves blocks between the store and vLLM's KV cache.

Loads: when every block of a load sits in the worker's private L2,
``scatter_blocks`` reads them in place (``store.lend``, valid while pinned);
otherwise ``store.load`` reads the blocks into landing blocks (``landing.py``:
page-aligned, registered with L4; on the store's transfer threads), then
``scatter_blocks`` writes them into vLLM's
per-layer caches — inside ``start_load_kv`` for a synchronous load, from
``get_finished`` for an asynchronous one, whose request vLLM holds in
WAITING_FOR_REMOTE_KVS meanwhile. Only the leading run of good blocks is
written; the vLLM block ids from the first bad block on are reported by
``get_block_ids_with_load_errors`` so vLLM recomputes them.

Saves: ``gather_blocks`` copies this step's full blocks into staging
canonical blocks and ``store.put_blocks`` stores them. With ``save_async``
both run on one background thread; a block it still reads is never handed
back for reuse: vLLM delays freeing a finished request's blocks
(``finished_sending`` says when), preemptions and loads into such a block
wait for the thread first.

Removals: a listener on the store's index collects the keys of blocks that
leave every local tier (eviction out of L3, a failed load) and ships them with
the worker metadata; the scheduler side turns those it announced into
``BlockRemoved``. The listener runs on whichever thread changed the index,
under the store's lock, so it only takes ``_lock`` to append; nothing here
calls the store while holding ``_lock``.

Counters (``stats.py``): the blocks each load really put into vLLM's cache,
by tier, and the store's corrupt/failure/byte counters, as deltas in
``get_kv_connector_stats``; hit counts and namespace labels also go to the L3
directory's catalog (what ``tierkv ls`` / ``info`` show), on the save thread.

Shutdown (vLLM calls it when the worker exits, within its grace period):
saves already gathered are stored, then the store's close lands the
write-through copies still queued. A kill at any point loses queued blocks
whole: an L3 block is indexed in the same LMDB commit that follows its
fdatasync, so a reader never finds a torn or half-indexed block.

Called from vLLM's worker thread; the background save thread and the
removal listener share only the state guarded by ``_lock``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tierkv.connectors.vllm.config import VllmSettings
from tierkv.connectors.vllm.cpus import ThreadPinner, pin_thread
from tierkv.connectors.vllm.landing import LandingPool
from tierkv.connectors.vllm.layer_feed import LayerFeed
from tierkv.connectors.vllm.layout import cache_view, resolve_split
from tierkv.connectors.vllm.metadata import LoadSpec, TierKVMetadata, TierKVWorkerMetadata
from tierkv.connectors.vllm.shards import Cover, best
from tierkv.connectors.vllm.stats import TierKVStats, store_deltas
from tierkv.metrics import TIER_NAMES
from tierkv.kernels import gather_blocks, scatter_block_list, scatter_blocks
from tierkv.store import Match, TierKVStore
from tierkv.transfer import LoadHandle, LoadResult

log = logging.getLogger("tierkv.connectors.vllm")


_MIN_SLICE = 512 << 10  # an L3 read slice: large enough that a disk queue stays efficient


def read_parts(layout) -> int:
    """How many slices of whole layers an L3 read of one block is cut into (1: not cut): the most
    that divide the layers evenly, each at least ``_MIN_SLICE`` bytes and a whole O_DIRECT unit."""
    layer_bytes = layout.block_bytes // layout.num_layers
    best = 1
    for parts in range(2, layout.num_layers + 1):
        size = layer_bytes * (layout.num_layers // parts)
        if layout.num_layers % parts == 0 and size >= _MIN_SLICE and size % 4096 == 0:
            best = parts
    return best


@dataclass
class _Load:
    spec: LoadSpec
    match: Match
    handle: LoadHandle
    staging: torch.Tensor
    num_found: int
    lent: list[torch.Tensor] | None = None  # the blocks in place (a private L2), read while pinned


@dataclass
class _StepSaves:
    meta: TierKVMetadata
    ids: torch.Tensor
    staging: torch.Tensor
    gathered: set[int] = field(default_factory=set)


class ConnectorWorker:
    def __init__(self, store: TierKVStore, settings: VllmSettings, layer_names: Sequence[str],
                 rank: int = 0, covers: Sequence[Cover] = (), replica: bool = False) -> None:
        self.store = store
        # A replica's heads are stored by another rank (shards.is_primary): it saves nothing and
        # reports each save whole, so the scheduler's count (the fewest any rank stored) is the primary's.
        self.replica = replica
        self.rank = rank  # tensor-parallel rank: its store holds that rank's shard of KV heads
        self.covers = list(covers)  # other TP sizes' shards of its heads (shards.py), read where they hold more
        self.settings = settings
        self.layout = store.layout
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.layer_names = list(layer_names)
        self.kv: torch.Tensor | None = None
        self._async: dict[str, _Load] = {}
        self._errors: set[int] = set()
        self._step: _StepSaves | None = None
        self._lock = threading.Lock()
        self._loads_done: set[str] = set()
        self._saves_done: dict[int, int] = {}
        self._removed: list[bytes] = []
        self._putting: set[bytes] = set()
        self._put_removed: list[bytes] = []
        self._loads_short: dict[str, int] = {}
        self._running: Counter[str] = Counter()
        self._reading: Counter[int] = Counter()
        self._report: set[str] = set()
        self._jobs: list[Future] = []
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="tierkv-vllm-save",
                                         initializer=pin_thread, initargs=(settings.io_cpus,))
        self._feed = LayerFeed(settings.io_cpus)
        self._pinner = ThreadPinner(settings.io_cpus)
        self._fed: list[_Load] | None = None  # this step's loads on the feed thread, until joined
        self._by_layer = False  # set by register_kv_caches
        self._parts = read_parts(self.layout)
        self.landing = LandingPool(store, settings.landing_blocks)
        # Without L2 and L3 the index tracks nothing the connector saved (L4 is untracked).
        self._listening = store.l2 is not None or store.l3 is not None
        if self._listening:
            store.index.add_removal_listener(self._on_removed)
        self._stats = TierKVStats()
        self._store_seen: dict[str, int] = {}
        self._catalog = None
        if store.l3 is not None:
            from tierkv.catalog import Catalog

            try:
                self._catalog = Catalog(store.config.l3.path)
            except Exception as exc:  # advisory: a missing catalog costs the tools' hit counts only
                log.warning("tierkv: cannot open the L3 catalog (%r); hit counts are not recorded", exc)
        self._labelled: set[bytes] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer caches as one strided view; refuses a layout it does not know."""
        first = kv_caches[self.layer_names[0]] if self.layer_names[0] in kv_caches else next(iter(kv_caches.values()))
        split = resolve_split(self.settings.kv_split, first.device)
        self.kv = cache_view(kv_caches, self.layer_names, self.layout, split)
        self._by_layer = self.settings.load_by_layer == "auto" and self.kv.device.type == "cpu"
        self._pinner.pin_new()  # vLLM has bound its threads by now; the store's were started earlier

    def bind(self, meta: TierKVMetadata) -> None:
        """This step's metadata: note the requests to report once saved; pass on the finished ones'
        output lengths to the store (an eviction hint; a key the store no longer holds is skipped)."""
        self._report |= meta.report_when_saved
        for keys, output_tokens in meta.finished:
            self.store.finished(keys, output_tokens)

    # -- loads ----------------------------------------------------------------

    def start_load_kv(self, meta: TierKVMetadata) -> None:
        """Start every load of this step. Synchronous ones are finished before returning, or, on a
        CPU cache, handed to the feed thread, which writes them layer by layer while the forward
        runs (``wait_for_layer_load``); they are accounted for when the step ends (``_join_feed``)."""
        self._join_feed()
        pending = [self._start(spec) for spec in meta.loads]
        fed = []
        for load in pending:
            if load.spec.is_async:
                self._async[load.spec.req_id] = load
            elif self._by_layer and load.num_found:
                self._wait_for_readers(load.spec.block_ids[: load.num_found])
                fed.append(load)
            else:
                self._finish(load)
        if fed:
            self._fed = fed
            self._feed.start(lambda ready: self._feed_job(fed, ready))
        if pending:
            self._pinner.pin_new()  # threads the store started for these loads (readers, copies)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this step's synchronous loads have written ``layer_name`` (at once if none)."""
        if self._fed is not None and layer_name in self.layer_index:
            self._feed.wait(self.layer_index[layer_name])

    def _feed_job(self, fed: list[_Load], ready) -> list[int]:
        """Feed thread: write the loads into vLLM's cache one layer at a time, announcing each;
        returns each load's count of good leading blocks. A load read in slices (L3) is written
        slice by slice as it lands, before it is verified: its blocks that then fail verification
        are reported as errors, so vLLM drops this step's output for it and recomputes."""
        sliced = [load.handle.parts > 1 for load in fed]
        goods = [load.num_found if s else self._good(load) for load, s in zip(fed, sliced)]
        ids = [torch.tensor(load.spec.block_ids[:good], dtype=torch.int64, device=self.kv.device)
               for load, good in zip(fed, goods)]
        per_part = len(self.layer_names) // self._parts
        for layer in range(len(self.layer_names)):
            for load, s, good, block_ids in zip(fed, sliced, goods, ids):
                if s and layer % per_part == 0:
                    load.handle.wait_part(layer // per_part)
                if good:
                    self._scatter(load, good, block_ids, layer, layer + 1)
            ready(layer + 1)
        return [self._good(load) if s else good for load, s, good in zip(fed, sliced, goods)]

    def _join_feed(self) -> None:
        """Account for the feed thread's loads once its job ends (vLLM's thread, after the forward).
        A failed job, or a layer the forward did not wait for (its attention may have read the cache
        before the feed wrote it), makes every block of those loads an error: vLLM drops the step's
        output for those requests and recomputes them."""
        if self._fed is None:
            return
        fed, self._fed = self._fed, None
        goods, exc, waited = self._feed.join()
        missing = len(self.layer_names) - len(waited)
        if exc is not None:
            log.warning("tierkv: layer-by-layer load failed (%r); vLLM recomputes those blocks", exc)
            goods = [0] * len(fed)
        elif missing:
            log.warning("tierkv: vLLM waited for %d of %d layers of a layer-by-layer load; those blocks are "
                        "recomputed and loads finish before the forward from now on",
                        len(waited), len(self.layer_names))
            self._by_layer = False
            goods = [0] * len(fed)
        for load, good in zip(fed, goods):
            self._account(load, good)

    def _start(self, spec: LoadSpec) -> _Load:
        m, cover = best(self.store, spec.keys, self.covers, True)
        end = min(m.num_blocks, len(spec.keys))
        found = max(0, end - spec.start)
        if cover is not None:  # another TP size's shards hold more: read and assemble them, now
            staging = self.landing.take(found)
            if found:
                handle = cover.load(m, spec.start, staging[:found])
            else:
                cover.release(m)
                handle = LoadHandle.completed(LoadResult([]))
            return _Load(spec, m, handle, staging, found)
        sub = Match(m.keys[spec.start : spec.start + found], m.tiers[spec.start : spec.start + found],
                    m.entries[spec.start : spec.start + found], m.block_size)
        lent = self.store.lend(sub) if found else None
        if lent is not None:  # scattered straight from where they sit: no copy into landing slots
            return _Load(spec, m, LoadHandle.completed(LoadResult([True] * found)), None, found, lent)
        staging = self.landing.take(found)
        if found:
            # Fed layer by layer: L3 reads each block in slices of whole layers, first layers first.
            parts = self._parts if self._by_layer and not spec.is_async else 1
            handle = self.store.load(sub, list(staging.unbind(0)), parts)
        else:
            handle = LoadHandle.completed(LoadResult([]))
        return _Load(spec, m, handle, staging, found)

    def _good(self, load: _Load) -> int:
        """Wait for a load's reads; the length of its leading run of good blocks (a failure is a miss)."""
        try:
            ok = load.handle.wait().ok
        except Exception as exc:  # a failed load is a miss, never a failed request
            log.warning("tierkv: load for %s failed (%r); vLLM recomputes it", load.spec.req_id, exc)
            ok = [False] * load.num_found
        good = 0
        while good < load.num_found and ok[good]:
            good += 1
        return good

    def _scatter(self, load: _Load, good: int, ids: torch.Tensor, lo: int, hi: int) -> None:
        """Write layers ``[lo, hi)`` of the load's first ``good`` blocks into vLLM blocks ``ids``."""
        kv = self.kv[lo:hi]
        if load.lent is not None:
            # One call for all the blocks (on CPU); synchronous on CUDA (the pin ends with release
            # in _account, after this).
            scatter_block_list(kv, ids, [block[lo:hi] for block in load.lent[:good]])
        else:
            # On CUDA, .to() returns once the host blocks are read (they are not pinned), so
            # the landing slots can go back right after.
            scatter_blocks(kv, ids, load.staging[:good, lo:hi].to(kv.device, non_blocking=True))

    def _finish(self, load: _Load) -> None:
        """Finish a load now: wait, write every layer, account."""
        good = self._good(load)
        if good:
            self._wait_for_readers(load.spec.block_ids[:good])
            ids = torch.tensor(load.spec.block_ids[:good], dtype=torch.int64, device=self.kv.device)
            self._scatter(load, good, ids, 0, len(self.layer_names))
        self._account(load, good)

    def _account(self, load: _Load, good: int) -> None:
        """Hand back the load's slots and pins; errors, counters and the report for its first ``good``."""
        spec = load.spec
        if load.staging is not None:
            self.landing.give_back(load.staging)
        self._errors.update(spec.block_ids[good:])
        self.store.release(load.match)
        with self._lock:
            for tier in load.match.tiers[spec.start : spec.start + good]:
                self._stats.add(f"hits:{TIER_NAMES[tier]}")
            self._stats.add("load_errors", len(spec.block_ids) - good)
        if good and self._catalog is not None:
            self._saver.submit(self._catalog_job, self._catalog.count_hits, spec.keys[spec.start : spec.start + good])
        with self._lock:
            self._loads_done.add(spec.req_id)
            if good < len(spec.block_ids):
                self._loads_short[spec.req_id] = spec.start + good

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose delayed free may happen now, requests whose async load completed)."""
        self._join_feed()
        recving = set()
        for req_id, load in list(self._async.items()):
            if load.handle.done():
                del self._async[req_id]
                self._finish(load)
                recving.add(req_id)
        with self._lock:
            sending = {r for r in self._report if self._running[r] == 0}
        self._report -= sending
        return sending or None, recving or None

    def take_stats(self) -> TierKVStats | None:
        """Counter deltas since the last call (this worker's loads and saves, its store's counters)."""
        snapshot = self.store.metrics.snapshot()
        with self._lock:
            store_deltas(snapshot, self._store_seen, self._stats)
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, TierKVStats()
        return stats

    def _catalog_job(self, fn, *args) -> None:
        """Save thread: one catalog write; advisory, so a failure is logged, never raised."""
        try:
            fn(*args)
        except Exception as exc:
            log.warning("tierkv: catalog write failed (%r)", exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._join_feed()
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ----------------------------------------------------------------

    def _step_for(self, meta: TierKVMetadata) -> _StepSaves:
        if self._step is None or self._step.meta is not meta:
            ids = [b for spec in meta.saves for b in spec.block_ids]
            staging = torch.empty((len(ids), *self.layout.block_shape), dtype=self.layout.torch_dtype,
                                  device=self.kv.device)
            self._step = _StepSaves(meta, torch.tensor(ids, dtype=torch.int64, device=self.kv.device), staging)
        return self._step

    def save_kv_layer(self, layer_name: str, meta: TierKVMetadata) -> None:
        """Synchronous saves gather each layer as soon as vLLM has written it."""
        if not meta.saves or self.settings.save_async or self.replica or layer_name not in self.layer_index:
            return
        step = self._step_for(meta)
        self._gather(step, [self.layer_index[layer_name]])

    def _gather(self, step: _StepSaves, layers: Sequence[int]) -> None:
        for layer in layers:
            if layer not in step.gathered:
                gather_blocks(self.kv[layer : layer + 1], step.ids, step.staging[:, layer : layer + 1])
                step.gathered.add(layer)

    def wait_for_save(self, meta: TierKVMetadata) -> None:
        """Store this step's full blocks: now, or on the save thread with ``save_async``."""
        self._join_feed()
        if not meta.saves:
            return
        if self.replica:
            with self._lock:
                for spec in meta.saves:
                    self._saves_done[spec.save_id] = len(spec.block_ids)
            return
        step = self._step_for(meta)
        self._step = None
        every = range(len(self.layer_names))
        if not self.settings.save_async:
            self._gather(step, every)
            self._put(step, step.staging.cpu())
            return
        on_cuda = self.kv.device.type == "cuda"
        event = None
        if on_cuda:  # gather on the compute stream; the thread only waits for it
            self._gather(step, every)
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            for spec in meta.saves:
                self._running[spec.req_id] += 1
                self._reading.update(spec.block_ids)
        self._jobs = [j for j in self._jobs if not j.done()]
        self._jobs.append(self._saver.submit(self._save_job, step, event))

    def _save_job(self, step: _StepSaves, event) -> None:
        try:
            if event is not None:
                event.synchronize()
                staging = step.staging.cpu()
            else:
                self._gather(step, range(len(self.layer_names)))
                staging = step.staging
            self._put(step, staging)
        except Exception as exc:  # a failed save is a future miss, never a failed request
            log.warning("tierkv: background save failed (%r); those blocks stay uncached", exc)
            with self._lock:
                for spec in step.meta.saves:
                    self._saves_done.setdefault(spec.save_id, 0)
        finally:
            with self._lock:
                for spec in step.meta.saves:
                    self._running[spec.req_id] -= 1
                    self._reading.subtract(spec.block_ids)
                self._reading = +self._reading

    def _put(self, step: _StepSaves, staging: torch.Tensor) -> None:
        first = 0
        for spec in step.meta.saves:
            n = len(spec.block_ids)
            with self._lock:
                self._putting = set(spec.keys[spec.start : spec.start + n])
            flags = None
            try:
                flags = self.store.put_blocks(spec.keys, list(staging[first : first + n].unbind(0)), spec.start)
            finally:
                with self._lock:
                    if flags is not None:
                        good = 0
                        while good < n and flags[good]:
                            good += 1
                        self._saves_done[spec.save_id] = good
                        self._stats.add("saved", good)
                    # Shipped with (never before) this save's report: else the scheduler would
                    # see the removal first and then announce a block already gone as stored.
                    self._removed.extend(self._put_removed)
                    self._putting, self._put_removed = set(), []
            first += n
            root = spec.keys[0] if spec.keys else None
            if self._catalog is not None and spec.start == 0 and root not in self._labelled:
                self._labelled.add(root)
                self._catalog_job(self._catalog.label, [root], self.store.config.namespace)

    def _on_removed(self, key: bytes) -> None:
        """Index removal listener: runs under the store's lock on any thread; only records."""
        with self._lock:
            (self._put_removed if key in self._putting else self._removed).append(key)

    def _wait_for_readers(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            busy = any(self._reading[b] for b in block_ids)
        if busy:
            self._drain()

    def _drain(self) -> None:
        for job in self._jobs:
            job.result()
        self._jobs = []

    def handle_preemptions(self, meta: TierKVMetadata) -> None:
        """vLLM freed the preempted requests' blocks: finish saves that still read them."""
        self._join_feed()
        with self._lock:
            busy = any(self._running[r] for r in meta.preempted)
        if busy:
            self._drain()

    def build_worker_meta(self) -> TierKVWorkerMetadata | None:
        self._join_feed()
        with self._lock:
            if not (self._loads_done or self._saves_done or self._removed):
                return None
            meta = TierKVWorkerMetadata(self._loads_done, self._saves_done, self._removed, self._loads_short,
                                        rank=self.rank)
            self._loads_done, self._saves_done, self._removed, self._loads_short = set(), {}, [], {}
        return meta

    def shutdown(self) -> None:
        self._join_feed()
        self._feed.shutdown()
        self._drain()
        self._saver.shutdown(wait=True)
        if self._listening:
            self.store.index.remove_removal_listener(self._on_removed)
        for load in self._async.values():
            try:
                load.handle.wait()
            except Exception:  # shutting down: the outcome no longer matters
                pass
            self.store.release(load.match)
            self.landing.give_back(load.staging)
        self._async.clear()
        self.landing.close()
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
