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
replicated across ranks (H < T: rank r holds head r // (T/H)) are stored once,
by the first rank holding them (``is_primary``); the replicas open that shard's
directory as a view and read it.

One cache for every TP size, nothing to configure: the keys do not depend on
T, so blocks another TP size saved are found under the same keys in *its*
shard directories. ``covers`` finds, among the layouts stored under
``l3.path``, each other partition of the model's heads that covers a rank's
heads (finer shards assembled, a coarser one sliced); where a rank's own shard
holds a shorter prefix than a cover, the rank reads the cover's pieces
(``Cover.load``) and copies their heads into its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from tierkv.config import StoreConfig
from tierkv.layout import KVLayout
from tierkv.reads import Match
from tierkv.store import TierKVStore
from tierkv.transfer import LoadHandle, LoadResult


def rank_layouts(layout: KVLayout, tp: int, total_kv_heads: int) -> list[KVLayout]:
    """Each rank's shard layout (``layout`` is one rank's, as vLLM's cache spec gives it)."""
    if tp == 1:
        return [layout]
    if total_kv_heads % tp and tp % total_kv_heads:
        raise ValueError(
            f"parallel_config.tensor_parallel_size: {total_kv_heads} KV heads over {tp} ranks split "
            f"unevenly (supported: tensor_parallel_size dividing the KV heads, or a multiple of them)")
    local = max(1, total_kv_heads // tp)
    if layout.num_kv_heads != local:
        raise ValueError(f"kv_cache_spec.num_kv_heads: {layout.num_kv_heads} per rank, expected "
                         f"{total_kv_heads} / {tp} = {local}" if total_kv_heads >= tp else
                         f"kv_cache_spec.num_kv_heads: {layout.num_kv_heads} per rank, expected 1 "
                         f"({total_kv_heads} KV heads replicated over {tp} ranks)")
    logical = replace(layout, num_kv_heads=total_kv_heads)
    if total_kv_heads >= tp:
        return [logical.shard(r * local, local) for r in range(tp)]
    replicas = tp // total_kv_heads  # vLLM's QKVParallelLinear: rank r holds head r // replicas
    return [logical.shard(r // replicas, 1) for r in range(tp)]


def is_primary(shards: Sequence[KVLayout], rank: int) -> bool:
    """Whether ``rank`` stores its shard: the first rank holding those heads does; a replica (heads
    replicated across ranks, fewer KV heads than ranks) only reads the one copy the primary stores."""
    return shards.index(shards[rank]) == rank


def rank_config(config: StoreConfig, layout: KVLayout) -> StoreConfig:
    """``config`` for the store of shard ``layout``: a shared L2 slab gets the shard's own name."""
    if not layout.is_shard or not config.l2.shared_name:
        return config
    end = layout.kv_head_start + layout.num_kv_heads
    name = f"{config.l2.shared_name}.h{layout.kv_head_start}-{end}of{layout.kv_heads_total}"
    return replace(config, l2=replace(config.l2, shared_name=name))


def _heads(layout: KVLayout) -> tuple[int, int]:
    return layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads


def covers(layout: KVLayout, stored: Sequence[KVLayout]) -> list[list[tuple[KVLayout, int, int, int]]]:
    """Ways to build blocks of ``layout`` (a rank's shard, or the unsharded layout) from the
    ``stored`` layouts of other partitions of the same model's heads: per way, its pieces as
    (stored layout, first head in it, end head in it, first head in ``layout``). A partition
    counts only when every piece it needs is stored; partitions of ``layout``'s own width are
    left out (its own directory is the one that would hold those heads)."""
    lo, hi = _heads(layout)
    by_width: dict[int, dict[int, KVLayout]] = {}
    for other in stored:
        if other.logical == layout.logical and other.num_kv_heads != layout.num_kv_heads:
            by_width.setdefault(other.num_kv_heads, {})[other.kv_head_start] = other
    out = []
    for width, shards in sorted(by_width.items(), key=lambda kv: -kv[0]):
        starts = range(lo // width * width, hi, width)
        if all(s in shards for s in starts):
            out.append([(shards[s], max(lo, s) - s, min(hi, s + width) - s, max(lo, s) - lo) for s in starts])
    return out


class Cover:
    """One way to read blocks of this rank's heads from another TP size's shards (``covers``): one
    store per piece (views: it never writes them). Not thread-safe; the caller serialises."""

    def __init__(self, pieces: Sequence[tuple[TierKVStore, int, int, int]]) -> None:
        self.pieces = list(pieces)

    def lookup(self, keys: Sequence[bytes], pin: bool) -> ShardMatch:
        """The leading run of ``keys`` every piece holds (pinned in each piece's store when ``pin``)."""
        parts = [store.lookup_keys(keys, pin) for store, *_ in self.pieces]
        return _combine(keys, parts, self.pieces[0][0].block_size)

    def release(self, m: ShardMatch) -> None:
        for (store, *_), part in zip(self.pieces, m.parts):
            store.release(part)

    def load(self, m: ShardMatch, start: int, dst: torch.Tensor) -> LoadHandle:
        """Read blocks ``start ..`` of ``m`` (``len(dst)`` of them) from every piece and copy each
        piece's heads into ``dst`` ([n, L, 2, B, H_rank, D]); synchronous (the returned handle is
        complete); a block is good only where every piece read it. Releases ``m``."""
        n = dst.shape[0]
        ok = [True] * n
        try:
            for (store, a, b, at), part in zip(self.pieces, m.parts):
                sub = Match(part.keys[start:start + n], part.tiers[start:start + n],
                            part.entries[start:start + n], part.block_size)
                tmp = torch.empty((n, *store.layout.block_shape), dtype=store.layout.torch_dtype)
                got = store.load(sub, list(tmp.unbind(0))).wait().ok
                ok = [x and y for x, y in zip(ok, got)]
                dst[:, :, :, :, at:at + (b - a)].copy_(tmp[:, :, :, :, a:b])
        except Exception:  # a failed read is a miss, never a failed request
            ok = [False] * n
        finally:
            self.release(m)
        return LoadHandle.completed(LoadResult(ok))


def _combine(keys: Sequence[bytes], parts: list[Match], block_size: int) -> ShardMatch:
    n = min(len(m.tiers) for m in parts)
    tiers = [max(m.tiers[i] for m in parts) for i in range(n)]
    return ShardMatch(keys=list(keys[:n]), tiers=tiers, entries=[None] * n, block_size=block_size,
                      est_load_us=sum(m.est_load_us for m in parts),
                      est_recompute_us=max(m.est_recompute_us for m in parts), parts=parts)


def best(store: TierKVStore, keys: Sequence[bytes], options: Sequence[Cover],
         pin: bool) -> tuple[Match, Cover | None]:
    """A rank's match for ``keys``: in its own shard ``store``, or in the cover holding a longer
    prefix (with that cover) when there is one; the matches not returned are released."""
    own = store.lookup_keys(keys, pin)
    if own.num_blocks >= len(keys) or not options:
        return own, None
    chosen: tuple[Match, Cover | None] = (own, None)
    for cover in options:
        m = cover.lookup(keys, pin)
        if m.num_blocks > chosen[0].num_blocks:
            (chosen[1] or store).release(chosen[0])
            chosen = (m, cover)
        else:
            cover.release(m)
    return chosen


@dataclass
class ShardMatch(Match):
    """A ``Match`` over every shard: ``parts[r]`` is rank r's own match (each pinned in its view)."""

    parts: list[Match] = field(default_factory=list)
    covers: list = field(default_factory=list)  # per part: the Cover it came from, or None (own shard)


class ShardedView:
    """The scheduler's view of the engine's store: one store per rank's shard (one without TP).

    Offers what ``ConnectorScheduler`` uses of a ``TierKVStore`` (``seed``, ``hasher``,
    ``lookup_keys``, ``release``, ``block_size``, ``layout``, ``config``, ``l2``, ``l3``), over
    the rank stores it is given (it owns none: the connector acquires and releases them), and
    ``options[r]``, rank r's covers from other TP sizes' shards. A block is in the match only
    while every rank can read it: its own shard, or a cover holding a longer prefix than that.
    Called from the scheduler thread.
    """

    def __init__(self, stores: Sequence[TierKVStore], options: Sequence[Sequence[Cover]] = ()) -> None:
        self.stores = list(stores)
        self.options = [list(o) for o in options] or [[] for _ in self.stores]
        first = self.stores[0]
        self.layout, self.config, self.hasher = first.layout, first.config, first.hasher
        self.block_size, self.l2, self.l3 = first.block_size, first.l2, first.l3

    def seed(self, namespace: str | None = None, extra_keys: Sequence[str] = ()) -> bytes:
        return self.stores[0].seed(namespace, extra_keys)

    def lookup_keys(self, keys: Sequence[bytes], pin: bool = True) -> ShardMatch:
        """The leading run of ``keys`` every rank can read, each block at its slowest rank's tier."""
        parts, self_covers = [], []
        for store, options in zip(self.stores, self.options):
            m, cover = best(store, keys, options, pin)
            parts.append(m)
            self_covers.append(cover)
        out = _combine(keys, parts, self.block_size)
        out.covers = self_covers
        return out

    def release(self, m: ShardMatch) -> None:
        """Unpin every rank's part of ``m`` (idempotent)."""
        for store, cover, part in zip(self.stores, m.covers or [None] * len(m.parts), m.parts):
            (cover or store).release(part)
