"""vLLM's KV event wire format, declared here so tierkv core never imports vLLM.

The structs mirror ``vllm/distributed/kv_events.py`` (vLLM 0.32): the same
names, field order, defaults and msgspec options (``array_like`` batch,
``tag``-ged events), so a batch tierkv encodes decodes with vLLM's own
classes and any consumer of vLLM's stream (vLLM's subscriber, llm-d
kv-cache, Dynamo) can read it. ``tests/vllm/test_kv_events_decode.py``
decodes with vLLM's classes to hold this true.

tierkv fills ``medium`` with the tier name (``MEDIA``), ``block_hashes`` with
its 16-byte block keys (not necessarily one chain: ``parent_block_hash`` is
None) and leaves ``token_ids`` empty: the store keeps bytes, not tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIA = ("L1", "L2", "L3", "L4")  # medium of tierkv.index.Tier 0..3


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds; encoded as a map tagged ``type``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = -1
"""Sequence number of the frame that ends a replay answer (as vLLM's publisher sends it)."""


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


_TIER_OF = {medium: tier for tier, medium in enumerate(MEDIA)}


def tier_of(medium: str | None) -> int | None:
    """The tier a ``medium`` names, or None for a medium tierkv does not publish."""
    return _TIER_OF.get(medium)
