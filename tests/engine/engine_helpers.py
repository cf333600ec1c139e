"""Shared helpers of the engine tests (a plain module: test files import it by name)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from tierkv.config import L2Config, L3Config, StoreConfig
from tierkv.engine import SamplingParams
from tierkv.engine.kv_cache import KVCacheManager
from tierkv.engine.scheduler import Scheduled
from tierkv.engine.sequence import Sequence

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


def engine_logits(llm, batch_prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt, logits of every prompt position then of ``steps`` greedy decode steps (all
    prompts in one batch), and each prompt's tokens after those steps."""
    kv = KVCacheManager(llm.store, enable_cache=False)
    seqs = [Sequence(p, GREEDY, None, 10_000) for p in batch_prompts]
    for seq in seqs:
        assert kv.admit(seq)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    batch = [Scheduled(s, s.num_tokens) for s in seqs]
    for step in range(steps + 1):
        logits = llm.runner.logits(batch)
        starts = [0]
        for item in batch:
            starts.append(starts[-1] + item.num_tokens)
        for i, item in enumerate(batch):
            rows[i].append(logits[starts[i]:starts[i + 1]])
            item.seq.num_computed += item.num_tokens
            item.seq.token_ids.append(int(logits[starts[i + 1] - 1].argmax()))
            assert kv.ensure_slots(item.seq, item.seq.num_tokens)
        batch = [Scheduled(s, 1) for s in seqs]
    for seq in seqs:
        kv.release(seq)
    return [torch.cat(r) for r in rows], [s.token_ids for s in seqs]


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]
