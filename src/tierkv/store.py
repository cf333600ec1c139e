"""TierKVStore: the facade that wires config -> tiers -> placement -> transfer (docs/design.md §6, §9).

Ownership: the store owns the index and every tier (``tiers[Tier]``, each a
``BlockTier``). A slot ``allocate`` hands the engine is *private* until
``save`` adopts it; the index then owns it and the saving request pins it
until ``release``. Pinned blocks are never evicted. A full tier demotes its
victim one tier down (L1 -> L2 -> L3 -> L4 -> gone) unless that tier has it.

Thread-safety: every public method is safe from any thread. State changes
happen under one lock, and no disk write, fsync or network call runs while it
is held: ``placement.py`` plans under it, ``moves.py`` runs the plans on the IO
thread, their results are committed under it; loads are ``reads.py``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from tierkv.catalog import other_layouts
from tierkv.config import StoreConfig
from tierkv.cost import CostModel, calibrate
from tierkv.events import TierEvents, TierListener
from tierkv.hashing import BlockHash, BlockHasher
from tierkv.identity import ModelIdentity, recorded
from tierkv.why import EvictionLog
from tierkv.index import Entry, PrefixIndex, Tier
from tierkv.layout import KVLayout
from tierkv.metrics import TIER_NAMES, Metrics
from tierkv.matching import Matcher
from tierkv.moves import Mover, Plan
from tierkv.pacing import TRANSFER, Pacer
from tierkv.placement import Placement
from tierkv.reads import Loader, Match
from tierkv.seeds import SeedLog
from tierkv.tierset import make_policies, open_tiers
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.slots import OutOfBlocks
from tierkv.transfer import LoadHandle, TransferEngine

__all__ = ["Match", "OutOfBlocks", "TierKVStore"]
log = logging.getLogger("tierkv.store")
_STAGE_PER_EVICTION = 2  # outbox slots one L1 eviction may take (L2 victim to L3, L3 victim to L4)
_WRITE_DOWN_CHUNK = 64  # blocks per plan when close writes L1/L2-only blocks down (the deadline's grain)
_OPEN: weakref.WeakSet[TierKVStore] = weakref.WeakSet()


def _close_open_stores() -> None:
    """Close, at interpreter exit, every store the program left open: its queued writes land (or are
    dropped, counted, at ``io.shutdown_flush_s``) and its files close consistently. Registered with
    ``threading._register_atexit``, which runs before ``concurrent.futures`` stops the executors the
    store's IO runs on (``atexit`` would run after: a write then raised "cannot schedule new futures
    after shutdown"). One deadline for all of them: the longest of their settings."""
    stores = list(_OPEN)
    if not stores:
        return
    deadline = time.monotonic() + max(st.config.io.shutdown_flush_s for st in stores)
    for st in stores:
        try:
            st.close(deadline=deadline)
        except Exception as exc:  # never a traceback at exit; the cache loses what it had queued
            log.warning("tierkv: closing a store at exit failed: %r", exc)


try:
    threading._register_atexit(_close_open_stores)  # the hook concurrent.futures itself uses
except AttributeError:  # pragma: no cover - an interpreter without it: plain atexit, after the executors
    import atexit

    atexit.register(_close_open_stores)


