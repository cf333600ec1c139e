"""The store's read path: ``Match`` (what a lookup found) and ``Loader`` (copying it into L1 or tensors).

A load groups the matched blocks by tier and runs each tier's batched ``get``
on the thread that tier's reads use — the copy thread for L2 (on CUDA inside
the host->device stream), the IO thread for L3 and L4, after any write queued
there before — with no store lock held. Its completion takes the lock once to
adopt the loaded L1 slots and to forget blocks that failed to load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tierkv.hashing import BlockHash
from tierkv.index import Entry, PrefixIndex, Tier
from tierkv.metrics import TIER_NAMES, Metrics
from tierkv.pacing import UNPACED, Pacer
from tierkv.tiers.base import BlockTier, leading_ok
from tierkv.transfer import LoadHandle, LoadResult, TransferEngine, gather_futures, now


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


def probe_shared(tiers: dict[int, BlockTier], index: PrefixIndex, keys: list[BlockHash], matched: list[int]) -> None:
    """Caller holds the lock: extend ``matched`` (the fastest tier of each block of the prefix the index
    knows) with blocks other processes put in a shared L2 slab or in L3 since we opened them, adding
    them to the index. Index reads only (LMDB), no IO that writes."""
    rest = keys[len(matched):]
    l2, l3 = tiers.get(Tier.L2), tiers.get(Tier.L3)
    none = [False] * len(rest)
    in_l2 = l2.contains(rest) if l2 is not None and l2.shared else none
    in_l3 = l3.contains(rest) if l3 is not None else none
    for i, (l2_hit, l3_hit) in enumerate(zip(in_l2, in_l3), len(matched)):
        if not (l2_hit or l3_hit):
            break
        for tier, hit in ((Tier.L2, l2_hit), (Tier.L3, l3_hit)):
            if hit:
                index.add(keys[i], keys[i - 1] if i else None, i, tier)
        matched.append(Tier.L2 if l2_hit else Tier.L3)


class Loader:
    """Starts batched reads of a match and adopts what landed in L1 slots. Thread-safe."""

    def __init__(self, tiers: dict[int, BlockTier], index: PrefixIndex, lock: threading.RLock,
                 transfer: TransferEngine, metrics: Metrics, block_bytes: int,
                 on_failure: Callable[[str, str, int, str], None], pacer: Pacer = UNPACED) -> None:
        self.tiers = tiers
        self._pacer = pacer
        self.index = index
        self.lock = lock
        self.metrics = metrics
        self.block_bytes = block_bytes
        self._on_failure = on_failure
        self.evictions = None  # an EvictionLog (why.py) to note damaged blocks in, when the store keeps one
        # The thread each tier's reads run on: L2 copies beside the device stream, L3 and L4 on
        # the IO thread, in order after the writes queued there.
        self._runner = {Tier.L2: transfer.copy, Tier.L3: transfer.io, Tier.L4: transfer.io}

    def load(self, m: Match, dst: Sequence[int] | Sequence[torch.Tensor], parts: int = 1) -> LoadHandle:
        positions = m.to_load
        if len(dst) != len(positions):
            raise ValueError(f"load: dst has {len(dst)} entries for {len(positions)} blocks to load")
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"load: parts must be an integer >= 1, got {parts!r}")
        handle = LoadHandle(parts)
        if not positions:
            handle._finish(LoadResult([True] * m.num_blocks, 0.0, [False] * m.num_blocks))
            return handle
        slots = list(dst) if dst and isinstance(dst[0], int) else None
        views = [self.tiers[Tier.L1].block(s) for s in dst] if slots is not None else list(dst)
        ok = [True] * m.num_blocks
        started = now()
        by_tier: dict[int, list[int]] = {}
        for j, i in enumerate(positions):
            by_tier.setdefault(m.tiers[i], []).append(j)
        landed = dict.fromkeys(by_tier, 0)  # per tier: slices of all its blocks landed
        landed_lock = threading.Lock()

        def part_landed(tier: int, n: int) -> None:
            with landed_lock:
                landed[tier] = max(landed[tier], n)
                low = min(landed.values())
            handle._part_landed(low)

        with self.lock:  # reads start in lock order with the writes other threads plan
            futures = [self._start(m, tier, [positions[j] for j in js], [views[j] for j in js], ok,
                                   parts, part_landed)
                       for tier, js in by_tier.items()]

        def finish() -> None:
            try:
                result = self._finish(m, positions, slots, ok, started)
            except BaseException as exc:  # a programming error: surface it to the waiter
                handle._finish(None, exc)
                return
            handle._finish(result)

        gather_futures(futures, finish)
        return handle

    def lend(self, m: Match) -> list[torch.Tensor] | None:
        """Every matched block's bytes in place (L1, a private L2), counted as read; None unless
        all of them can be lent. Valid while ``m`` stays pinned; the caller only reads them."""
        views = []
        for key, tier in zip(m.keys, m.tiers):
            view = self.tiers[tier].view(key) if tier in (Tier.L1, Tier.L2) else None
            if view is None:
                return None
            views.append(view)
        for tier in {t for t in m.tiers}:
            self.metrics.add("bytes", (TIER_NAMES[tier], "read"), m.tiers.count(tier) * self.block_bytes)
        return views

    def _start(self, m: Match, tier: int, pos: list[int], views: list[torch.Tensor], ok: list[bool],
               parts: int = 1, part_landed: Callable[[int, int], None] | None = None):
        keys = [m.keys[i] for i in pos]
        # On a shared slab another process may free and reuse a slot while this copy waits (pins
        # are per process): every tier's get verifies what it copied.
        in_parts = getattr(self.tiers[tier], "get_in_parts", None) if parts > 1 else None
        runner = self._runner[tier]
        # A read queued on the IO thread behind background writes ends their pacing pauses.
        urgent = self._pacer.urgent if tier in (Tier.L3, Tier.L4) else (lambda fn: fn)
        if in_parts is not None:  # a tier that can say how far a read got (L3)
            fut = runner(urgent(in_parts), keys, views, parts, lambda n: part_landed(tier, n))
        else:
            fut = runner(urgent(self.tiers[tier].get), keys, views)

        def record(f) -> None:
            try:
                flags = f.result()
            except Exception as exc:  # a tier that raised is a tier that missed
                self._on_failure(TIER_NAMES[tier], "error", len(pos), repr(exc))
                flags = [False] * len(pos)
            for i, flag in zip(pos, flags):
                ok[i] = flag
            self.metrics.add("bytes", (TIER_NAMES[tier], "read"), sum(flags) * self.block_bytes)
            if part_landed is not None:
                part_landed(tier, parts)

        fut.add_done_callback(record)
        return fut

    def _finish(self, m: Match, positions: list[int], slots, ok: list[bool], started: float) -> LoadResult:
        adopted = [False] * m.num_blocks
        l1 = self.tiers.get(Tier.L1)
        with self.lock:
            first_bad = leading_ok(ok)
            for j, i in enumerate(positions):
                key, tier = m.keys[i], m.tiers[i]
                if not ok[i]:
                    if self.evictions is not None:
                        self.evictions.note(key, tier, "damaged")
                    # L3 already removed a bad block itself; L4 is not in the index.
                    if tier == Tier.L2:
                        self.tiers[tier].remove([key])
                    if tier != Tier.L4:
                        self.index.drop(key, tier)
                    continue
                if slots is None or i >= first_bad:
                    continue
                entry = self.index.get(key)
                if entry is not None and entry.in_tier(Tier.L1):
                    continue
                entry = self.index.add(key, m.keys[i - 1] if i else None, i, Tier.L1)
                entry.l1_slot = slots[j]
                l1.adopt(key, slots[j])
                if m.entries[i] is not entry:
                    self.index.pin([entry])
                    m.pinned.append(entry)
                    m.entries[i] = entry
                adopted[i] = True
        elapsed = now() - started
        self.metrics.observe_load(elapsed)
        return LoadResult(ok, elapsed, adopted)
