"""The narrow protocol every key-addressed tier implements (docs/design.md §5).

Each method is batched and synchronous; ``transfer.py`` runs them on copy or IO
threads to make them asynchronous. A tier moves bytes and decides nothing:
which block goes where is the store's and the policy's business. Failures are
reported per key (``False``), never raised for a lost or bad block.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import xxhash

FailureHook = Callable[[str, str, int, str], None]
"""``on_failure(tier, reason, blocks, detail)``: how a tier reports a failure it turned into a miss."""


class Lineage(NamedTuple):
    """Where a block sits in its chain: enough to rebuild the index from a tier."""

    parent: bytes | None
    depth: int


@runtime_checkable
class BlockTier(Protocol):
    """A key-addressed store of fixed-size blocks: ``l1`` device slots, ``l2`` host DRAM,
    ``l3`` local disk, ``l4`` a remote pool."""

    name: str

    @property
    def capacity(self) -> int:
        """Blocks this tier can hold (L4: unbounded, the pool evicts on its own)."""

    @property
    def used(self) -> int:
        """Blocks this tier holds now (L4: -1, unknown)."""

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def view(self, key: bytes) -> torch.Tensor | None:
        """The block's bytes in place (no copy), valid while the store pins the block; None when
        the tier cannot lend them (not held; on disk or remote; a shared slab another process may
        reuse at any time): then ``get`` copies them out."""

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            lineage: Sequence[Lineage]) -> list[bool]:
        """Store each block under its key; False where it could not (full, IO error)."""

    def get(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> list[bool]:
        """Copy each block into ``dst[i]``; False where missing or corrupt (dst then undefined)."""

    def remove(self, keys: Sequence[bytes]) -> None: ...


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One contiguous block copy: a single-threaded memmove on CPU, an async DMA on CUDA.

    CPU copies bypass torch's intra-op pool on purpose: on small hosts threaded
    copies ran 3-5x slower than one memmove.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        n = dst.numel() * dst.element_size()
        if n != src.numel() * src.element_size():
            raise ValueError(f"copy_block: {src.numel() * src.element_size()} bytes into {n}")
        if dst.is_contiguous() and src.is_contiguous():
            _memmove(dst.data_ptr(), src.data_ptr(), n)
        else:  # a strided view: a raw memmove would scramble it and write past its elements
            dst.copy_(src)
    else:
        dst.copy_(src, non_blocking=True)


_memmove = ctypes.memmove  # (dst address, src address, n); releases the GIL


def round_up(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step


def checksum(key: bytes, data) -> int:
    """The 64-bit checksum tiers store beside a block: xxh3 of its bytes, seeded by its key (so a
    block read back under another key fails it). ``data``: a bytes-like object or a CPU tensor."""
    if isinstance(data, torch.Tensor):
        data = as_bytes(data)
    return xxhash.xxh3_64_intdigest(data, seed=int.from_bytes(key[:8], "little"))


def leading_ok(flags: Sequence[bool]) -> int:
    """Length of the leading run of True in ``flags`` (the usable prefix of a batch)."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("as_bytes: expected a contiguous CPU tensor")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")
