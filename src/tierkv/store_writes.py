"""The write half of TierKVStore: write-through copies, ``persist``/``flush`` and L4 puts.

A mixin of ``TierKVStore`` (it shares the store's lock, index, tiers and IO
thread; it has no state of its own) kept in its own file so each stays small.
Deciding where a block goes stays with the policy and ``TierKVStore``; these
methods only queue and run the copies. Thread-safety: as the store's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.hashing import BlockHash
from tierkv.index import LOCAL_TIERS, Entry, Tier
from tierkv.tiers.base import Lineage, copy_block

L4_MAX_QUEUED = 256  # blocks copied into the L4 outbox and waiting for the IO thread to send them


class StoreWrites:
    """Write-through, persist and asynchronous L4 puts (mixed into TierKVStore)."""

    def _persist_targets(self, entry: Entry) -> list[int]:
        """Local tiers below the fastest one holding ``entry`` that lack it (L2, L3)."""
        return [t for t in LOCAL_TIERS if t > entry.best and self._tiers[t] is not None and not entry.in_tier(t)]

    def _persist_async(self, entries: Sequence[Entry], to_l4: Sequence[Entry] | None = None) -> None:
        """Copy ``entries`` down to L2/L3 on the IO thread, and those of ``to_l4`` to L4 as well.

        ``to_l4`` is a subset of ``entries``; None means all of them under
        write_through and none otherwise (write_through_selective names the
        blocks it selects now). Caller holds the lock. Each entry is pinned
        until its copy has landed, so its source slot cannot be evicted or
        reused meanwhile.
        """
        if to_l4 is None:
            to_l4 = entries if self.config.policy.write == "write_through" else ()
        l4_keys = {e.key for e in to_l4} if self.l4 is not None else set()
        todo = [e for e in entries if e.key not in self._persisting and (e.key in l4_keys or self._persist_targets(e))]
        if not todo:
            return
        self.index.pin(todo)
        self._persisting.update(e.key for e in todo)
        self.transfer.io(self._persist, todo, l4_keys)

    def _persist(self, entries: list[Entry], l4_keys: set[bytes]) -> None:
        """IO thread: L2 copies (memmoves) under the lock; L3 as one batch (one fdatasync) and the
        L4 copies of ``l4_keys`` as one batched put, both outside it."""
        try:
            with self._lock:
                for entry in entries:
                    if Tier.L2 in self._persist_targets(entry):
                        src = self._block_view(entry, entry.best)
                        self.transfer.d2h_sync()
                        self._put_lower(entry, Tier.L2, src)
                to_l4 = self._sources_for_l4([e for e in entries if e.key in l4_keys])
                to_l3 = [e for e in entries if Tier.L3 in self._persist_targets(e)]
                srcs = [self._block_view(e, e.best) for e in to_l3]  # L1/L2 slots, stable while pinned
                if to_l3:
                    self.transfer.d2h_sync()
                    self._make_room(Tier.L3, len(to_l3))
            if to_l4:
                self._send_l4(*zip(*to_l4))
            if not to_l3:
                return
            ok = self.l3.put([e.key for e in to_l3], srcs, [Lineage(e.parent, e.depth) for e in to_l3])
            with self._lock:
                for entry, flag in zip(to_l3, ok):
                    if flag:
                        self.index.add(entry.key, entry.parent, entry.depth, Tier.L3)
            self.metrics.add("bytes", ("l3", "write"), sum(ok) * self.layout.block_bytes)
        except Exception as exc:  # nobody waits on this thread: count and log it, as a lost write
            self._on_failure("l3", "write_through", len(entries), repr(exc))
        finally:
            with self._lock:
                self.index.unpin(entries)
                self._persisting.difference_update(e.key for e in entries)

    def flush(self) -> None:
        """Block until every write-through copy queued so far has landed and its tier events
        have reached the listeners. Thread-safe."""
        self.transfer.io(lambda: None).result()
        self.events.flush()

    def persist(self, keys: Sequence[BlockHash], tier: int = Tier.L3) -> int:
        """Copy the cached blocks of the chain ``keys`` into ``tier`` (L2, L3 or L4) where it lacks them.

        For tools that must leave a prefix behind them (``tierkv warm``, the
        demo's restart). Walks the chain from its root and stops at the first
        block no local tier holds. Blocks stay where they are: a copy, not a
        move. Returns the blocks written. Thread-safe; synchronous for L2/L3
        (written, and for L3 durable, on return); L4 copies are queued on the
        IO thread like every L4 put (``close`` waits until they are sent).
        """
        target = self.l4 if tier == Tier.L4 else self._tiers[tier] if tier != Tier.L1 else None
        if target is None:
            return 0
        with self._lock:
            todo: list[Entry] = []
            for key in keys:
                entry = self.index.get(key)
                if entry is None:
                    break
                if tier == Tier.L4 or not entry.in_tier(tier):
                    todo.append(entry)
            if tier != Tier.L3:
                return sum(self._put_lower(e, tier, src) for e in todo
                           if (src := self._block_view(e, e.best)) is not None)
            pairs = [(e, src) for e in todo if (src := self._block_view(e, e.best)) is not None]
            todo, srcs = [e for e, _ in pairs], [src for _, src in pairs]  # unreadable sources are skipped
            self.transfer.d2h_sync()
            self._make_room(tier, len(todo))
            ok = self.l3.put([e.key for e in todo], srcs, [Lineage(e.parent, e.depth) for e in todo])
            for e, flag in zip(todo, ok):
                if flag:
                    self.index.add(e.key, e.parent, e.depth, tier)
        self.metrics.add("bytes", ("l3", "write"), sum(ok) * self.layout.block_bytes)
        return sum(ok)


    def _put_l4_async(self, key: BlockHash, src: torch.Tensor, lineage: list[Lineage]) -> bool:
        """Queue a copy of ``src`` for L4; False (counted) when too many are queued.

        The bytes are copied first, into a slot of the L4 outbox (memory
        registered with the pool's client, with trailer room where the client
        uses it), so the source slot may be reused at once and the put needs no
        further copy. The IO thread sends whatever has queued meanwhile in one
        batched put (a demotion storm becomes a few calls, not one per block).
        L4 failures are counted by the tier and never raise into the caller.
        """
        with self._l4_lock:
            if self._l4_queued >= L4_MAX_QUEUED:
                self._on_failure("l4", "put_dropped", 1, f"{L4_MAX_QUEUED} L4 puts already queued")
                return False
            self._l4_queued += 1
            slot = self._l4_outbox.allocate(1)[0]  # never short: the outbox has L4_MAX_QUEUED slots
        _copy_into(self._l4_outbox.block(slot), src)
        with self._l4_lock:
            self._l4_pending.append((key, slot, lineage[0]))
            start, self._l4_sending = not self._l4_sending, True
        if start:
            self.transfer.io(self._send_queued_l4)
        return True

    def _send_queued_l4(self) -> None:
        """IO thread: send the queued L4 copies, batch after batch, until none is left."""
        while True:
            with self._l4_lock:
                batch, self._l4_pending = self._l4_pending, []
                if not batch:
                    self._l4_sending = False
                    return
            keys, slots, lineage = (list(x) for x in zip(*batch))
            try:
                ok = self.l4.put(keys, [self._l4_outbox.block(s) for s in slots], lineage)
            except Exception as exc:  # a tier bug must not kill the IO thread: count it as a miss
                self._on_failure("l4", "error", len(batch), repr(exc))
                ok = [False] * len(batch)
            finally:
                with self._l4_lock:
                    self._l4_outbox.free(slots)
                    self._l4_queued -= len(batch)
            self.metrics.add("bytes", ("l4", "write"), sum(ok) * self.layout.block_bytes)
            for key, flag in zip(keys, ok):
                if flag:
                    self.events.stored(key, Tier.L4)

    def _sources_for_l4(self, entries: Sequence[Entry]) -> list[tuple[BlockHash, torch.Tensor, Lineage]]:
        """Caller holds the lock: what a write-through L4 put sends for each of ``entries`` (pinned
        until it is sent), none without L4.

        An L1 slot or a private L2 slot is sent as it lies: the pin keeps it
        from being evicted or reused meanwhile, and the L1 pool is registered
        with the pool's client. Anything else (a block read out of L3 into the
        shared scratch buffer) is copied first.
        """
        if self.l4 is None or not entries:
            return []
        self.transfer.d2h_sync()
        out = []
        for entry in entries:
            src = self._block_view(entry, entry.best)
            if src is None:
                continue
            stable = entry.best == Tier.L1 or (entry.best == Tier.L2 and not self.l2.shared)
            out.append((entry.key, src if stable else _copy_into(torch.empty_like(src, device="cpu"), src),
                        Lineage(entry.parent, entry.depth)))
        return out

    def _send_l4(self, keys, blocks, lineage) -> None:
        """IO thread, outside the lock: one batched L4 put; failures are counted by the tier."""
        ok = self.l4.put(list(keys), list(blocks), list(lineage))
        self.metrics.add("bytes", ("l4", "write"), sum(ok) * self.layout.block_bytes)
        for key, flag in zip(keys, ok):
            if flag:
                self.events.stored(key, Tier.L4)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy a block (from L1 on any device, L2 or L3) into the CPU block ``dst``; returns ``dst``."""
    if src.device.type == "cpu":
        copy_block(dst, src)
    else:
        dst.copy_(src)
    return dst
