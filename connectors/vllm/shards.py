"""Tensor parallelism: which KV heads each rank holds, and the scheduler's view over all of them.

With ``tensor_parallel_size = T`` vLLM gives rank r the KV heads
``r*H/T .. (r+1)*H/T`` of the model's H (``QKVParallelLinear``), and each
rank's KV cache holds only those. Each rank's worker opens its own store with
the *shard* layout of its heads (``KVLayout.shard``): the shard's fingerprint
names the head range, so its L3 directory, its L4 names and its shared L2 slab
are its own and ranks never collide, while the chain of block keys — rooted in
the logical (unsharded) layout, ``TierKVStore.seed`` — is the same on every
rank, so one key names the block on all of them.

The scheduler decides for all ranks at once: ``ShardedView`` looks a chain up
in every rank's shard and counts a block held only where every shard holds it
(at the slowest shard's tier); a shard missing on one rank cuts the prefix
there for all ranks, so no rank loads what another must recompute. Heads
replicated across ranks (H < T) are refused for now (docs/design.md §13).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tierkv.config import StoreConfig
from tierkv.layout import KVLayout
from tierkv.reads import Match
from tierkv.store import TierKVStore


def rank_layouts(layout: KVLayout, tp: int, total_kv_heads: int) -> list[KVLayout]:
    """Each rank's shard layout (``layout`` is one rank's, as vLLM's cache spec gives it)."""
    if tp == 1:
        return [layout]
    if total_kv_heads < tp or total_kv_heads % tp:
        raise ValueError(
            f"parallel_config.tensor_parallel_size: tierkv shards KV heads evenly across ranks; "
            f"{total_kv_heads} KV heads over {tp} ranks would replicate or split heads unevenly "
            f"(supported: tensor_parallel_size dividing the KV heads)")
    local = total_kv_heads // tp
    if layout.num_kv_heads != local:
        raise ValueError(f"kv_cache_spec.num_kv_heads: {layout.num_kv_heads} per rank, expected "
                         f"{total_kv_heads} / {tp} = {local}")
    logical = replace(layout, num_kv_heads=total_kv_heads)
    return [logical.shard(r * local, local) for r in range(tp)]


def rank_config(config: StoreConfig, layout: KVLayout) -> StoreConfig:
    """``config`` for the store of shard ``layout``: a shared L2 slab gets the shard's own name."""
    if not layout.is_shard or not config.l2.shared_name:
        return config
    end = layout.kv_head_start + layout.num_kv_heads
    name = f"{config.l2.shared_name}.h{layout.kv_head_start}-{end}of{layout.kv_heads_total}"
    return replace(config, l2=replace(config.l2, shared_name=name))


@dataclass
class ShardMatch(Match):
    """A ``Match`` over every shard: ``parts[r]`` is rank r's own match (each pinned in its view)."""

    parts: list[Match] = field(default_factory=list)


class ShardedView:
    """The scheduler's view of a tensor-parallel engine's store: one store per rank's shard.

    Offers what ``ConnectorScheduler`` uses of a ``TierKVStore`` (``seed``, ``hasher``,
    ``lookup_keys``, ``release``, ``block_size``, ``layout``, ``config``, ``l2``, ``l3``), over
    the rank stores it is given (it owns none: the connector acquires and releases them). A
    block is in the match only while every shard holds it. Called from the scheduler thread.
    """

    def __init__(self, stores: Sequence[TierKVStore]) -> None:
        self.stores = list(stores)
        first = self.stores[0]
        self.layout, self.config, self.hasher = first.layout, first.config, first.hasher
        self.block_size, self.l2, self.l3 = first.block_size, first.l2, first.l3

    def seed(self, namespace: str | None = None, extra_keys: Sequence[str] = ()) -> bytes:
        return self.stores[0].seed(namespace, extra_keys)

    def lookup_keys(self, keys: Sequence[bytes], pin: bool = True) -> ShardMatch:
        """The leading run of ``keys`` every shard holds, each block at its slowest shard's tier."""
        parts = [s.lookup_keys(keys, pin) for s in self.stores]
        n = min(len(m.tiers) for m in parts)
        tiers = [max(m.tiers[i] for m in parts) for i in range(n)]
        return ShardMatch(keys=list(keys[:n]), tiers=tiers, entries=[None] * n, block_size=self.block_size,
                          est_load_us=sum(m.est_load_us for m in parts),
                          est_recompute_us=max(m.est_recompute_us for m in parts), parts=parts)

    def release(self, m: ShardMatch) -> None:
        """Unpin every shard's part of ``m`` (idempotent)."""
        for store, part in zip(self.stores, m.parts):
            store.release(part)
