"""TierKVStore: the facade that wires index, policy, cost model, tiers and transfers (docs/design.md §6).

Ownership in one paragraph: the store owns the index and every tier. L1 slots
are handed to the engine by ``allocate``; a slot the engine holds is *private*
until ``save`` adopts it as a cached block, after which the index owns it and
the request that saved it holds a pin until ``release``. Pinned blocks are
never evicted from any tier. A full tier demotes its victim one tier down
(L1 -> L2 -> L3 -> L4 -> gone) unless the lower tier already holds it.

Thread-safety: every public method is safe to call from any thread; state
changes happen under one lock, byte copies of loads run on transfer threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tierkv.config import StoreConfig
from tierkv.cost import CostModel, calibrate
from tierkv.events import TierEvents, TierListener
from tierkv.hashing import BlockHash, BlockHasher
from tierkv.index import LOCAL_TIERS, Entry, PrefixIndex, Tier
from tierkv.layout import KVLayout
from tierkv.metrics import TIER_NAMES, Metrics
from tierkv.policy import make_policy
from tierkv.tiers.base import Lineage
from tierkv.tiers.device import DeviceTier, OutOfBlocks
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.host import HostTier
from tierkv.tiers.remote import trailer_room
from tierkv.store_writes import L4_MAX_QUEUED, StoreWrites
from tierkv.transfer import LoadHandle, LoadResult, TransferEngine, gather_futures, now

__all__ = ["Match", "OutOfBlocks", "TierKVStore"]


@dataclass
class Match:
    """The longest usable cached prefix of a prompt, as found by ``lookup``.

    ``tiers[i]`` is the tier block i will be read from; ``pinned`` lists the
    entries this match holds a pin on (released by ``store.release``).
    """

    keys: list[BlockHash]
    tiers: list[int]
    entries: list[Entry | None]
    block_size: int
    est_load_us: float = 0.0
    est_recompute_us: float = 0.0
    pinned: list[Entry] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def num_tokens(self) -> int:
        return len(self.tiers) * self.block_size

    @property
    def counts(self) -> dict[str, int]:
        out = {name: 0 for name in TIER_NAMES}
        for t in self.tiers:
            out[TIER_NAMES[t]] += 1
        return out

    @property
    def to_load(self) -> list[int]:
        """Positions of matched blocks that are not already in L1."""
        return [i for i, t in enumerate(self.tiers) if t != Tier.L1]

    def l1_slots(self) -> list[int | None]:
        """Per matched block, its L1 slot if it is an L1 hit, else None."""
        return [e.l1_slot if t == Tier.L1 else None for t, e in zip(self.tiers, self.entries)]


class TierKVStore(StoreWrites):
    def __init__(self, config: StoreConfig | None = None, layout: KVLayout | None = None, *,
                 l1_blocks: int | None = None) -> None:
        if layout is None:
            raise ValueError("layout: a KVLayout is required")
        self.config = cfg = config or StoreConfig()
        self.layout = layout
        self.block_size = layout.block_size
        self.metrics = Metrics()
        self.hasher = BlockHasher(cfg.hashing.algorithm, bytes.fromhex(cfg.hashing.key) if cfg.hashing.key else None)
        self._seeds: dict[tuple, bytes] = {}
        self._lock = threading.RLock()
        n1 = cfg.l1.num_blocks if l1_blocks is None else l1_blocks
        # With a Mooncake L4 each CPU slot keeps room for a value trailer: values land in one piece.
        room = trailer_room(cfg.l4.url)
        self.l1 = DeviceTier(layout, n1, cfg.l1.device, slot_room=room) if n1 > 0 else None
        n2 = cfg.l2.capacity // layout.block_bytes
        self.l2 = HostTier(layout, n2, cfg.l2.shared_name, cfg.l2.pin) if n2 > 0 else None
        n3 = cfg.l3.capacity // layout.block_bytes
        self.l3 = None
        if cfg.l3_enabled and n3 > 0:
            meta = {"model_id": cfg.model_id, "model_revision": cfg.model_revision}
            self.l3 = DiskTier(cfg.l3.path, layout, n3, meta, cfg.l3.direct_io, self._on_failure)
        # Queued L4 puts copy their block into the outbox: registered with the pool's client (with
        # trailer room where it uses it), so the put moves it without another copy.
        self._l4_outbox = DeviceTier(layout, L4_MAX_QUEUED, "cpu", slot_room=room) if cfg.l4.url else None
        self.l4 = self._open_remote() if cfg.l4.url else None
        self._l4_lock = threading.Lock()
        self._l4_queued = 0  # copies taken for L4 and not yet sent (pending or in the put running now)
        self._l4_pending: list = []  # (key, outbox slot, lineage) waiting for the IO thread
        self._l4_sending = False  # an IO-thread job is draining _l4_pending
        self._tiers = [self.l1, self.l2, self.l3]
        device = self.l1.device if self.l1 is not None else torch.device("cpu")
        measured = calibrate(layout.block_bytes, layout.block_size, device=str(device),
                             disk_dir=cfg.l3.path if self.l3 is not None else None) if cfg.cost.calibrate else None
        self.cost = CostModel.from_config(cfg.cost, layout.block_bytes, layout.block_size, measured)
        context = {"cost": self.cost, "half_life": cfg.policy.half_life, "reuse_exponent": cfg.policy.reuse_exponent}
        policies = [make_policy(cfg.policy.name, t, lower=self._lower(t), **context)
                    if self._tiers[t] is not None else None for t in LOCAL_TIERS]
        self.index = PrefixIndex(policies, cfg.policy.half_life)
        self.events = self.index.events = TierEvents()
        self._persisting: set[bytes] = set()
        self.transfer = TransferEngine(device)
        self._scratch = torch.empty(layout.block_shape, dtype=layout.torch_dtype)
        if self.l3 is not None:
            self._rebuild_from_l3()

    @classmethod
    def from_config_file(cls, path: str | os.PathLike, layout: KVLayout, **kwargs) -> TierKVStore:
        return cls(StoreConfig.load(path), layout, **kwargs)

    def _open_remote(self):
        from tierkv.tiers.remote import open_remote

        tier = open_remote(self.config.l4, self.layout, self._on_failure)
        # Loads from L4 land in L1 slots (or L2 slots): registered once, a pool client that moves
        # data by registered memory (Mooncake) fills them without a staging copy.
        for pool in (self.l1, self._l4_outbox):
            if pool is not None:
                tier.register(pool.pool, room=pool.slot_room)
        if self.l2 is not None:
            tier.register(self.l2.slab)
        return tier

    def _on_failure(self, tier: str, reason: str, n: int, detail: str) -> None:
        self.metrics.failure(tier, reason, n, detail)

    def _rebuild_from_l3(self) -> None:
        # A bad record never fails the start: the tier dropped (and counted) the malformed ones
        # and those past the end of its slot file when it opened, and records() skips any
        # written since and ends a walk LMDB cannot finish (counted) instead of raising.
        records = sorted(self.l3.records(), key=lambda r: r.depth)
        with self._lock:
            for rec in records:
                self.index.add(rec.key, rec.parent, rec.depth, Tier.L3)

    # -- keys -----------------------------------------------------------------

    def seed(self, namespace: str | None = None, extra_keys: Sequence[str] = ()) -> bytes:
        ns = self.config.namespace if namespace is None else namespace
        k = (ns, tuple(extra_keys))
        s = self._seeds.get(k)
        if s is None:
            s = self._seeds[k] = self.hasher.seed(self.config.model_id, self.config.model_revision,
                                                  self.layout.fingerprint, ns, extra_keys)
        return s

    def hash(self, token_ids: Sequence[int], namespace: str | None = None,
             extra_keys: Sequence[str] = ()) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids`` (docs/design.md §3). Pure; thread-safe."""
        return self.hasher.hash_blocks(token_ids, self.block_size, self.seed(namespace, extra_keys))

    # -- lookup ---------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], namespace: str | None = None,
               extra_keys: Sequence[str] = (), pin: bool = True) -> Match:
        """Longest cached prefix of ``token_ids``, fastest tier per block, cut by the cost model.

        With ``pin`` (default) every matched local block is pinned until
        ``release(match)``, so nothing the match names is evicted before it is loaded.
        """
        return self.lookup_keys(self.hash(token_ids, namespace, extra_keys), pin)

    def lookup_keys(self, keys: Sequence[BlockHash], pin: bool = True) -> Match:
        """``lookup`` for callers that already hold the chain of block hashes."""
        keys = list(keys)
        with self._lock:
            tiers = self.index.match(keys)
            if len(tiers) < len(keys) and (self.l3 is not None or (self.l2 is not None and self.l2.shared)):
                self._probe_shared(keys, tiers)
            if len(tiers) == len(keys) or self.l4 is None:
                return self._matched(keys, tiers, pin)  # one lock section: tiers cannot go stale
            local = len(tiers)
            held = [self.index.get(k) for k in keys[:local]]
            self.index.pin(held)  # the local prefix stays cached while L4 is asked without the lock
        try:  # a slow or dead pool delays this lookup only, never the store
            for hit in self._probe_l4(keys[local:]):
                if not hit:
                    break
                tiers.append(Tier.L4)
        finally:
            with self._lock:
                self.index.unpin(held)
        with self._lock:
            # Pinned, the prefix stayed cached but may have changed tier meanwhile (a load by
            # another request, or a failed one): match it again so every tier named is current.
            now_local = self.index.match(keys[:local])
            tiers = now_local if len(now_local) < local else now_local + tiers[local:]
            return self._matched(keys, tiers, pin)

    def _matched(self, keys: list[BlockHash], tiers: list[int], pin: bool) -> Match:
        """Caller holds the lock: cut ``tiers`` by cost, pin and touch the local blocks, count."""
        tiers = tiers[: self.cost.cut(tiers, self.block_size)]
        entries = [self.index.get(k) if t != Tier.L4 else None for k, t in zip(keys, tiers)]
        local = [e for e in entries if e is not None]
        m = Match(keys, tiers, entries, self.block_size)
        m.est_load_us, m.est_recompute_us = self.cost.estimate_us(tiers, len(keys), self.block_size)
        if pin:
            self.index.pin(local)
            m.pinned = list(local)
        selective = self.config.policy.write == "write_through_selective"
        unselected = [e for e in local if e.freq <= 1.0] if selective else []
        self.index.touch(local)
        if selective:
            # freq > 1 only after a block's second hit (each hit adds 1, decay keeps the rest > 0).
            # L2/L3 copies are redone whenever a selected block lacks them; L4, which the index
            # does not track, gets one copy, at the hit that selects the block.
            self._persist_async([e for e in local if e.freq > 1.0], [e for e in unselected if e.freq > 1.0])
        self.metrics.count_lookup(tiers, len(keys) - len(tiers))
        return m

    def _probe_l4(self, keys: list[BlockHash]) -> list[bool]:
        """One batched L4 membership call; a failing pool is all misses (the tier counts why)."""
        try:
            return self.l4.contains(keys)
        except Exception as exc:  # the tier never raises for a pool failure; this guards its bugs
            self._on_failure("l4", "error", len(keys), repr(exc))
            return [False] * len(keys)

    def _probe_shared(self, keys: list[BlockHash], tiers: list[int]) -> None:
        """Blocks other processes put in a shared L2 slab or in L3 since we opened them."""
        start = len(tiers)
        rest = keys[start:]
        none = [False] * len(rest)
        in_l2 = self.l2.contains(rest) if self.l2 is not None and self.l2.shared else none
        in_l3 = self.l3.contains(rest) if self.l3 is not None else none
        for i, (l2_hit, l3_hit) in enumerate(zip(in_l2, in_l3), start):
            if not (l2_hit or l3_hit):
                break
            parent = keys[i - 1] if i else None
            for tier, hit in ((Tier.L2, l2_hit), (Tier.L3, l3_hit)):
                if hit:
                    self.index.add(keys[i], parent, i, tier)
            tiers.append(Tier.L2 if l2_hit else Tier.L3)

    # -- L1 slots -------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` private L1 slots, evicting unpinned cached blocks down a tier as needed.

        The caller owns them until it ``free``s them or ``save`` adopts them.
        Raises OutOfBlocks when L1 cannot make room (everything pinned).
        """
        if self.l1 is None:
            raise OutOfBlocks("l1: this store has no L1 tier")
        with self._lock:
            while self.l1.num_free < n:
                if not self._evict(Tier.L1):
                    raise OutOfBlocks(f"l1: need {n} slots, {self.l1.num_free} free, nothing evictable")
            return self.l1.allocate(n)

    def free(self, slots: Sequence[int]) -> None:
        """Return private L1 slots (never adopted ones) to the free list."""
        with self._lock:
            self.l1.free(list(slots))

    # -- eviction -------------------------------------------------------------

    def _lower(self, tier: int) -> int | None:
        for t in range(tier + 1, len(LOCAL_TIERS)):
            if self._tiers[t] is not None:
                return t
        return Tier.L4 if self.l4 is not None else None

    def _evict(self, tier: int) -> bool:
        entry = self.index.victim(tier)
        if entry is None:
            return False
        self._demote(entry, tier)
        self.metrics.add("evictions", TIER_NAMES[tier])
        return True

    def _block_view(self, entry: Entry, tier: int) -> torch.Tensor | None:
        if tier == Tier.L1:
            return self.l1.block(entry.l1_slot)
        if tier == Tier.L2:
            if self.l2.shared:  # another process may be reusing the slot: copy out and verify
                buf = torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype)
                return buf if self.l2.get([entry.key], [buf])[0] else None
            slot = self.l2.slot_of(entry.key)
            return None if slot is None else self.l2.block(slot)
        ok = self.l3.get([entry.key], [self._scratch])[0]
        return self._scratch if ok else None

    def _demote(self, entry: Entry, tier: int) -> None:
        key, lower = entry.key, self._lower(tier)
        src = None
        # One tier down; when that tier cannot take it (full of pinned blocks, of another
        # process's blocks in a shared slab, a full disk), the next one: a victim never
        # vanishes while some tier below could keep it.
        while lower is not None and (lower == Tier.L4 or not entry.in_tier(lower)):
            src = self._block_view(entry, tier) if src is None else src
            if src is None or self._put_lower(entry, lower, src) or lower == Tier.L4:
                break
            lower = self._lower(lower)
        if src is not None:
            self.transfer.d2h_sync()  # the device slot is reused as soon as we return
        if tier == Tier.L1:
            slot = entry.l1_slot
            self.index.drop(key, Tier.L1)
            self.l1.free([slot])
        else:
            self._tiers[tier].remove([key])
            self.index.drop(key, tier)

    def _put_lower(self, entry: Entry, tier: int, src: torch.Tensor) -> bool:
        lineage = [Lineage(entry.parent, entry.depth)]
        if tier == Tier.L4:
            return self._put_l4_async(entry.key, src, lineage)
        self._make_room(tier, 1)
        ok = self._tiers[tier].put([entry.key], [src], lineage)[0]
        if ok:
            self.index.add(entry.key, entry.parent, entry.depth, tier)
            self.metrics.add("bytes", (TIER_NAMES[tier], "write"), self.layout.block_bytes)
        return ok

    def _make_room(self, tier: int, n: int) -> None:
        t = self._tiers[tier]
        while t.capacity - (self.index.counts[tier] if tier != Tier.L3 else t.used) < n:
            if not self._evict(tier):
                return

    # -- load -----------------------------------------------------------------

    def load(self, m: Match, dst: Sequence[int] | Sequence[torch.Tensor]) -> LoadHandle:
        """Copy the matched blocks that are not in L1 into ``dst``, asynchronously.

        ``dst`` has one entry per position of ``m.to_load``: L1 slots the caller
        allocated (loaded blocks are then adopted into L1, pinned by ``m``), or
        tensors of the block shape (nothing adopted). The handle's result says
        per matched block whether it is usable; only the leading run counts
        (``num_ok``) — the caller recomputes from the first failure.
        """
        positions = m.to_load
        if len(dst) != len(positions):
            raise ValueError(f"load: dst has {len(dst)} entries for {len(positions)} blocks to load")
        handle = LoadHandle()
        if not positions:
            handle._finish(LoadResult([True] * m.num_blocks, 0.0, [False] * m.num_blocks))
            return handle
        slots = dst if dst and isinstance(dst[0], int) else None
        views = [self.l1.block(s) for s in dst] if slots is not None else list(dst)
        ok = [True] * m.num_blocks
        started = now()
        futures = []
        with self._lock:
            by_tier: dict[int, list[int]] = {}
            for j, i in enumerate(positions):
                by_tier.setdefault(m.tiers[i], []).append(j)
            for tier, js in by_tier.items():
                futures.append(self._start_reads(m, tier, [positions[j] for j in js], [views[j] for j in js], ok))

        def finish() -> None:
            try:
                result = self._finish_load(m, positions, slots, ok, started)
            except BaseException as exc:  # a programming error: surface it to the waiter
                handle._finish(None, exc)
                return
            handle._finish(result)

        gather_futures(futures, finish)
        return handle

    def _start_reads(self, m: Match, tier: int, pos: list[int], views: list[torch.Tensor], ok: list[bool]):
        keys = [m.keys[i] for i in pos]
        if tier == Tier.L2:
            # Through the tier's get: on a shared slab another process may free and reuse
            # a slot while this copy waits (pins are per process); get verifies the checksum.
            fut = self.transfer.copy(self.l2.get, keys, views)
        elif tier == Tier.L3:
            fut = self.transfer.io(self.l3.get, keys, views)
        else:
            fut = self.transfer.io(self.l4.get, keys, views)

        def record(f) -> None:
            try:
                flags = f.result()
            except Exception as exc:  # a tier that raised is a tier that missed
                self._on_failure(TIER_NAMES[tier], "error", len(pos), repr(exc))
                flags = [False] * len(pos)
            for i, flag in zip(pos, flags):
                ok[i] = flag
            self.metrics.add("bytes", (TIER_NAMES[tier], "read"), sum(flags) * self.layout.block_bytes)

        fut.add_done_callback(record)
        return fut

    def _finish_load(self, m: Match, positions: list[int], slots, ok: list[bool], started: float) -> LoadResult:
        adopted = [False] * m.num_blocks
        with self._lock:
            first_bad = next((i for i, flag in enumerate(ok) if not flag), m.num_blocks)
            for j, i in enumerate(positions):
                key, tier = m.keys[i], m.tiers[i]
                if not ok[i]:
                    # L3 already removed a bad block itself; L2 and L4 misses need no cleanup there.
                    if tier == Tier.L2:
                        self.l2.remove([key])
                    if tier != Tier.L4:
                        self.index.drop(key, tier)
                    continue
                if slots is None or i >= first_bad:
                    continue
                entry = self.index.get(key)
                if entry is not None and entry.in_tier(Tier.L1):
                    continue
                parent = m.keys[i - 1] if i else None
                entry = self.index.add(key, parent, i, Tier.L1)
                entry.l1_slot = slots[j]
                if m.entries[i] is not entry:
                    self.index.pin([entry])
                    m.pinned.append(entry)
                    m.entries[i] = entry
                adopted[i] = True
        elapsed = now() - started
        self.metrics.observe_load(elapsed)
        return LoadResult(ok, elapsed, adopted)

    # -- save / release -------------------------------------------------------

    def save(self, keys: Sequence[BlockHash], slots: Sequence[int], start: int = 0,
             match: Match | None = None) -> list[bool]:
        """Adopt the filled L1 slots of blocks ``start .. start+len(slots)`` of the chain ``keys``.

        An adopted slot becomes a cached block owned by the index and pinned
        (added to ``match.pinned`` when given; otherwise the caller must
        ``release_entries`` it). A block already cached in L1 is not adopted:
        the caller keeps its private slot. Returns adopted per slot.
        """
        out = []
        adopted: list[Entry] = []
        with self._lock:
            for j, slot in enumerate(slots):
                i = start + j
                key = keys[i]
                entry = self.index.get(key)
                if entry is not None and entry.in_tier(Tier.L1):
                    out.append(False)
                    continue
                entry = self.index.add(key, keys[i - 1] if i else None, i, Tier.L1)
                entry.l1_slot = slot
                self.index.pin([entry])
                if match is not None:
                    match.pinned.append(entry)
                out.append(True)
                adopted.append(entry)
            if self.config.policy.write == "write_through":
                self._persist_async(adopted)
        return out

    def put_blocks(self, keys: Sequence[BlockHash], blocks: Sequence[torch.Tensor], start: int = 0) -> list[bool]:
        """Store blocks that live outside L1 (e.g. gathered from vLLM's cache) in the highest host tier."""
        out = []
        with self._lock:
            tier = self._lower(Tier.L1)
            for j, block in enumerate(blocks):
                i = start + j
                key = keys[i]
                entry = self.index.get(key)
                if entry is not None and (entry.mask & 0b110):
                    out.append(True)
                    continue
                probe = Entry(key, keys[i - 1] if i else None, i)
                out.append(tier is not None and self._put_lower(probe, tier, block))
                if out[-1] and self.config.policy.write == "write_through" and tier != Tier.L4:
                    self._persist_async([self.index.get(key)])  # on down to L3
        return out

    def release(self, m: Match) -> None:
        """Unpin everything ``m`` pinned (idempotent)."""
        with self._lock:
            self.index.unpin(m.pinned)
            m.pinned = []

    def release_entries(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            self.index.unpin(entries)

    # -- tier events ----------------------------------------------------------

    def add_tier_listener(self, listener: TierListener) -> None:
        """Call ``listener(stored, removed)`` with each batch of tier changes from now on.

        ``stored`` / ``removed`` are lists of ``(block key, Tier)``: a block that
        arrived in / left that tier (L1, L2, L3; L4 arrivals when a put lands —
        the pool's own evictions are not seen). A demotion is a removal from one
        tier and an arrival in the next. Batches are net changes, delivered in
        order on the ``tierkv-events`` thread with no store lock held, so the
        listener may call the store; it never delays a lookup or a save. Its
        exceptions are counted and logged once. Thread-safe.
        """
        self.events.add_listener(listener)

    def remove_tier_listener(self, listener: TierListener) -> None:
        """Stop calling ``listener`` (unknown ones are ignored). Thread-safe."""
        self.events.remove_listener(listener)

    # -- reporting ------------------------------------------------------------

    def stats(self) -> dict:
        """Counters by tier plus usage and capacity in blocks. Thread-safe snapshot."""
        with self._lock:
            usage = {}
            if self.l1 is not None:
                usage["l1"] = (self.index.counts[Tier.L1], self.l1.capacity)
            if self.l2 is not None:
                usage["l2"] = (self.index.counts[Tier.L2], self.l2.capacity)
            if self.l3 is not None:
                usage["l3"] = (self.l3.used, self.l3.capacity)
            self.metrics.usage = usage
        out = self.metrics.snapshot()
        out["block_bytes"] = self.layout.block_bytes
        out["index_entries"] = len(self.index)
        if self.l4 is not None:
            out["l4"] = self.l4.stats()
        return out

    def close(self) -> None:
        """Finish pending transfers (queued L4 puts included) and close files. The store is unusable afterwards."""
        self.transfer.close()
        self.events.close()
        if self.l4 is not None:
            self.l4.close()
        if self.l3 is not None:
            self.l3.close()
        if self.l2 is not None:
            self.l2.close()

    def __enter__(self) -> TierKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
