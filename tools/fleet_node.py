"""One simulated tierkv node for tools/fleet.py, and the router's view of it (issue 27).

``SimNode`` is what runs on a node: tierkv's real ``PrefixIndex`` and eviction
policies over L1/L2/L3 capacities counted in blocks (accounting only: no bytes
move), the store's rules for a request, and an ``EngineSim``
(tools/engine_model.py) that schedules its requests as the bundled engine does.
A request's TTFT is what that engine model gives it; nothing here charges
``CostModel.estimate_us``.

The store's rules: at admission the longest cached prefix is matched, cut by
the node's cost model, pinned and touched; the blocks below L1 are loaded
(the engine model's load time); when the prefill ends every block of the
prompt is in L1, pinned until the request finishes; victims are demoted one
tier down. Every change to what a tier holds is recorded through the index's
``events`` hook, as the real store's ``TierEvents`` records it, and goes out
as one ``KVEventBatch``'s events (``BlockRemoved`` / ``BlockStored``, medium
``"L1"``..``"L3"``) at the end of the step that made it.

``RouteView`` is all a router learns about the node, as ``tierkv route`` learns
it: those batches, ``event_delay_us`` after they were made, applied to an
``Inventory``; and the requests it sent there that have not finished. Its
``node`` is a real ``tierkv.route.nodes.Node``, so ``candidate`` is the
deployed code: matched tokens from the inventory, ``queue_us = depth ×
recompute estimate``. It never reads the node's index or engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierkv.cost import CostModel
from tierkv.index import LOCAL_TIERS, PrefixIndex
from tierkv.kvevents import Inventory
from tierkv.kvevents.wire import MEDIA, BlockRemoved, BlockStored
from tierkv.policy import make_policy
from tierkv.route import Candidate
from tierkv.route.nodes import Node

from tools.engine_model import EngineParams, EngineSim, Seq


@dataclass(eq=False)
class Job:
    """What the node's store keeps of one request while it runs (an ``EngineSim`` ``Seq``'s payload)."""

    keys: list[bytes]  # the block keys of the prompt's full blocks
    tell_output: bool = True  # tell the index its output length as it finishes
    hit_blocks: int = 0  # leading blocks served from cache (after the cost cut)
    pinned: list = field(default_factory=list)  # index entries it holds pinned


class SimEvents:
    """The index's ``events`` hook: net per-tier changes since the last ``take``, as the store's
    ``TierEvents`` keeps them (a block stored and removed again before a batch went out is in neither)."""

    records = None  # the index calls stored / removed (no DeferredRecords log)
    _listeners = True  # the index records a saved chain only when someone listens

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._new: list[dict[bytes, bool]] = [{} for _ in MEDIA]
        self._gone: list[dict[bytes, bool]] = [{} for _ in MEDIA]

    def stored(self, key: bytes, tier: int) -> None:
        if self._gone[tier].pop(key, None) is None:
            self._new[tier][key] = True

    def removed(self, key: bytes, tier: int) -> None:
        if self._new[tier].pop(key, None) is None:
            self._gone[tier][key] = True

    def stored_keys(self, keys: list[bytes], tier: int) -> None:
        for key in keys:
            self.stored(key, tier)

    def removed_keys(self, keys: list[bytes], tier: int) -> None:
        for key in keys:
            self.removed(key, tier)

    def take(self) -> list:
        """The pending changes as one batch's events (removals first, as the publisher sends them)."""
        events: list = [BlockRemoved(list(g), MEDIA[t]) for t, g in enumerate(self._gone) if g]
        events += [BlockStored(list(n), None, [], self.block_size, None, MEDIA[t], None)
                   for t, n in enumerate(self._new) if n]
        self._new = [{} for _ in MEDIA]
        self._gone = [{} for _ in MEDIA]
        return events


