"""How much of a prompt a store holds, per tier, and what the store's cost model says it would cost.

``match_tiers(store, token_ids)`` is the per-node answer a router needs: the
longest cached prefix split by the fastest tier holding each block, the part
of it the store would load (its cost model cuts a match where loading more
costs more than recomputing), and the estimated load and recompute time of
the whole prompt. It is a probe, not a use: nothing is pinned or touched and
no lookup is counted, so routing probes do not distort eviction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.index import Tier
from tierkv.kvevents.wire import MEDIA
from tierkv.route.ttft import recompute_us


@dataclass(frozen=True)
class TierMatch:
    """One prompt against one store. Token counts per tier are in L1..L4 order."""

    prompt_tokens: int
    block_size: int
    keys: list[bytes]
    matched_tokens: tuple[int, int, int, int]
    loaded_tokens: tuple[int, int, int, int]
    est_load_us: float
    est_recompute_us: float

    def to_json(self) -> dict:
        """The ``POST /v1/kv/match`` body: tiers by name, times in µs, keys as hex."""
        return {
            "prompt_tokens": self.prompt_tokens, "block_size": self.block_size,
            "matched_tokens": dict(zip(MEDIA, self.matched_tokens)),
            "loaded_tokens": dict(zip(MEDIA, self.loaded_tokens)),
            "est_load_us": round(self.est_load_us, 3), "est_recompute_us": round(self.est_recompute_us, 3),
            "est_ttft_us": round(self.est_load_us + self.est_recompute_us, 3),
            "keys": [k.hex() for k in self.keys],
        }


def _per_tier(tiers: Sequence[int], block_size: int) -> tuple[int, int, int, int]:
    out = [0, 0, 0, 0]
    for t in tiers:
        out[t] += block_size
    return tuple(out)


def match_tiers(store, token_ids: Sequence[int], namespace: str | None = None, *,
                probe_l4: bool = False) -> TierMatch:
    """Per-tier match of ``token_ids`` in ``store`` (a ``TierKVStore``). Thread-safe; pins nothing.

    Local tiers come from the index under the store's lock. With ``probe_l4``
    the blocks after the local prefix are asked of L4 (a network round trip,
    outside the lock; a failure counts as a miss). Only full blocks match; the
    partial tail is always recomputed.
    """
    keys = list(store.hash(token_ids, namespace))
    with store._lock:  # a read of the index; no pin, no touch
        tiers = store.index.match(keys)
    if probe_l4 and store.l4 is not None and len(tiers) < len(keys):
        try:
            for hit in store.l4.contains(keys[len(tiers):]):
                if not hit:
                    break
                tiers.append(Tier.L4)
        except Exception:  # a dead pool is a miss, never an error for the router
            pass
    bs, cost = store.block_size, store.cost
    loaded = tiers[: cost.cut(tiers, bs)]
    load_us, rest_us = cost.estimate_us(loaded, len(keys), bs)
    full = len(keys) * bs
    tail_us = recompute_us(cost, full, len(token_ids))
    return TierMatch(len(token_ids), bs, keys, _per_tier(tiers, bs), _per_tier(loaded, bs), load_us,
                     rest_us + tail_us)
