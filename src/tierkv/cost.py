"""Per-tier load cost and depth-growing recompute cost, in µs per token (docs/design.md §8). Pure Python.

Recomputing a block costs more the deeper it sits, because each of its tokens
attends to every token before it. The model is linear in context length::

    recompute(block at depth d) = recompute_us * block_size * (1 + growth * d * block_size)

``recompute_us`` is the prefill cost per token with no context before it and
``growth`` the relative extra cost per token of context. Loading a block from
tier t costs ``load_us[t] * block_size``. The time to first token of a request
whose first k blocks are loaded is ``Σ_{i<k} load(t_i) + Σ_{i>=k} recompute(i)``;
``cut`` picks the k that minimises it, so a match is cut where loading more
would cost more than recomputing and a tier slower than recompute is ignored.

``calibrate`` measures the tier bandwidths of this machine (and prefill speed
when given a prefill function); every figure can be overridden in config.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tierkv.config import CostConfig

# Built-in estimates when neither config nor calibration gives a figure: a
# small model's prefill on a CPU, attention adding ~1/32 of the base cost per
# 1k tokens of context, and rough bandwidths of device, host, disk and remote.
_DEFAULT_RECOMPUTE_US = 100.0
_DEFAULT_GROWTH = 1.0 / 32768
_DEFAULT_GBPS = (20.0, 5.0, 1.0, 0.5)


@dataclass(frozen=True)
class CostModel:
    """Load cost per tier (L1..L4) and recompute cost, µs per token. Immutable; thread-safe."""

    load_us: tuple[float, float, float, float]
    recompute_us: float
    growth: float = _DEFAULT_GROWTH
    block_size: int = 16
    block_bytes: int = 1

    def __post_init__(self) -> None:
        if len(self.load_us) != 4 or any(c < 0 for c in self.load_us):
            raise ValueError(f"cost.load_us: expected 4 numbers >= 0 (L1..L4), got {self.load_us!r}")
        if self.recompute_us <= 0:
            raise ValueError(f"cost.recompute_us_per_token: expected > 0, got {self.recompute_us!r}")
        if self.growth < 0:
            raise ValueError(f"cost.recompute_growth: expected >= 0, got {self.growth!r}")
        if self.block_size < 1 or self.block_bytes < 1:
            raise ValueError(f"cost: block_size and block_bytes must be >= 1, got {self.block_size}, {self.block_bytes}")

    @classmethod
    def from_config(cls, cfg: CostConfig, block_bytes: int, block_size: int,
                    measured: CostModel | None = None) -> CostModel:
        """Config figures where set (> 0), else ``measured`` (from ``calibrate``), else built-in estimates."""
        per_token_bytes = block_bytes / block_size
        # bytes per token / (bytes per µs) -> µs per token.
        est = tuple(per_token_bytes / (gbps * 1e3) for gbps in _DEFAULT_GBPS)
        base = measured.load_us if measured is not None else est
        given = (cfg.l1_us_per_token, cfg.l2_us_per_token, cfg.l3_us_per_token, cfg.l4_us_per_token)
        load = tuple(g if g > 0 else b for g, b in zip(given, base))
        recompute = cfg.recompute_us_per_token or (measured.recompute_us if measured else _DEFAULT_RECOMPUTE_US)
        growth = cfg.recompute_growth
        if growth < 0:
            growth = measured.growth if measured is not None else _DEFAULT_GROWTH
        return cls(load, recompute, growth, block_size, block_bytes)

    @classmethod
    def units(cls, depth_weight: float, block_size: int = 512) -> CostModel:
        """A model in abstract units: a block at depth d costs ``1 + depth_weight * d``, loads are free."""
        return cls((0.0, 0.0, 0.0, 0.0), 1.0 / block_size, depth_weight / block_size, block_size, 1)

    # -- per block -------------------------------------------------------------

    def recompute_block_us(self, depth: int, block_size: int | None = None) -> float:
        """Prefill time of the block at ``depth`` (0-based), given all blocks before it are cached."""
        bs = self.block_size if block_size is None else block_size
        return self.recompute_us * bs * (1.0 + self.growth * depth * bs)

    def load_block_us(self, tier: int, block_size: int | None = None) -> float:
        return self.load_us[tier] * (self.block_size if block_size is None else block_size)

    def keep_benefit_us(self, depth: int, tier: int, lower: int | None) -> float:
        """Prefill time one reuse of a block saves by staying in ``tier`` rather than being evicted.

        Evicted, the block is reloaded from ``lower`` (if that is cheaper than
        recomputing) or recomputed; staying, it is loaded from ``tier``. Never
        below a tiny positive floor, so policies can rank in a log domain.
        """
        recompute = self.recompute_block_us(depth)
        fallback = recompute if lower is None else min(recompute, self.load_block_us(lower))
        return max(fallback - self.load_block_us(tier), 1e-9 * recompute)

    # -- per match ---------------------------------------------------------------

    def cut(self, tiers: Sequence[int], block_size: int | None = None) -> int:
        """How many leading blocks of a match to load: the k minimising load(0..k) + recompute(k..).

        Ties go to the shorter prefix (fewer transfers). A tier whose load cost
        exceeds recompute never pays for itself unless deeper blocks make up for it.
        """
        # recompute_block_us / load_block_us inlined, same arithmetic: this runs for every lookup.
        bs = self.block_size if block_size is None else block_size
        load = [u * bs for u in self.load_us]
        base, growth = self.recompute_us * bs, self.growth
        best_k, best, running = 0, 0.0, 0.0
        for i, tier in enumerate(tiers):
            running += load[tier] - base * (1.0 + growth * i * bs)
            if running < best:
                best_k, best = i + 1, running
        return best_k

    def estimate_us(self, tiers: Sequence[int], total_blocks: int, block_size: int | None = None) -> tuple[float, float]:
        """(load time of the matched blocks, recompute time of the rest)."""
        bs = self.block_size if block_size is None else block_size
        per_tier = [u * bs for u in self.load_us]
        base, growth = self.recompute_us * bs, self.growth
        load = sum(per_tier[t] for t in tiers)
        rest = sum(base * (1.0 + growth * d * bs) for d in range(len(tiers), total_blocks))
        return load, rest

    def saved_us(self, tiers: Sequence[int], block_size: int | None = None) -> float:
        """Prefill time a match saves against recomputing it all."""
        return sum(self.recompute_block_us(i, block_size) - self.load_block_us(t, block_size)
                   for i, t in enumerate(tiers))


# -- calibration ---------------------------------------------------------------


def _best_of(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _host_copy_seconds(nbytes: int, repeat: int) -> float:
    """One single-threaded memmove of ``nbytes`` between two host buffers (as tiers copy)."""
    import ctypes

    src = (ctypes.c_char * nbytes).from_buffer(bytearray(os.urandom(nbytes)))
    dst = (ctypes.c_char * nbytes)()
    return _best_of(lambda: ctypes.memmove(dst, src, nbytes), repeat)


def _h2d_seconds(nbytes: int, device: str, repeat: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def h2d() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    h2d()
    return _best_of(h2d, repeat)


def _disk_read_seconds(nbytes: int, directory: str | None, repeat: int) -> float:
    with tempfile.NamedTemporaryFile(dir=os.path.expanduser(directory) if directory else None) as fh:
        fh.write(os.urandom(nbytes))
        fh.flush()
        os.fsync(fh.fileno())
        fd = fh.fileno()

        def read() -> None:
            # Drop the page cache for this file so the read hits the device.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
            os.pread(fd, nbytes, 0)

        return _best_of(read, repeat)


def fit_prefill(n1: int, us1: float, n2: int, us2: float) -> tuple[float, float]:
    """(recompute_us, growth) from two prefill timings: ``t(n) = a n + a g n^2 / 2``.

    Per-token cost at position p is ``a (1 + g p)``, so a prompt of n tokens
    costs ``a n + a g n^2 / 2``; two lengths give a and g. Noise that makes
    the quadratic term negative is clamped to no growth.
    """
    if not 0 < n1 < n2:
        raise ValueError(f"fit_prefill: expected 0 < n1 < n2, got {n1}, {n2}")
    det = n1 * n2 * (n2 - n1) / 2
    a = (us1 * n2 * n2 / 2 - us2 * n1 * n1 / 2) / det
    b = (n1 * us2 - n2 * us1) / det
    if a <= 0:
        return max(us2 / n2, 1e-6), 0.0
    return a, max(b, 0.0) / a


def calibrate(block_bytes: int, block_size: int, *, disk_dir: str | None = None,
              prefill: Callable[[int], None] | None = None, prefill_lengths: tuple[int, int] = (256, 1024),
              device: str = "cpu", blocks: int = 4, repeat: int = 3, base: CostModel | None = None) -> CostModel:
    """Measure this machine's tier costs; figures it cannot measure come from ``base`` or built-in estimates.

    A load cost is the time to bring a block into L1: L1 itself is free, L2 is
    a pinned host-to-device copy (a host memmove without CUDA) of ``blocks``
    blocks, L3 a read of a fresh file under ``disk_dir`` with its pages
    dropped from the cache plus that copy; L4 keeps ``base``'s figure. ``prefill(n)`` — a callable that runs
    one prefill of ``n`` tokens, e.g. the engine's — gives ``recompute_us`` and
    ``growth``. Takes a few hundred ms for MiB-sized blocks; blocks the caller.
    """
    model = base or CostModel.from_config(CostConfig(), block_bytes, block_size)
    nbytes = max(block_bytes * blocks, 1 << 20)
    tokens = nbytes / block_bytes * block_size
    if device.startswith("cuda"):
        l2 = _h2d_seconds(nbytes, device, repeat) * 1e6 / tokens
    else:
        l2 = _host_copy_seconds(nbytes, repeat) * 1e6 / tokens
    l3 = _disk_read_seconds(nbytes, disk_dir, repeat) * 1e6 / tokens + l2
    load = (0.0, l2, l3, model.load_us[3])
    recompute, growth = model.recompute_us, model.growth
    if prefill is not None:
        n1, n2 = prefill_lengths
        us1 = _best_of(lambda: prefill(n1), repeat) * 1e6
        us2 = _best_of(lambda: prefill(n2), repeat) * 1e6
        recompute, growth = fit_prefill(n1, us1, n2, us2)
    return replace(model, load_us=load, recompute_us=recompute, growth=growth)