class SimNode:
    """One node: index, policies and engine model. Driven by tools/fleet.py in arrival order."""

    def __init__(self, name: str, capacities: Sequence[int], policy: str, params: EngineParams,
                 half_life: float = 2000.0) -> None:
        self.name = name
        self.params = params
        self.cost = params.cost_model()
        self.capacities = list(capacities)
        present = [t for t in LOCAL_TIERS if self.capacities[t] > 0]
        self.lower = {t: next((u for u in present if u > t), None) for t in present}
        policies = [make_policy(policy, t, cost=self.cost, lower=self.lower[t], half_life=half_life)
                    if t in self.lower else None for t in LOCAL_TIERS]
        self.index = PrefixIndex(policies, half_life)
        self.events = SimEvents(params.block_size)
        self.index.events = self.events
        self.batches: deque[tuple[float, list]] = deque()  # (made at µs, events): what the node publishes
        self.finishes: deque[float] = deque()  # end times of its requests, in order (a response ending)
        self.engine = EngineSim(params, self._admit, self._prefilled, self._finished)
        self.done: list[Seq] = []

    def submit(self, seq: Seq) -> None:
        """Queue a request (``seq.payload``: its ``Job``) at its arrival."""
        self.engine.add(seq)

    def run_until(self, t: float) -> None:
        self.engine.run_until(t)

    # -- the store's part, called by the engine model ------------------------

    def _admit(self, seq: Seq, now: float) -> tuple[int, list[tuple[int, int]]]:
        index, bs = self.index, self.params.block_size
        job = seq.payload
        entries = index.match_entries(job.keys)
        tiers = [e.best for e in entries]
        hit = self.cost.cut(tiers)
        used = entries[:hit]
        index.pin(used)
        index.touch(used)
        job.hit_blocks, job.pinned = hit, list(used)
        loads = [0, 0, 0, 0]
        for tier in tiers[:hit]:
            loads[tier] += bs
        return hit * bs, [(t, n) for t, n in enumerate(loads) if t and n]

    def _prefilled(self, seq: Seq, now: float) -> None:
        """The prompt's blocks are in L1 (loaded or computed), pinned while the request runs."""
        index, get, job = self.index, self.index.get, seq.payload
        pinned = job.pinned
        parent = None
        for depth, key in enumerate(job.keys):
            entry = get(key)
            if entry is None or not entry.mask & 1:
                unpinned = entry is None or entry.ref_count == 0
                entry = index.add(key, parent, depth, 0, pin=unpinned)
                if unpinned:
                    pinned.append(entry)
            parent = key
        self._make_room(0)
        self._publish(now)

    def _finished(self, seq: Seq, now: float) -> None:
        index, job = self.index, seq.payload
        if job.tell_output:
            index.finished([e for e in map(index.get, job.keys) if e is not None], seq.output_tokens)
        index.unpin(job.pinned)
        job.pinned = []
        self._make_room(0)
        self._publish(now)
        self.finishes.append(now)
        self.done.append(seq)

    def _publish(self, now: float) -> None:
        events = self.events.take()
        if events:
            self.batches.append((now, events))

    def _make_room(self, tier: int, extra: int = 0) -> None:
        counts, cap = self.index.counts, self.capacities[tier]
        while counts[tier] + extra > cap and self._evict(tier):
            pass

    def _evict(self, tier: int) -> bool:
        entry = self.index.victim(tier)
        if entry is None:
            return False
        lower = self.lower[tier]
        if lower is not None and not entry.mask >> lower & 1:
            self._make_room(lower, extra=1)
            self.index.add(entry.key, entry.parent, entry.depth, lower)
        self.index.drop(entry.key, tier)
        return True


class _EventFeed:
    """Stands where ``Node.subscriber`` (a ``KVEventSubscriber``) stands: only its ``inventory`` is read."""

    def __init__(self) -> None:
        self.inventory = Inventory()


class RouteView:
    """The router's side of one node: a real ``Node`` fed by the node's event batches and by the
    ends of the requests this router sent it, each once its time has come."""

    def __init__(self, node: SimNode, event_delay_us: float) -> None:
        self.sim = node
        self.event_delay_us = event_delay_us
        self.node = Node(node.name, up=True, cost=CostModel(*_cost_fields(node.cost)),
                         block_size=node.params.block_size)
        self.node.subscriber = _EventFeed()
        self.batches_applied = 0

    def catch_up(self, now: float) -> None:
        """Apply what reached the router by ``now``: event batches and finished responses."""
        sim, node = self.sim, self.node
        inventory = node.subscriber.inventory
        while sim.batches and sim.batches[0][0] + self.event_delay_us <= now:
            inventory.apply(sim.batches.popleft()[1])
            self.batches_applied += 1
        while sim.finishes and sim.finishes[0] <= now:
            sim.finishes.popleft()
            node.inflight -= 1

    def candidate(self, keys: Sequence[bytes], n_tokens: int) -> Candidate:
        return self.node.candidate(keys, n_tokens)

    def sent(self) -> None:
        self.node.inflight += 1
        self.node.served += 1


def _cost_fields(cost: CostModel) -> tuple:
    """A copy of the node's reported cost figures (what ``/v1/kv/status`` carries)."""
    return (tuple(cost.load_us), cost.recompute_us, cost.growth, cost.block_size, cost.block_bytes)
