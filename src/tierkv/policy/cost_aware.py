"""Evicts the leaf with the lowest expected prefill time saved per byte (docs/design.md §8). The default.

A listed block's *worth* is ``reuse × benefit / bytes``:

- ``reuse`` is ``1 + freq``: the use that computed the block plus the
  index's decayed count of lookups that hit it since;
- ``benefit`` is the prefill time one reuse saves because the block stayed in
  this tier (``CostModel.keep_benefit_us``): its recompute cost at its depth
  (deep blocks attend to more context, so they cost more) or, where a lower
  tier would keep a copy, the cheaper reload from there, minus the cost of
  loading it from this tier;
- per byte: all blocks of a tier have one size, so this is a constant factor,
  kept so figures compare across layouts.

Expected saved prefill per unit of time is worth × hazard, the chance per
lookup that the block is used again. In prefix-cache traces that hazard falls
off as a power of the time since the last use, ``age ** -reuse_exponent``
(heavy-tailed reuse: a block untouched for long is ever less likely to come
back), so the score of a block at time ``now`` is
``worth / (now - last_access) ** reuse_exponent``.

Scores fall at different speeds, so they cannot key a heap directly; instead
the key is the time a block's score drops below the tier's eviction threshold
``θ``: ``last_access + (worth / θ) ** (1 / reuse_exponent)``. That key changes
only on ``touch``. ``θ`` is a running average of the victims' scores at
eviction; when it drifts by more than ``_REKEY_DRIFT`` the heap is re-keyed
(O(n), rare once the tier is in steady state), so decisions stay amortised
O(log n). With equal worth everywhere the order is exactly LRU.
"""

from __future__ import annotations

from tierkv.cost import CostModel
from tierkv.index import Entry
from tierkv.policy.base import HeapPolicy

# Power-law decay of the reuse hazard with age. On the Mooncake synthetic trace
# the right-censored hazard is flat up to ~30 lookups, then falls with a log-log
# slope of -0.70 (64..2048 lookups); 1.0 is the classic hyperbolic assumption.
# 0.75 is a round value between the two (policy.reuse_exponent overrides it).
DEFAULT_REUSE_EXPONENT = 0.75
# Weight of one victim in the threshold's running average, and how far the
# threshold may drift before the heap is re-keyed.
_THETA_WEIGHT = 0.01
_REKEY_DRIFT = 1.5


class CostAwarePolicy(HeapPolicy):
    name = "cost_aware"
    # Slots: the C hot path (tierkv.index_native) computes priority and taken from these.
    __slots__ = ("cost", "lower", "beta", "_inv_beta", "_benefit", "theta", "_keyed_theta", "rekeys", "rekeyed")

    def __init__(self, tier: int, cost: CostModel | None = None, lower: int | None = None,
                 reuse_exponent: float = DEFAULT_REUSE_EXPONENT, **_context) -> None:
        """``cost`` prices loads and recompute (abstract units ``1 + 0.5·depth`` if None);
        ``lower`` is the tier a victim demotes to (None: it is dropped)."""
        super().__init__(tier)
        if not reuse_exponent > 0:
            raise ValueError(f"policy.reuse_exponent: expected > 0, got {reuse_exponent!r}")
        self.cost = cost if cost is not None else CostModel.units(0.5)
        self.lower = lower
        self.beta = float(reuse_exponent)
        self._inv_beta = 1.0 / self.beta
        self._benefit: list[float] = []
        # Until the first eviction: a fresh block at depth 0 is worth keeping one lookup.
        self.theta = self._benefit_per_byte(0)
        self._keyed_theta = self.theta
        self.rekeys = 0      # heap re-keys so far, and the items they re-keyed (amortisation)
        self.rekeyed = 0

    def _benefit_per_byte(self, depth: int) -> float:
        table = self._benefit
        while len(table) <= depth:
            d = len(table)
            table.append(self.cost.keep_benefit_us(d, self.tier, self.lower) / self.cost.block_bytes)
        return table[depth]

    def worth(self, entry: Entry) -> float:
        """Expected prefill µs saved per byte per unit of hazard: reuse × benefit / bytes."""
        return (1.0 + entry.freq) * self._benefit_per_byte(entry.depth)

    def priority(self, entry: Entry):
        try:
            benefit = self._benefit[entry.depth]
        except IndexError:
            benefit = self._benefit_per_byte(entry.depth)
        return entry.last_access + ((1.0 + entry.freq) * benefit / self._keyed_theta) ** self._inv_beta

    def taken(self, entry: Entry) -> Entry:
        """Each victim moves the threshold ``theta`` toward its score; a drift re-keys the heap."""
        now = self.index.clock if self.index is not None else entry.last_access
        age = max(now - entry.last_access, 1)
        score = self.worth(entry) / age ** self.beta
        self.theta += _THETA_WEIGHT * (score - self.theta)
        ratio = self.theta / self._keyed_theta
        if ratio > _REKEY_DRIFT or ratio * _REKEY_DRIFT < 1.0:
            self._keyed_theta = self.theta
            self.rekeys += 1
            self.rekeyed += len(self)
            self.rekey()
        return entry
