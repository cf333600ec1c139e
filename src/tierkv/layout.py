"""The canonical KV block layout shared by every tier (docs/design.md §2).

A block holds the KV of ``block_size`` consecutive tokens for all layers::

    block[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]   contiguous

The same bytes are the block in L1, L2, L3 and L4, so moving a block between
tiers is one contiguous copy. The fingerprint enters every key, so a block can
never be read back under another layout.

A *shard* layout (tensor parallelism, docs/design.md §13) holds KV heads
``kv_head_start .. kv_head_start + num_kv_heads`` of ``kv_heads_total``: its
fingerprint names the head range, so each rank's objects live apart (their own
L3 directory, their own L4 names) under the same chain of block keys, which
``logical`` (the unsharded layout) roots. An unsharded layout keeps
``kv_heads_total == 0``; one that holds every head is normalised to it.
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
    kv_heads_total: int = 0  # a shard: heads [kv_head_start, +num_kv_heads) of this many; 0: every head
    kv_head_start: int = 0

    def __post_init__(self) -> None:
        for name, upper in _LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
                raise ValueError(f"layout.{name}: expected an integer in [1, {upper}], got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"layout.dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        total, start = self.kv_heads_total, self.kv_head_start
        for name, value in (("kv_heads_total", total), ("kv_head_start", start)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"layout.{name}: expected an integer >= 0, got {value!r}")
        if total == 0 and start != 0:
            raise ValueError(f"layout.kv_head_start: {start} needs kv_heads_total (the model's KV heads)")
        if total and start + self.num_kv_heads > total:
            raise ValueError(f"layout.kv_head_start: heads {start}..{start + self.num_kv_heads} do not fit "
                             f"in kv_heads_total={total}")
        if total == self.num_kv_heads:  # every head: the unsharded layout, one fingerprint
            object.__setattr__(self, "kv_heads_total", 0)

    @property
    def is_shard(self) -> bool:
        """True when this layout holds only some of the model's KV heads."""
        return self.kv_heads_total != 0

    @property
    def logical(self) -> KVLayout:
        """The unsharded layout of the same model (every KV head): what roots the chain of keys."""
        if not self.kv_heads_total:
            return self
        return KVLayout(self.num_layers, self.kv_heads_total, self.head_dim, self.block_size, self.dtype)

    def shard(self, start: int, count: int) -> KVLayout:
        """The layout of KV heads ``start .. start + count`` of this (unsharded) layout."""
        if self.kv_heads_total:
            raise ValueError("layout.shard: already a shard; take it of the logical layout")
        return KVLayout(self.num_layers, count, self.head_dim, self.block_size, self.dtype,
                        kv_heads_total=self.num_kv_heads, kv_head_start=start)

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
        if self.kv_heads_total:
            text += f"|heads{self.kv_head_start}:{self.kv_head_start + self.num_kv_heads}/{self.kv_heads_total}"
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
            **({"kv_heads_total": self.kv_heads_total, "kv_head_start": self.kv_head_start}
               if self.kv_heads_total else {}),
        }
