"""The store's tiers, opened from config: ``tiers[Tier]`` (each a BlockTier), the outbox, the policies.

One place that knows which config section makes which tier, so the store
facade only wires them together (docs/design.md §5).
"""

from __future__ import annotations

import time

from tierkv.catalog import open_disk
from tierkv.config import StoreConfig
from tierkv.cost import CostModel
from tierkv.identity import ModelIdentity, meta_records
from tierkv.index import LOCAL_TIERS, Tier
from tierkv.layout import KVLayout
from tierkv.outbox import Outbox
from tierkv.policy import make_policy
from tierkv.policy.hit_density import ghosts_for
from tierkv.tiers.base import BlockTier, FailureHook
from tierkv.tiers.device import DeviceTier
from tierkv.tiers.host import HostTier
from tierkv.tiers.remote import open_remote, trailer_room


def open_tiers(cfg: StoreConfig, layout: KVLayout, l1_blocks: int | None,
               on_failure: FailureHook, identity: ModelIdentity | None = None) -> tuple[dict[int, BlockTier], Outbox | None]:
    """The configured tiers (a tier of no blocks is absent) and, when L3 or L4 exists, the outbox.
    L3 records ``identity`` (``identity.meta_records``) each time it is opened; it is the directory
    of ``layout`` under ``l3.path`` (``catalog.open_disk``)."""
    tiers: dict[int, BlockTier] = {}
    room = trailer_room(cfg.l4.url)  # with a Mooncake L4, CPU slots keep room for the value trailer
    n1 = cfg.l1.num_blocks if l1_blocks is None else l1_blocks
    if n1 > 0:
        tiers[Tier.L1] = DeviceTier(layout, n1, cfg.l1.device, slot_room=room)
    if cfg.l2.capacity // layout.block_bytes > 0:
        tiers[Tier.L2] = HostTier(layout, cfg.l2.capacity // layout.block_bytes, cfg.l2.shared_name, cfg.l2.pin)
    if cfg.l3_enabled and cfg.l3.capacity // layout.block_bytes > 0:
        meta = {"model_id": cfg.model_id, "model_revision": cfg.model_revision}
        if identity is not None:
            meta.update(meta_records(identity, time.time()))
        # Another layout under the same l3.path (fp32 beside bf16) opens its own directory: 0 hits, not refused.
        tiers[Tier.L3] = open_disk(cfg.l3.path, layout, cfg.l3.capacity // layout.block_bytes, meta=meta,
                                   direct_io=cfg.l3.direct_io, on_failure=on_failure, read_depth=cfg.l3.read_depth,
                                   compress=cfg.l3.compress, compress_level=cfg.l3.compress_level,
                                   compress_threads=cfg.l3.compress_threads)
    # Demoted blocks wait in the outbox for the IO thread: registered with the pool's client.
    outbox = Outbox(layout, room) if cfg.l4.url or Tier.L3 in tiers else None
    if cfg.l4.url:
        l4 = tiers[Tier.L4] = open_remote(cfg.l4, layout, on_failure)
        # Loads land in L1 (or L2) slots and puts leave the outbox: registered once, a pool client
        # that moves registered memory (Mooncake) needs no staging copy.
        for pool in (tiers.get(Tier.L1), outbox):
            if pool is not None:
                l4.register(pool.slots.pool, room=pool.slots.slot_room)
        if Tier.L2 in tiers:
            l4.register(tiers[Tier.L2].slab)
    return tiers, outbox


def make_policies(cfg: StoreConfig, tiers: dict[int, BlockTier], cost: CostModel, block_bytes: int) -> list:
    """One eviction policy per local tier (None where the tier is absent), told the tier below it;
    hit_density keeps as many ghosts per block as ``policy.metadata_share`` of ``block_bytes`` allows."""
    out = []
    for tier in LOCAL_TIERS:
        lower = next((t for t in range(tier + 1, Tier.L4 + 1) if t in tiers), None)
        out.append(make_policy(cfg.policy.name, tier, lower=lower, cost=cost, half_life=cfg.policy.half_life,
                               reuse_exponent=cfg.policy.reuse_exponent,
                               ghost_factor=ghosts_for(block_bytes, cfg.policy.metadata_share))
                   if tier in tiers else None)
    return out
