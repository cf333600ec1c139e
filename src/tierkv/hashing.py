"""Chained 128-bit block hashes (docs/design.md §3).

``h_0 = H(seed | bytes(t_0))``, ``h_i = H(h_{i-1} | bytes(t_i))`` where
``bytes(t)`` are little-endian int32 token ids and the seed binds the model id,
revision, layout fingerprint, namespace and any extra keys (LoRA adapter,
cache salt). Only full blocks get keys. Never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)
"""16 bytes naming a block and, through the chain, its whole prefix."""

ALGORITHMS = ("xxh3_128", "sha256", "blake2b")  # config.HASH_ALGORITHMS names the same (tested)
HASH_BYTES = 16


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian int32 bytes of token ids (struct is ~2x faster than numpy for lists)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<i4", copy=False).tobytes()
    if isinstance(token_ids, (bytes, bytearray)):
        raise TypeError("token_ids: expected a sequence of ints, got bytes")
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token_ids: every id must fit in int32 ({exc})") from None


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
        self._native_chain = None
        if algorithm == "sha256":
            self._base = hashlib.sha256()
            from tierkv import sha256_chain

            if sha256_chain.available():
                self._native_chain = sha256_chain.chain
        elif algorithm == "blake2b":
            self._base = hashlib.blake2b(digest_size=HASH_BYTES, key=self._key)

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
        if start and parent is None:  # the seed in its place would silently start another chain
            raise ValueError(f"hash_blocks: start={start} needs the hash of block {start - 1} as parent")
        data = token_bytes(token_ids)
        step = 4 * block_size
        end = (len(data) // step) * step
        prev = seed if parent is None else parent
        out: list[BlockHash] = []
        append = out.append
        if self.algorithm == "xxh3_128":
            digest = xxhash.xxh3_128_digest
            for off in range(start * step, end, step):
                prev = digest(prev + data[off : off + step])
                append(prev)
            return out
        if self._native_chain is not None and end > start * step:
            found = self._native_chain(prev, data, end // step - start, step, start)
            if found is not None:
                return found
        # Copying a primed hash object skips OpenSSL's per-object setup (~15% of a small hash).
        fresh = self._base.copy
        for off in range(start * step, end, step):
            h = fresh()
            h.update(prev + data[off : off + step])
            prev = h.digest()[:HASH_BYTES]
            append(prev)
        return out
