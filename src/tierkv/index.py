"""The prefix index: block hash -> Entry (docs/design.md §4). Decides nothing.

Its per-block loops run in C when that builds (``tierkv.index_native``: the same
statements on the same objects), in the Python below otherwise.

An entry knows its parent, its depth, which local tiers hold it, its L1 slot,
how many running requests pin it, when it was last used, a decayed use count
and, per tier, how many of its children that tier holds. A block is
*evictable* from a tier when the tier holds it, no child is held there (leaves
first: removing an inner block strands its descendants) and no request pins
it. The index tells each tier's policy when a block becomes or stops being
evictable, so a policy only ever ranks candidates. Removal listeners hear of
each block that leaves the index (no local tier holds it any more).

Not thread-safe: the store serialises calls under its lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from functools import partial
from typing import Protocol

from tierkv.events import NUM_TIERS as _NUM_TIERS  # a removal's code in a DeferredRecords: NUM_TIERS + its tier

log = logging.getLogger("tierkv")


class Tier(IntEnum):
    L1 = 0
    L2 = 1
    L3 = 2
    L4 = 3


LOCAL_TIERS = (Tier.L1, Tier.L2, Tier.L3)
MISS = -1
# Lowest set bit of a 3-bit tier mask, i.e. the fastest tier holding a block.
_BEST = (MISS, 0, 1, 0, 2, 0, 1, 0)
# The tiers set in a 3-bit tier mask, fastest first (the loops over a block's tiers).
_TIERS_OF = tuple(tuple(t for t in range(3) if m >> t & 1) for m in range(8))
_L1 = int(Tier.L1)


class Entry:
    """One cached block. Mutated only by PrefixIndex."""

    __slots__ = (
        "key", "parent", "depth", "mask", "best", "l1_slot", "ref_count",
        "last_access", "freq", "hits", "tag", "children", "handles",
    )

    def __init__(self, key: bytes, parent: bytes | None, depth: int, last_access: int = 0,
                 mask: int = 0, ref_count: int = 0) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.mask = mask
        self.best = _BEST[mask]
        self.l1_slot: int | None = None
        self.ref_count = ref_count
        self.last_access = last_access
        self.freq = 0.0
        self.hits = 0  # lookups that hit it while cached (not decayed)
        self.tag = 0   # owned by the policies (e.g. hit_density's class bits); the index never reads it
        self.children = [0, 0, 0]
        self.handles: list = [None, None, None]  # policy bookkeeping, one per tier

    def in_tier(self, tier: int) -> bool:
        return bool(self.mask >> tier & 1)

    def __repr__(self) -> str:
        tiers = ",".join(f"L{t + 1}" for t in LOCAL_TIERS if self.in_tier(t))
        return f"Entry({self.key.hex()[:8]} d={self.depth} [{tiers}] ref={self.ref_count})"


class Ranking(Protocol):
    """What the index needs from a tier's eviction policy (``tierkv.policy.base.EvictionPolicy``).

    Declared here so the index imports nothing from the policies: they depend
    on the index (for ``Entry``), never the other way round.
    """

    def bind(self, index: PrefixIndex) -> None: ...
    def add(self, entry: Entry) -> None: ...
    def discard(self, entry: Entry) -> None: ...
    def touch(self, entry: Entry) -> None: ...
    def pop(self) -> Entry | None: ...
    # Optional: ``observe(entries, clock)``, called by ``PrefixIndex.touch`` with every
    # block a lookup hit (listed or not), before their use times are updated; and
    # ``admit(entry)``, called by ``PrefixIndex.add`` each time the policy's tier gains a block;
    # and ``pop_after(entry)``, ``add(entry)`` then ``pop()`` in one call (``evict`` hands it
    # the parent each victim exposes, which is often the next victim itself); and
    # ``finished(entries, output_tokens)``, called by ``PrefixIndex.finished`` when a
    # request that used those blocks has finished generating.
    def __len__(self) -> int: ...


class PrefixIndex:
    """hash -> Entry with longest-prefix match and per-tier eviction candidates.

    ``policies[t]`` ranks the evictable blocks of local tier ``t``; ``None``
    for an absent tier. ``half_life`` (in lookups) sets how fast ``freq`` decays.
    ``native``: run the per-block loops (``match_entries``, ``use``, ``save_chain``,
    ``unpin``, ``evict``) in C (``tierkv.index_native``, the same decisions on the
    same objects) when it can be built; None (default) uses it when available,
    False never (the pure-Python path, which tests compare it with).
    """

    def __init__(self, policies: Sequence[Ranking | None], half_life: float = 2000.0,
                 native: bool | None = None) -> None:
        if len(policies) != len(LOCAL_TIERS):
            raise ValueError(f"index.policies: expected {len(LOCAL_TIERS)} entries, got {len(policies)}")
        if half_life <= 0:
            raise ValueError(f"index.half_life: expected > 0, got {half_life}")
        self._entries: dict[bytes, Entry] = {}
        # Parents no tier holds whose children are cached (a parent evicted first, or
        # never added): never matched, but they keep counting those children, so a
        # parent cached again is still an inner block, not an eviction candidate.
        self._uncached_parents: dict[bytes, Entry] = {}
        self.counts = [0, 0, 0]
        self.clock = 0
        self.policies = list(policies)
        for policy in self.policies:
            if policy is not None:
                policy.bind(self)
        self._observing = tuple(p for p in self.policies if p is not None and hasattr(p, "observe"))
        self._observers = tuple(p.observe for p in self._observing)
        self._admits = [getattr(p, "admit", None) for p in self.policies]
        self._finishers = tuple(p for p in self.policies if p is not None and hasattr(p, "finished"))
        self._decay = 0.5 ** (1.0 / half_life)
        # Copy-on-write under its own lock: drop() reads the tuple without taking any.
        self._removal_listeners: tuple[Callable[[bytes], None], ...] = ()
        self._listeners_lock = threading.Lock()
        self.listener_errors = 0
        # Optional tierkv.events.TierEvents: told of every (key, tier) this index adds or drops (a
        # save's chain in one stored_keys call, when anyone listens; each other change by itself).
        # For one operation it may be a DeferredRecords, whose ``records`` list add and drop append
        # to directly (``records`` is None on a TierEvents: they call stored / removed).
        self.events = None
        if native is False:
            self._c = None
        else:
            from tierkv import index_native  # imports the policies it speeds up: not at module import

            self._c = index_native.load()
        if self._c is not None:
            # The hot methods straight to C, no Python frame per call: instance attributes that
            # shadow the methods below (which, called on the class, take the same C path).
            c = self._c
            self.match_entries = partial(c.match_entries, self._entries)
            self.use = partial(c.use, self)
            self.save_chain = partial(c.save_chain, self)
            self.unpin = partial(c.unpin, self)
            self.evict = partial(c.evict, self)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> Iterable[Entry]:
        return self._entries.values()

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """Fastest local tier of each block of the longest cached prefix of ``keys``."""
        return [entry.best for entry in self.match_entries(keys)]

    # -- membership ---------------------------------------------------------

    def add(self, key: bytes, parent: bytes | None, depth: int, tier: int, pin: bool = False) -> Entry:
        """Record that ``tier`` holds ``key`` (creating the entry if new).

        With ``pin`` the block is also pinned, as ``pin([entry])`` would, without
        being listed as a candidate in between.
        """
        entry = self._entries.get(key)
        if entry is None:
            entry = self._uncached_parents.pop(key, None)
            if entry is None:
                entry = Entry(key, parent, depth)
            else:
                entry.parent, entry.depth = parent, depth
            entry.last_access = self.clock
            self._entries[key] = entry
        if pin:
            entry.ref_count += 1
            if entry.ref_count == 1:
                for t in LOCAL_TIERS:
                    if entry.handles[t] is not None:
                        self.policies[t].discard(entry)
        bit = 1 << tier
        if entry.mask & bit:
            return entry
        entry.mask |= bit
        entry.best = _BEST[entry.mask]
        self.counts[tier] += 1
        admit = self._admits[tier]
        if admit is not None:
            admit(entry)
        events = self.events
        if events is not None:
            records = events.records  # a DeferredRecords' log: two appends, no call
            if records is None:
                events.stored(key, tier)
            else:
                records.append(key)
                records.append(tier)
        if parent is not None:
            parent_entry = self._entries.get(parent) or self._uncached_parents.get(parent)
            if parent_entry is None:
                parent_entry = self._uncached_parents[parent] = Entry(parent, None, max(depth - 1, 0))
            parent_entry.children[tier] += 1
            if parent_entry.children[tier] == 1 and parent_entry.handles[tier] is not None:
                self.policies[tier].discard(parent_entry)  # no longer a leaf in this tier
        if entry.ref_count == 0 and not entry.children[tier]:  # _relist, inlined
            policy = self.policies[tier]
            if policy is not None:
                policy.add(entry)
        return entry

    def match_entries(self, keys: Sequence[bytes]) -> list[Entry]:
        """The entries of the longest cached prefix of ``keys`` (``match`` without the tiers)."""
        if self._c is not None:
            return self._c.match_entries(self._entries, keys)
        get = self._entries.get
        out: list[Entry] = []
        append = out.append
        for key in keys:
            entry = get(key)
            if entry is None:
                break
            append(entry)
        return out

    def save_chain(self, keys: Sequence[bytes], start: int, tier: int) -> list[Entry]:
        """``add(keys[i], keys[i - 1], i, tier, pin=True)`` for each ``i >= start`` that ``tier`` lacks.

        The request's blocks as one call (the hot path of a save). A block this
        call pins is pinned once whatever its tier; one pinned already (by the
        caller's lookup) is not pinned again. Returns the entries it pinned, for
        the caller to ``unpin`` when the request ends.
        """
        if self._c is not None:
            return self._c.save_chain(self, keys, start, tier)
        entries, uncached, policies = self._entries, self._uncached_parents, self.policies
        get = entries.get
        bit, clock, admit, policy = 1 << tier, self.clock, self._admits[tier], self.policies[tier]
        events = self.events
        recorded: list[bytes] | None = [] if events is not None and getattr(events, "_listeners", True) else None
        pinned: list[Entry] = []
        append = pinned.append
        parent = keys[start - 1] if start else None
        parent_entry = None if parent is None else (get(parent) or uncached.get(parent))
        depth = start
        skipped = 0  # blocks the tier held already
        try:
            for key in keys[start:] if start else keys:
                entry = get(key)
                if entry is None:
                    revived = uncached.pop(key, None) if uncached else None
                    if revived is None:
                        # New (the common case): listed nowhere, so pinning it is setting the count.
                        entry = entries[key] = Entry(key, parent, depth, clock, bit, 1)
                        append(entry)
                    else:  # a parent no tier held: listed nowhere, perhaps pinned
                        entry = entries[key] = revived
                        entry.parent, entry.depth, entry.last_access = parent, depth, clock
                        entry.mask, entry.best = bit, _BEST[bit]
                        if entry.ref_count == 0:
                            entry.ref_count = 1
                            append(entry)
                elif entry.mask & bit:
                    parent, parent_entry = key, entry
                    depth += 1
                    skipped += 1
                    continue
                else:
                    if entry.ref_count == 0:
                        entry.ref_count = 1
                        handles = entry.handles
                        for t in _TIERS_OF[entry.mask]:
                            if handles[t] is not None:
                                policies[t].discard(entry)
                        append(entry)
                    entry.mask |= bit
                    entry.best = _BEST[entry.mask]
                if admit is not None:
                    admit(entry)
                if recorded is not None:
                    recorded.append(key)
                if parent is not None:
                    if parent_entry is None:
                        parent_entry = uncached[parent] = Entry(parent, None, max(depth - 1, 0))
                    children = parent_entry.children
                    children[tier] += 1
                    if children[tier] == 1 and parent_entry.handles[tier] is not None:
                        policy.discard(parent_entry)
                parent, parent_entry = key, entry
                depth += 1
        finally:  # told once, for the whole chain (also what a save that failed part way did)
            if recorded:
                events.stored_keys(recorded, tier)
        self.counts[tier] += depth - start - skipped
        return pinned

    def drop(self, key: bytes, tier: int) -> Entry | None:
        """Record that ``tier`` no longer holds ``key``; forget the block when no tier does."""
        entry = self._entries.get(key)
        if entry is None or not entry.mask >> tier & 1:
            return None
        self._drop(entry, tier)
        return entry

    def evict(self, tier: int, n: int) -> list[Entry]:
        """Take up to ``n`` of ``tier``'s victims (its policy chooses) and drop them from ``tier``.

        For a tier whose victims go nowhere (no tier below to demote to);
        ``drop`` for each victim, in order. Returns the victims (fewer when
        nothing more is evictable).
        """
        if self._c is not None:
            return self._c.evict(self, tier, n)
        policy, drop_ = self.policies[tier], self._drop
        victims: list[Entry] = []
        if policy is None or n <= 0:
            return victims
        pop, append = policy.pop, victims.append
        pop_after = getattr(policy, "pop_after", None)
        exposed = None  # a parent the last victim made evictable, not listed yet
        for _ in range(n):
            if exposed is None:
                entry = pop()
                if entry is None:
                    break
            else:
                entry = pop_after(exposed)
            exposed = drop_(entry, tier, pop_after is not None)
            append(entry)
        if exposed is not None:
            policy.add(exposed)
        return victims

    def _drop(self, entry: Entry, tier: int, defer: bool = False) -> Entry | None:
        """``drop`` of an entry that ``tier`` holds (the one code path of every drop and eviction).

        A parent this makes evictable in ``tier`` is listed, or with ``defer``
        returned unlisted for the caller to list (``evict``); otherwise None.
        """
        handles = entry.handles
        if handles[tier] is not None:
            self.policies[tier].discard(entry)
        mask = entry.mask & ~(1 << tier)
        entry.mask = mask
        entry.best = _BEST[mask]
        if tier == _L1:
            entry.l1_slot = None
        self.counts[tier] -= 1
        key = entry.key
        events = self.events
        if events is not None:
            records = events.records  # as in add
            if records is None:
                events.removed(key, tier)
            else:
                records.append(key)
                records.append(tier + _NUM_TIERS)
        exposed = None
        parent = entry.parent
        if parent is not None:
            parent_entry = self._entries.get(parent) or self._uncached_parents.get(parent)
            if parent_entry is not None:
                children = parent_entry.children
                children[tier] -= 1
                if children[tier] == 0:
                    # _relist, inlined (hot path: every eviction of a chain's tail exposes its parent)
                    if (parent_entry.mask >> tier & 1 and parent_entry.ref_count == 0
                            and parent_entry.handles[tier] is None):
                        policy = self.policies[tier]
                        if defer:
                            exposed = parent_entry
                        elif policy is not None:
                            policy.add(parent_entry)
                    elif parent_entry.mask == 0 and not any(children):
                        del self._uncached_parents[parent]
        if mask == 0:
            del self._entries[key]
            if any(entry.children):
                self._uncached_parents[key] = entry
            if self._removal_listeners:
                self._notify_removed(key)
        return exposed

    # -- removal listeners ----------------------------------------------------

    def add_removal_listener(self, listener: Callable[[bytes], None]) -> None:
        """Call ``listener(key)`` each time a block leaves the index: its last local tier dropped it.

        Not called when a block moves between tiers (the lower tier is added
        before the upper one is dropped), nor for L4, which the index does not
        track. The listener runs on whichever thread changed the index, while
        the store holds its lock: it must be quick (record the key, nothing
        more) and must not call back into the store. An exception it raises
        is caught, counted in ``listener_errors`` and logged once; the store
        never sees it. Registering and removing are safe from any thread.
        """
        with self._listeners_lock:
            self._removal_listeners = (*self._removal_listeners, listener)

    def remove_removal_listener(self, listener: Callable[[bytes], None]) -> None:
        """Stop calling ``listener`` (registered with ``add_removal_listener``); unknown ones are ignored."""
        with self._listeners_lock:
            listeners = list(self._removal_listeners)
            if listener in listeners:
                listeners.remove(listener)
                self._removal_listeners = tuple(listeners)

    def _notify_removed(self, key: bytes) -> None:
        for listener in self._removal_listeners:
            try:
                listener(key)
            except Exception:  # a listener's bug must not break an eviction half-way
                self.listener_errors += 1
                if self.listener_errors == 1:
                    log.warning("tierkv: index removal listener %r failed; further failures are only "
                                "counted (index.listener_errors)", listener, exc_info=True)

    # -- use ------------------------------------------------------------------

    def pin(self, entries: Iterable[Entry]) -> None:
        """Pin each of ``entries`` once more: a pinned block is no eviction candidate in any tier."""
        policies = self.policies
        for entry in entries:
            entry.ref_count += 1
            if entry.ref_count == 1:
                handles = entry.handles
                for tier in _TIERS_OF[entry.mask]:
                    if handles[tier] is not None:
                        policies[tier].discard(entry)

    def unpin(self, entries: Iterable[Entry]) -> None:
        """Release one pin of each of ``entries``; a block left unpinned is listed where it is a leaf."""
        if self._c is not None:
            return self._c.unpin(self, entries)
        policies = self.policies
        for entry in entries:
            ref = entry.ref_count - 1
            if ref < 0:
                raise RuntimeError(f"unpin of an unpinned block {entry!r}")
            entry.ref_count = ref
            if ref == 0:
                # _relist, inlined: this loop runs for every block of every request. An entry
                # the index forgot has no tier left (mask 0), so nothing lists it again.
                children, handles = entry.children, entry.handles
                for tier in _TIERS_OF[entry.mask]:
                    if not children[tier] and handles[tier] is None:
                        policy = policies[tier]
                        if policy is not None:
                            policy.add(entry)

    def touch(self, entries: Iterable[Entry]) -> None:
        """One access (a lookup that hit these blocks): advance the clock, decay and bump ``freq``."""
        self.use(entries, False)

    def use(self, entries: Iterable[Entry], pin: bool) -> None:
        """A lookup's hits: with ``pin``, ``pin(entries)``, then ``touch(entries)``, in one pass.

        The clock advances once; each policy that observes hits sees them all
        (listed or not) before their use times change; each block gains a use
        (``freq`` decays by the half-life and gains 1, ``hits`` gains 1).
        """
        if self._c is not None:
            return self._c.use(self, entries, pin)
        self.clock += 1
        clock, decay, policies = self.clock, self._decay, self.policies
        if self._observers:
            entries = entries if isinstance(entries, list) else list(entries)
            for observe in self._observers:
                observe(entries, clock)
        for entry in entries:
            last = entry.last_access
            entry.freq = entry.freq * decay ** (clock - last) + 1.0
            entry.hits += 1
            entry.last_access = clock
            ref = entry.ref_count
            if pin:
                entry.ref_count = ref + 1
            if ref == 0:
                handles = entry.handles
                for tier in _TIERS_OF[entry.mask]:
                    if handles[tier] is not None:
                        if pin:
                            policies[tier].discard(entry)
                        else:
                            policies[tier].touch(entry)

    def finished(self, entries: list[Entry], output_tokens: int) -> None:
        """A request that used ``entries`` (its prompt's blocks) finished, having generated ``output_tokens``.

        A hint, not a use: no clock, age or hit count changes. Each tier's
        policy that learns from it (``hit_density``: the output's band is part
        of a block's class) sees it; the others ignore it. Not thread-safe.
        """
        for policy in self._finishers:
            policy.finished(entries, output_tokens)

    def victim(self, tier: int) -> Entry | None:
        """The evictable block ``tier``'s policy would evict next, unlisted; None if none."""
        policy = self.policies[tier]
        return None if policy is None else policy.pop()

    def evictable(self, entry: Entry, tier: int) -> bool:
        return bool(entry.mask >> tier & 1) and entry.children[tier] == 0 and entry.ref_count == 0

    # -- policy bookkeeping -------------------------------------------------

    def _relist(self, entry: Entry, tier: int) -> None:
        if (entry.handles[tier] is None and entry.ref_count == 0 and not entry.children[tier]
                and entry.mask >> tier & 1):
            policy = self.policies[tier]
            if policy is not None:
                policy.add(entry)

