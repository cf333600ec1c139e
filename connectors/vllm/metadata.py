"""What the scheduler-side connector tells the workers each step, and what they answer.

Plain data (bytes, ints, lists), so it crosses process boundaries as vLLM
pickles it. Keys are tierkv's chained block hashes (docs/design.md §3), always the
whole chain from block 0 so a worker can look blocks up and name parents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """Load blocks ``start .. len(keys)`` of a request's chain into vLLM blocks ``block_ids``."""

    req_id: str
    keys: list[bytes]
    start: int
    block_ids: list[int]
    is_async: bool


@dataclass
class SaveSpec:
    """Save vLLM blocks ``block_ids`` as blocks ``start .. len(keys)`` of a request's chain."""

    save_id: int
    req_id: str
    keys: list[bytes]
    start: int
    block_ids: list[int]


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    """One step's work. ``report_when_saved``: requests whose block free vLLM
    delayed for us; a worker lists each in ``finished_sending`` once its saves
    are done. ``preempted``: requests whose blocks vLLM just freed.
    ``finished``: requests that ended since the last step, as (their chain as
    far as it was saved, tokens generated): the store's eviction hint
    (``TierKVStore.finished``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    report_when_saved: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    finished: list[tuple[list[bytes], int]] = field(default_factory=list)


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: loads finished (pins can go), loads that stopped
    short (request -> first chain position not loaded: vLLM recomputes from
    there and those blocks must be saved again), saves finished (save_id ->
    blocks stored, a leading run), and keys that left every local tier of the
    store (evicted out of L3, or a failed load dropped them), in the order
    they left; a key removed while its own save ran comes in the same report
    as that save, so the scheduler sees the store before the removal.

    ``rank``: the tensor-parallel rank that wrote it. vLLM aggregates one step's
    reports of all ranks with ``aggregate``, which keeps each rank's report whole
    (``reports``): a rank's save or load may finish a step after another's, and
    the scheduler counts a save done only once every rank reported it."""

    loads_done: set[str] = field(default_factory=set)
    saves_done: dict[int, int] = field(default_factory=dict)
    removed: list[bytes] = field(default_factory=list)
    loads_short: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    parts: list[TierKVWorkerMetadata] = field(default_factory=list)

    def reports(self) -> list[TierKVWorkerMetadata]:
        """Each rank's own report in this one (itself, unless it is an aggregate)."""
        return self.parts or [self]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TierKVWorkerMetadata):
            return self
        return TierKVWorkerMetadata(rank=-1, parts=[*self.reports(), *other.reports()])
