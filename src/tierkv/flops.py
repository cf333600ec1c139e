"""Prefill FLOPs of named reference models, computed from their architecture. Pure Python.

A grade for caches that no policy can tune: a hit saves the prefill of its
tokens, and a token at position ``p`` (0-based, ``p`` tokens before it) costs

    flops(p) = 2 × parameters + 4 × layers × heads × head_dim × p

the first term the weight matmuls (one multiply-add per parameter), the second
attention's scores and weighted sum over the ``p`` tokens before it (QKᵀ and
AV, 2 × heads × head_dim multiply-adds per earlier token and layer; grouped
KV heads share keys but each query head still does the work). ``parameters``
is the model's whole parameter count as its architecture gives it (embedding
and an untied LM head included, the figure a model card quotes); the embedding
lookup does no matmul and the LM head runs only for the last prompt token, so
this slightly overstates the per-token term and understates the depth term
(for Llama-3.1-8B by 13 %) — a conservative grade for depth-aware policies.

Per 512-token block of depth ``d`` the attention share is small on real models:
Llama-3.1-8B adds about 1.7 % of a depth-0 block per block of depth, 70B about
0.95 %, SmolLM2-135M (small weights, 30 layers) about 12 %. Immutable data;
thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class ReferenceModel:
    """A decoder-only transformer's shape (Llama family: GQA attention, gated MLP, RMSNorm)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}.{field}: expected an integer >= 1, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}.kv_heads: expected a divisor of heads={self.heads}, got {self.kv_heads}")

    @property
    def parameters(self) -> int:
        """All weights: embeddings, per layer q/k/v/o + gate/up/down + two norms, final norm, LM head."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h
        embed = self.vocab * h
        return embed * (1 if self.tied_embeddings else 2) + self.layers * per_layer + h

    @property
    def attention_flops_per_position(self) -> int:
        """Extra FLOPs a token pays per token before it: 4 × layers × heads × head_dim."""
        return 4 * self.layers * self.heads * self.head_dim

    def token_flops(self, position: int) -> float:
        """Prefill FLOPs of the token at 0-based ``position``."""
        return 2.0 * self.parameters + self.attention_flops_per_position * position

    def span_flops(self, start: int, stop: int) -> float:
        """Prefill FLOPs of tokens ``start .. stop-1`` (a closed form of Σ token_flops)."""
        n = stop - start
        if n <= 0:
            return 0.0
        positions = (start + stop - 1) * n / 2.0
        return 2.0 * self.parameters * n + self.attention_flops_per_position * positions

    def block_flops(self, depth: int, block_tokens: int = BLOCK_TOKENS) -> float:
        """Prefill FLOPs of the ``block_tokens``-token block at block depth ``depth`` (0 = first)."""
        return self.span_flops(depth * block_tokens, (depth + 1) * block_tokens)

    def prompt_flops(self, tokens: int) -> float:
        """Prefill FLOPs of a whole prompt of ``tokens`` tokens."""
        return self.span_flops(0, tokens)

    def depth_weight(self, block_tokens: int = BLOCK_TOKENS) -> float:
        """Extra cost of a block per block of depth, relative to a depth-0 block."""
        return (self.block_flops(1, block_tokens) - self.block_flops(0, block_tokens)) / self.block_flops(0, block_tokens)


# Shapes from the models' published configs (config.json).
REFERENCE_MODELS: dict[str, ReferenceModel] = {
    m.name: m for m in (
        ReferenceModel("llama-3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                       intermediate=14336, vocab=128256, tied_embeddings=False),
        ReferenceModel("llama-3.1-70b", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128,
                       intermediate=28672, vocab=128256, tied_embeddings=False),
        ReferenceModel("smollm2-135m", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
                       intermediate=1536, vocab=49152, tied_embeddings=True),
    )
}


def reference_model(name: str) -> ReferenceModel:
    """The named reference model; an unknown name fails naming the known ones."""
    try:
        return REFERENCE_MODELS[name]
    except KeyError:
        raise ValueError(f"reference model: expected one of {sorted(REFERENCE_MODELS)}, got {name!r}") from None


__all__ = ["BLOCK_TOKENS", "REFERENCE_MODELS", "ReferenceModel", "reference_model"]
