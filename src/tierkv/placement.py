"""The deciding side of the store's write path: where blocks go, as plans; and the commit of results.

Everything here runs with the store lock held and moves no bytes to disk or
network. ``evict`` takes a tier's victim (the index's policy chooses) and
demotes it: into L2 at once when both sides are memory (a memmove), else
staged in the outbox and planned as a ``Move`` for the IO thread, the index
listing the block in its new tier already (reads of L3 run on that thread,
after the write). ``copies`` plans write-through and persist copies whose
sources stay pinned until the commit. ``commit`` records what the moves did.

A victim never vanishes while some tier below could keep it: when the next
tier refuses it (full of pinned blocks, of another process's blocks in a
shared slab), the one below that is tried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tierkv.events import TierEvents
from tierkv.index import LOCAL_TIERS, Entry, PrefixIndex, Tier
from tierkv.metrics import TIER_NAMES, Metrics
from tierkv.moves import Move, Mover, Plan
from tierkv.outbox import Outbox
from tierkv.tiers.base import BlockTier, Lineage

MEMORY = (Tier.L1, Tier.L2)


class Placement:
    """Victims, demotions, room and copies as plans; commits their results. Caller holds the store lock."""

    def __init__(self, tiers: dict[int, BlockTier], index: PrefixIndex, mover: Mover, outbox: Outbox | None,
                 metrics: Metrics, events: TierEvents, block_bytes: int, sync: Callable[[], None],
                 on_failure: Callable[[str, str, int, str], None]) -> None:
        self.tiers = tiers
        self.index = index
        self.mover = mover
        self.outbox = outbox
        self.metrics = metrics
        self.events = events
        self.block_bytes = block_bytes
        self._sync = sync
        self._on_failure = on_failure
        self.persisting: set[bytes] = set()  # keys with a write-through copy queued

    def lower(self, tier: int) -> int | None:
        """The next tier below ``tier`` that exists (L4 last), or None."""
        return next((t for t in range(tier + 1, Tier.L4 + 1) if t in self.tiers), None)

    def room(self, tier: int, plan: Plan) -> int:
        """Free blocks in local tier ``tier``: by the index's count, by the L3 files for L3 (other
        processes' blocks included) less what queued plans and ``plan`` will still write."""
        t = self.tiers[tier]
        if tier == Tier.L3:
            return t.capacity - t.used - self.mover.pending_l3 - plan.l3_delta
        return t.capacity - self.index.counts[tier]

    def make_room(self, tier: int, n: int, plan: Plan) -> None:
        while self.room(tier, plan) < n:
            if not self.evict(tier, plan):
                return

    def evict(self, tier: int, plan: Plan) -> bool:
        """Demote ``tier``'s next victim; False when nothing there is evictable."""
        entry = self.index.victim(tier)
        if entry is None:
            return False
        self.demote(entry, tier, plan)
        self.metrics.add("evictions", TIER_NAMES[tier])
        return True

    def demote(self, entry: Entry, tier: int, plan: Plan) -> None:
        """``entry`` leaves ``tier``: into the first tier below that takes it, then out of ``tier``."""
        key, lower, relayed = entry.key, self.lower(tier), False
        while lower is not None and (lower == Tier.L4 or not entry.in_tier(lower)):
            if tier in MEMORY and lower in MEMORY:  # a memmove, now
                self.make_room(lower, 1, plan)
                if self.put_now(entry, tier, lower):
                    break
            elif tier == Tier.L3:  # the bytes are on disk: the IO thread reads them, relays them, removes them
                slot = self._reserve(lower)
                if slot is not None:
                    plan.move(Move(entry, tier, lower, staged=slot, remove_src=True))
                    relayed = True
                break
            else:
                self.stage(entry, tier, lower, plan)
                break
            lower = self.lower(lower)
        self.index.drop(key, tier)
        if tier == Tier.L3:
            if not relayed:
                plan.drop(key, tier)
        else:
            self.tiers[tier].remove([key])  # L1 frees the slot, L2 releases it: memory

    def put_now(self, entry: Entry, src: int, dst: int, data: torch.Tensor | None = None) -> bool:
        """Copy ``entry`` (from memory tier ``src``, or ``data``) into memory tier ``dst`` now, under
        the lock (a memmove); True when ``dst`` took it."""
        data = self.tiers[src].view(entry.key) if data is None else data
        if data is None:
            return False
        ok = self.tiers[dst].put([entry.key], [data], [Lineage(entry.parent, entry.depth)])[0]
        self._sync()  # the source slot is reused as soon as we return
        if ok:
            self.index.add(entry.key, entry.parent, entry.depth, dst)
            self.metrics.add("bytes", (TIER_NAMES[dst], "write"), self.block_bytes)
        return ok

    def stage(self, entry: Entry, src: int, dst: int, plan: Plan) -> bool:
        """Plan a write of ``entry`` from ``src`` to ``dst`` from a copy in the outbox, so the source
        may go at once: memory is copied now (a shared slab's copy checked), L3 is read by the IO
        thread. A local ``dst`` lists the block at once (the move is optimistic). False (counted)
        when the outbox is full or the source unreadable."""
        slot = self._reserve(dst)
        if slot is None:
            return False
        data = None
        if src != Tier.L3:
            view = self.tiers[src].view(entry.key)
            if view is not None:
                self.outbox.stage_into(slot, view)
                self._sync()
            elif not self.tiers[src].get([entry.key], [self.outbox.block(slot)])[0]:
                self.outbox.release([slot])  # another process reused the shared slot: nothing to keep
                return False
            data = self.outbox.block(slot)
        local = dst != Tier.L4
        if local:
            self.make_room(dst, 1, plan)
            self.index.add(entry.key, entry.parent, entry.depth, dst)
        plan.move(Move(entry, src, dst, data=data, staged=slot, optimistic=local))
        return True

    def _reserve(self, dst: int) -> int | None:
        slot = self.outbox.reserve() if self.outbox is not None else None
        if slot is None:
            self._on_failure(TIER_NAMES[dst], "put_dropped", 1, "the outbox is full: a demoted block was dropped")
        return slot

    def copies(self, entries: Sequence[Entry], dst: int, plan: Plan) -> list[Move]:
        """Plan copies of ``entries`` (from their fastest tier, pinned until the commit) into ``dst``."""
        entries = list(entries)
        if not entries:
            return []
        if dst != Tier.L4:
            self.make_room(dst, len(entries), plan)
        self.index.pin(entries)
        moves = [Move(e, e.best, dst, pinned=True) for e in entries]
        for m in moves:
            plan.move(m)
        return moves

    def stage_given(self, entry: Entry, data, dst: int, plan: Plan) -> bool:
        """Plan a write of a caller's block ``data`` to ``dst``: L4 copies it into the outbox first
        (nobody waits for an L4 put); other tiers read it in place (the caller waits for the plan)."""
        if dst == Tier.L4:
            slot = self._reserve(dst)
            if slot is None:
                return False
            self.outbox.stage_into(slot, data)
            self._sync()
            plan.move(Move(entry, -1, dst, data=self.outbox.block(slot), staged=slot))
            return True
        self.make_room(dst, 1, plan)
        plan.move(Move(entry, -1, dst, data=data))
        return True

    # -- commit ------------------------------------------------------------------

    def commit(self, moves: list[Move], flags: list[bool]) -> None:
        """Record what the executed ``moves`` did (caller holds the lock)."""
        staged, unpin = [], []
        for move, ok in zip(moves, flags):
            e = move.entry
            if ok:
                self.metrics.add("bytes", (TIER_NAMES[move.dst], "write"), self.block_bytes)
                if move.dst == Tier.L4:
                    self.events.stored(e.key, Tier.L4)
                elif not move.optimistic:
                    self.index.add(e.key, e.parent, e.depth, move.dst)
            elif move.optimistic:
                held = self.index.get(e.key)
                if held is not None and held.in_tier(move.dst):
                    self.index.drop(e.key, move.dst)  # listed early; the write failed (counted by the tier)
            if move.staged is not None:
                staged.append(move.staged)
            if move.pinned:
                unpin.append(e)
                self.persisting.discard(e.key)
        self.index.unpin(unpin)
        if staged:
            self.outbox.release(staged)

    def put_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], start: int,
                   plan: Plan) -> tuple[list[bool], list[Entry]]:
        """Plan blocks from outside L1 into the highest tier below it: L2 now (a memmove), L3 read in
        place by the IO thread (the caller waits), L4 staged. Returns per block whether it is stored
        (or already was, in L2 or L3) and the entries now in L2 (for write-through). The tier changes
        (each block stored, each victim evicted) are told to the events in one go, at the end."""
        deferred = self.events.deferred()
        if deferred is None:
            return self._put_blocks(keys, blocks, start, plan)
        self.index.events = deferred
        try:
            return self._put_blocks(keys, blocks, start, plan)
        finally:
            self.index.events = self.events
            self.events.record_deferred(deferred)

    def _put_blocks(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], start: int,
                    plan: Plan) -> tuple[list[bool], list[Entry]]:
        tier, out, in_l2 = self.lower(Tier.L1), [], []
        for i, block in enumerate(blocks, start):
            entry = self.index.get(keys[i])
            if entry is not None and (entry.in_tier(Tier.L2) or entry.in_tier(Tier.L3)):
                out.append(True)
                continue
            probe = Entry(keys[i], keys[i - 1] if i else None, i)
            if tier == Tier.L2:
                self.make_room(tier, 1, plan)
                out.append(self.put_now(probe, -1, tier, block))
                if out[-1]:
                    in_l2.append(self.index.get(keys[i]))
            else:
                out.append(tier is not None and self.stage_given(probe, block, tier, plan))
        return out, in_l2

    def write_through(self, entries: Sequence[Entry], to_l4: Sequence[Entry], plan: Plan) -> None:
        """Plan pinned copies of ``entries`` to the local tiers below them that lack them, and of
        ``to_l4`` to L4; entries with copies already queued are skipped, and so are those no local
        tier holds any more (a put larger than L2 and L3 demoted and evicted them meanwhile)."""
        l4_keys = {e.key for e in to_l4}
        todo = [e for e in entries if e.mask and e.key not in self.persisting
                and (e.key in l4_keys or self.targets(e))]
        for dst in (Tier.L2, Tier.L3):
            self.copies([e for e in todo if dst in self.targets(e)], dst, plan)
        self.copies([e for e in todo if e.key in l4_keys], Tier.L4, plan)
        self.persisting.update(e.key for e in todo)

    def persist(self, keys: Sequence[bytes], tier: int, plan: Plan) -> list[Move]:
        """Plan copies into ``tier`` of the cached blocks of the chain ``keys`` that it lacks (walking
        from the root, stopping at the first block no local tier holds): pinned for L2/L3, staged in
        the outbox for L4 (as every L4 put)."""
        todo = []
        for key in keys:
            entry = self.index.get(key)
            if entry is None:
                break
            if tier == Tier.L4 or not entry.in_tier(tier):
                todo.append(entry)
        if tier != Tier.L4:
            return self.copies(todo, tier, plan)
        for e in todo:
            self.stage(e, e.best, tier, plan)
        return [m for m in plan.moves if m.dst == Tier.L4]

    def write_down(self, limit: int, chunk: int) -> list[Plan]:
        """Plans (of up to ``chunk`` blocks each) copying into L3 the blocks that live only in L1 or
        L2, at most ``limit``, shallowest first: roots before their children, so whatever prefix of
        the plans lands is a set of chains a restart can match. L3 makes room as for any write (its
        policy's victims go first). For ``close``."""
        held = sorted((e for e in self.index.entries() if e.best in MEMORY and not e.in_tier(Tier.L3)
                       and e.key not in self.persisting), key=lambda e: e.depth)[:limit]
        plans = []
        for i in range(0, len(held), chunk):
            plan = Plan()
            self.copies(held[i:i + chunk], Tier.L3, plan)
            self.persisting.update(e.key for e in held[i:i + chunk])
            plans.append(plan)
        return plans

    def targets(self, entry: Entry) -> list[int]:
        """Local tiers below the fastest one holding ``entry`` that lack it (write-through copies)."""
        return [t for t in LOCAL_TIERS if t > entry.best and t in self.tiers and not entry.in_tier(t)]
