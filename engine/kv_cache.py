"""Sequence block tables on top of the store: the engine's block manager.

The store's L1 tier is the engine's KV pool, so there is one block manager,
the store; this module only keeps each sequence's view of it. At admission a
sequence looks up its prompt (``lookup_keys`` over hashes extended
incrementally), reuses L1 hits in place, allocates private slots for
everything else and starts one asynchronous ``load`` for the blocks found in
L2/L3/L4. As its blocks fill they are ``save``d (adopted by the index, pinned
by the sequence's match). At the end it ``release``s the match and ``free``s
the slots it still owns. With the cache disabled nothing is looked up or
saved: every slot is private.

Runs on the engine thread only; the store it calls is thread-safe.
"""

from __future__ import annotations

from tierkv.engine.sequence import Sequence, SeqState
from tierkv.index import Tier
from tierkv.metrics import TIER_NAMES
from tierkv.store import OutOfBlocks, TierKVStore


class KVCacheManager:
    def __init__(self, store: TierKVStore, enable_cache: bool) -> None:
        self.store = store
        self.enable_cache = enable_cache
        self.block_size = store.block_size

    def _cdiv(self, n: int) -> int:
        return -(-n // self.block_size)

    def _extend_keys(self, seq: Sequence) -> None:
        full = seq.num_tokens // self.block_size
        if len(seq.keys) < full:
            seed = self.store.seed(seq.namespace, seq.extra_keys)
            parent = seq.keys[-1] if seq.keys else None
            seq.keys += self.store.hasher.hash_blocks(seq.token_ids, self.block_size, seed,
                                                      len(seq.keys), parent)

    # -- admission ------------------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        """Give ``seq`` blocks for all its tokens; False (nothing held) when L1 has no room.

        Leaves the sequence RUNNING with ``num_computed`` at its cached prefix,
        or LOADING while lower-tier blocks are copied into its slots.
        """
        match = None
        if self.enable_cache:
            self._extend_keys(seq)
            # The last token is always computed: its logits give the next token.
            usable = (seq.num_tokens - 1) // self.block_size
            match = self.store.lookup_keys(seq.keys[:usable])
        hits = match.num_blocks if match is not None else 0
        to_load = match.to_load if match is not None else []
        need = len(to_load) + self._cdiv(seq.num_tokens) - hits
        try:
            slots = self.store.allocate(need)
        except OutOfBlocks:
            if match is not None:
                self.store.release(match)
            return False
        fresh = iter(slots)
        l1 = match.l1_slots() if match is not None else []
        seq.block_table = [s if s is not None else next(fresh) for s in l1] + list(fresh)
        seq.private = [s is None for s in l1] + [True] * (len(seq.block_table) - hits)
        seq.match = match
        if to_load:
            seq.load = self.store.load(match, [seq.block_table[i] for i in to_load])
            seq.state = SeqState.LOADING
        else:
            self._ready(seq, hits)
        return True

    def _ready(self, seq: Sequence, num_ok: int) -> None:
        seq.num_computed = seq.num_saved = num_ok
        seq.num_computed *= self.block_size
        if not seq.output_ids:
            counts = dict.fromkeys(TIER_NAMES, 0)
            for t in seq.match.tiers[:num_ok] if seq.match is not None else []:
                counts[TIER_NAMES[t]] += self.block_size
            seq.hit_tokens = counts
        seq.state = SeqState.RUNNING

    def poll_load(self, seq: Sequence) -> bool:
        """True once ``seq``'s load finished and it is RUNNING (blocks from the first failure on are recomputed).

        False while the copy is in flight, or when a failed block left the
        sequence unable to get a private slot (it is then released and WAITING).
        """
        if not seq.load.done():
            return False
        result = seq.load.wait()
        seq.load = None
        num_ok = result.num_ok
        for i, adopted in enumerate(result.adopted):
            if adopted:
                seq.private[i] = False
        # A shared L1 hit past the first failure must not be overwritten by the recompute.
        shared = [i for i in range(num_ok, seq.match.num_blocks) if seq.match.tiers[i] == Tier.L1]
        if shared:
            try:
                slots = self.store.allocate(len(shared))
            except OutOfBlocks:
                self.release(seq)
                seq.state = SeqState.WAITING
                return False
            for i, slot in zip(shared, slots):
                seq.block_table[i], seq.private[i] = slot, True
        self._ready(seq, num_ok)
        return True

    # -- running --------------------------------------------------------------

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold ``num_tokens``; False when L1 has no room."""
        need = self._cdiv(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        try:
            slots = self.store.allocate(need)
        except OutOfBlocks:
            return False
        seq.block_table += slots
        seq.private += [True] * need
        return True

    def commit(self, seq: Sequence) -> None:
        """Save the blocks that became full and computed in the last step (cache on only)."""
        full = seq.num_computed // self.block_size
        if not self.enable_cache or full <= seq.num_saved:
            return
        self._extend_keys(seq)
        start = seq.num_saved
        adopted = self.store.save(seq.keys, seq.block_table[start:full], start, seq.match)
        for j, flag in enumerate(adopted):
            if flag:
                seq.private[start + j] = False
        seq.num_saved = full

    def finished(self, seq: Sequence) -> None:
        """Tell the store that ``seq`` ended and how many tokens it generated (an eviction hint)."""
        if self.enable_cache and seq.keys:
            self.store.finished(seq.keys, len(seq.output_ids))

    def release(self, seq: Sequence) -> None:
        """Unpin the sequence's cached blocks and free its private slots; it holds nothing after."""
        if seq.load is not None:
            # The copy thread may still be writing into our slots; what it adopted is no longer ours.
            for i, adopted in enumerate(seq.load.wait().adopted):
                if adopted:
                    seq.private[i] = False
        if seq.match is not None:
            self.store.release(seq.match)
        mine = [s for s, p in zip(seq.block_table, seq.private) if p]
        if mine:
            self.store.free(mine)
        seq.reset_blocks()
