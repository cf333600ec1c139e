"""Eviction policies, one per file, chosen by name."""

from __future__ import annotations

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


__all__ = ["CostAwarePolicy", "DEFAULT_POLICY", "EvictionPolicy", "HeapPolicy", "HitDensityPolicy", "LFUPolicy", "LRUPolicy",
           "POLICIES", "make_policy"]
