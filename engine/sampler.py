"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, per-request seeds.

The whole batch is filtered with tensor ops; only the final draw runs per row,
so a seeded request gets the same tokens whatever it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature`` 0 is greedy.

    ``top_k`` 0 and ``top_p`` 1.0 disable those filters; ``seed`` makes a
    sampled request reproducible; generation stops after ``max_tokens``, at
    any of ``stop_token_ids`` (included in the output) or at the model's EOS
    unless ``ignore_eos``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed: expected an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Picks one token per row of a logits batch. Not thread-safe (owns a generator)."""

    def __init__(self, seed: int = 0) -> None:
        self._gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
        """``logits`` [S, V] fp32; ``generators[i]`` is row i's own generator (seeded requests) or None.

        Draws run on the CPU (the generators are CPU generators), so a seed gives
        the same tokens on every device.
        """
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows and logits.device.type != "cpu":
            logits = logits.cpu()
        out = logits.argmax(dim=-1).cpu()
        if rows:
            probs = self._filtered_probs(logits[rows], [params[i] for i in rows])
            for j, i in enumerate(rows):
                gen = generators[i] or self._gen
                noise = torch.empty_like(probs[j]).exponential_(generator=gen)
                out[i] = (probs[j] / noise).argmax()
        return out.tolist()

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
        logits = logits / temps
        top_k = torch.tensor([p.top_k or logits.shape[-1] for p in params])[:, None]
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1])[None, :]
        drop = rank >= top_k
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)
