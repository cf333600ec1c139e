"""The canonical KV block layout shared by every tier (docs/design.md §2).

A block holds the KV of ``block_size`` consecutive tokens for all layers::

    block[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]   contiguous

The same bytes are the block in L1, L2, L3 and L4, so moving a block between
tiers is one contiguous copy. The fingerprint enters every key, so a block can
never be read back under another layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_LIMITS = {"num_layers": 4096, "num_kv_heads": 1024, "head_dim": 4096, "block_size": 65536}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of one canonical block. Immutable, hashable, validated."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name, upper in _LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
                raise ValueError(f"layout.{name}: expected an integer in [1, {upper}], got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"layout.dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.itemsize

    @property
    def fingerprint(self) -> str:
        """16 hex digits naming this layout; stable across processes and versions."""
        text = (
            f"tierkv-layout-v1|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}"
            f"|{self.block_size}|{self.dtype}"
        )
        return xxhash.xxh3_64_hexdigest(text.encode())

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a pool of ``num_blocks`` canonical blocks (L1 and L2 slabs)."""
        return (num_blocks, *self.block_shape)

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": self.dtype,
        }
