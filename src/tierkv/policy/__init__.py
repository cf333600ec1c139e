"""Eviction policies, one per file, chosen by name."""

from __future__ import annotations

from tierkv import index_native
from tierkv.policy.base import EvictionPolicy, HeapPolicy
from tierkv.policy.cost_aware import CostAwarePolicy
from tierkv.policy.hit_density import HitDensityPolicy
from tierkv.policy.lfu import LFUPolicy
from tierkv.policy.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "cost_aware": CostAwarePolicy,
    "hit_density": HitDensityPolicy,
    "lfu": LFUPolicy,
    "lru": LRUPolicy,
}
DEFAULT_POLICY = "hit_density"


def make_policy(name: str, tier: int, **context) -> EvictionPolicy:
    """A policy instance for ``tier`` by name; unknown names fail naming the allowed ones.

    ``context`` may carry ``cost`` (a CostModel), ``lower`` (the tier a victim
    demotes to, or None) and ``half_life`` (the index's decay, in lookups);
    each policy takes what it needs and ignores the rest.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy.name: expected one of {sorted(POLICIES)}, got {name!r}") from None
    return cls(tier, **context)


def _setup_index_native(mod) -> None:
    """Give the index's C loops (``tierkv.index_native``) the classes and constants they work on."""
    import heapq
    from collections import deque

    from tierkv.index import _BEST, Entry
    from tierkv.policy import cost_aware, hit_density
    from tierkv.policy.age_queue import TAG_BITS, AgeQueue

    constants = (TAG_BITS, hit_density.BINS, hit_density._LEVELS, hit_density.CLASSES, hit_density._TIP,
                 hit_density._SEEN, hit_density._EXTRA_SHIFT, hit_density._EXTRA_MASK, hit_density.BANDS,
                 hit_density._BAND_SHIFT, hit_density._BAND_MASK)
    mod.setup(Entry, AgeQueue, LRUPolicy, HitDensityPolicy, vars(hit_density), deque, tuple(_BEST), constants,
              (HeapPolicy, CostAwarePolicy, heapq, cost_aware._THETA_WEIGHT, cost_aware._REKEY_DRIFT))


index_native.set_setup(_setup_index_native)

__all__ = ["CostAwarePolicy", "DEFAULT_POLICY", "EvictionPolicy", "HeapPolicy", "HitDensityPolicy", "LFUPolicy", "LRUPolicy",
           "POLICIES", "make_policy"]
