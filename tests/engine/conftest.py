"""Engine fixtures: one tiny seeded checkpoint per session and an LLM factory that closes what it made."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.config import L2Config, L3Config, StoreConfig
from tierkv.engine import LLM, EngineConfig, SamplingParams
from tierkv.engine.checkpoint import write_checkpoint

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(n: int = 4, base: int = 40, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts of mixed lengths sharing a 32-token prefix."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(32)]
    return [shared + [rng.randrange(3, 256) for _ in range(base + 13 * i)] for i in range(n)]


def store_config(l3: Path | None, l2: str | int = "8MiB") -> StoreConfig:
    if l3 is None:
        return StoreConfig(l2=L2Config(capacity=l2), l3_enabled=False)
    return StoreConfig(l2=L2Config(capacity=l2), l3=L3Config(path=str(l3), capacity="16MiB"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture
def make_llm(tiny_dir: Path):
    made: list[LLM] = []

    def make(store: StoreConfig | None = None, enable_cache: bool = True, model_dir: Path | None = None,
             **engine) -> LLM:
        engine.setdefault("num_blocks", 128)
        engine.setdefault("num_threads", 1)  # a shared 2-core host: threaded GEMMs of this size only contend
        llm = LLM(model_dir or tiny_dir, store or store_config(None), EngineConfig(**engine), enable_cache)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()
