"""The L4 value format: a block followed by a 64-byte trailer, built and checked (docs/design.md §10, §15).

Every value stored in a remote pool is ``payload || trailer`` where the
64-byte trailer (a header stored last, so the block starts at the
value's first byte and moves to and from the caller's memory in one piece) is::

    magic "TKV4" | version u16 | flags u16 | layout fingerprint 8B | key 16B
    | payload length u64 | xxh3_64(payload) u64 | MAC 16B (zeros when no auth key)

With ``l4.auth_key`` set, the MAC is a keyed BLAKE2b-128 over the first 48
trailer bytes and the payload, so a value written by anyone without the key is
a miss. With ``l4.compress`` on, the payload of a block that shrinks is its
compressed bytes (``tierkv.compress``): flags bits 1-2 say how it was coded,
the length and checksum are those of the stored bytes, so damage is found
before anything is decoded. Raw values (flags 0-1) read as before. A value that is foreign, truncated, of another layout or fails its
checksum is a miss too, counted by its verdict, never wrong KV. Pure: no I/O.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import struct

import torch
import xxhash

from tierkv.layout import KVLayout
from tierkv.tiers.base import as_bytes, copy_block

MAGIC = b"TKV4"
VERSION = 2  # 1 was header-first
FLAG_MAC = 1
CODED_SHIFT = 1  # flags >> CODED_SHIFT: the tierkv.compress flags of the payload (0: raw)
_CODED_MASK = 0b11
_TAIL = struct.Struct("<4sHH8s16sQQ")  # magic, version, flags, fingerprint, key, length, checksum
MAC_BYTES = 16
TRAILER_BYTES = _TAIL.size + MAC_BYTES  # 64
# Why a value is not usable; each is a failure reason in the store's metrics.
OK, TRUNCATED, FOREIGN, LAYOUT, CORRUPT, UNAUTHENTICATED = (
    "ok", "truncated", "foreign", "layout", "corrupt", "unauthenticated")



class ValueCodec:
    """Builds and checks value trailers for one layout. Stateless after construction; thread-safe."""

    def __init__(self, layout: KVLayout, auth_key: str = "") -> None:
        self.fingerprint = bytes.fromhex(layout.fingerprint)
        self.payload_bytes = layout.block_bytes
        self.value_bytes = layout.block_bytes + TRAILER_BYTES
        self._mac_key = auth_key.encode() if auth_key else b""
        if len(self._mac_key) > 64:
            self._mac_key = hashlib.blake2b(self._mac_key, digest_size=64).digest()

    @property
    def authenticated(self) -> bool:
        return bool(self._mac_key)

    def _mac(self, fields: bytes | memoryview, payload: memoryview) -> bytes:
        h = hashlib.blake2b(key=self._mac_key, digest_size=MAC_BYTES)
        h.update(fields)
        h.update(payload)
        return h.digest()

    def trailer(self, key: bytes, payload, coded: int = 0) -> bytes:
        """The 64 trailer bytes for ``payload`` (a buffer, or a contiguous CPU tensor) stored
        under ``key``, compressed with ``tierkv.compress`` flags ``coded`` (0: the raw block);
        reads the payload once, twice with a MAC."""
        flags = (FLAG_MAC if self._mac_key else 0) | coded << CODED_SHIFT
        fields = _TAIL.pack(MAGIC, VERSION, flags, self.fingerprint, key, _nbytes(payload), _xxh3(payload))
        mac = self._mac(fields, _raw(payload)) if self._mac_key else bytes(MAC_BYTES)
        return fields + mac

    def encode_into(self, key: bytes, block: torch.Tensor, out: memoryview) -> None:
        """Write payload and trailer of ``block`` into ``out`` (``value_bytes`` long)."""
        payload = out[:self.payload_bytes]
        copy_block(torch.frombuffer(payload, dtype=torch.uint8), block.reshape(-1).view(torch.uint8))
        out[self.payload_bytes:self.value_bytes] = self.trailer(key, payload)

    def _check_trailer(self, key: bytes, length: int, tail: bytes | memoryview) -> tuple[str, int, int]:
        """(verdict, checksum, stored payload bytes) of a ``length``-byte value from its last bytes
        ``tail`` alone. Verdict OK means the payload is worth hashing.
        """
        if length < TRAILER_BYTES or len(tail) < TRAILER_BYTES:
            # Too short to hold a trailer, or one larger than a staging slot (the backend kept none).
            return (LAYOUT if length > self.value_bytes else TRUNCATED), 0, 0
        magic, version, flags, fp, vkey, size, checksum = _TAIL.unpack_from(tail, len(tail) - TRAILER_BYTES)
        if magic != MAGIC or version != VERSION or vkey != key:
            # A value cut short ends inside its payload: no trailer where one should be.
            return (TRUNCATED if length < self.value_bytes else FOREIGN), 0, 0
        coded = flags >> CODED_SHIFT
        if fp != self.fingerprint or coded > _CODED_MASK or (
                size != self.payload_bytes if not coded else not 0 < size < self.payload_bytes):
            return LAYOUT, 0, 0
        if length != size + TRAILER_BYTES:
            return TRUNCATED, 0, 0
        if self._mac_key and not flags & FLAG_MAC:
            return UNAUTHENTICATED, 0, 0
        return OK, checksum, size

    def coded(self, tail: bytes | memoryview) -> int:
        """The ``tierkv.compress`` flags of a value whose trailer ``verify`` found OK (0: raw)."""
        return _TAIL.unpack_from(tail, len(tail) - TRAILER_BYTES)[2] >> CODED_SHIFT

    def stored_bytes(self, tail: bytes | memoryview) -> int:
        """The payload length a good trailer records (the block's size, or its compressed size)."""
        return _TAIL.unpack_from(tail, len(tail) - TRAILER_BYTES)[5]

    def verify(self, key: bytes, length: int, tail: bytes | memoryview, payload) -> str:
        """OK when a ``length``-byte value, whose last bytes are ``tail`` and whose payload
        sits in ``payload`` (a buffer, or a contiguous CPU tensor), is a whole, untampered block
        of this layout under ``key``; else the reason. ``payload`` is read only when the trailer
        is good: one xxh3 pass (and one BLAKE2b pass with the MAC on), in place, so a backend
        can land it in the caller's block. A compressed value's stored bytes lie at the
        payload's start; only they are read.
        """
        verdict, checksum, size = self._check_trailer(key, length, tail)
        if verdict != OK:
            return verdict
        tail = tail[len(tail) - TRAILER_BYTES:]
        stored = _raw(payload)[:size]
        if self._mac_key and not hmac.compare_digest(self._mac(tail[:_TAIL.size], stored),
                                                     bytes(tail[_TAIL.size:])):
            return UNAUTHENTICATED
        found = _xxh3(payload) if size == _nbytes(payload) else xxhash.xxh3_64_intdigest(stored)
        return OK if found == checksum else CORRUPT

    def check(self, key: bytes, value: memoryview) -> str:
        """``verify`` for a whole value in one buffer."""
        cut = max(0, len(value) - TRAILER_BYTES)
        return self.verify(key, len(value), value[cut:], value[:cut])


def _raw(block):
    """A contiguous CPU block's bytes as a buffer (``as_bytes``: no copy, any dtype); a buffer as it is."""
    return as_bytes(block) if isinstance(block, torch.Tensor) else block


def _nbytes(payload) -> int:
    return payload.nbytes if isinstance(payload, torch.Tensor) else memoryview(payload).nbytes


def _xxh3_by_address():
    """xxhash's own XXH3_64bits (runtime-dispatched SIMD) called by address through ctypes.

    The same function ``xxhash.xxh3_64_intdigest`` runs, minus building a
    buffer object per block (measured ~3 us of a tensor's .view().numpy()).
    None when the extension does not export it; callers then use the
    Python API.
    """
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        fn = lib.XXH3_64bits_dispatch
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    probe = b"tierkv xxh3 probe"
    return fn if fn(probe, len(probe)) == xxhash.xxh3_64_intdigest(probe) else None


_XXH3_AT = _xxh3_by_address()


def _xxh3(payload) -> int:
    """xxh3_64 of a buffer or of a contiguous CPU tensor's bytes."""
    if isinstance(payload, torch.Tensor):
        if _XXH3_AT is not None:
            return _XXH3_AT(payload.data_ptr(), payload.nbytes)
        payload = _raw(payload)
    return xxhash.xxh3_64_intdigest(payload)