class TierKVStore:
    def __init__(self, config: StoreConfig | None = None, layout: KVLayout | None = None, *,
                 l1_blocks: int | None = None, identity: ModelIdentity | None = None,
                 record_identity: bool = True) -> None:
        """Open the configured tiers for ``layout``. ``identity`` (``identity.py``) names what fixes
        the KV of a token sequence and roots every key; None means the caller vouches for
        ``config.model_id`` / ``model_revision`` alone (``ModelIdentity.declared``). The engine and
        the vLLM connector always pass the identity they computed. ``record_identity`` False opens
        L3 without recording the identity as one that wrote there (``tierkv why`` looking in)."""
        if layout is None:
            raise ValueError("layout: a KVLayout is required")
        self.config = cfg = config or StoreConfig()
        self.identity = identity or ModelIdentity.declared(cfg.model_id, cfg.model_revision)
        self.layout, self.block_size = layout, layout.block_size
        self.metrics = Metrics()
        self.hasher = BlockHasher(cfg.hashing.algorithm, bytes.fromhex(cfg.hashing.key) if cfg.hashing.key else None)
        self._seeds: dict[tuple, bytes] = {}
        self._lock = threading.RLock()
        self.tiers, self.outbox = open_tiers(cfg, layout, l1_blocks, self._on_failure,
                                             self.identity if record_identity else None)
        self.evictions: EvictionLog | None = None
        self.seed_log: SeedLog | None = None
        device = self.l1.device if self.l1 is not None else torch.device("cpu")
        measured = calibrate(layout.block_bytes, layout.block_size, device=str(device),
                             disk_dir=cfg.l3.path if Tier.L3 in self.tiers else None) if cfg.cost.calibrate else None
        self.cost = CostModel.from_config(cfg.cost, layout.block_bytes, layout.block_size, measured)
        self.index = PrefixIndex(make_policies(cfg, self.tiers, self.cost, layout.block_bytes), cfg.policy.half_life)
        self.events = self.index.events = TierEvents(self._lock)
        self.transfer = TransferEngine(device)
        self.pacer = Pacer(cfg.io.background_share)
        if Tier.L3 in self.tiers:
            self.tiers[Tier.L3].pacer = self.pacer
        self.mover = Mover(self.tiers, layout, self.transfer.io, self.transfer.d2h_sync, self._commit,
                           self._on_failure, lambda slot: self.outbox.block(slot), self.pacer)
        self.placement = Placement(self.tiers, self.index, self.mover, self.outbox, self.metrics, self.events,
                                   layout.block_bytes, self.transfer.d2h_sync, self._on_failure)
        self.loader = Loader(self.tiers, self.index, self._lock, self.transfer, self.metrics,
                             layout.block_bytes, self._on_failure, self.pacer)
        self.matcher = Matcher(self.tiers, self.index, self._lock, self.cost, self.metrics, self.block_size,
                               cfg.policy.write == "write_through_selective", self._write_through,
                               self._on_failure)
        if Tier.L3 in self.tiers:
            self._rebuild_from_l3()
            self._say_foreign_identities()
        self._closed = False
        _OPEN.add(self)

    l1 = property(lambda self: self.tiers.get(Tier.L1), doc="The L1 tier (DeviceTier) or None.")
    l2 = property(lambda self: self.tiers.get(Tier.L2), doc="The L2 tier (HostTier) or None.")
    l4 = property(lambda self: self.tiers.get(Tier.L4), doc="The L4 tier (RemoteTier) or None.")

    @property
    def l3(self) -> DiskTier | None:
        """The L3 tier (DiskTier) or None, for callers outside the store: demotions are written to it
        behind, on the IO thread, so this first waits until those queued so far have landed (never
        on the IO thread itself). The store itself reads ``tiers``."""
        if self.mover.queued and not threading.current_thread().name.startswith("tierkv-io"):
            self.transfer.io(lambda: None).result()
        return self.tiers.get(Tier.L3)

    def _on_failure(self, tier: str, reason: str, n: int, detail: str) -> None:
        self.metrics.failure(tier, reason, n, detail)

    def _commit(self, moves, flags) -> None:
        with self._lock:
            self.placement.commit(moves, flags)

    def _rebuild_from_l3(self) -> None:
        # A bad record never fails the start: the tier dropped (and counted) the malformed ones
        # and those past the end of its slot file when it opened, and records() skips any
        # written since and ends a walk LMDB cannot finish (counted) instead of raising.
        records = sorted(self.tiers[Tier.L3].records(), key=lambda r: r.depth)
        with self._lock:
            for rec in records:
                self.index.add(rec.key, rec.parent, rec.depth, Tier.L3)

    def _say_foreign_identities(self) -> None:
        """Once per open: an L3 that other model identities wrote finds none of their blocks under
        this one's keys; say so, naming the fields that differ from the one seen last. Blocks of
        other layouts under the same ``l3.path`` (another dtype) sit in their own directories: say
        that too, once, with the fields in which their last identity differs."""
        others = [(i, t) for i, t in self.recorded_identities() if i.digest != self.identity.digest]
        if others:
            ident, seen = others[0]
            log.warning("tierkv l3 %s: blocks written under %d other model identit%s are not found under "
                        "this one (%s); the last one differs in: %s", self.config.l3.path, len(others),
                        "y" if len(others) == 1 else "ies", self.identity.digest[:12],
                        "; ".join(self.identity.diff(ident)))
        elsewhere = [e for e in other_layouts(self.config.l3.path, self.tiers[Tier.L3].path)
                     if e[1].logical != self.layout.logical]  # not the other tensor-parallel ranks' shards
        if elsewhere:
            last = max((r for _, _, meta in elsewhere for r in recorded(meta)), key=lambda r: r[1], default=None)
            differs = "; ".join(self.identity.diff(last[0])) if last is not None else "a model identity not recorded"
            log.warning("tierkv l3 %s: blocks of %d other layout%s (%s) are kept in their own directories and "
                        "are not found under this one (%s %s); the last one differs in: %s", self.config.l3.path,
                        len(elsewhere), "" if len(elsewhere) == 1 else "s",
                        ", ".join(f"{lay.fingerprint[:12]} {lay.dtype}" for _, lay, _ in elsewhere),
                        self.layout.fingerprint[:12], self.layout.dtype, differs)

    def recorded_identities(self) -> list[tuple[ModelIdentity, float]]:
        """(identity, last opened) of every model identity L3 records, this one included, newest first."""
        l3 = self.tiers.get(Tier.L3)
        return recorded(l3.meta()) if l3 is not None else []

    # -- keys -----------------------------------------------------------------

    def seed(self, namespace: str | None = None, extra_keys: Sequence[str] = (),
             identity: ModelIdentity | None = None, layout: KVLayout | None = None) -> bytes:
        """The root of every chain of this store's identity and layout (or ``identity`` / ``layout``,
        for ``why``) — the logical layout: every tensor-parallel shard of a model shares the chain —, namespace (``config.namespace`` when None) and per-request extra keys (LoRA,
        cache salt)."""
        ident = identity or self.identity
        ns = self.config.namespace if namespace is None else namespace
        k = (ident.digest, ns, tuple(extra_keys))
        s = self._seeds.get(k) if layout is None else None
        if s is None:
            s = self.hasher.seed(ident.get("model_id", ""), ident.get("model_revision", ""),
                                 (layout or self.layout).logical.fingerprint, ns,
                                 ("identity:" + ident.digest, *extra_keys))
            if identity is None and layout is None:
                self._seeds[k] = s
                if extra_keys and self.seed_log is not None:
                    self.seed_log.note(s, ident.digest, ns, extra_keys)
        return s

    def hash(self, token_ids: Sequence[int], namespace: str | None = None,
             extra_keys: Sequence[str] = ()) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids`` (design §3). Pure; thread-safe."""
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
        """``lookup`` for callers that already hold the chain of block hashes (``matching.py``)."""
        return self.matcher.lookup_keys(keys, pin)

    # -- L1 slots, loads, saves -----------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` private L1 slots, evicting unpinned cached blocks down a tier as needed.

        The caller owns them until it ``free``s them or ``save`` adopts them. Demotions to
        L3/L4 are written behind, on the IO thread; when the outbox is full this waits,
        without the lock, for it to drain. Raises OutOfBlocks when L1 cannot make room.
        """
        if self.l1 is None:
            raise OutOfBlocks("l1: this store has no L1 tier")
        while True:
            with self._lock:
                plan = Plan()
                try:
                    while self.l1.num_free < n:
                        if self.outbox is not None and self.outbox.num_free < _STAGE_PER_EVICTION:
                            break
                        if not self.placement.evict(Tier.L1, plan):
                            raise OutOfBlocks(f"l1: need {n} slots, {self.l1.num_free} free, nothing evictable")
                    else:
                        return self.l1.allocate(n)
                finally:
                    self.mover.submit(plan)
            self.outbox.wait_free(_STAGE_PER_EVICTION, timeout=1.0)

    def free(self, slots: Sequence[int]) -> None:
        """Return private L1 slots (never adopted ones) to the free list."""
        with self._lock:
            self.l1.free(list(slots))

    def load(self, m: Match, dst: Sequence[int] | Sequence[torch.Tensor], parts: int = 1) -> LoadHandle:
        """Copy the matched blocks that are not in L1 into ``dst``, asynchronously.

        ``dst`` has one entry per position of ``m.to_load``: L1 slots the caller
        allocated (loaded blocks are then adopted into L1, pinned by ``m``), or
        tensors of the block shape (nothing adopted). The handle's result says
        per matched block whether it is usable; only the leading run counts
        (``num_ok``) — the caller recomputes from the first failure.
        ``parts`` > 1: L3 reads each block in that many equal slices, slice 0
        of every block first (its layers, as the block is layer-major), and
        ``handle.wait_part(p)`` returns once slice p of every block has landed,
        unverified, so a consumer can start on the first layers before the
        last have arrived (it must still drop what ``wait()`` says is bad).
        """
        return self.loader.load(m, dst, parts)

    def lend(self, m: Match) -> list[torch.Tensor] | None:
        """The matched blocks' bytes in place, when every one sits where it can be read without a
        copy (L1, a private L2), else None (``load`` copies). Valid while ``m`` stays pinned (until
        ``release``); read-only. Thread-safe."""
        return self.loader.lend(m)

    def save(self, keys: Sequence[BlockHash], slots: Sequence[int], start: int = 0,
             match: Match | None = None) -> list[bool]:
        """Adopt the filled L1 slots of blocks ``start .. start+len(slots)`` of the chain ``keys``.

        An adopted slot becomes a cached block owned by the index and pinned
        (added to ``match.pinned`` when given; otherwise the caller must
        ``release_entries`` it). A block already cached in L1 is not adopted:
        the caller keeps its private slot. Returns adopted per slot.
        """
        out, adopted = [], []
        with self._lock:
            for i, slot in enumerate(slots, start):
                entry = self.index.get(keys[i])
                if entry is not None and entry.in_tier(Tier.L1):
                    out.append(False)
                    continue
                entry = self.index.add(keys[i], keys[i - 1] if i else None, i, Tier.L1)
                entry.l1_slot = slot
                self.l1.adopt(keys[i], slot)
                self.index.pin([entry])
                if match is not None:
                    match.pinned.append(entry)
                out.append(True)
                adopted.append(entry)
            if self.config.policy.write == "write_through":
                self._write_through(adopted)
        return out

    def put_blocks(self, keys: Sequence[BlockHash], blocks: Sequence[torch.Tensor], start: int = 0) -> list[bool]:
        """Store blocks that live outside L1 (e.g. gathered from vLLM's cache) in the highest tier
        below L1. Synchronous for L2 and L3 (on return, written; L3 durably, without the lock
        held); an L4 put is queued, as every L4 put. Returns stored (or already held) per block.
        Pacing (``tierkv.pacing``): the copies into L2 yield to an engine step running meanwhile and
        are foreground to background writes; the demotions they cause are background."""
        # The copies yield to the engine's step (a TRANSFER piece, gated before the lock is taken)
        # and are foreground to the background writes.
        with self.pacer.piece(TRANSFER), self.pacer.foreground(TRANSFER), self._lock:
            plan = Plan()
            out, in_l2 = self.placement.put_blocks(keys, blocks, start, plan)
            if self.config.policy.write == "write_through":
                # On down to L3 in the same plan: its room counts the demotions just planned, and
                # its copies run after them (a plan of their own ran first and overfilled L3).
                self.placement.write_through(in_l2, in_l2 if self.l4 is not None else (), plan)
            done = self.mover.submit(plan)
        if done is not None:
            done.result()
        return out

    def foreground(self):
        """Context manager: the enclosed work is foreground (a request waits for it, e.g. the engine's
        forward), and background IO (demotions written behind, write-through, persist, L4 sends)
        fills at most ``io.background_share`` of wall time meanwhile (``tierkv.pacing``). Reentrant;
        any thread; holds no lock."""
        return self.pacer.foreground()

    def release(self, m: Match) -> None:
        """Unpin everything ``m`` pinned (idempotent)."""
        with self._lock:
            self.index.unpin(m.pinned)
            m.pinned = []

    def finished(self, keys: Sequence[BlockHash], output_tokens: int) -> None:
        """A request whose blocks are the chain ``keys`` finished after generating ``output_tokens``.

        A hint for eviction (the default policy learns, per output band, how
        often such blocks come back); nothing is pinned, touched or moved, and
        keys the store no longer holds are skipped. Call it once per request
        as it ends (the engine and the vLLM connector do). Thread-safe.
        """
        if output_tokens < 0:
            raise ValueError(f"output_tokens: expected >= 0, got {output_tokens}")
        index = self.index
        with self._lock:
            entries = [e for e in map(index.get, keys) if e is not None]
            if entries:
                index.finished(entries, output_tokens)

    def release_entries(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            self.index.unpin(entries)

    # -- copies down ------------------------------------------------------------

    def _write_through(self, entries: Sequence[Entry], to_l4: Sequence[Entry] | None = None) -> None:
        """Caller holds the lock: queue copies of ``entries`` down to the local tiers that lack them,
        and of ``to_l4`` (None: all under write_through, else none) to L4, sources pinned until landed."""
        if to_l4 is None:
            to_l4 = entries if self.config.policy.write == "write_through" else ()
        plan = Plan()
        self.placement.write_through(entries, to_l4 if self.l4 is not None else (), plan)
        self.mover.submit(plan)

    def persist(self, keys: Sequence[BlockHash], tier: int = Tier.L3) -> int:
        """Copy the cached blocks of the chain ``keys`` into ``tier`` (L2, L3 or L4) where it lacks them.

        For tools that must leave a prefix behind them (``tierkv warm``, the
        demo's restart). Walks the chain from its root and stops at the first
        block no local tier holds. Blocks stay where they are: a copy, not a
        move. Returns the blocks written (L4: queued). Thread-safe; synchronous
        for L2/L3 (written, and for L3 durable, on return) and the lock is not
        held while they are written; L4 copies go through the outbox like every
        L4 put (``close`` waits until they are sent).
        """
        if tier == Tier.L1 or tier not in self.tiers:
            return 0
        with self._lock:
            plan = Plan()
            moves = self.placement.persist(keys, tier, plan)
            done = self.mover.submit(plan)
        if tier == Tier.L4:
            return len(moves)
        if done is not None:
            done.result()
        return sum(1 for m in moves if m.entry.in_tier(tier))

    def flush(self) -> None:
        """Block until every copy queued so far (write-through, demotions written behind) has landed
        and its tier events have reached the listeners. Thread-safe."""
        self.transfer.io(lambda: None).result()
        self.events.flush()

    # -- tier events, reporting -------------------------------------------------

    def add_tier_listener(self, listener: TierListener, by_tier: bool = False) -> None:
        """Call ``listener(stored, removed)`` — lists of ``(block key, Tier)`` that arrived in / left a
        tier (L1-L3, and L4 arrivals when a put lands; a demotion is one of each) — with each batch of
        net changes from now on, on the ``tierkv-events`` thread with no store lock held (it may call
        the store, but not ``flush``; it never delays a lookup or a save). With ``by_tier`` each list
        is 4 key lists, one per tier L1..L4 (no per-block tuples). Thread-safe; see ``events.py``."""
        self.events.add_listener(listener, by_tier)

    def remove_tier_listener(self, listener: TierListener) -> None:
        """Stop calling ``listener`` (unknown ones are ignored). Thread-safe."""
        self.events.remove_listener(listener)

    def keep_eviction_log(self, capacity: int = 65536) -> EvictionLog:
        """Record, for up to ``capacity`` blocks, the last tier each left and when, and which were
        dropped as damaged (``why.EvictionLog``, read by ``why.explain``); with L3 it starts from the
        log an earlier process left there and is saved there again on ``close``. Idempotent."""
        if self.evictions is None:
            log_ = EvictionLog(capacity)
            if Tier.L3 in self.tiers:
                log_.load(self.tiers[Tier.L3].path)
            self.add_tier_listener(log_, by_tier=True)
            self.evictions = self.loader.evictions = log_
        return self.evictions

    def keep_seed_log(self, capacity: int = 4096) -> SeedLog:
        """Note, for up to ``capacity`` seeds, the extra keys (LoRA name and content digest; that a
        cache_salt was set, never the salt) each seed with extra keys that ``seed`` hands out was
        rooted in (``seeds.SeedLog``, read by ``why.explain``); with L3 kept in its directory, merged
        with what other processes noted there. Seeds asked for with an explicit ``identity`` or
        ``layout`` (``why`` looking) are not noted. Idempotent; thread-safe."""
        if self.seed_log is None:
            self.seed_log = SeedLog(self.tiers[Tier.L3].path if Tier.L3 in self.tiers else None, capacity)
            for (digest, ns, extra), seed in list(self._seeds.items()):  # handed out before the log began
                if extra:
                    self.seed_log.note(seed, digest, ns, extra)
        return self.seed_log

    def stats(self) -> dict:
        """Counters by tier plus usage and capacity in blocks (L3: writes queued included). Thread-safe snapshot."""
        with self._lock:
            self.metrics.usage = {
                TIER_NAMES[t]: (tier.used + (self.mover.pending_l3 if t == Tier.L3 else 0), tier.capacity)
                for t, tier in self.tiers.items() if t != Tier.L4}
        out = self.metrics.snapshot()
        out["block_bytes"] = self.layout.block_bytes
        out["index_entries"] = len(self.index)
        if self.l4 is not None:
            out["l4"] = self.l4.stats()
        return out

    def close(self, deadline: float | None = None) -> None:
        """Land what is queued, write the blocks that live only in L1/L2 down to L3, close the files.

        Both share one deadline: ``io.shutdown_flush_s`` from now, or ``deadline`` (a
        ``time.monotonic()`` value). Writes still queued then are dropped, counted, with one log
        line; L3 stays consistent either way (a dropped write never reaches its records). A
        process that exits without calling it gets it at exit (``_close_open_stores``). The store
        is unusable afterwards; a second call does nothing. Call it from one thread, with no
        request of this store still running."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        start = time.monotonic()
        if deadline is None:
            deadline = start + self.config.io.shutdown_flush_s
        if deadline > start and Tier.L3 in self.tiers:
            with self._lock:
                l3 = self.tiers[Tier.L3]
                for plan in self.placement.write_down(l3.capacity, _WRITE_DOWN_CHUNK):
                    self.mover.submit(plan)
        drained = self.transfer.io(lambda: None)
        try:
            drained.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.mover.abandon()  # the run in progress finishes; the rest is skipped, fast
            drained.result()
        if self.mover.dropped:
            self.metrics.failure("store", "shutdown", self.mover.dropped, say=False)
            log.warning("tierkv: close dropped %d queued block writes after %.1f s (io.shutdown_flush_s); "
                        "the cache lost them, L3 is consistent", self.mover.dropped, time.monotonic() - start)
        self.transfer.close()
        if self.evictions is not None:
            self.events.flush()
        self.events.close()
        if self.evictions is not None and Tier.L3 in self.tiers:
            self.evictions.save(self.tiers[Tier.L3].path)
        if self.seed_log is not None:
            self.seed_log.close()
        for tier in reversed(self.tiers.values()):
            tier.close()

    def __enter__(self) -> TierKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
