"""L3's index record: one block's entry in the LMDB ``blocks`` database, and the free-list key.

A raw record (the first format) is ``slot, depth, checksum, created`` (24 bytes); a compressed
one adds the stored bytes and the ``tierkv.compress`` flags (32 bytes). The parent's hash (16
bytes) follows either, or nothing for a root. ``parse`` refuses what cannot be a record (a
damaged index), so a caller never reads a slot on the word of garbage. Nothing here does IO;
a ``Record`` is built once and only read after.
"""

from __future__ import annotations

import struct

ALIGN = 4096  # O_DIRECT unit: slots, buffers and compressed lengths are whole pages
_REC = struct.Struct("<IIQd")  # slot, depth, checksum, created; parent hash follows (0 or 16 bytes)
_REC_CODED = struct.Struct("<IIQdII")  # ... then stored bytes, compress flags; parent follows
_SLOT = struct.Struct(">I")    # free-list keys sort by slot number
_HEADS = {_REC.size: _REC.size, _REC.size + 16: _REC.size,
          _REC_CODED.size: _REC_CODED.size, _REC_CODED.size + 16: _REC_CODED.size}


class Record:
    """One block's index entry. ``flags`` 0: raw (``stored`` is the block's size); else the
    ``tierkv.compress`` flags of the ``stored`` bytes at the start of its slot."""

    __slots__ = ("key", "slot", "depth", "checksum", "created", "stored", "flags", "parent")

    def __init__(self, key: bytes, raw: bytes, block_bytes: int) -> None:
        self.key = key
        if len(raw) in (_REC_CODED.size, _REC_CODED.size + 16):
            self.slot, self.depth, self.checksum, self.created, self.stored, self.flags = _REC_CODED.unpack_from(raw)
            self.parent = bytes(raw[_REC_CODED.size:]) or None
        else:
            self.slot, self.depth, self.checksum, self.created = _REC.unpack_from(raw)
            self.stored, self.flags = block_bytes, 0
            self.parent = bytes(raw[_REC.size:]) or None


def parse(key: bytes, raw: bytes, block_bytes: int) -> Record | None:
    """The record stored under ``key``, or None when ``raw`` cannot be one (a damaged index).
    Raw records are 24 or 40 bytes (with a parent), compressed ones 32 or 48."""
    head = _HEADS.get(len(raw))
    if head is None or (len(raw) > head and bytes(raw[head:]) == bytes(key)):
        return None
    rec = Record(bytes(key), raw, block_bytes)
    if head == _REC_CODED.size and not (rec.flags and 0 < rec.stored < block_bytes):
        return None  # a compressed record always has flags and fewer bytes than the block
    return rec


def pack(slot: int, depth: int, crc: int, created: float, parent: bytes | None,
         stored: int | None = None, flags: int = 0) -> bytes:
    """The stored value of a record: raw when ``stored`` is None, else compressed (``stored``
    bytes written with ``flags``)."""
    head = (_REC.pack(slot, depth, crc, created) if stored is None else
            _REC_CODED.pack(slot, depth, crc, created, stored, flags))
    return head + (parent or b"")


def slot_key(slot: int) -> bytes:
    """The key of ``slot`` in the free list (big-endian, so a cursor's first key is the lowest slot)."""
    return _SLOT.pack(slot)


def key_slot(key: bytes) -> int:
    """The slot a free-list key names."""
    return _SLOT.unpack(key)[0]
