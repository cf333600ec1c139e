"""Shared helpers of the engine tests (a plain module: test files import it by name)."""

from __future__ import annotations

import random
from pathlib import Path

from tierkv.config import L2Config, L3Config, StoreConfig
from tierkv.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(n: int = 4, base: int = 40, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts of mixed lengths sharing a 32-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(32)]
    return [shared + [rng.randrange(3, 256) for _ in range(base + 13 * i)] for i in range(n)]


def store_config(l3: Path | None, l2: str | int = "8MiB") -> StoreConfig:
    if l3 is None:
        return StoreConfig(l2=L2Config(capacity=l2), l3_enabled=False)
    return StoreConfig(l2=L2Config(capacity=l2), l3=L3Config(path=str(l3), capacity="16MiB"))
