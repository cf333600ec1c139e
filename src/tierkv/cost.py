"""Per-tier load cost and recompute cost in µs per token (DESIGN §6). Pure Python.

A match is cut where loading more would cost more than recomputing, and a
tier whose load cost exceeds the recompute cost is ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.config import CostConfig

# Built-in estimates when neither config nor calibration gives a figure:
# a small model's prefill on a CPU (~100 µs/token) and rough tier bandwidths.
_DEFAULT_RECOMPUTE_US = 100.0


@dataclass(frozen=True)
class CostModel:
    """Load cost per local/remote tier and recompute cost, µs per token."""

    load_us: tuple[float, float, float, float]
    recompute_us: float

    @classmethod
    def from_config(cls, cfg: CostConfig, block_bytes: int, block_size: int) -> CostModel:
        per_token_bytes = block_bytes / block_size
        # bytes per token / (GB/s) -> µs per token, for 20, 5, 1 and 0.5 GB/s.
        est = [per_token_bytes / (gbps * 1e3) for gbps in (20.0, 5.0, 1.0, 0.5)]
        given = (cfg.l1_us_per_token, cfg.l2_us_per_token, cfg.l3_us_per_token, cfg.l4_us_per_token)
        load = tuple(g if g > 0 else e for g, e in zip(given, est))
        return cls(load, cfg.recompute_us_per_token or _DEFAULT_RECOMPUTE_US)

    def recompute_block_us(self, depth: int, block_size: int) -> float:
        return self.recompute_us * block_size

    def cut(self, tiers: Sequence[int], block_size: int) -> int:
        """How many leading blocks of a match are worth loading rather than recomputing."""
        for i, tier in enumerate(tiers):
            if tier > 0 and self.load_us[tier] * block_size > self.recompute_block_us(i, block_size):
                return i
        return len(tiers)

    def estimate_us(self, tiers: Sequence[int], total_blocks: int, block_size: int) -> tuple[float, float]:
        """(load time of the matched blocks, recompute time of the rest)."""
        load = sum(self.load_us[t] for t in tiers) * block_size
        rest = sum(self.recompute_block_us(d, block_size) for d in range(len(tiers), total_blocks))
        return load, rest
