"""The explicit TTFT cost model a router minimises (issue 16). Pure Python; decides nothing.

For a prompt of ``N`` tokens on a node that holds ``m_i`` of its leading tokens
in tier ``i``::

    TTFT ≈ Σ_i m_i·c_i + recompute(M..N) + q,    M = Σ_i m_i

``c_i`` is the node's per-token load cost of tier ``i`` (``CostModel.load_us``),
``recompute(M..N)`` the prefill of the tokens it does not hold (per token
``r·(1 + g·p)`` at position ``p``, ``CostModel.recompute_us`` and ``growth``:
the same physics the node's store uses) and ``q`` the node's queueing delay.
With ``g = 0`` this is the issue's ``Σ m_i·c_i + (N − M)·r + q``.

A node loads a tier only while loading beats recomputing (``CostModel.cut``),
so tiers are taken fastest first and a tier whose per-token load cost is not
below the recompute cost at the depth reached is treated as a miss: a long
match in a tier slower than recompute is worth nothing, as on the node itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.cost import CostModel


def recompute_us(cost: CostModel, start: int, end: int) -> float:
    """Prefill time of tokens ``start..end-1`` given all tokens before ``start`` are cached. O(1)."""
    if end <= start:
        return 0.0
    n = end - start
    # Σ_{p=start}^{end-1} (1 + g p) = n + g (Σ p)
    positions = (start + end - 1) * n / 2.0
    return cost.recompute_us * (n + cost.growth * positions)


def usable_tokens(cost: CostModel, matched: Sequence[int]) -> tuple[list[int], int]:
    """Per tier, the matched tokens the node would load, and their sum.

    Tiers are taken in order of load cost; the first one whose per-token cost
    is not below recompute at the depth reached so far ends the loaded prefix.
    """
    used = [0] * len(matched)
    depth = 0
    for tier in sorted(range(len(matched)), key=lambda t: cost.load_us[t]):
        m = matched[tier]
        if m <= 0:
            continue
        if cost.load_us[tier] >= cost.recompute_us * (1.0 + cost.growth * depth):
            break
        used[tier] = m
        depth += m
    return used, depth


def estimate_ttft_us(cost: CostModel, matched: Sequence[int], n_tokens: int, queue_us: float = 0.0) -> float:
    """Estimated time to first token (µs) of an ``n_tokens`` prompt on a node.

    ``matched[i]`` is the number of the prompt's leading tokens the node holds
    in tier ``i`` (L1, L2, L3, L4; at most ``n_tokens`` in all). Pure; thread-safe.
    """
    if n_tokens < 0 or any(m < 0 for m in matched):
        raise ValueError(f"estimate_ttft_us: expected counts >= 0, got n_tokens={n_tokens}, matched={list(matched)}")
    total = sum(matched)
    if total > n_tokens:
        raise ValueError(f"estimate_ttft_us: matched {total} tokens of a {n_tokens}-token prompt")
    used, depth = usable_tokens(cost, matched)
    load = sum(m * cost.load_us[t] for t, m in enumerate(used))
    return load + recompute_us(cost, depth, n_tokens) + max(queue_us, 0.0)
