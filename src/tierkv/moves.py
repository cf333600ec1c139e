"""The moving side of the store's one write path: plans, executed off the lock, then committed.

The deciding side (``placement.py``) builds a ``Plan`` under the store lock:
an ordered list of ``Move`` (copy one block into a tier) and ``Drop`` (remove
blocks from a tier that is slow to change, L3). ``Mover.submit`` hands it to
the IO thread, which runs every op in plan order with no store lock held, each
run of ops one background piece of the store's ``Pacer`` —
reading each source (a pinned slot in place, a staged copy, or a ``get`` from
a tier that cannot lend its bytes), one batched ``put`` per run of moves into
one tier (one fdatasync, one network round) — and then calls the commit
callback, which takes the lock and records the results in the index.

One error policy: a tier reports a lost write as False and counts why; a
tier that raises instead is counted as ``<tier>_error`` for the blocks of
that call and treated as having written none of them. Nothing here raises
into the IO thread or the caller.

Thread-safety: ``Plan`` is built under the store lock; ``Mover`` counts its
pending L3 changes under its own lock; ops run on the single IO thread, in
submission order, so a read of L3 queued after a write sees the write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tierkv.index import Entry, Tier
from tierkv.layout import KVLayout
from tierkv.metrics import TIER_NAMES
from tierkv.pacing import UNPACED, Pacer
from tierkv.tiers.base import BlockTier, FailureHook, Lineage


@dataclass(slots=True, eq=False)
class Move:
    """Copy block ``entry`` from tier ``src`` into tier ``dst``.

    The bytes come from ``data`` when set (a staged copy in ``staged`` outbox
    slot, or a caller's tensor that outlives the move), else from ``src``
    (``view`` in place, ``get`` otherwise). ``pinned``: the plan pinned the
    entry so its source stays put; the commit unpins it. ``optimistic``: the
    index already lists ``dst`` (a demotion whose source is gone); the commit
    only takes that back if the write failed. ``remove_src``: remove the block
    from ``src`` once read (an L3 victim relayed to L4).
    """

    entry: Entry
    src: int
    dst: int
    data: torch.Tensor | None = None
    staged: int | None = None
    pinned: bool = False
    optimistic: bool = False
    remove_src: bool = False

    @property
    def lineage(self) -> Lineage:
        return Lineage(self.entry.parent, self.entry.depth)


@dataclass(slots=True, eq=False)
class Drop:
    """Remove ``key`` from ``tier`` (the index no longer lists it there)."""

    key: bytes
    tier: int


@dataclass(eq=False)
class Plan:
    """Ops to run in order on the IO thread; built under the store lock by the deciding side."""

    ops: list[Move | Drop] = field(default_factory=list)
    l3_delta: int = 0  # blocks this plan will add to L3 (puts) minus those it removes

    def move(self, move: Move) -> None:
        self.ops.append(move)
        if move.dst == Tier.L3:
            self.l3_delta += 1
        if move.remove_src and move.src == Tier.L3:
            self.l3_delta -= 1

    def drop(self, key: bytes, tier: int) -> None:
        self.ops.append(Drop(key, tier))
        if tier == Tier.L3:
            self.l3_delta -= 1

    @property
    def moves(self) -> list[Move]:
        return [op for op in self.ops if isinstance(op, Move)]


Commit = Callable[[list[Move], list[bool]], None]


class Mover:
    """Runs plans on the IO thread and hands their results to ``commit``. Owns no cache state."""

    def __init__(self, tiers: dict[int, BlockTier], layout: KVLayout, io: Callable[..., Future],
                 sync: Callable[[], None], commit: Commit, on_failure: FailureHook,
                 staged_block: Callable[[int], torch.Tensor], pacer: Pacer = UNPACED) -> None:
        self.tiers = tiers
        self._pacer = pacer
        self.layout = layout
        self._io = io
        self._sync = sync
        self._commit = commit
        self._on_failure = on_failure
        self._staged_block = staged_block
        self._lock = threading.Lock()
        self._pending_l3 = 0  # L3 blocks queued to be written minus those queued to be removed
        self._queued = 0  # plans submitted and not yet committed
        self._abandoned = False
        self.dropped = 0  # block writes skipped after ``abandon``

    @property
    def queued(self) -> int:
        """Plans submitted and not yet committed."""
        return self._queued

    @property
    def pending_l3(self) -> int:
        """Blocks L3 will gain once the queued plans have run (negative: lose)."""
        return self._pending_l3

    def abandon(self) -> None:
        """From now on skip the writes of plans not yet run (their removals still run, so a tier never
        keeps a slot the index dropped); each skipped block is committed as failed and counted in
        ``dropped``. For a shutdown past its deadline. Any thread."""
        self._abandoned = True

    def submit(self, plan: Plan) -> Future | None:
        """Queue ``plan`` on the IO thread (call under the store lock, so plans run in the order
        they were decided). The future completes once the plan ran and was committed."""
        if not plan.ops:
            return None
        with self._lock:
            self._pending_l3 += plan.l3_delta
            self._queued += 1
        return self._io(self._run, plan)

    # -- the IO thread ----------------------------------------------------------

    def _run(self, plan: Plan) -> None:
        moves: list[Move] = []
        flags: list[bool] = []
        try:
            for run in _runs(plan.ops):
                # background, spaced while foreground work runs; charged the CPU time it spent
                # beyond the tier's own wall-charged slices (an fdatasync waits, it slows nobody)
                with self._pacer.piece(cpu=True):
                    if isinstance(run[0], Drop):
                        self._drop(run)
                    elif self._abandoned:
                        moves += run
                        flags += [False] * len(run)
                        self.dropped += len(run)
                        self._drop_relayed(run)  # as planned: the block is lost, not kept twice
                    else:
                        moves += run
                        flags += self._put(run)
        finally:
            with self._lock:
                self._pending_l3 -= plan.l3_delta
            flags += [False] * (len(moves) - len(flags))
            try:
                self._commit(moves, flags)
            finally:
                with self._lock:
                    self._queued -= 1

    def _drop(self, run: list[Drop]) -> None:
        tier = run[0].tier
        try:
            self.tiers[tier].remove([op.key for op in run])
        except Exception as exc:  # a tier bug: the slots leak until the next start, nothing is wrong
            self._on_failure(TIER_NAMES[tier], "error", len(run), repr(exc))

    def _source(self, move: Move) -> torch.Tensor | None:
        if move.data is not None:
            return move.data
        key, src = move.entry.key, self.tiers[move.src]
        if move.staged is None:
            view = src.view(key)
            if view is not None:
                return view
        buf = (self._staged_block(move.staged) if move.staged is not None
               else torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype))
        try:
            return buf if src.get([key], [buf])[0] else None
        except Exception as exc:
            self._on_failure(TIER_NAMES[move.src], "error", 1, repr(exc))
            return None

    def _put(self, run: list[Move]) -> list[bool]:
        dst = run[0].dst
        srcs = [self._source(m) for m in run]
        self._sync()  # device copies read above (and the source slots' last writes) have landed
        todo = [i for i, s in enumerate(srcs) if s is not None]
        out = [False] * len(run)
        if todo:
            try:
                ok = self.tiers[dst].put([run[i].entry.key for i in todo], [srcs[i] for i in todo],
                                         [run[i].lineage for i in todo])
            except Exception as exc:  # a tier that raised wrote nothing we can trust
                self._on_failure(TIER_NAMES[dst], "error", len(todo), repr(exc))
                ok = [False] * len(todo)
            self._sync()  # a device->host copy the put issued has landed before the commit lists it
            for i, flag in zip(todo, ok):
                out[i] = bool(flag)
        self._drop_relayed(run)
        return out

    def _drop_relayed(self, run: list[Move]) -> None:
        """Remove from their source the blocks of ``run`` relayed down (an L3 victim sent to L4)."""
        relayed = [Drop(m.entry.key, m.src) for m in run if m.remove_src]
        if relayed:
            self._drop(relayed)


def _runs(ops: list[Move | Drop]) -> list[list[Move | Drop]]:
    """Consecutive ops of one kind into one tier, in order (each run is one batched call)."""
    runs: list[list[Move | Drop]] = []
    for op in ops:
        tier = op.dst if isinstance(op, Move) else op.tier
        last = runs[-1][0] if runs else None
        if last is not None and type(last) is type(op) and (last.dst if isinstance(last, Move) else last.tier) == tier:
            runs[-1].append(op)
        else:
            runs.append([op])
    return runs
