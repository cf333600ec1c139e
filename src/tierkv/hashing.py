"""Chained 128-bit block hashes (DESIGN §3).

``h_0 = H(seed | bytes(t_0))``, ``h_i = H(h_{i-1} | bytes(t_i))`` where
``bytes(t)`` are little-endian int32 token ids and the seed binds the model id,
revision, layout fingerprint, namespace and any extra keys (LoRA adapter,
cache salt). Only full blocks get keys. Never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
"""16 bytes naming a block and, through the chain, its whole prefix."""

ALGORITHMS = ("xxh3_128", "sha256", "blake2b")
HASH_BYTES = 16


class BlockHasher:
    """Computes seeds and chained block hashes. Stateless after construction; thread-safe."""

    def __init__(self, algorithm: str = "xxh3_128", key: bytes | None = None) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"hashing.algorithm: expected one of {list(ALGORITHMS)}, got {algorithm!r}")
        if algorithm == "blake2b":
            if not key:
                raise ValueError("hashing.key: blake2b is keyed; give 1..64 bytes of key")
            if len(key) > 64:
                raise ValueError(f"hashing.key: at most 64 bytes for blake2b, got {len(key)}")
        self.algorithm = algorithm
        self._key = key or b""
        self._digest = self._make_digest()

    def _make_digest(self):
        if self.algorithm == "xxh3_128":
            return xxhash.xxh3_128_digest
        if self.algorithm == "sha256":
            sha = hashlib.sha256
            return lambda data: sha(data).digest()[:HASH_BYTES]
        blake, key = hashlib.blake2b, self._key
        return lambda data: blake(data, digest_size=HASH_BYTES, key=key).digest()

    def seed(
        self,
        model_id: str,
        model_revision: str,
        layout_fingerprint: str,
        namespace: str = "",
        extra_keys: Sequence[str] = (),
    ) -> BlockHash:
        """The root of every chain for this model, layout and namespace."""
        parts = ["tierkv-v1", model_id, model_revision, layout_fingerprint, namespace, *extra_keys]
        text = "\x1f".join(f"{len(p)}:{p}" for p in parts)
        return BlockHash(self._digest(text.encode()))

    def hash_blocks(
        self, token_ids: Sequence[int] | np.ndarray, block_size: int, seed: bytes, start: int = 0,
        parent: bytes | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

        ``parent`` is the hash of block ``start - 1`` (``seed`` when ``start`` is 0),
        so callers that already hashed a prefix extend the chain without rehashing it.
        """
        data = np.asarray(token_ids, dtype="<i4").tobytes()
        step = 4 * block_size
        end = (len(data) // step) * step
        prev = seed if parent is None else parent
        digest = self._digest
        out: list[BlockHash] = []
        append = out.append
        for off in range(start * step, end, step):
            prev = digest(prev + data[off : off + step])
            append(prev)
        return out
