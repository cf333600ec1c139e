"""Eviction policies, one per file, chosen by name."""

from __future__ import annotations

from tierkv.policy.base import EvictionPolicy, HeapPolicy
from tierkv.policy.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str, tier: int, **kwargs) -> EvictionPolicy:
    """A policy instance for ``tier`` by name; unknown names fail naming the allowed ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy.name: expected one of {sorted(POLICIES)}, got {name!r}") from None
    return cls(tier, **kwargs)


__all__ = ["EvictionPolicy", "HeapPolicy", "LRUPolicy", "POLICIES", "make_policy"]
