"""L3: local disk — one preallocated slot file plus an LMDB index (docs/design.md §5).

All slots have one size, so slot k sits at offset k x stride (stride = block
bytes rounded up to 4 KiB): no fragmentation. Data moves with O_DIRECT through
page-aligned buffers, straight into the caller's buffer when it is aligned.
The LMDB environment maps key -> (slot, depth, checksum, created, [stored
bytes, flags,] parent). With ``compress`` on, a block that shrinks by at least a
page is stored as byte planes + zstd (``tierkv.compress``) at the start of its
slot, its stored size and flags in the record and its checksum over the stored
bytes, so damage is found before anything is decoded; raw records (the old
format, and blocks that do not shrink) sit beside them. A compressed block reads
fewer bytes; it still takes a whole slot (capacity is unchanged).

Compression (CPU only) runs first, outside any transaction; then the data,
fdatasync and the LMDB commit, all inside one LMDB write transaction — LMDB's writer lock serialises writers across processes, so
slot allocation needs no other coordination, and a crash (even SIGKILL) leaves
at worst a slot whose bytes nobody points at. Every read verifies a checksum
bound to the key; a bad block is a miss, is removed and is counted. Readers
never block (LMDB MVCC), and any number of processes may open one directory.

Damage found at open never stops the store: damaged files are moved into
``damaged-<UTC time>/`` beside them and an empty L3 starts in their place
(``disk_open.py`` checks and moves); records whose block cannot be in the slot
file are dropped. Both are counted.

This file is the facade: it owns the LMDB environment (records, free list, meta
records) and decides which slot a block takes. The record format is
``disk_record.py``, the slot file ``disk_file.py``, the write path
``disk_write.py``, the read path ``disk_read.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import torch

from tierkv.compress import AutoChooser, BlockCodec
from tierkv.config import COMPRESS_MODES
from tierkv.identity import IDENTITY_PREFIX
from tierkv.layout import KVLayout
from tierkv.pacing import UNPACED, Pacer
from tierkv.tiers.base import FailureHook, Lineage, as_bytes, round_up
from tierkv.tiers.disk_file import SlotFile
from tierkv.tiers.disk_open import (
    DAMAGE, Damaged, check_before_mapping, foreign_layout, has_data, open_checked, read_count,
)
from tierkv.tiers.disk_read import BlockReader, ReadPlan
from tierkv.tiers.disk_record import ALIGN, Record, key_slot, pack, parse, slot_key
from tierkv.tiers.disk_runs import pieces as _pieces  # noqa: F401  (bench/ imports them from here)
from tierkv.tiers.disk_runs import runs as _runs  # noqa: F401
from tierkv.tiers.disk_write import BlockWriter

log = logging.getLogger("tierkv")
_parse = parse  # the name older callers know
__all__ = ["ALIGN", "DiskTier", "Record"]


class DiskTier:
    name = "l3"
    pacer: Pacer = UNPACED  # the owning store's: a put's slices and checksums are background pieces

    def __init__(self, path: str | os.PathLike, layout: KVLayout, num_blocks: int,
                 meta: dict[str, str] | None = None, direct_io: bool = True,
                 on_failure: FailureHook | None = None, create: bool = True, read_depth: int = 4,
                 compress: str = "off", compress_level: int = 1, compress_threads: int = 1) -> None:
        """Open (or create) the L3 directory ``path``; openers in any process take turns on ``path/open.lock``.

        Damaged files (an index LMDB rejects, or that kills the process reading it; unreadable
        meta records; a slot file that is not a file) are moved into ``path/damaged-<UTC time>/``
        (never deleted) and an empty L3 starts in their place, reported once through
        ``on_failure`` as ("l3", "damaged_index" or "damaged_slots", blocks lost or 0). With
        ``create=False`` (the offline tools) damage raises instead. Records whose bytes cannot
        be in the slot file (malformed, or past its end) are dropped and counted as corrupt.
        Configuration errors raise ValueError naming ``l3.path``: a path that cannot be a
        directory, a directory of another layout, one already open in this process.

        ``compress`` (``l3.compress``): ``off`` writes raw blocks, ``zstd`` every block that
        shrinks by a page, ``auto`` only while ``AutoChooser`` finds the get faster by 1.2x.
        Compressed blocks are read whatever the setting.
        """
        if not isinstance(read_depth, int) or isinstance(read_depth, bool) or not 1 <= read_depth <= 64:
            raise ValueError(f"l3.read_depth: expected an integer in 1..64, got {read_depth!r}")
        if compress not in COMPRESS_MODES:
            raise ValueError(f"l3.compress: expected one of {list(COMPRESS_MODES)}, got {compress!r}")
        self.compress = compress
        self._codec = (BlockCodec(layout.itemsize, layout.block_bytes, compress_level, compress_threads)
                       if compress != "off" else None)
        self._auto = AutoChooser(self._codec) if compress == "auto" else None
        self._auto_noted = ""
        self._codec_read: BlockCodec | None = None
        self.path = Path(path).expanduser()
        self.read_depth = read_depth  # preadv calls in flight per get
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self.stride = round_up(layout.block_bytes, ALIGN)
        self._hooked = on_failure is not None
        self._on_failure = on_failure or (lambda *a: None)
        self._file: SlotFile | None = None
        if not create and not (self.path / "index").exists():
            raise FileNotFoundError(f"l3.path: no tierkv L3 directory at {self.path}")
        open_checked(self.path, lambda: self._open(num_blocks, meta or {}, direct_io), create, self._report_damage)
        self._writer = BlockWriter(self._file, self._codec, self._auto)
        self._reader = BlockReader(self._file, read_depth, self._holds, self._decoder, self._auto,
                                   self._on_failure, self.path)

    # -- setup ----------------------------------------------------------------

    def _open(self, num_blocks: int, meta: dict[str, str], direct_io: bool) -> None:
        """Open index and slot file. Raises Damaged for damaged files, ValueError for configuration."""
        index, slots = self.path / "index", self.path / "slots.bin"
        check_before_mapping(self.path)
        self._env, self._file = None, None
        try:
            self._blocks = None
            # metasync=False: one fsync per commit instead of two. LMDB keeps its integrity; an
            # OS crash may undo the last commit, which only loses that batch's records (their
            # data was synced first and is then in slots nobody points at).
            self._env = lmdb.open(str(index), map_size=max(1 << 30, num_blocks * 512),
                                  max_dbs=4, max_readers=512, subdir=True, lock=True, metasync=False)
            self._blocks = self._env.open_db(b"blocks")
            self._free = self._env.open_db(b"free")
            self._meta = self._env.open_db(b"meta")
            self._capacity = self._init_meta(num_blocks, meta, slots)
            self._file = SlotFile(slots, self.block_bytes, direct_io, self.path)
            self.direct = self._file.direct
            self._drop_unusable()
            self._file.grow(self._capacity)
        except DAMAGE as exc:
            lost = self._entries()
            self._close_files()
            raise Damaged("damaged_index", lost, f"{type(exc).__name__}: {exc}") from None
        except (lmdb.Error, OSError) as exc:  # e.g. a second store on this directory in one process
            self._close_files()
            raise ValueError(f"l3.path: cannot open the L3 files under {self.path}: {exc}") from None
        except BaseException:
            self._close_files()
            raise

    def _init_meta(self, num_blocks: int, meta: dict[str, str], slots: Path) -> int:
        with self._env.begin(write=True) as txn:
            entries = txn.stat(self._blocks)["entries"]
            found = txn.get(b"layout_fingerprint", db=self._meta)
            if found is None and (entries or has_data(slots)):
                raise Damaged("damaged_index", entries, "the index has lost its meta records "
                              f"but {'holds blocks' if entries else 'slots.bin holds data'}")
            if found is not None and found != self.layout.fingerprint.encode():
                raise foreign_layout(self.path, self.layout, found, txn.get(b"layout", db=self._meta), entries)
            capacity = max(num_blocks, read_count(txn, self._meta, b"capacity", entries))
            read_count(txn, self._meta, b"next_slot", entries)
            txn.put(b"layout_fingerprint", self.layout.fingerprint.encode(), db=self._meta)
            txn.put(b"layout", repr(self.layout.to_dict()).encode(), db=self._meta)
            txn.put(b"capacity", str(capacity).encode(), db=self._meta)
            for k, v in meta.items():  # identity records say who wrote here: updated each open
                if k.startswith(IDENTITY_PREFIX) or txn.get(k.encode(), db=self._meta) is None:
                    txn.put(k.encode(), str(v).encode(), db=self._meta)
        return capacity

    def _drop_unusable(self) -> None:
        """Drop the records whose block cannot be in the slot file: malformed, or past its end."""
        size = self._file.size
        suspects = []
        with self._env.begin() as txn:
            for key, raw in txn.cursor(db=self._blocks):
                rec = parse(key, raw, self.block_bytes)
                if rec is None or rec.slot * self.stride + self.block_bytes > size:
                    suspects.append((key, raw, rec))
        if not suspects:
            return
        size = self._file.size  # another process's block lands before its record does
        bad = [s for s in suspects if s[2] is None or s[2].slot * self.stride + self.block_bytes > size]
        if bad:
            malformed = sum(rec is None for _, _, rec in bad)
            self._drop_records(bad)
            self._on_failure("l3", "corrupt", len(bad), f"{self.path}: {len(bad) - malformed} records point past "
                             f"the end of slots.bin ({size} bytes), {malformed} are malformed; dropped")

    def _report_damage(self, reason: str, lost: int, detail: str) -> None:
        if not self._hooked:
            log.warning("tierkv l3 %s: %s", reason, detail)
        self._on_failure("l3", reason, lost, detail)

    def _entries(self) -> int:
        """Blocks the index lists, or 0 when it cannot say."""
        if self._env is None or self._blocks is None:
            return 0
        try:
            with self._env.begin() as txn:
                return txn.stat(self._blocks)["entries"]
        except lmdb.Error:
            return 0

    def _close_files(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._env is not None:
            self._env.close()

    def meta(self) -> dict[str, str]:
        """Every meta record: layout, capacity, the first model id, and one ``identity:<digest>``
        record per model identity that opened this directory (``identity.recorded``)."""
        with self._env.begin() as txn:
            return {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor(db=self._meta)}

    # -- protocol -------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots in the directory: the largest capacity any opener asked for (read fresh)."""
        return self._refresh_capacity()

    @property
    def used(self) -> int:
        with self._env.begin() as txn:
            return txn.stat(self._blocks)["entries"]

    def view(self, key: bytes) -> None:
        """Never: the bytes are on disk (``get`` reads them)."""
        return None

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            with self._env.begin() as txn:
                return [txn.get(k, db=self._blocks) is not None for k in keys]
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")
            return [False] * len(keys)

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            lineage: Sequence[Lineage] | None = None) -> list[bool]:
        """Persist blocks: encode, then data, fdatasync and one LMDB commit. False where full or on IO error.

        Compression runs before the write transaction opens (``_encode_first``), so LMDB's writer
        lock, which every writer of the directory in any process waits for, is held for slot
        choice, the data write, fdatasync and the index update, never for zstd. Blocking; any
        thread (writers serialise on that lock). The caller keeps ``blocks`` until it returns.
        """
        lineage = lineage or [Lineage(None, 0)] * len(keys)
        out = [False] * len(keys)
        try:
            encoded = self._encode_first(keys, blocks)
            with self._env.begin(write=True) as txn:
                todo, batch = [], set()
                for i, key in enumerate(keys):
                    # A key twice in one batch must take one slot: the second record would
                    # overwrite the first and leak its slot for good.
                    if key in batch or txn.get(key, db=self._blocks) is not None:
                        out[i] = True
                        continue
                    batch.add(key)
                    slot = self._take_slot(txn)
                    if slot is None:
                        self._on_failure("l3", "full", len(keys) - i, str(self.path))
                        break
                    todo.append((i, slot))
                if not todo:
                    return out
                # A block another process removed since the check was not coded: it goes raw.
                stored = [encoded.get(i) for i, _ in todo]
                sums = self._writer.write([slot for _, slot in todo], [keys[i] for i, _ in todo],
                                          [blocks[i] for i, _ in todo], stored, self.pacer)
                self._file.sync()
                now = time.time()
                for (i, slot), crc, coded in zip(todo, sums, stored):
                    parent, depth = lineage[i]
                    value = (pack(slot, depth, crc, now, parent) if coded is None else
                             pack(slot, depth, crc, now, parent, len(coded), self._codec.flags))
                    txn.put(keys[i], value, db=self._blocks)
                    out[i] = True
                self._note_auto(txn)
        except OSError as exc:
            reason = "full" if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else "io"
            self._on_failure("l3", reason, len(keys), f"{self.path}: {exc}")
            return [False] * len(keys)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")
            return [False] * len(keys)
        return out

    def _encode_first(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> dict[int, bytes]:
        """The stored bytes of the blocks a put will write compressed, by position, coded outside
        any write transaction: those not yet in the index (first of a key twice), at most as many
        as it has free slots (read from one snapshot; the write transaction decides again)."""
        if self._codec is None:
            return {}
        with self._env.begin() as txn:
            raw_next = txn.get(b"next_slot", db=self._meta)
            free = txn.stat(self._free)["entries"] + max(0, self._refresh_capacity(txn) - int(raw_next or 0))
            todo, seen = [], set()
            for i, key in enumerate(keys):
                if len(todo) == free:
                    break
                if key not in seen and txn.get(key, db=self._blocks) is None:
                    seen.add(key)
                    todo.append(i)
        stored = self._writer.encode([blocks[i] for i in todo])
        return {i: c for i, c in zip(todo, stored) if c is not None}

    def get(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> list[bool]:
        """Read and verify blocks into ``dst``; a missing, short or corrupt block is False.

        Aligned destinations on consecutive slots are read with one preadv per piece (a run of
        them, about 4 MiB), ``read_depth`` pieces in flight on the process's reader threads, each
        verified by the thread that read it. Returns when every read has finished.
        """
        plan = self._plan(keys, dst)
        if plan is None:
            return [False] * len(keys)
        return self._settle(plan, self._reader.read(plan, dst))

    def get_in_parts(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor], parts: int,
                     progress) -> list[bool]:
        """``get``, reading each block in ``parts`` equal slices, slice 0 of every block first;
        ``progress(n)`` (on a reader thread) once slices ``[0, n)`` of every block have landed,
        unverified. Each block is verified once all its slices are in; the result is ``get``'s.
        Without slices that are whole O_DIRECT units, or with a destination that is not aligned,
        it is ``get`` (no progress until the end). Returns when every read has finished.
        """
        part = self.block_bytes // parts
        if parts < 2 or part * parts != self.block_bytes or part % ALIGN or self.stride != self.block_bytes:
            return self.get(keys, dst)
        plan = self._plan(keys, dst)
        if plan is None:
            return [False] * len(keys)
        if plan.staged or not plan.direct:
            return self.get(keys, dst)
        return self._settle(plan, self._reader.read_in_parts(plan, parts, progress))

    def _plan(self, keys: Sequence[bytes], dst: Sequence[torch.Tensor]) -> ReadPlan | None:
        """The read plan of ``keys`` into ``dst`` from one index snapshot; None if LMDB failed (counted)."""
        try:
            with self._env.begin() as txn:
                raws = [txn.get(k, db=self._blocks) for k in keys]
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")
            return None
        return self._reader.plan(keys, raws, dst)

    def _settle(self, plan: ReadPlan, bad: list[Record]) -> list[bool]:
        """Count and remove the bad and malformed records of a finished read; its result."""
        if bad:
            self._on_failure("l3", "corrupt", len(bad), f"{self.path}: checksum mismatch or short read")
            self._remove_if_unchanged(bad)
        if plan.malformed:
            self._on_failure("l3", "corrupt", len(plan.malformed), f"{self.path}: malformed records")
            self._drop_records(plan.malformed)
        return plan.out

    def remove(self, keys: Sequence[bytes]) -> None:
        try:
            with self._env.begin(write=True) as txn:
                for key in keys:
                    raw = txn.pop(key, db=self._blocks)
                    rec = parse(key, raw, self.block_bytes) if raw is not None else None
                    if rec is not None:  # a malformed record's slot number means nothing
                        txn.put(slot_key(rec.slot), b"", db=self._free)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(keys), f"{self.path}: {exc}")

    # -- inspection -----------------------------------------------------------

    def records(self) -> Iterator[Record]:
        """Every well-formed block record, in key order (a consistent snapshot).

        Never raises for a damaged index: a walk that LMDB cannot finish ends early, counted.
        """
        try:
            with self._env.begin() as txn:
                for key, raw in txn.cursor(db=self._blocks):
                    rec = parse(key, raw, self.block_bytes)
                    if rec is not None:
                        yield rec
        except lmdb.Error as exc:
            self._on_failure("l3", "index", 0, f"{self.path}: the record walk stopped: {exc}")

    def verify(self, repair: bool = False) -> tuple[int, list[bytes]]:
        """Read every block and check it; returns (blocks checked, bad keys). ``repair`` removes the bad."""
        buf = torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype)
        checked, bad = 0, []
        for rec in list(self.records()):
            checked += 1
            try:
                ok = self._reader.read_one(rec, buf)
            except OSError:
                ok = False
            if not ok:
                bad.append(rec)
        if repair and bad:
            self._remove_if_unchanged(bad)
        return checked, [r.key for r in bad]

    def read_raw(self, key: bytes) -> bytes | None:
        """The stored bytes of one block after verification (for export)."""
        buf = torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype)
        return bytes(as_bytes(buf)) if self.get([key], [buf])[0] else None

    def compression(self) -> dict:
        """``l3.compress`` as this opener runs it, and ``auto``'s current choice (None otherwise)."""
        choice = self._auto.choice if self._auto is not None else None
        return {"mode": self.compress, "auto": None if choice is None else {"on": choice.on, "gain": round(
            choice.gain, 3), "why": choice.why}}

    def close(self) -> None:
        self._close_files()
        for codec in (self._codec, self._codec_read):
            if codec is not None:
                codec.close()

    # -- internals ------------------------------------------------------------

    def _aligned(self, t: torch.Tensor) -> memoryview | None:
        """A byte view usable for O_DIRECT when ``t`` is page-aligned and stride-sized, else None."""
        return self._file.aligned(t)

    def _take_slot(self, txn) -> int | None:
        cur = txn.cursor(db=self._free)
        if cur.first():
            slot = key_slot(cur.key())
            cur.delete()
            return slot
        raw = txn.get(b"next_slot", db=self._meta)
        slot = int(raw) if raw else 0
        if slot >= self._capacity and slot >= self._refresh_capacity(txn):
            return None
        txn.put(b"next_slot", str(slot + 1).encode(), db=self._meta)
        return slot

    def _holds(self, slot: int, fresh: bool) -> bool:
        """Whether ``slot`` is within the directory's capacity (``fresh``: re-read it if not)."""
        return slot < self._capacity or (fresh and slot < self._refresh_capacity())

    def _refresh_capacity(self, txn=None) -> int:
        # Another process may have opened the directory with more slots (and grown the
        # file): its blocks past our own capacity are valid, not corrupt.
        if self._file is None:  # closed
            return self._capacity
        if txn is None:
            with self._env.begin() as rtxn:
                raw = rtxn.get(b"capacity", db=self._meta)
        else:
            raw = txn.get(b"capacity", db=self._meta)
        if raw is not None and int(raw) > self._capacity:
            self._capacity = int(raw)
        return self._capacity

    def _note_auto(self, txn) -> None:
        """Record what ``auto`` decides in the meta records (``tierkv info`` shows it), when it changes."""
        if self._auto is None:
            return
        why = self._auto.choice.why
        if why != self._auto_noted:
            txn.put(b"compress_auto", why.encode(), db=self._meta)
            self._auto_noted = why

    def _decoder(self) -> BlockCodec:
        """The codec that reads compressed records: this tier's, or (compress off) one made on first use."""
        if self._codec is None:
            self._codec_read = self._codec_read or BlockCodec(self.layout.itemsize, self.block_bytes)
            return self._codec_read
        return self._codec

    def _drop_records(self, items: list[tuple[bytes, bytes, Record | None]]) -> None:
        """Delete (key, raw value, parsed record) entries still stored unchanged; free their slots
        when the record names one that is in use (below next_slot and the capacity)."""
        try:
            with self._env.begin(write=True) as txn:
                raw_next = txn.get(b"next_slot", db=self._meta)
                limit = min(self._capacity, int(raw_next) if raw_next else 0)
                for key, raw, rec in items:
                    if txn.get(key, db=self._blocks) == raw:
                        txn.delete(key, db=self._blocks)
                        if rec is not None and rec.slot < limit:
                            txn.put(slot_key(rec.slot), b"", db=self._free)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(items), f"{self.path}: {exc}")

    def _remove_if_unchanged(self, recs: list[Record]) -> None:
        """Delete records a read found bad, where the index still holds that very record, and
        free their slots. The same key put again since (by another process, after a remove) has
        the same checksum but another slot and time: it is a different record and stays, and
        the stale slot, which a newer block may hold, is not freed a second time."""
        try:
            with self._env.begin(write=True) as txn:
                for rec in recs:
                    raw = txn.get(rec.key, db=self._blocks)
                    now = parse(rec.key, raw, self.block_bytes) if raw is not None else None
                    if now is not None and (now.slot, now.checksum, now.created) == (
                            rec.slot, rec.checksum, rec.created):
                        txn.delete(rec.key, db=self._blocks)
                        txn.put(slot_key(rec.slot), b"", db=self._free)
        except lmdb.Error as exc:
            self._on_failure("l3", "index", len(recs), f"{self.path}: {exc}")
